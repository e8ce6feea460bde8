#!/usr/bin/env bash
# The measurements of the decode series waiting in dev/gpu-pending, for one GPU session of three
# runs. Each tree that dev/compare_builds.sh builds (main's, and one per series) runs this script,
# which finds the series the tree holds and runs what measures it.
#
#   here:   dev/gpu-pending/decode-session.sh pack
#           each series applied to HEAD as a temporary commit and packed into .whl/compare
#           (HEAD is left as it was; carry [".whl"]).
#   there, run A (builds every tree, then in each: the decode GEMM's times beside bf16; in main's,
#           the eager host time of a decode-layout F.linear and of each layer below it):
#           export QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16
#           dev/compare_builds.sh run .whl/compare "bash dev/gpu-pending/decode-session.sh A"
#   there, run B (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare): the multicast tree's CUDA tests (its own first: a wrong barrier
#           hangs rather than fails, hence the time limits):
#           for t in "${TMPDIR:-/tmp}"/compare/*/; do (cd "$t" && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh B); done
#   there, run C (the same loop with C): the multicast tree's (mates, K split) sweep, the
#           kernel's own choices among them, and the timeline tree's per-CTA phases.
#
# Settings (read once, here): TMPDIR as for compare_builds.sh.
set -uo pipefail

# The series this tree holds, from what each adds.
series() {
  if grep -q "int multicast=0" csrc/registration.cpp; then echo decode-multicast
  elif grep -q "decode_timeline" csrc/registration.cpp; then echo decode-timeline
  else echo main; fi
}

host_overhead() {
  timeout 240 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_overhead as b
b.linear_section(8192, 8192, 1)"
}

case "${1:-}" in
  pack)
    git diff --quiet && git diff --cached --quiet || { echo "decode-session: commit first" >&2; exit 1; }
    base=$(git rev-parse HEAD)
    revs=()
    for s in decode-multicast decode-timeline; do
      git am -q "dev/gpu-pending/$s"/*.patch || { git am --abort; exit 1; }
      revs+=("$(git rev-parse --short HEAD)")
      echo "$s: ${revs[-1]}"
      git reset -q --hard "$base"
    done
    rm -rf .whl/compare
    dev/compare_builds.sh pack .whl/compare "${revs[@]}"
    ;;
  A)
    echo "series: $(series)"
    timeout 240 python3 dev/experiments/decode_launches.py times
    case "$(series)" in
      main) host_overhead ;;
    esac
    ;;
  B)
    echo "== series: $(series) ($PWD)"
    case "$(series)" in
      decode-multicast)
        timeout 200 python3 -m pytest -m cuda -q -x tests/test_decode_gemm.py -k multicast 2>&1 | tail -n 5
        timeout 330 python3 -m pytest -m cuda -q -x tests/test_decode_gemm.py tests/test_decode_fusion.py \
          -k "not multicast" 2>&1 | tail -n 5
        ;;
    esac
    ;;
  C)
    echo "== series: $(series) ($PWD)"
    case "$(series)" in
      decode-multicast)
        timeout 360 python3 dev/experiments/decode_launches.py splits \
          --shapes 8192x8192,28672x8192,8192x28672 --ms 16,64 --multicast 0,1,2,4 --splits 1,2,4,8
        ;;
      decode-timeline)
        timeout 120 python3 dev/experiments/decode_timeline.py --ms 1,16
        ;;
    esac
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
