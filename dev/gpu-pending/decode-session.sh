#!/usr/bin/env bash
# The measurements of the decode series waiting in dev/gpu-pending (decode-half-stages,
# decode-probes, decode-wg-sets), for one GPU session, best on an H200: the probes ask why the
# H200's rate trails bf16's while the H100's matches it (on the H100 the stream bounds the
# kernel; on the H200 the consumers likely do); decode-half-stages gives the consumers twice the
# warps at one token on the large 4-bit weights; decode-wg-sets gives the warpgroup tile (33-64
# tokens) two B sets, with its fence moved later in a second tree. Each tree that
# dev/compare_builds.sh builds runs this script, which finds what the tree holds and runs what
# measures it. The trees: main's (the working tree); decode-half-stages, the two probes,
# wg-sets and wg-late-fence on main, packed into .whl/decode.
#
#   here:   dev/gpu-pending/decode-session.sh pack
#           the series applied to HEAD as temporary commits and packed (HEAD is left as it
#           was; carry [".whl"] with the torchao and expecttest wheels). Removing the probes'
#           two archives from .whl/decode leaves main and the three series to land: four trees.
#   there, run P (about 7 minutes with the build of four trees): each tree's times at 1, 4, 8
#           and 16 tokens beside bf16's (the wg-* trees, whose kernels up to 32 tokens are
#           main's, skip it): main's, half-stages', main's kernel with its consumers reduced to
#           waiting for each stage (the stream alone), and with its producer copying one stage
#           that the consumers decode over and over (the consumers alone): which side bounds
#           the rate.
#           export QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16
#           dev/compare_builds.sh run .whl/decode "bash dev/gpu-pending/decode-session.sh P"
#   there, run S (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare): main's kernel at its own K split beside forced splits on the large
#           weights at 1 and 4 tokens. On an H100 the consumers alone ran 21-35 % faster on
#           28672x8192 at a split of 2 than at the chosen 1 (benchmarks/RESULTS.md, "seventh
#           decode session"); where the consumers bound (the H200), so may the kernel:
#           PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh S
#   there, run T (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare; about 4 minutes a tree, the trees at once on the one GPU): every
#           decode CUDA test in the trees of half-stages, wg-sets and wg-late-fence (or those
#           named after T), and the wgmma A-register check of the latter two:
#           bash dev/gpu-pending/decode-session.sh T [SERIES...]
#   there, run W (the next call after P while the machine is warm, or alone after
#           `dev/compare_builds.sh run DIR true`, which only builds the trees; for any series of
#           the 33-64-token kernels): every tree's times at 40 and 64 tokens, in the trees'
#           order, then again in the reverse order (each row over bf16's time of its own pass):
#           bash dev/gpu-pending/decode-session.sh W
#   there, run C (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare): Nsight Compute on cuBLAS's bf16 kernel and the NVFP4 decode kernel
#           at one token in main's tree, and the fused decode loop:
#           PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh C
#           PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh L
#
# Settings (read once, here): TMPDIR as for compare_builds.sh; W_SHAPES, run W's weights
# (default 4096x4096,8192x8192,4096x14336,6144x4096).
set -uo pipefail
w_shapes=${W_SHAPES:-4096x4096,8192x8192,4096x14336,6144x4096}

# The series this tree holds, from what it adds.
series() {
  local s=main
  grep -q "MT == 1 && FMT != kMxfp8 && U == 2 ? 2 : 1" csrc/decode_gemm_cuda.cu && s="half-stages"
  grep -q "^constexpr int kProbe = 1;" csrc/decode_gemm_cuda.cu && s="probe-stream"
  grep -q "^constexpr int kProbe = 2;" csrc/decode_gemm_cuda.cu && s="probe-consumers"
  grep -q "^constexpr int kBSets" csrc/decode_gemm_cuda.cu && s="wg-sets"
  grep -q "it comes after the wait and the activation's loads" csrc/decode_gemm_cuda.cu &&
    s="wg-late-fence"
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
    half=$(apply dev/gpu-pending/decode-half-stages/*.patch) &&
      git reset -q --hard "$base" &&
      stream=$(apply dev/gpu-pending/decode-probes/0001-*.patch) &&
      consumers=$(apply dev/gpu-pending/decode-probes/0002-*.patch) &&
      git reset -q --hard "$base" &&
      sets=$(apply dev/gpu-pending/decode-wg-sets/0001-*.patch) &&
      late=$(apply dev/gpu-pending/decode-wg-sets/0002-*.patch)
    ok=$?
    git reset -q --hard "$base"
    [ "$ok" -eq 0 ] || exit 1
    echo "half-stages: $half; probes: $stream, $consumers; wg-sets: $sets, $late"
    rm -rf .whl/decode
    dev/compare_builds.sh pack .whl/decode "$half" "$stream" "$consumers" "$sets" "$late"
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
    case "$(series)" in
      wg-*) echo "(its kernels up to 32 tokens are main's: run W times it)"; exit 0 ;;
    esac
    timeout 120 python3 dev/experiments/decode_launches.py times \
      --shapes 28672x8192,8192x8192,8192x28672,4096x4096,4096x14336 --ms 1,4,8,16
    ;;
  S)
    echo "series: $(series)"
    timeout 150 python3 dev/experiments/decode_launches.py splits \
      --shapes 28672x8192,8192x28672,8192x8192 --ms 1,4 --splits 1,2,3,4,7
    ;;
  T)
    shift
    want=" ${*:-half-stages wg-sets wg-late-fence} "
    for t in "${TMPDIR:-/tmp}"/compare/*/; do
      (cd "$t" || exit 0
       [[ $want == *" $(series) "* ]] || exit 0
       tests="tests/test_decode_gemm.py tests/test_decode_weight.py tests/test_decode_fusion.py"
       log="${TMPDIR:-/tmp}/T-$(series).log"
       {
         echo "== series: $(series)"
         case "$(series)" in
           wg-*) obj=$(find build -name 'decode_gemm_cuda*.o' | head -1)
                 python3 csrc/tools/wgmma_a_hazards.py "$obj" | tail -n 9 ;;
         esac
         PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 480 python3 -m pytest -m cuda -q \
           $tests 2>&1 | tail -n 5
       } > "$log" 2>&1) &
    done
    wait
    cat "${TMPDIR:-/tmp}"/T-*.log
    ;;
  W)
    here=$(pwd)
    trees=("$here" "${TMPDIR:-/tmp}"/compare/*/)
    for pass in forward reverse; do
      [ "$pass" = reverse ] && trees=($(printf '%s\n' "${trees[@]}" | tac))
      for t in "${trees[@]}"; do
        (cd "$t" && echo "== $pass: $(basename "$t"), series $(series)"
         PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 60 python3 \
           dev/experiments/decode_launches.py times \
           --shapes "$w_shapes" --ms 40,64)
      done
    done
    ;;
  L)
    echo "== series: $(series)"
    timeout 120 python3 benchmarks/bench_decode.py --loop-only --configs nvfp4_weight_only \
      --batches 1 --modes fused 2>&1 | grep "^|"
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
