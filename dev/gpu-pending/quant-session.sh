#!/usr/bin/env bash
# The measurements of the quantizer series waiting in dev/gpu-pending (its quant-*/ folders), for
# one GPU session of the quantization-kernels issue in two runs. Each tree that
# dev/compare_builds.sh builds (main's, and one per series) runs this script, which finds the
# series the tree holds and runs what measures it.
#
#   here:   dev/gpu-pending/quant-session.sh pack
#           each series applied to HEAD as a temporary commit and packed into .whl/compare
#           (HEAD is left as it was; carry [".whl"]); or pack revisions of series written in
#           worktrees: dev/compare_builds.sh pack .whl/compare REV...
#   there, run A (builds every tree; in each series', the quantizers' whole CUDA suite, which
#           hangs rather than fails if a ring's barrier is wrong; then bench_quantize without the
#           peers in each, its table also to $OUT/bench_quantize_<series>.md):
#           export QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16
#           dev/compare_builds.sh run .whl/compare "bash dev/gpu-pending/quant-session.sh A"
#   there, run B (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare): a second bench pass in the reverse order, and Nsight Compute's
#           instructions, warps resident and DRAM throughput of the tile and amax kernels in each
#           tree (all to $OUT/ncu_all.txt), and in main's the stall, scheduler and memory sections
#           of its transposing casts ($OUT/ncu_detail_main.txt):
#           for t in "${TMPDIR:-/tmp}"/compare/*/ "$PWD"; do (cd "$t" && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/quant-session.sh B); done
#   there, P (one call from main's root, where machines are scarce: builds every tree, a failed
#           build stopping it, runs each series' quantizer CUDA suite, then PASSES bench passes
#           over CASES and SHAPES in alternating tree order, each table to p<k>_<series>.md,
#           and prints
#           dev/bench_ratios.py's verdicts of every series against main, eager and GPU time (also
#           to $OUT/verdicts_us.txt and verdicts_gpu.txt); the tables, suites and build log stay
#           under $TMPDIR/compare/results and are packed into $OUT/results.tgz after each stage
#           (a call brings back at most 8 files).
#           Each finished stage leaves a mark under $TMPDIR/compare, so the same call issued again
#           while the machine is warm goes on where a call cut at its limit stopped; a call with
#           other trees packed builds them and starts its passes afresh):
#           export QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16 OUT
#           bash dev/gpu-pending/quant-session.sh P
#   there, S RANGE... (in one built tree, from its root): Nsight Compute's per-instruction SASS
#           counters and stall reasons of the kernels of profile_quantize's named ranges (e.g.
#           "nvfp4 col"), as one gzipped CSV (about 2 MB a kernel unpacked),
#           $OUT/ncu_src_<series>.csv.gz, for benchmarks/ncu_sass_regions.py:
#           bash dev/gpu-pending/quant-session.sh S "nvfp4 col" "mxfp8 both"
#
# Settings (read once, here): OUT (where the tables go; default: none; P requires it), TMPDIR as
# for compare_builds.sh; for P, PASSES (default 3), CASES and SHAPES (bench_quantize's --cases and
# --shapes; default: the transposing casts at the issue's two shapes).
set -uo pipefail
out=${OUT:-}
work=${TMPDIR:-/tmp}/compare
passes=${PASSES:-3}
cases=${CASES:-nvfp4 col,nvfp4 col rht+sr,mxfp8 col,mxfp8 both,hybrid grad,hybrid grad rht+sr}
shapes=${SHAPES:-16384x8192,8192x5120}

