#!/usr/bin/env bash
# The measurements of the decode series waiting in dev/gpu-pending (decode-splits), for one GPU
# session of two runs. Each tree that dev/compare_builds.sh builds (main's, and the series') runs
# this script, which finds whether the tree holds the series and runs what measures it.
#
#   here:   dev/gpu-pending/decode-session.sh pack
#           the series applied to HEAD as a temporary commit and packed into .whl/compare
#           (HEAD is left as it was; carry [".whl"]).
#   there, run A (builds both trees, then in each: the kernel's own K split on the shapes whose
#           choice moves, in main's tree beside the forced ones, and the kernel times beside
#           bf16):
#           export QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16
#           dev/compare_builds.sh run .whl/compare "bash dev/gpu-pending/decode-session.sh A"
#   there, run B (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare): the series tree's decode CUDA tests, then the fused decode loop in
#           both trees:
#           for t in "${TMPDIR:-/tmp}"/compare/*/ "$PWD"; do (cd "$t" && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh B); done
#
# Settings (read once, here): TMPDIR as for compare_builds.sh.
set -uo pipefail

# The series this tree holds, from what it adds.
series() {
  if grep -q "kSplitStages" csrc/decode_gemm_cuda.cu; then echo decode-splits; else echo main; fi
}

case "${1:-}" in
  pack)
    git diff --quiet && git diff --cached --quiet || { echo "decode-session: commit first" >&2; exit 1; }
    base=$(git rev-parse HEAD)
    git am -q dev/gpu-pending/decode-splits/*.patch || { git am --abort; exit 1; }
    rev=$(git rev-parse --short HEAD)
    echo "decode-splits: $rev"
    git reset -q --hard "$base"
    rm -rf .whl/compare
    dev/compare_builds.sh pack .whl/compare "$rev"
    ;;
  A)
    echo "series: $(series)"
    # The forced splits are the same kernel in both trees: main's sweep has them, the series'
    # only its own choice (column 0) beside a split of 8.
    case "$(series)" in
      main) forced=2,3,4,7,8 ;;
      *) forced=8 ;;
    esac
    timeout 150 python3 dev/experiments/decode_launches.py splits \
      --shapes 4096x4096,6144x4096,4096x1024,4096x14336,8192x8192 --ms 1,4,8,16,32 --splits "$forced"
    timeout 90 python3 dev/experiments/decode_launches.py times
    ;;
  B)
    echo "== series: $(series) ($PWD)"
    case "$(series)" in
      decode-splits)
        timeout 300 python3 -m pytest -m cuda -q -x tests/test_decode_gemm.py tests/test_decode_fusion.py \
          2>&1 | tail -n 5
        ;;
    esac
    timeout 120 python3 benchmarks/bench_decode.py --loop-only --configs nvfp4_weight_only \
      --batches 1 --modes fused 2>&1 | tail -n 8
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
