"""Numbers streamed into error messages, found in the C++ and CUDA sources.

    python csrc/tools/check_messages.py FILE...

On the GPU machine's toolchain, a number streamed into a `TORCH_CHECK` message from this
extension (`std::ostream::_M_insert<long>` and its kin: integers, flags, floats, `x.sizes()`)
crashes the process with a segmentation fault instead of raising the error; strings stream
fine. So the messages pass numbers through `num()` and shapes through `shape_str()`
(`csrc/checks.h`), and spell flags as strings. A test that asks for the error then dies with
the test run, on the GPU only: the CPU build here does not crash, so nothing else catches it.

This check reads every `TORCH_CHECK` (and `TORCH_CHECK_*`) call of the files given and reports
each message argument that would stream a number: a numeric literal; a name the file declares
with an integer, flag or floating type (anywhere in the file: a name the file also uses for a
tensor is taken as a number, so name tensors and numbers apart); or a call of `size`, `dim`,
`numel`, `stride`, `sizes`, `strides`, `element_size`, `itemsize`, `get_device` or
`storage_offset`. Allowed: string literals, `num(...)`, `shape_str(...)`, `std::to_string(...)`,
a conditional of two string literals, and anything else (`op`, `x.scalar_type()`, a subscript of
a table of names). Prints `FILE:LINE: ARGUMENT` per finding and exits 1 if there is any.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_NUMERIC = (r"(?:bool|char|short|int|long|unsigned|signed|size_t|ssize_t|u?int(?:8|16|32|64)_t"
            r"|float|double)")
# A declaration of a numeric name: the type, maybe `const` and `&`, the name, then what may follow
# a declared name (an initializer, the next parameter, the end of a list, an array bound).
_DECL = re.compile(r"\b" + _NUMERIC + r"(?:\s+(?:long|int))*\s*(?:const\s*)?&?\s*([A-Za-z_]\w*)\s*(?=[=,;)\[{:])")
_INT_METHOD = re.compile(r"\.(?:size|dim|numel|stride|sizes|strides|element_size|itemsize|get_device"
                         r"|storage_offset)\s*\(")
_SAFE_CALL = re.compile(r"(?:num|shape_str|std::to_string)\s*\(")
_STRINGS = re.compile(r'(?:"(?:[^"\\]|\\.)*"\s*)+', re.S)
_STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
_CHECK = re.compile(r"\bTORCH_CHECK(?:_[A-Z_]+)?\s*\(")


def _skip_quoted(text: str, i: int) -> int:
    """The index just past the string or character literal that starts at text[i]."""
    quote, j = text[i], i + 1
    while text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _call_end(text: str, i: int) -> int:
    """The index just past the parenthesis that closes the one open before text[i]."""
    depth = 1
    while depth:
        if text[i] in "\"'":
            i = _skip_quoted(text, i)
            continue
        depth += (text[i] == "(") - (text[i] == ")")
        i += 1
    return i


def strip_comments(src: str) -> str:
    """The source without its comments (string literals kept whole), lines kept in place."""
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * src.count("\n", i, j))
            i = j
        elif src[i] in "\"'":
            j = _skip_quoted(src, i)
            out.append(src[i:j])
            i = j
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def split_arguments(text: str) -> list[str]:
    """A call's argument list split at its top-level commas."""
    args, cur, depth, i = [], [], 0, 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            j = _skip_quoted(text, i)
            cur.append(text[i:j])
            i = j
            continue
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            args.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    args.append("".join(cur).strip())
    return args


def checks(src: str):
    """(line, argument text) of each TORCH_CHECK call in comment-free source."""
    for m in _CHECK.finditer(src):
        yield src.count("\n", 0, m.start()) + 1, src[m.end():_call_end(src, m.end()) - 1]


def streams_number(arg: str, numeric_names: set[str]) -> bool:
    """Whether a message argument would stream a number (the module's rules)."""
    if _STRINGS.fullmatch(arg):
        return False
    call = _SAFE_CALL.match(arg)
    if call and _call_end(arg, call.end()) == len(arg):  # the whole argument is one such call
        return False
    bare = _STRING_LITERAL.sub('""', arg).strip()
    if re.fullmatch(r'\(?[^?]*\?\s*""\s*:\s*""\s*\)?', bare):
        return False  # a flag spelled as one of two strings
    while re.search(r"\[[^\[\]]*\]", bare):  # a subscript's index is not what streams
        bare = re.sub(r"\[[^\[\]]*\]", "@", bare)
    if re.fullmatch(r"\(?\s*-?\d[\w.']*\s*\)?", bare):
        return True
    names = set(re.findall(r"(?<![\w.:>])([A-Za-z_]\w*)(?!\s*(?:\(|\.|->|@))", bare))
    return bool(names & numeric_names) or _INT_METHOD.search(bare) is not None


def findings(source: str) -> list[tuple[int, str]]:
    """(line, argument) of every message argument of the source that would stream a number."""
    src = strip_comments(source)
    numeric_names = set(_DECL.findall(src))
    return [(line, arg) for line, body in checks(src) for arg in split_arguments(body)[1:]
            if streams_number(arg, numeric_names)]


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    found = 0
    for path in paths:
        for line, arg in findings(Path(path).read_text()):
            print(f"{path}:{line}: {arg} (stream it as a string: num(), shape_str(), or a flag's two strings)")
            found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
