"""Writing a numerics report (qtensor.cli.analyze.Report): markdown, JSON and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

from qtensor.cli.analyze import ZERO_SCALE, ConfigReport, Report


def _db(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "inf" if math.isinf(v) and v > 0 else f"{v:.2f}"


def _frac(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _hist_summary(hist: dict[int, int]) -> str:
    """'2^-9..2^3, mode 2^-2' of a scale-exponent histogram (+ zero blocks)."""
    exps = [e for e in hist if e != ZERO_SCALE]
    if not exps:
        return "all zero"
    mode = max(exps, key=lambda e: hist[e])
    text = f"2^{min(exps)}..2^{max(exps)}, mode 2^{mode}"
    return text + (f", {hist[ZERO_SCALE]} zero" if ZERO_SCALE in hist else "")


def model_table(report: Report) -> str:
    lines = ["| config | description | model output SQNR dB | weight MiB | vs bf16 | skipped |",
             "|---|---|---:|---:|---:|---:|"]
    for c in report.configs:
        ratio = c.weight_bytes / c.bf16_weight_bytes if c.bf16_weight_bytes else float("nan")
        lines.append(f"| {c.name} | {c.description} | {_db(c.model_sqnr_db)} | "
                     f"{c.weight_bytes / 2**20:.3f} | {ratio:.3f}x | {len(c.skipped)} |")
    return "\n".join(lines)


def layer_table(c: ConfigReport) -> str:
    lines = ["| layer | shape | weight SQNR dB | output SQNR dB | map-to-4 W | map-to-4 A | "
             "scale exponents |", "|---|---|---:|---:|---:|---:|---|"]
    for lr in c.layers:
        lines.append(f"| {lr.name} | {lr.shape[0]}x{lr.shape[1]} | {_db(lr.weight_sqnr_db)} | "
                     f"{_db(lr.output_sqnr_db)} | {_frac(lr.weight_map4_fraction)} | "
                     f"{_frac(lr.activation_map4_fraction)} | "
                     f"{_hist_summary(lr.scale_histogram)} |")
    return "\n".join(lines)


def markdown(report: Report, plots: list[str]) -> str:
    parts = [
        f"# qtensor numerics report: {report.model}",
        "",
        f"Model dtype {report.dtype}, input {'x'.join(map(str, report.input_shape))}. SQNR is "
        "10 log10(signal / error) in dB against the high-precision model (model output) or the "
        "fp32 product (one layer on its recorded input); +6 dB is one more bit. map-to-4: the "
        "fraction of 16-element blocks where 4over6 chose the map-to-4 scale.",
        "",
        model_table(report),
    ]
    for c in report.configs:
        parts += ["", f"## {c.name}: {c.description}", ""]
        if c.skipped:
            parts += [f"Left in high precision (shape): {', '.join(c.skipped)}", ""]
        parts.append(layer_table(c))
    if plots:
        parts += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(parts) + "\n"


def write_report(report: Report, out_dir: Path, plots: bool = True) -> list[Path]:
    """report.md, report.json and (with plots) the PNGs into out_dir; returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(report, out_dir) if plots else []
    md = out_dir / "report.md"
    md.write_text(markdown(report, [p.name for p in pngs]))
    js = out_dir / "report.json"
    js.write_text(json.dumps(report.to_dict(), indent=2))
    return [md, js, *pngs]


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    import matplotlib  # optional: the command line turns its absence into a remedy

    matplotlib.use("Agg")  # files only: no display on servers or CI
    from matplotlib import pyplot as plt

    files = [_plot_sqnr(plt, report, out_dir), _plot_scales(plt, report, out_dir)]
    if any(lr.weight_map4_fraction is not None or lr.activation_map4_fraction is not None
           for c in report.configs for lr in c.layers):
        files.append(_plot_map4(plt, report, out_dir))
    return files


def _layer_axis(ax, names: list[str]) -> None:
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


def _plot_sqnr(plt, report: Report, out_dir: Path) -> Path:
    fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    names = [lr.name for lr in report.configs[0].layers] if report.configs else []
    for c in report.configs:
        index = {lr.name: lr for lr in c.layers}
        for ax, key in zip(axes, ("weight_sqnr_db", "output_sqnr_db"), strict=True):
            ys = [getattr(index[n], key) if n in index else math.nan for n in names]
            ax.plot(range(len(names)), ys, marker="o", ms=3,
                    label=f"{c.name} (model {_db(c.model_sqnr_db)} dB)")
    axes[0].set_ylabel("weight SQNR (dB)")
    axes[1].set_ylabel("layer output SQNR (dB)")
    axes[0].set_title(f"{report.model}: SQNR per layer vs high precision")
    axes[0].legend(fontsize=8)
    for ax in axes:
        _layer_axis(ax, names)
    return _save(fig, plt, out_dir / "sqnr_per_layer.png")


def _plot_scales(plt, report: Report, out_dir: Path) -> Path:
    n = max(1, len(report.configs))
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.4 * n), squeeze=False)
    for ax, c in zip(axes[:, 0], report.configs, strict=False):
        total: dict[int, int] = {}
        for lr in c.layers:
            for e, k in lr.scale_histogram.items():
                total[e] = total.get(e, 0) + k
        exps = sorted(e for e in total if e != ZERO_SCALE)
        ax.bar(exps, [total[e] for e in exps], width=0.8)
        zero = f", {total[ZERO_SCALE]} zero scales" if ZERO_SCALE in total else ""
        ax.set_title(f"{c.name}: weight block-scale exponents (floor log2){zero}", fontsize=9)
        ax.set_xticks(range(min(exps, default=0), max(exps, default=0) + 1))
        ax.set_ylabel("blocks")
    axes[-1, 0].set_xlabel("exponent")
    return _save(fig, plt, out_dir / "scale_histograms.png")


def _plot_map4(plt, report: Report, out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4.5))
    names = [lr.name for lr in report.configs[0].layers]
    for c in report.configs:
        index = {lr.name: lr for lr in c.layers}
        for key, style in (("weight_map4_fraction", "-o"), ("activation_map4_fraction", "--s")):
            ys = [getattr(index[n], key) if n in index else None for n in names]
            if any(y is not None for y in ys):
                ax.plot(range(len(names)), [math.nan if y is None else y for y in ys], style,
                        ms=3, label=f"{c.name} {key.split('_')[0]}s")
    ax.set_ylabel("fraction of blocks on map-to-4")
    ax.set_title(f"{report.model}: 4over6 map-to-4 fraction per layer")
    ax.legend(fontsize=8)
    _layer_axis(ax, names)
    return _save(fig, plt, out_dir / "map4_fraction.png")


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
