"""`qtensor study`: the default CPU study end to end, accumulation of results, the data split,
the gradient-error measurement, the claims' verdicts and the one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qtensor.cli import main
from qtensor.cli import study, study_train
from qtensor.cli.study_train import CONFIGS, PRESETS


def run_main(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def default_study(tmp_path_factory):
    """The command with no options but --out: the tiny preset, every config, seeds 0 and 1."""
    out = tmp_path_factory.mktemp("study")
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["study", "--out", str(out), "--no-progress"])
    return rc, buf.getvalue(), out, json.loads((out / "study.json").read_text())


def test_default_study_runs_every_config_and_seed(default_study):
    rc, printed, out, data = default_study
    assert rc == 0
    assert sorted(data["runs"]) == sorted(f"{c}/{s}" for c in CONFIGS for s in (0, 1))
    for name in CONFIGS:
        assert f"| {name} | 2 |" in printed
    for png in ("loss.png", "grad_error.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["data"] == "python stdlib" and data["val_bytes"] > 0
    assert data["command"].startswith("python -m qtensor study --preset tiny")
    preset = PRESETS["tiny"]
    for run in data["runs"].values():
        assert len(run["train_loss"]) == preset.steps
        assert [s for s, _ in run["val_loss"]] == [0, 12, 24]
        assert all(math.isfinite(v) for _, v in run["val_loss"])
        assert run["tokens_per_s"] > 0
        assert [g["step"] for g in run["grad_error"]] == list(preset.grad_steps)


def test_training_learns_the_text(default_study):
    *_, data = default_study
    for run in data["runs"].values():
        first, last = run["val_loss"][0][1], run["val_loss"][-1][1]
        # ln(256) = 5.55 nats per byte at the start; 24 steps of real text take off over 1.5.
        assert first > 5.0 and last < first - 1.5, (run["config"], first, last)


def test_bf16_gradients_equal_the_replica_and_quantized_ones_do_not(default_study):
    *_, data = default_study
    layers = 2 * 7  # q, k, v, o, gate, up, down per block
    for run in data["runs"].values():
        for g in run["grad_error"]:
            assert len(g["layers"]) == layers
            for errors in g["layers"].values():
                if run["config"] == "bf16":
                    assert errors == {"wgrad": 0.0, "dgrad": 0.0}
                else:
                    assert 0.0 < errors["wgrad"] < 2.0 and 0.0 < errors["dgrad"] < 2.0, errors


def test_the_dequantized_reference_has_the_same_forward_and_isolates_the_backward(default_study):
    """The second reference runs the recipe's own quantized forward (the same loss, bitwise)
    with a backward of plain GEMMs on the dequantized operands: its errors are the backward's
    own. MXFP8 dgrad cuts the input-gradient share of them on every seed and step."""
    *_, data = default_study
    for key, run in data["runs"].items():
        for g in run["grad_error"]:
            if run["config"] == "bf16":
                assert "bwd_ref_loss" not in g and g["ref_loss"] == g["loss"], key
                continue
            assert g["bwd_ref_loss"] == g["loss"], key
            for errors in g["layers"].values():
                assert 0.0 < errors["bwd_wgrad"] < 2.0 and 0.0 < errors["bwd_dgrad"] < 2.0
    for seed in (0, 1):
        for step in range(len(PRESETS["tiny"].grad_steps)):
            def mean(config, gemm):
                layers = data["runs"][f"{config}/{seed}"]["grad_error"][step]["layers"].values()
                return sum(v[gemm] for v in layers) / len(layers)
            assert mean("dgrad_mxfp8", "bwd_dgrad") < mean("nvfp4", "bwd_dgrad")


def test_runs_without_the_dequantized_reference_say_so(default_study):
    """Runs recorded before the backward's own error was measured summarize to n/a, and its
    claims say "not measured" instead of judging missing numbers."""
    *_, data = default_study
    old = json.loads(json.dumps(data))
    for run in old["runs"].values():
        for g in run["grad_error"]:
            for errors in g["layers"].values():
                errors.pop("bwd_wgrad", None)
                errors.pop("bwd_dgrad", None)
    summary = study.summarize(old)
    assert summary["nvfp4"]["bwd_wgrad_error"] is None and summary["nvfp4"]["dgrad_error"]
    verdicts = {(*c["configs"], c["metric"]): c["verdict"] for c in study.claims(summary)}
    assert verdicts["dgrad_mxfp8", "nvfp4", "bwd_wgrad_error"] == "not measured in these runs"
    assert verdicts["4over6_grad", "4over6", "bwd_wgrad_error"] == "not measured in these runs"
    assert verdicts["dgrad_mxfp8", "nvfp4", "dgrad_error"] == "holds"
    assert "| n/a | n/a |" in study.table(summary)


def test_same_seed_same_batches_same_start(default_study):
    """Every config of a seed starts from one model on one batch: the step-0 loss differs only
    by the forward's quantization, and is bitwise equal where the forward is bf16."""
    *_, data = default_study
    for seed in (0, 1):
        base = data["runs"][f"bf16/{seed}"]["train_loss"][0][1]
        for config in CONFIGS:
            loss = data["runs"][f"{config}/{seed}"]["train_loss"][0][1]
            assert abs(loss - base) < 0.02, (config, loss, base)
    assert data["runs"]["bf16/0"]["train_loss"][0][1] != data["runs"]["bf16/1"]["train_loss"][0][1]


