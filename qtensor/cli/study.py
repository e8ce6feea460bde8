"""`qtensor study`: train a small decoder on real text with bf16 and each NVFP4 recipe, and
compare their loss curves and gradient errors.

With no arguments it runs the tiny CPU preset (2 seeds of every config in a few minutes on
2 cores); `--device cuda --preset full` runs the real study. The text is the Python standard
library of the running interpreter (every .py file, sorted, byte tokens; every 20th file held
out), or `--data PATH`. Results accumulate per (config, seed) in OUT/study.json, so a study can
be spread over several runs (`--configs`, `--seeds`), one after another or at the same time
(each run is merged into the file under a lock); OUT/loss.png and OUT/grad_error.png are drawn
from everything in the file, and the table is printed. `--report` redraws them from the file
without training. docs/study.md has what each number means and the claims it checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import statistics
from pathlib import Path

import torch

from qtensor.cli.common import UsageError, progress_bar, resolve_device

SCHEMA = 1  # version of study.json's layout


def add_parser(sub) -> None:
    from qtensor.cli.study_train import CONFIGS, PRESETS

    p = sub.add_parser("study", help="train bf16 and every NVFP4 recipe on real text; loss "
                       "curves and gradient errors", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="study", metavar="DIR",
                   help="folder of study.json, loss.png and grad_error.png (default ./study)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="tiny (default: CPU, minutes) or full (GPU, about 24M parameters)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated configs (default all: {', '.join(CONFIGS)})")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    p.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or folder instead of the standard library")
    p.add_argument("--report", action="store_true",
                   help="train nothing: summarize and plot what OUT/study.json holds for this "
                   "preset and text")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print the summary and the claims as JSON instead of the table")
    p.set_defaults(run=run)


def _parse(args):
    from qtensor.cli.study_train import CONFIGS, PRESETS

    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise UsageError(f"--configs takes names from {', '.join(CONFIGS)}; got "
                         f"{', '.join(unknown) or 'none'}.")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        raise UsageError(f"--seeds takes comma-separated non-negative ints; got {args.seeds!r}."
                         ) from None
    if not seeds or min(seeds) < 0:
        raise UsageError(f"--seeds takes comma-separated non-negative ints; got {args.seeds!r}.")
    preset = PRESETS[args.preset]
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError(f"--steps must be positive; got {args.steps}.")
        # The measured steps keep their place in the schedule (the first, the last, a quarter
        # of the way) when the schedule is stretched or shortened.
        last = preset.steps - 1
        grad_steps = tuple(sorted({round(s * (args.steps - 1) / last) if last else 0
                                   for s in preset.grad_steps}))
        preset = dataclasses.replace(preset, steps=args.steps, grad_steps=grad_steps,
                                     eval_every=min(preset.eval_every, args.steps))
    # bf16 first: every other config's gap is measured against it.
    configs.sort(key=lambda c: c != "bf16")
    return configs, seeds, preset


def load_results(path: Path, preset: dict, text: str) -> dict:
    """study.json's content, or a fresh one: runs of another preset or another text are not
    mixed in."""
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("schema") == SCHEMA and data.get("preset") == preset and \
                data.get("data") == text:
            return data
    return {"schema": SCHEMA, "preset": preset, "data": text, "runs": {}}


@contextlib.contextmanager
def _locked(folder: Path):
    """Holds an exclusive lock on the output folder, so that studies running at the same time
    into it read and write study.json one at a time."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks (Windows): runs into one folder must not overlap
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _dumps(results: dict) -> str:
    """study.json's text: one line per run (a run's curves are thousands of numbers), the rest
    indented."""
    parts = []
    for key, value in results.items():
        if key == "runs":
            runs = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                              for k, v in value.items())
            parts.append(f' "runs": {{\n{runs}\n }}')
        else:
            parts.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n", "\n "))
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _write(path: Path, results: dict) -> None:
    """Replaces study.json whole (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(_dumps(results))
    os.replace(tmp, path)


def update_results(path: Path, preset: dict, text: str, change) -> dict:
    """Re-reads study.json under the lock, applies `change` to it, writes it back, and returns
    it: runs that other processes added meanwhile are kept."""
    with _locked(path.parent):
        results = load_results(path, preset, text)
        change(results)
        _write(path, results)
    return results


def run(args) -> int:
    from qtensor.cli.study_train import load_splits, text_files, train_one

    device = resolve_device(args.device)
    configs, seeds, preset = _parse(args)
    if not args.no_plots:
        import matplotlib  # noqa: F401  (fail before the work, not after it)
    out = Path(args.out)
    path = out / "study.json"
    text = args.data or "python stdlib"
    preset_key = json.loads(json.dumps(dataclasses.asdict(preset)))
    if args.report:
        results = load_results(path, preset_key, text) if path.exists() else {"runs": {}}
        if not results["runs"]:
            raise UsageError(f"--report: {path} holds no runs of this preset and text; run the "
                             "study first, with the same --preset, --steps and --data.")
    else:
        try:
            files = text_files(args.data)
            data = load_splits(files, preset.max_bytes, preset.batch * (preset.seq + 1) + 1)
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "train_bytes": data[0].numel(), "val_bytes": data[1].numel(),
            "command": _command(args),
        }
        bar = progress_bar(args, len(configs) * len(seeds) * preset.steps, "study")
        try:
            for config in configs:
                for seed in seeds:
                    if bar is not None:
                        bar.set_postfix_str(f"{config} seed {seed}")
                    r = train_one(config, seed, preset, data, device, progress=bar)
                    r["command"] = meta["command"]

                    def add(results, key=f"{config}/{seed}", r=r):
                        results.update(meta)
                        results["runs"][key] = r
                    results = update_results(path, preset_key, text, add)  # after every run
        finally:
            if bar is not None:
                bar.close()

    def conclude(results):
        results["summary"] = summarize(results)
        results["claims"] = claims(results["summary"])
    results = update_results(path, preset_key, text, conclude)
    summary = results["summary"]
    files_written = [path]
    if not args.no_plots:
        files_written += plot(results, out)
    if args.json:
        print(json.dumps({"summary": summary, "claims": results["claims"]}, indent=2))
        return 0
    print(f"qtensor study: {preset.layers} layers of width {preset.hidden}, {preset.steps} steps "
          f"of {preset.batch}x{preset.seq} byte tokens on {results['device']}")
    print(table(summary))
    if any(c != "bf16" for c in summary):
        print()
        print(step_table(summary))
    print()
    for c in results["claims"]:
        print(f"- {c['claim']}: {c['verdict']} ({c['numbers']})")
    print("wrote " + ", ".join(str(f) for f in files_written))
    return 0


def _command(args) -> str:
    """The command line that reproduces this run's settings."""
    parts = ["python -m qtensor study", f"--preset {args.preset}", f"--device {args.device}",
             f"--configs {args.configs}", f"--seeds {args.seeds}"]
    if args.steps is not None:
        parts.append(f"--steps {args.steps}")
    if args.data is not None:
        parts.append(f"--data {args.data}")
    return " ".join(parts)


