"""The docs stay true: every ```python block of README.md and docs/*.md runs.

Each file's blocks run in order in one namespace (a page builds on its earlier blocks), in a
fresh temporary working directory. A block that cannot run on a CPU is fenced as ```text (or
```bash) instead. docs/index.md is the map of the docs: it must link every page, and every
relative link of every page must resolve.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, source) of each ```python block."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def _label(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=_label)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem}"}
    for line, source in python_blocks(page):
        code = compile(source, f"{_label(page)}:{line}", "exec")
        exec(code, namespace)  # a failure's traceback names the page and line


def test_readme_has_a_python_block():
    assert python_blocks(ROOT / "README.md"), "the README's usage block went missing"


def test_index_maps_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    linked = {Path(target).name for target in LINK.findall(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert not pages - linked, f"docs/index.md does not link {sorted(pages - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=_label)
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{_label(page)} links to missing {target}"