def test_summary_and_claims(default_study):
    _, printed, _, data = default_study
    summary = data["summary"]
    assert summary["bf16"]["gap_to_bf16"] == [0.0, 0.0]
    # The MXFP8 dgrad recipe's input-gradient error is below NVFP4's on every seed.
    for seed in ("0", "1"):
        assert summary["dgrad_mxfp8"]["per_seed"][seed]["dgrad_error"] < \
            summary["nvfp4"]["per_seed"][seed]["dgrad_error"]
    assert [c["configs"] for c in data["claims"]] == [[a, b] for _, a, b, _, _ in study.CLAIMS]
    for c in data["claims"]:
        assert c["verdict"] in ("holds", "does not hold", "within noise",
                                "holds (within noise)") or c["verdict"].startswith("does not hold (")
        assert f"- {c['claim']}: {c['verdict']}" in printed
    assert data["claims"][0]["verdict"] == "holds"


def test_verdicts_on_paired_differences():
    assert study._verdict((-0.1, 0.02), True) == "holds"
    assert study._verdict((0.1, 0.02), True) == "does not hold"
    assert study._verdict((0.01, 0.02), True) == "within noise"
    assert study._verdict((0.01, 0.02), None) == "holds (within noise)"
    assert study._verdict((-0.05, 0.02), None).startswith("does not hold (lower")
    assert study._verdict(None, True).startswith("needs at least 2 seeds")
    summary = {"a": {"per_seed": {"0": {"m": 1.0}, "1": {"m": 3.0}}},
               "b": {"per_seed": {"0": {"m": 0.5}, "1": {"m": 2.0}, "2": {"m": 9.0}}}}
    assert study._paired(summary, "a", "b", "m") == (0.75, 0.25)  # seeds 0 and 1 only


def test_results_accumulate_per_config_and_seed(capsys, tmp_path):
    common = ["study", "--out", str(tmp_path), "--steps", "3", "--no-progress", "--no-plots"]
    assert run_main(capsys, *common, "--configs", "bf16", "--seeds", "0")[0] == 0
    rc, out, _ = run_main(capsys, *common, "--configs", "row_scaled", "--seeds", "0", "--json")
    assert rc == 0
    data = json.loads((tmp_path / "study.json").read_text())
    assert sorted(data["runs"]) == ["bf16/0", "row_scaled/0"]
    printed = json.loads(out)
    assert printed["summary"]["row_scaled"]["gap_to_bf16"] is not None
    assert printed["claims"] == []  # no claim's two configs both ran
    # Another preset (here: other steps) starts a fresh file instead of mixing runs.
    assert run_main(capsys, "study", "--out", str(tmp_path), "--steps", "2", "--configs",
                    "bf16", "--seeds", "1", "--no-progress", "--no-plots")[0] == 0
    assert sorted(json.loads((tmp_path / "study.json").read_text())["runs"]) == ["bf16/1"]
    # So does another text.
    book = tmp_path / "book.txt"
    book.write_bytes(bytes(range(256)) * 100)
    assert run_main(capsys, "study", "--out", str(tmp_path), "--steps", "2", "--configs",
                    "bf16", "--seeds", "2", "--data", str(book), "--no-progress",
                    "--no-plots")[0] == 0
    data = json.loads((tmp_path / "study.json").read_text())
    assert sorted(data["runs"]) == ["bf16/2"] and data["data"] == str(book)


