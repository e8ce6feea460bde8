"""The error messages of the C++ and CUDA sources stream no numbers (csrc/tools/check_messages.py).

A number streamed into a `TORCH_CHECK` message crashes the process on the GPU machine's
toolchain instead of raising, so the CPU build cannot show it: this check reads the sources. It
runs on every source in csrc/, and on hand-written calls that it must and must not report."""

from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path

_ROOT = os.path.join(os.path.dirname(__file__), "..")
_PATH = os.path.join(_ROOT, "csrc", "tools", "check_messages.py")
_spec = importlib.util.spec_from_file_location("check_messages", _PATH)
messages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(messages)


def test_every_source_streams_its_numbers_as_strings():
    paths = sorted(p for ext in ("cu", "cuh", "cpp", "h")
                   for p in glob.glob(os.path.join(_ROOT, "csrc", "**", f"*.{ext}"), recursive=True))
    assert len(paths) > 10, paths
    sources = {os.path.relpath(p, _ROOT): Path(p).read_text() for p in paths}
    found = {p: messages.findings(src) for p, src in sources.items()}
    assert {p: f for p, f in found.items() if f} == {}
    # The sources do hold checks for it to read.
    assert sum(len(list(messages.checks(messages.strip_comments(src)))) for src in sources.values()) > 50


SOURCE = '''
void op(const at::Tensor& x, int64_t walk, bool rht, double eps, const char* op) {
  const uint32_t rows = 4;
  const char* kName[] = {"a", "b"};
  // TORCH_CHECK(false, "a comment is not code: ", walk);
  TORCH_CHECK(walk == 0, op, " takes walk 0; got ", walk, ".");
  TORCH_CHECK(rht, "flag ", rht, ", eps ", eps, ", rows ", rows);
  TORCH_CHECK(x.dim() == 2, "got ", x.dim(), " dims, size ", x.size(0), ", shape ", x.sizes());
  TORCH_CHECK(true, "a literal ", 16, " and a sum ", walk + 1);
  TORCH_CHECK_VALUE(false, "walk ", walk, num(walk) + x.size(1));
  TORCH_CHECK(walk == 0, op, " takes walk 0 (chosen, or 2); got ", num(walk), ", rht ",
              (rht ? "true" : "false"), ", shape ", shape_str(x), ", dtype ", x.scalar_type(),
              ", name ", kName[walk], ", ", std::to_string(rows), ".");
}
'''


def test_numbers_flags_and_sizes_are_found_and_strings_pass():
    found = messages.findings(SOURCE)
    assert found == [
        (6, "walk"),
        (7, "rht"), (7, "eps"), (7, "rows"),
        (8, "x.dim()"), (8, "x.size(0)"), (8, "x.sizes()"),
        (9, "16"), (9, "walk + 1"),
        (10, "walk"), (10, "num(walk) + x.size(1)"),
    ]


def test_arguments_split_at_top_level_commas_only():
    args = messages.split_arguments('a(1, 2), "x, (y", b[1, 2], {3, 4}')
    assert args == ["a(1, 2)", '"x, (y"', "b[1, 2]", "{3, 4}"]


def test_the_command_line_reports_and_fails(tmp_path, capsys):
    bad = tmp_path / "bad.cu"
    bad.write_text(SOURCE)
    good = tmp_path / "good.cu"
    good.write_text('void f(int64_t n) { TORCH_CHECK(n > 0, "n ", num(n)); }\n')
    assert messages.main([str(good)]) == 0
    assert messages.main([str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:6: walk (stream it as a string" in out and str(good) not in out
    assert messages.main([]) == 2
