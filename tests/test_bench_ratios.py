"""dev/bench_ratios.py: rows over the copy of their own table, trees over the base, per pass."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
import bench_ratios

HEAD = "| shape | kernel | us | GB/s | of copy | vs | GPU us | host us |\n|---|---|---|---|---|---|---|---|\n"


def table(copy: float, rows: dict[str, tuple[float, float, float]]) -> str:
    lines = [f"| 64x64 | copy | {copy} | 1 | 1.00 |  | {copy} | 1.0 |"]
    lines += [f"| 64x64 | {k} | {us} | 1 | 1.00 |  | {gpu} | {host} |" for k, (us, gpu, host) in rows.items()]
    return "# a run\n" + HEAD + "\n".join(lines) + "\n"


def test_verdicts_take_each_row_over_its_own_copy():
    texts = {
        # pass 1: the series' copy ran 10 % slow, so its raw 'col' time (110) is the base's in copies
        "b1": table(100.0, {"col": (100.0, 90.0, 10.0), "row": (50.0, 45.0, 10.0), "tiny": (5.0, 2.0, 20.0)}),
        "s1": table(110.0, {"col": (110.0, 99.0, 10.0), "row": (52.8, 50.0, 10.0), "tiny": (5.0, 2.0, 20.0)}),
        "b2": table(100.0, {"col": (100.0, 90.0, 10.0), "row": (50.0, 45.0, 10.0), "tiny": (5.0, 2.0, 20.0)}),
        "s2": table(100.0, {"col": (97.0, 90.0, 10.0), "row": (45.0, 40.0, 10.0), "tiny": (5.0, 2.0, 20.0)}),
    }
    lines = bench_ratios.verdicts([("main", ["b1", "b2"]), ("series", ["s1", "s2"])], texts, 0.02)
    by_kernel = {line.split("|")[2].strip(): line for line in lines[2:]}
    assert "1.000 / 0.970 within noise" in by_kernel["col"]  # one pass only moved
    assert "0.960 / 0.900 faster" in by_kernel["row"]  # 52.8 / 110 over 50 / 100, then 45 / 50
    assert "tiny (host)" in by_kernel  # host 20 us over GPU 2 us: the row measures the host
    assert "0.500 / 0.500" in by_kernel["row"]  # the base's own time in copies, per pass


def test_gpu_time_takes_the_graph_column_over_the_copy_s_own():
    # The copy's GPU time (its graph replay) is its us column here, 100; the rows' eager and
    # graph times disagree: eager says slower, the kernels alone faster.
    texts = {"b": table(100.0, {"k": (100.0, 90.0, 1.0)}), "s": table(100.0, {"k": (104.0, 81.0, 1.0)})}
    groups = [("main", ["b"]), ("s", ["s"])]
    assert bench_ratios.verdicts(groups, texts, 0.02)[-1].endswith("1.040 slower |")
    lines = bench_ratios.verdicts(groups, texts, 0.02, "gpu")
    assert "main (GPU time in copies)" in lines[0]
    assert lines[-1] == "| 64x64 | k | 0.900 | 0.900 faster |"


def test_slower_needs_every_pass():
    texts = {"b": table(100.0, {"k": (100.0, 90.0, 1.0)}), "s": table(100.0, {"k": (104.0, 90.0, 1.0)})}
    lines = bench_ratios.verdicts([("main", ["b"]), ("s", ["s"])], texts, 0.02)
    assert lines[-1].endswith("1.040 slower |")
    lines = bench_ratios.verdicts([("main", ["b"]), ("s", ["s"])], texts, 0.05)
    assert lines[-1].endswith("1.040 within noise |")


def test_rows_the_base_ran_in_one_pass_only_are_left_out():
    # A first pass of every row, then a second of a few (`--cases`): only rows of both compare.
    texts = {"b1": table(100.0, {"k": (100.0, 90.0, 1.0), "full": (80.0, 70.0, 1.0)}),
             "b2": table(100.0, {"k": (100.0, 90.0, 1.0)}),
             "s1": table(100.0, {"k": (90.0, 80.0, 1.0)}), "s2": table(100.0, {"k": (90.0, 80.0, 1.0)})}
    lines = bench_ratios.verdicts([("main", ["b1", "b2"]), ("s", ["s1", "s2"])], texts, 0.02)
    assert [line.split("|")[2].strip() for line in lines[2:]] == ["k"]
    assert lines[-1].endswith("0.900 / 0.900 faster |")


def test_errors_name_the_requirement():
    good = table(100.0, {"k": (100.0, 90.0, 1.0)})
    with pytest.raises(ValueError, match="same number of passes"):
        bench_ratios.verdicts([("main", ["a", "b"]), ("s", ["a"])], {"a": good, "b": good}, 0.02)
    no_copy = HEAD + "| 64x64 | k | 1.0 | 1 | 1.00 |  | 1.0 | 1.0 |\n"
    with pytest.raises(ValueError, match="no copy row"):
        bench_ratios.verdicts([("main", ["a"]), ("s", ["c"])], {"a": good, "c": no_copy}, 0.02)
    with pytest.raises(ValueError, match="no rows of a bench_quantize table"):
        bench_ratios.parse_table("# nothing here\n", "empty.md")


def test_cli_reads_files_and_rejects_bad_arguments(tmp_path, capsys):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text(table(100.0, {"k": (100.0, 90.0, 1.0)}))
    b.write_text(table(100.0, {"k": (90.0, 80.0, 1.0)}))
    assert bench_ratios.main([f"main={a}", f"s={b}"]) == 0
    assert "0.900 faster" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_ratios.main([f"main={a}"])  # one tree: nothing to compare
    with pytest.raises(SystemExit):
        bench_ratios.main([str(a), f"s={b}"])  # not NAME=FILE
