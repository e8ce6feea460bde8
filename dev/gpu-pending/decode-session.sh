#!/usr/bin/env bash
# The measurements of the decode series waiting in dev/gpu-pending (decode-chains,
# decode-probes), for one GPU session. Each tree that dev/compare_builds.sh builds runs this
# script, which finds what the tree holds and runs what measures it. Run A decides the landing
# of decode-chains and needs about 7 minutes of device time with the start; C and D are
# measurements for a session with time left, in that order (on an H200 where one is lent: the
# probes ask why the H200's rate trails bf16's while the H100's matches it). The trees: main's
# (the working tree); decode-chains on main, packed into .whl/compare; the two probes on main,
# packed into .whl/probes.
#
#   here:   dev/gpu-pending/decode-session.sh pack
#           the series applied to HEAD as temporary commits and packed (HEAD is left as it
#           was; carry [".whl"] with the torchao and expecttest wheels).
#   there, run A (about 6 minutes: builds main and decode-chains at once, then in each the
#           kernel times beside bf16, and in decode-chains every decode CUDA test):
#           export QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16
#           dev/compare_builds.sh run .whl/compare "bash dev/gpu-pending/decode-session.sh A"
#   there, run C (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare): where the stream's rate goes, in main's tree (Nsight Compute on
#           cuBLAS's bf16 kernel and the NVFP4 decode kernel at one token, whose rate on the
#           H200 is 3.35 TB/s against bf16's 4.30 while on the H100 they match), and the fused
#           decode loop in main's tree and decode-chains':
#           PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh C
#           for t in "$PWD" "${TMPDIR:-/tmp}"/compare/*/; do (cd "$t" && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh L); done
#   there, run D (about 5 minutes; decode-probes, experiments that never land): main's kernel
#           with its consumers reduced to waiting for each stage (the stream alone), and with its
#           producer copying one stage that the consumers decode over and over (the consumers
#           alone), their times beside main's and bf16's: which side bounds the rate.
#           dev/compare_builds.sh run .whl/probes "bash dev/gpu-pending/decode-session.sh P"
#
# Settings (read once, here): TMPDIR as for compare_builds.sh.
set -uo pipefail

# The series this tree holds, from what it adds.
series() {
  local s=main
  grep -q "summed into chain 0, in chain order" csrc/decode_gemm_cuda.cu && s=chains
  grep -q "^constexpr int kProbe = 1;" csrc/decode_gemm_cuda.cu && s="probe-stream"
  grep -q "^constexpr int kProbe = 2;" csrc/decode_gemm_cuda.cu && s="probe-consumers"
  echo "$s"
}

# Applies the patches given to HEAD as temporary commits, prints the last one's short hash.
apply() {
  local base
  base=$(git rev-parse HEAD)
  git am -q "$@" || { git am --abort; git reset -q --hard "$base"; return 1; }
  git rev-parse --short HEAD
}

case "${1:-}" in
  pack)
    git diff --quiet && git diff --cached --quiet || { echo "decode-session: commit first" >&2; exit 1; }
    base=$(git rev-parse HEAD)
    chains=$(apply dev/gpu-pending/decode-chains/*.patch) &&
      git reset -q --hard "$base" &&
      stream=$(apply dev/gpu-pending/decode-probes/0001-*.patch) &&
      consumers=$(apply dev/gpu-pending/decode-probes/0002-*.patch)
    ok=$?
    git reset -q --hard "$base"
    [ "$ok" -eq 0 ] || exit 1
    echo "chains: $chains; probes: $stream, $consumers"
    rm -rf .whl/compare .whl/probes
    dev/compare_builds.sh pack .whl/compare "$chains"
    dev/compare_builds.sh pack .whl/probes "$stream" "$consumers"
    ;;
  A)
    echo "series: $(series)"
    timeout 100 python3 dev/experiments/decode_launches.py times \
      --shapes 8192x8192,28672x8192,8192x28672,4096x4096,4096x14336 --ms 1,4,16,64
    if [ "$(series)" = chains ]; then
      timeout 300 python3 -m pytest -m cuda -q tests/test_decode_gemm.py \
        tests/test_decode_weight.py tests/test_decode_fusion.py 2>&1 | tail -n 5
    fi
    ;;
  C)
    echo "series: $(series)"
    timeout 150 ncu --clock-control none -k regex:"decode_gemm|gemv|gemm" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy \
      python3 dev/experiments/decode_launches.py profile --shapes 28672x8192,8192x8192 --ms 1 \
      --bf16 2>&1 | grep -v "^==PROF==" | tail -n 400
    ;;
  P)
    echo "series: $(series)"
    timeout 100 python3 dev/experiments/decode_launches.py times \
      --shapes 28672x8192,8192x8192,4096x4096 --ms 1,16
    ;;
  L)
    case "$(series)" in
      main | chains)
        echo "== series: $(series)"
        timeout 120 python3 benchmarks/bench_decode.py --loop-only --configs nvfp4_weight_only \
          --batches 1 --modes fused 2>&1 | grep "^|" ;;
    esac
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