# The series this tree holds: the name its pack recorded, else (a revision packed by hand) the
# tree's folder under compare/, else main.
series() {
  if [ -f .qtensor-series ]; then cat .qtensor-series
  else case "$PWD" in */compare/*) basename "$PWD" ;; *) echo main ;; esac; fi
}

# The quantizers' whole CUDA suite in this tree, its last lines (a wrong barrier hangs rather than
# fails: the limit).
suite() {
  timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_kernels_quant.py \
    tests/test_hybrid_gradient_cast.py tests/test_kernels_dispatch.py 2>&1 | tail -n 4
}

case "${1:-}" in
  pack)
    git diff --quiet && git diff --cached --quiet || { echo "quant-session: commit first" >&2; exit 1; }
    base=$(git rev-parse HEAD)
    revs=()
    for dir in dev/gpu-pending/quant-*/; do
      [ -d "$dir" ] || { echo "quant-session: no quant-* series in dev/gpu-pending" >&2; exit 1; }
      series=$(basename "$dir")
      [ "$series" = quant-probes ] && continue  # experiments, each patch alone: its README
      git am -q "$dir"*.patch || { git am --abort; exit 1; }
      echo "$series" > .qtensor-series
      git add -f .qtensor-series && git commit -q -m "series $series"
      revs+=("$(git rev-parse --short HEAD)")
      echo "$series: ${revs[-1]}"
      git reset -q --hard "$base"
    done
    rm -rf .whl/compare
    dev/compare_builds.sh pack .whl/compare "${revs[@]}"
    ;;
  A)
    s=$(series)
    echo "series: $s"
    [ "$s" = main ] || suite
    timeout 180 python3 benchmarks/bench_quantize.py --no-peers ${out:+--out "$out/bench_quantize_$s.md"} \
      | grep -v '^#'
    ;;
  B)
    s=$(series)
    echo "== series: $s ($PWD)"
    timeout 180 python3 benchmarks/bench_quantize.py --no-peers ${out:+--out "$out/bench_quantize_${s}_pass2.md"} \
      > /dev/null
    echo "== ncu: $s" >> "${out:-.}/ncu_all.txt"
    timeout 120 ncu --clock-control none -k regex:"tile_kernel|amax_all|rows_2d" \
      --metrics smsp__inst_executed.sum,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      python3 benchmarks/profile_quantize.py 2>&1 \
      | grep -E "^  [a-z0-9]|inst_executed|time_duration|warps_active|dram__" >> "${out:-.}/ncu_all.txt"
    if [ "$s" = main ]; then  # where the time of the transposing casts goes, for what comes next
      # tile kernels in profile_quantize's order: amax after RHT, NVFP4 col, col RHT + SR,
      # 4over6 MSE 2D, MXFP8 col, MXFP8 both, the hybrid cast and its RHT + SR form (profiled:
      # the 2nd to the 8th)
      timeout 150 ncu --clock-control none -k regex:tile_kernel --launch-skip 1 --launch-count 7 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy \
        python3 benchmarks/profile_quantize.py > "${out:-.}/ncu_detail_main.txt" 2>&1
    fi
    ;;
  P)
    [ -n "$out" ] || { echo "quant-session: P writes its tables to \$OUT; set OUT" >&2; exit 2; }
    ls .whl/compare/*.tar > /dev/null 2>&1 \
      || { echo "quant-session: P runs from main's root with .whl/compare packed (run pack here)" >&2; exit 2; }
    t0=$(date +%s)
    say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
    # Every table and log goes to $res on the machine, where a call issued again finds the
    # stages before it ($OUT starts empty each call, and at most 8 of its files come back): $OUT
    # gets them packed into one file, results.tgz, after each stage, and the verdicts beside it.
    res="$work/results"
    keep() { tar -czf "$out/results.tgz" -C "$res" .; }
    mkdir -p "$res"
    # a command of its own in tree $1 (cd there, the tree first on PYTHONPATH)
    at() { local t=$1; shift; (cd "$t" && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" "$@"); }
    # The mark of the build names the trees built; other trees (a call with another pack on the
    # warm machine) are built again, and the passes of the trees before are not theirs.
    packed=$(cd .whl/compare && ls -- *.tar | paste -sd' ')
    if [ "$(cat "$work/built" 2>/dev/null)" != "$packed" ]; then
      rm -f "$work"/pass* "$res"/p[0-9]*_*.md "$res"/verdicts_*.txt
      # compare_builds reports a failed build and goes on with the others: a failed tree stops P
      dev/compare_builds.sh run .whl/compare true > "$res/build.txt" 2>&1
      say "built"
      if grep -A5 'build failed' "$res/build.txt"; then keep; exit 1; fi
      echo "$packed" > "$work/built"
    fi
    trees=("$PWD")
    names=(main)
    for tar in .whl/compare/*.tar; do
      t="$work/$(basename "$tar" .tar)"
      [ -d "$t" ] || { echo "quant-session: $t was not unpacked (see build.txt in results.tgz)" >&2; exit 1; }
      trees+=("$t")
      names+=("$(cd "$t" && series)")
    done
    for i in "${!trees[@]}"; do
      [ "$i" -gt 0 ] && [ ! -f "$work/suite_${names[$i]}" ] || continue
      at "${trees[$i]}" suite > "$res/suite_${names[$i]}.txt"
      say "suite ${names[$i]}: $(tail -n 1 "$res/suite_${names[$i]}.txt")"
      # only a whole suite's pass marks it (a hang ends at the limit without a summary line)
      grep -qE '[0-9]+ passed' "$res/suite_${names[$i]}.txt" \
        && ! grep -qE 'failed|error' "$res/suite_${names[$i]}.txt" && touch "$work/suite_${names[$i]}"
      keep
    done
    for p in $(seq 1 "$passes"); do
      [ -f "$work/pass$p" ] && continue
      order=("${!trees[@]}")
      [ $((p % 2)) -eq 0 ] && order=($(printf '%s\n' "${order[@]}" | tac))
      whole=1
      for i in "${order[@]}"; do
        at "${trees[$i]}" timeout 120 python3 benchmarks/bench_quantize.py --no-peers \
          --cases "$cases" --shapes "$shapes" --out "$res/p${p}_${names[$i]}.md" > /dev/null || whole=0
      done
      [ "$whole" = 1 ] || { echo "quant-session: pass $p failed in a tree; rerun P" >&2; keep; exit 1; }
      touch "$work/pass$p"
      say "pass $p"
      keep
    done
    args=()
    for name in "${names[@]}"; do
      files=$(seq 1 "$passes" | sed "s|.*|$res/p&_$name.md|" | paste -sd,)
      args+=("$name=$files")
    done
    for time in us gpu; do
      python3 dev/bench_ratios.py --time "$time" "${args[@]}" | tee "$res/verdicts_$time.txt" "$out/verdicts_$time.txt"
    done
    keep
    ;;
  S)
    shift
    [ $# -gt 0 ] || { echo "quant-session: S takes profile_quantize range names" >&2; exit 2; }
    s=$(series)
    include=()
    for r in "$@"; do include+=(--nvtx-include "$r/"); done
    csv="${out:-.}/ncu_src_$s.csv"
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 300 ncu --clock-control none --nvtx "${include[@]}" \
      --section SourceCounters --page source --print-source sass --csv python3 benchmarks/profile_quantize.py \
      > "$csv" 2> "${out:-.}/ncu_src_$s.err"
    echo "S: $s, exit $?, $(grep -c '^"Kernel Name"' "$csv") kernel tables"
    gzip -f "$csv"
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