# ---- summary, claims, table ------------------------------------------------------------------------

def _mean_spread(values: list[float | None]) -> tuple[float, float] | None:
    """Mean and half the range over seeds (0 for one seed); None if a seed lacks the value."""
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(values), (max(values) - min(values)) / 2


# The gradient errors: against the bf16 replica, and against the dequantized backward of the
# same forward ("bwd_"; absent for bf16, and from runs recorded before it was measured).
ERRORS = ("dgrad", "wgrad", "bwd_dgrad", "bwd_wgrad")


def _grad_error(run: dict, gemm: str, step: int | None = None) -> float | None:
    """Mean over the layers, and over the measured steps (or at `step`), of one relative error;
    None where the run did not measure it."""
    if run["config"] == "bf16" and gemm.startswith("bwd_"):
        return 0.0  # bf16's backward is its own reference
    vals = [v.get(gemm) for g in run["grad_error"] if step is None or g["step"] == step
            for v in g["layers"].values()]
    return statistics.fmean(vals) if vals and None not in vals else None


def summarize(results: dict) -> dict:
    """Per config: final validation loss, its gap to bf16 (per seed, then averaged), the mean
    dgrad and wgrad errors and tokens/s, each as [mean, spread over seeds], and the per-seed
    values the claims pair up."""
    from qtensor.cli.study_train import CONFIGS

    by_config: dict[str, list[dict]] = {}
    order = {c: i for i, c in enumerate(CONFIGS)}
    for run in sorted(results["runs"].values(), key=lambda r: order.get(r["config"], len(order))):
        by_config.setdefault(run["config"], []).append(run)
    base = {r["seed"]: r["val_loss"][-1][1] for r in by_config.get("bf16", [])}
    summary = {}
    for config, runs in by_config.items():
        runs.sort(key=lambda r: r["seed"])
        per_seed = {str(r["seed"]): {"val_loss": r["val_loss"][-1][1],
                                     **{f"{e}_error": _grad_error(r, e) for e in ERRORS}}
                     for r in runs}
        gaps = [r["val_loss"][-1][1] - base[r["seed"]] for r in runs if r["seed"] in base]
        summary[config] = {
            "seeds": [r["seed"] for r in runs],
            "val_loss": _mean_spread([v["val_loss"] for v in per_seed.values()]),
            "gap_to_bf16": _mean_spread(gaps) if gaps else None,
            **{f"{e}_error": _mean_spread([v[f"{e}_error"] for v in per_seed.values()])
               for e in ERRORS},
            "tokens_per_s": _mean_spread([r["tokens_per_s"] for r in runs]),
            # The errors at each measured step: the mean hides how they move as training goes.
            "by_step": {str(step): {gemm: _mean_spread([_grad_error(r, gemm, step) for r in runs])
                                    for gemm in ERRORS}
                        for step in sorted({g["step"] for r in runs for g in r["grad_error"]})},
            "per_seed": per_seed,
        }
    return summary


