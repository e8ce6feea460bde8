"""The command line: demo, analyze, bench, and its one-sentence errors (exit code 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qtensor.cli import main
from qtensor.cli.analyze import ZERO_SCALE, scale_exponent_histogram, sqnr_db, stored_bytes
from qtensor.formats import nvfp4
from qtensor.formats.nvfp4 import NVFP4Spec

ROOT = Path(__file__).resolve().parents[1]
# A 1-layer model small enough for the emulated GEMMs to run in well under a second.
SMALL = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--vocab", "256",
         "--heads", "2", "--kv-heads", "1", "--batch", "2", "--seq", "16"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def run_main(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *needles):
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---- metrics --------------------------------------------------------------------------------


def test_sqnr_db_of_a_known_noise():
    ref = torch.ones(1000, dtype=torch.float64)
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0, abs=1e-9)  # 10 log10(1 / 0.01)
    assert sqnr_db(ref, ref) == math.inf


def test_stored_bytes_counts_codes_scales_and_amax():
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    qw = nvfp4_tensor(w)
    assert stored_bytes(qw) == 64 * 128 // 2 + 64 * 128 // 16 + 4  # codes, E4M3 scales, fp32 amax


def nvfp4_tensor(w, **kw):
    from qtensor import NVFP4Tensor

    return NVFP4Tensor.from_hp(w, **kw)


def test_scale_histogram_counts_every_block():
    w = torch.randn(32, 256, dtype=torch.bfloat16)
    w[0, :16] = 0  # one all-zero block: its scale is 0
    hist = scale_exponent_histogram(nvfp4_tensor(w).scale)
    assert sum(hist.values()) == 32 * 256 // 16
    assert hist[ZERO_SCALE] == 1


def test_fourover6_map4_marks_the_blocks_whose_scale_moved_up():
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 64)[:, None]
    spec = NVFP4Spec(fourover6="mae", e4m3_bound=256)
    map4 = nvfp4.fourover6_map4(x, spec)
    chosen = nvfp4.quantize(x, spec).scale.float()
    to6 = nvfp4.quantize(x, NVFP4Spec(e4m3_bound=256)).scale.float()
    assert map4.shape == chosen.shape and 0 < map4.float().mean() < 1
    assert torch.equal(chosen[~map4], to6[~map4])  # map-to-6 blocks keep the plain scale
    assert bool((chosen[map4] > to6[map4]).all())  # map-to-4 blocks scale by ~1.5x
    with pytest.raises(ValueError, match="fourover6"):
        nvfp4.fourover6_map4(x, NVFP4Spec())


# ---- demo -------------------------------------------------------------------------------------


def test_demo_default_runs_and_prints_the_table():
    """The real `python -m qtensor demo`, as `make demo` runs it."""
    done = subprocess.run([sys.executable, "-m", "qtensor", "demo"], cwd=ROOT, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in ("bf16", "nvfp4-weight", "nvfp4", "nvfp4-4over6", "nvfp4-rowscaled",
                 "mxfp8-weight", "mxfp8"):
        assert any(line.split()[:1] == [name] for line in done.stdout.splitlines()), name
    assert "Traceback" not in done.stderr and "Failed to load" not in done.stderr


def test_demo_json_bytes_and_sqnr(capsys):
    rc, out, _ = run_main(capsys, "demo", *SMALL, "--json")
    assert rc == 0
    result = json.loads(out)
    rows = {r["config"]: r for r in result["rows"]}
    cfg = result["model"]
    h, i, v = cfg["hidden"], cfg["intermediate"], cfg["vocab_size"]
    kv = cfg["kv_heads"] * h // cfg["heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] * cfg["layers"] + [(v, h)]
    elems = sum(n * k for n, k in shapes)
    assert rows["bf16"]["weight_bytes"] == 2 * elems
    # NVFP4: half a byte per element + one E4M3 scale per 16 + one fp32 amax per tensor.
    assert rows["nvfp4"]["weight_bytes"] == elems // 2 + elems // 16 + 4 * len(shapes)
    assert rows["mxfp8-weight"]["weight_bytes"] == elems + elems // 32
    for r in result["rows"][1:]:
        assert r["bf16_weight_bytes"] == 2 * elems and 3 < r["sqnr_db"] < 60, r
    # 8-bit elements beat 4-bit elements by far more than run-to-run noise.
    assert rows["mxfp8-weight"]["sqnr_db"] > rows["nvfp4-weight"]["sqnr_db"] + 6


def test_demo_config_subset_and_list(capsys):
    rc, out, _ = run_main(capsys, "demo", *SMALL, "--configs", "mxfp8")
    assert rc == 0 and "mxfp8" in out and "nvfp4" not in out
    rc, out, _ = run_main(capsys, "demo", "--configs", "list")
    assert rc == 0 and "nvfp4-4over6" in out


# ---- analyze ----------------------------------------------------------------------------------


def test_analyze_builtin_writes_report_and_plots(capsys, tmp_path):
    out_dir = tmp_path / "report"
    rc, out, _ = run_main(capsys, "analyze", *SMALL, "--configs", "nvfp4-4over6,mxfp8",
                          "--out", str(out_dir), "--json")
    assert rc == 0
    report = json.loads(out)
    assert [c["name"] for c in report["configs"]] == ["nvfp4-4over6", "mxfp8"]
    four, mx = report["configs"]
    assert len(four["layers"]) == 8 and not four["skipped"]  # 7 per block + lm_head
    for lr in four["layers"]:
        n, k = lr["shape"]
        assert 0 <= lr["weight_map4_fraction"] <= 1 and 0 <= lr["activation_map4_fraction"] <= 1
        assert sum(lr["scale_histogram"].values()) == n * k // 16
        assert math.isfinite(lr["output_sqnr_db"])
    for lr in mx["layers"]:
        n, k = lr["shape"]
        assert lr["weight_map4_fraction"] is None and lr["activation_map4_fraction"] is None
        assert sum(lr["scale_histogram"].values()) == n * k // 32
        assert lr["weight_sqnr_db"] > 25  # E4M3 elements: ~31 dB on Gaussian weights
    md = (out_dir / "report.md").read_text()
    assert "lm_head" in md and "blocks.0.mlp.down_proj" in md
    for png in ("sqnr_per_layer.png", "scale_histograms.png", "map4_fraction.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out_dir / "report.json").read_text()) == report


def test_analyze_shape_error_then_skip(capsys, tmp_path):
    # hidden 48: every Linear reading the hidden state has in_features 48, not a multiple of 32.
    small = [a if a != "64" else "48" for a in SMALL]
    args = ["analyze", *small, "--configs", "mxfp8", "--out", str(tmp_path), "--no-plots"]
    rc, _, err = run_main(capsys, *args)
    assert_one_line_error(rc, err, "divisible by 32; got 48", "--skip-incompatible")
    rc, out, _ = run_main(capsys, *args, "--skip-incompatible", "--json")
    assert rc == 0
    cfg = json.loads(out)["configs"][0]
    assert [lr["name"] for lr in cfg["layers"]] == ["blocks.0.mlp.down_proj"]
    assert len(cfg["skipped"]) == 7


@pytest.fixture
def llama_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama", model


def test_analyze_hugging_face_directory(capsys, llama_dir, tmp_path):
    from qtensor.cli.analyze import load_hf_causal_lm

    path, saved = llama_dir
    loaded = load_hf_causal_lm(path)
    pairs = zip(saved.parameters(), loaded.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    rc, out, _ = run_main(capsys, "analyze", "--model", str(path), "--configs", "nvfp4",
                          "--batch", "1", "--seq", "8", "--out", str(tmp_path / "r"),
                          "--no-plots", "--json")
    assert rc == 0
    names = [lr["name"] for lr in json.loads(out)["configs"][0]["layers"]]
    assert names[0] == "model.layers.0.self_attn.q_proj" and names[-1] == "lm_head"


# ---- errors: one sentence with the remedy, exit code 2 ------------------------------------------


@NO_CUDA
@pytest.mark.parametrize("argv", [["demo"], ["analyze", "--out", "unused"]])
def test_cuda_requested_without_cuda_is_one_line(capsys, argv):
    rc, _, err = run_main(capsys, *argv, "--device", "cuda")
    assert_one_line_error(rc, err, "CUDA", "--device cpu")


@pytest.mark.parametrize("package,argv", [
    ("matplotlib", ["analyze", *SMALL]),
    ("tqdm", ["analyze", *SMALL, "--no-plots"]),
    ("transformers", ["analyze", "--model", "MODEL", "--no-plots"]),
])
def test_missing_optional_package_is_one_line(capsys, monkeypatch, tmp_path, package, argv):
    (tmp_path / "config.json").write_text("{}")
    argv = [str(tmp_path) if a == "MODEL" else a for a in argv] + ["--out", str(tmp_path)]
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now fails
    rc, _, err = run_main(capsys, *argv)
    assert_one_line_error(rc, err, repr(package), "pip install")


@pytest.mark.parametrize("argv,needle", [
    (["demo", "--configs", "nvfp5"], "choose from"),
    (["demo", "--hidden", "60", "--heads", "8"], "heads"),
    (["demo", "--batch", "0"], "positive"),
    (["analyze", "--model", "no/such/dir"], "config.json"),
    (["demo", "--device", "tpu"], "cpu or cuda"),
])
def test_bad_option_values_are_one_line(capsys, argv, needle):
    rc, _, err = run_main(capsys, *argv)
    assert_one_line_error(rc, err, needle)


# ---- bench ------------------------------------------------------------------------------------


@pytest.fixture
def bench_dir(tmp_path):
    (tmp_path / "bench_ok.py").write_text(textwrap.dedent("""
        import sys
        print("| op | ratio |")
        print("| ok", *sys.argv[1:])
    """))
    (tmp_path / "bench_fails.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "bench_gpu.py").write_text(
        "raise AssertionError('Torch not compiled with CUDA enabled')\n")
    (tmp_path / "helper.py").write_text("raise SystemExit('not a benchmark')\n")
    return tmp_path


def test_bench_runs_each_script_and_says_what_it_measured(capfd, bench_dir):
    rc = main(["bench", "--dir", str(bench_dir), "--", "--quick"])
    out = capfd.readouterr().out
    assert rc == 1  # bench_fails failed
    assert "| ok --quick" in out and "failed (exit 3)" in out and "helper" not in out
    if not torch.cuda.is_available():
        assert "No CUDA device" in out and "No GEMM and no GPU kernel is timed" in out
        assert "skipped: needs a CUDA device" in out and "needs CUDA" in out
        # A GPU-only script on a CPU-only machine is expected, not a failure.
        assert main(["bench", "--dir", str(bench_dir), "--only", "gpu", "--only", "ok"]) == 0


def test_bench_only_list_and_json(capfd, bench_dir):
    assert main(["bench", "--dir", str(bench_dir), "--list"]) == 0
    assert capfd.readouterr().out.split() == ["bench_fails.py", "bench_gpu.py", "bench_ok.py"]
    assert main(["bench", "--dir", str(bench_dir), "--only", "ok", "--json"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert [r["script"] for r in result["results"]] == ["bench_ok.py"]
    assert result["results"][0]["output"].startswith("| op | ratio |")


def test_bench_without_scripts_is_one_line(capsys, tmp_path):
    rc, _, err = run_main(capsys, "bench", "--dir", str(tmp_path))
    assert_one_line_error(rc, err, "bench_*.py", "--dir")


def test_demo_counts_the_layers_it_quantized(capsys):
    """With --skip-incompatible most layers of a hidden-48 model stay bf16 under MXFP8: the
    table says how many were quantized, which the byte columns cover."""
    small = [a if a != "64" else "48" for a in SMALL]
    rc, out, _ = run_main(capsys, "demo", *small, "--configs", "mxfp8", "--skip-incompatible",
                          "--json")
    assert rc == 0
    rows = {r["config"]: r for r in json.loads(out)["rows"]}
    assert rows["mxfp8"]["layers"] == "1/8" and rows["bf16"]["layers"] == "-"


def test_imports_are_quiet_and_light():
    """`import qtensor` loads no torch._dynamo (about a second), and loading torchao for a
    config prints none of torchao's optional-kernel "Failed to load" lines nor torch's Enum
    deprecation for torchao's pytree constant (qtensor/_torchao.py)."""
    import subprocess
    import sys

    code = ("import sys, qtensor; print('torch._dynamo' in sys.modules); "
            "qtensor.NVFP4WeightOnlyConfig(); import torchao; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "ok"]
    assert "Failed to load" not in out.stderr and "register_constant" not in out.stderr, \
        out.stderr