def test_data_from_a_file_and_the_stdlib_split(tmp_path):
    text = tmp_path / "book.txt"
    text.write_bytes(bytes(range(256)) * 200)
    train, val = study_train.load_splits(study_train.text_files(str(text)), 1 << 20, 100)
    assert train.numel() + val.numel() == 256 * 200 and val.numel() == 256 * 200 // 20
    assert torch.equal(torch.cat((train, val)).long(), torch.arange(256).repeat(200))
    files = study_train.stdlib_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert any(f.name == "functools.py" for f in files)
    # Validation is every 20th file: none of its bytes start a training file.
    train, val = study_train.load_splits(files[:40], 1 << 30, 10)
    held = files[19].read_bytes() + b"\n" + files[39].read_bytes()
    assert bytes(val.tolist()) == held


@pytest.mark.parametrize("argv,needle", [
    (["--configs", "nvfp5"], "--configs takes names from"),
    (["--seeds", "a"], "--seeds takes"),
    (["--steps", "0"], "--steps must be positive"),
    (["--data", "no/such/file"], "no such file"),
    (["--preset", "huge"], "invalid choice"),
])
def test_bad_options_are_one_line(capsys, tmp_path, argv, needle):
    rc, _, err = run_main(capsys, "study", "--out", str(tmp_path), "--no-progress", *argv)
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and any(needle in line for line in lines), err


def test_too_little_text_is_one_line(capsys, tmp_path):
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    rc, _, err = run_main(capsys, "study", "--out", str(tmp_path), "--no-progress",
                          "--data", str(tmp_path / "short.txt"))
    assert rc == 2 and "Pass a larger --data" in err and "Traceback" not in err


def test_report_summarizes_the_file_without_training(capsys, default_study):
    _, printed, out, data = default_study
    (out / "loss.png").unlink()
    rc, again, _ = run_main(capsys, "study", "--out", str(out), "--report", "--no-progress")
    assert rc == 0
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert table and table == [line for line in again.splitlines() if line.startswith("|")]
    assert "dgrad / wgrad at step 0 | dgrad / wgrad at step 23 |" in again
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "study.json").read_text())["runs"] == data["runs"]


def test_report_of_an_empty_folder_is_one_line(capsys, tmp_path):
    rc, _, err = run_main(capsys, "study", "--out", str(tmp_path), "--report", "--no-plots")
    assert rc == 2 and "holds no runs of this preset" in err and "Traceback" not in err


def test_errors_by_step_average_to_the_summary(default_study):
    *_, data = default_study
    for config, s in data["summary"].items():
        assert sorted(s["by_step"], key=int) == [str(k) for k in PRESETS["tiny"].grad_steps]
        for gemm in ("dgrad", "wgrad"):
            # Every step has the same layers, so the steps' mean is the overall mean.
            steps_mean = sum(v[gemm][0] for v in s["by_step"].values()) / len(s["by_step"])
            assert steps_mean == pytest.approx(s[f"{gemm}_error"][0], rel=1e-9, abs=1e-12)


CONCURRENT_WRITER = """
import sys, time
from pathlib import Path
from qtensor.cli.study import update_results
path, who = Path(sys.argv[1]), sys.argv[2]
for i in range(15):
    def add(results, i=i):
        time.sleep(0.003)  # widen the read-modify-write window
        results["runs"][f"{who}/{i}"] = {"config": who, "seed": i}
    update_results(path, {"p": 1}, "text", add)
"""


def test_studies_running_at_once_keep_every_run(tmp_path):
    """Several studies writing into one folder at the same time: each run is merged under the
    folder's lock, so none is lost (unlocked read-modify-write loses some here)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root),
                                                                      os.environ.get("PYTHONPATH")])))
    writers = [subprocess.Popen([sys.executable, "-c", CONCURRENT_WRITER, str(tmp_path / "study.json"),
                                 f"w{k}"], env=env, stderr=subprocess.PIPE, text=True)
               for k in range(4)]
    for w in writers:
        _, err = w.communicate(timeout=300)
        assert w.returncode == 0, err
    runs = json.loads((tmp_path / "study.json").read_text())["runs"]
    assert sorted(runs) == sorted(f"w{k}/{i}" for k in range(4) for i in range(15))
    assert not [p.name for p in tmp_path.iterdir() if p.name != "study.json"]  # no temp files left


@pytest.mark.parametrize("preset,steps,expected", [
    ("tiny", 300, (0, 299)), ("tiny", 24, (0, 23)), ("tiny", 1, (0,)),
    ("full", 100, (0, 25, 99)), ("full", 4000, (0, 1001, 3999)),
])
def test_steps_keep_the_measured_steps_in_place(preset, steps, expected):
    import argparse

    args = argparse.Namespace(configs="bf16", seeds="0", preset=preset, steps=steps)
    _, _, p = study._parse(args)
    assert p.steps == steps and p.grad_steps == expected