def _paired(summary: dict, a: str, b: str, key: str):
    """Mean and spread over the seeds both configs ran of a's value minus b's, or None with
    fewer than two such seeds (one seed has no spread to judge a difference by)."""
    pa, pb = summary[a]["per_seed"], summary[b]["per_seed"]
    diffs = [pa[s][key] - pb[s][key] for s in pa if s in pb]
    return _mean_spread(diffs) if len(diffs) >= 2 else None


def _verdict(diff, claimed_negative: bool | None) -> str:
    """On a paired difference (mean, spread): `within noise` when |mean| <= spread, else
    `holds` or `does not hold` for a claimed sign (negative: a is lower); with no claimed sign
    (a claim of no effect) `holds` within noise and `does not hold` beyond it."""
    if diff is None:
        return "needs at least 2 seeds of both configs"
    mean, spread = diff
    if abs(mean) <= spread:
        return "holds (within noise)" if claimed_negative is None else "within noise"
    if claimed_negative is None:
        return f"does not hold ({'lower' if mean < 0 else 'higher'} beyond the seeds' spread)"
    return "holds" if (mean < 0) == claimed_negative else "does not hold"


# (claim, config a, config b, metric, claimed sign of a - b: True for lower, None for no effect)
CLAIMS = (
    ("MXFP8 dgrad has a lower input-gradient error than NVFP4 dgrad",
     "dgrad_mxfp8", "nvfp4", "dgrad_error", True),
    ("MXFP8 dgrad lowers the NVFP4 backward's weight-gradient error (the documents' measure: "
     "against the dequantized backward of the same forward; 0.206 vs 0.454 there)",
     "dgrad_mxfp8", "nvfp4", "bwd_wgrad_error", True),
    ("a bf16 backward has a lower input-gradient error than MXFP8 dgrad (the recipes' ordering: "
     "high precision < MXFP8 < NVFP4)", "high_precision_bwd", "dgrad_mxfp8", "dgrad_error", True),
    ("4over6 on gradients is roughly neutral (final validation loss; the gradient recipe also "
     "turns stochastic rounding off, as it must)", "4over6_grad", "4over6", "val_loss", None),
    ("4over6 on gradients is roughly neutral (the backward's weight-gradient error against the "
     "dequantized backward; stochastic rounding off too)", "4over6_grad", "4over6",
     "bwd_wgrad_error", None),
    ("4over6 brings NVFP4 training closer to the bf16 loss (final validation loss)",
     "4over6", "nvfp4", "val_loss", True),
)


def claims(summary: dict) -> list[dict]:
    """The design documents' claims, checked on these runs (those whose configs ran). Each
    compares two configs seed by seed: same initial weights, same batches."""
    out = []
    for claim, a, b, key, negative in CLAIMS:
        if a not in summary or b not in summary:
            continue
        if summary[a][key] is None or summary[b][key] is None:
            out.append({"claim": claim, "configs": [a, b], "metric": key, "difference": None,
                        "verdict": "not measured in these runs", "numbers": "n/a"})
            continue
        diff = _paired(summary, a, b, key)
        numbers = (f"{a} {summary[a][key][0]:.4f} vs {b} {summary[b][key][0]:.4f}; "
                   + (f"paired difference {diff[0]:+.4f} +- {diff[1]:.4f}" if diff else "one seed"))
        out.append({"claim": claim, "configs": [a, b], "metric": key,
                    "difference": list(diff) if diff else None,
                    "verdict": _verdict(diff, negative), "numbers": numbers})
    return out


def _cell(value, fmt: str) -> str:
    return "n/a" if value is None else format(value[0], fmt)


