#!/usr/bin/env bash
# The measurements of the decode series waiting in dev/gpu-pending (decode-split-five), for one
# GPU session in two runs. Each tree that dev/compare_builds.sh builds (main's, and the
# series') runs this script, which finds what the tree holds and runs what measures it.
#
#   here:   dev/gpu-pending/decode-session.sh pack
#           the series applied to HEAD as a temporary commit and packed into .whl/compare
#           (HEAD is left as it was; carry [".whl"]).
#   there, run A (builds both trees; in each the kernel times beside bf16, and in the series'
#           tree its own K split beside forced ones on the weights whose choice moves and on
#           those it must leave alone):
#           export QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16
#           dev/compare_builds.sh run .whl/compare "bash dev/gpu-pending/decode-session.sh A"
#   there, run B (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare): the series tree's decode CUDA tests of the kernel's own split and
#           of every forced one, and the fused decode loop in both trees:
#           for t in "$PWD" "${TMPDIR:-/tmp}"/compare/*/; do (cd "$t" && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh B); done
#
# Settings (read once, here): TMPDIR as for compare_builds.sh.
set -uo pipefail

# The series this tree holds, from what it adds.
series() {
  if grep -q "kShortStages" csrc/decode_gemm_cuda.cu; then echo decode-split-five
  else echo main; fi
}

case "${1:-}" in
  pack)
    git diff --quiet && git diff --cached --quiet || { echo "decode-session: commit first" >&2; exit 1; }
    base=$(git rev-parse HEAD)
    git am -q dev/gpu-pending/decode-split-five/*.patch || { git am --abort; exit 1; }
    rev=$(git rev-parse --short HEAD)
    echo "decode-split-five: $rev"
    git reset -q --hard "$base"
    rm -rf .whl/compare
    dev/compare_builds.sh pack .whl/compare "$rev"
    ;;
  A)
    echo "series: $(series)"
    # A forced split runs the same kernel in both trees, so the series' tree measures its own
    # choice (column 0) beside them; main's column 0 is in its `times`.
    if [ "$(series)" = decode-split-five ]; then
      timeout 150 python3 dev/experiments/decode_launches.py splits \
        --shapes 4096x4096,6144x4096,4096x14336,8192x8192 --ms 1,16,32 --splits 2,4,7,8
    fi
    timeout 90 python3 dev/experiments/decode_launches.py times \
      --shapes 4096x4096,6144x4096,4096x14336,8192x8192,28672x8192 --ms 1,4,16,32,64
    ;;
  B)
    echo "== series: $(series)"
    if [ "$(series)" = decode-split-five ]; then
      timeout 150 python3 -m pytest -m cuda -q -x tests/test_decode_gemm.py \
        -k "every_split or kernel_options or matches_reference or two_row_tiles or overlapped or one_k_range" \
        2>&1 | tail -n 5
    fi
    timeout 120 python3 benchmarks/bench_decode.py --loop-only --configs nvfp4_weight_only \
      --batches 1 --modes fused 2>&1 | tail -n 3
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