def table(summary: dict) -> str:
    """config | final val loss | gap to bf16 | dgrad / wgrad error against bf16, and against
    the dequantized backward | tokens/s (mean +- half the range over seeds)."""
    rows = ["| config | seeds | final val loss | gap to bf16 | dgrad error | wgrad error | "
            "backward's dgrad error | backward's wgrad error | tokens/s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for config, s in summary.items():
        gap = s["gap_to_bf16"]
        rows.append(
            f"| {config} | {len(s['seeds'])} | {s['val_loss'][0]:.4f} +- {s['val_loss'][1]:.4f} | "
            + (f"{gap[0]:+.4f} +- {gap[1]:.4f}" if gap else "n/a") + " | "
            + " | ".join(_cell(s[f"{e}_error"], ".3f") for e in ERRORS) + " | "
            f"{s['tokens_per_s'][0]:,.0f} |")
    return "\n".join(rows)


def step_table(summary: dict) -> str:
    """config | dgrad / wgrad error at each measured step (mean over seeds), the quantized
    configs only (bf16's errors are zero)."""
    steps = sorted({int(k) for s in summary.values() for k in s["by_step"]})
    rows = ["| config | " + " | ".join(f"dgrad / wgrad at step {k}" for k in steps) + " |",
            "|---|" + "---|" * len(steps)]
    for config, s in summary.items():
        if config == "bf16":
            continue
        cells = [(f"{_cell(s['by_step'][str(k)]['dgrad'], '.3f')} / "
                  f"{_cell(s['by_step'][str(k)]['wgrad'], '.3f')}"
                  if str(k) in s["by_step"] else "n/a") for k in steps]
        rows.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ---- plots -------------------------------------------------------------------------------------

def plot(results: dict, out: Path) -> list[Path]:
    """loss.png (validation loss per config, mean over seeds, and its gap to bf16 on a second
    axis) and grad_error.png (dgrad and wgrad errors per config)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    val: dict[str, dict[int, dict[int, float]]] = {}  # config -> step -> seed -> loss
    train: dict[str, dict[int, list[float]]] = {}  # config -> step -> losses over seeds
    for run in results["runs"].values():
        v = val.setdefault(run["config"], {})
        for step, loss in run["val_loss"]:
            v.setdefault(step, {})[run["seed"]] = loss
        t = train.setdefault(run["config"], {})
        for step, loss in run["train_loss"]:
            t.setdefault(step, []).append(loss)
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = val.get("bf16", {})
    for config in (c for c in results["summary"] if c in val):
        steps = sorted(val[config])
        line, = ax.plot(steps, [statistics.fmean(val[config][s].values()) for s in steps],
                        marker="o", ms=3, label=config)
        t_steps = sorted(train[config])
        window = max(1, len(t_steps) // 20)  # a running mean of the training loss, thin
        t_mean = [statistics.fmean(train[config][s]) for s in t_steps]
        smooth = [statistics.fmean(t_mean[max(0, k - window + 1):k + 1]) for k in range(len(t_mean))]
        ax.plot(t_steps, smooth, color=line.get_color(), lw=0.7, alpha=0.5)
        if config == "bf16" or not base:
            continue
        gaps = {s: [val[config][s][seed] - base[s][seed] for seed in val[config][s]
                    if seed in base.get(s, {})] for s in steps}
        common = [s for s in steps if gaps[s]]
        gap_ax.plot(common, [statistics.fmean(gaps[s]) for s in common], marker="o", ms=3,
                    color=line.get_color(), label=config)
        gap_ax.fill_between(common, [min(gaps[s]) for s in common],
                            [max(gaps[s]) for s in common], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("validation loss (dots; mean over seeds), training loss (thin)")
    ax.legend(fontsize=8)
    gap_ax.axhline(0.0, color="black", lw=0.8)
    gap_ax.set_xlabel("step")
    gap_ax.set_ylabel("validation loss - bf16's, same seed")
    gap_ax.set_title("gap to bf16 (band: range over seeds)")
    fig.tight_layout()
    loss_png = out / "loss.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    summary = results["summary"]
    names = list(summary)
    labels = {"dgrad": "dgrad (input gradient) vs bf16", "wgrad": "wgrad (weight gradient) vs bf16",
              "bwd_dgrad": "dgrad vs dequantized backward",
              "bwd_wgrad": "wgrad vs dequantized backward"}
    # The errors every config measured (runs recorded before the dequantized reference lack it).
    shown = [e for e in ERRORS if all(summary[n][f"{e}_error"] is not None for n in names)]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(shown)
    for i, e in enumerate(shown):
        vals = [summary[n][f"{e}_error"][0] for n in names]
        errs = [summary[n][f"{e}_error"][1] for n in names]
        ax.bar([j + (i - (len(shown) - 1) / 2) * width for j in range(len(names))], vals, width,
               yerr=errs, label=labels[e])
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("relative error")
    ax.legend(fontsize=8)
    ax.set_title("gradient error, mean over layers and measured steps")
    fig.tight_layout()
    grad_png = out / "grad_error.png"
    fig.savefig(grad_png, dpi=120)
    plt.close(fig)
    return [loss_png, grad_png]
