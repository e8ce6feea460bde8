#!/usr/bin/env bash
# The measurements of the decode series waiting in dev/gpu-pending (decode-splits and
# decode-direct), for one GPU session of three runs. Each tree that dev/compare_builds.sh builds
# (main's, and one per series) runs this script, which finds the series the tree holds and runs
# what measures it.
#
#   here:   dev/gpu-pending/decode-session.sh pack
#           each series applied to HEAD as a temporary commit and packed into .whl/compare
#           (HEAD is left as it was; carry [".whl"]).
#   there, run A (builds every tree, then in each the kernel times beside bf16; in
#           decode-splits' tree also its own K split beside forced ones on the shapes whose
#           choice moves):
#           export QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16
#           dev/compare_builds.sh run .whl/compare "bash dev/gpu-pending/decode-session.sh A"
#   there, run B (the next call, while the machine is warm: the trees stay built under
#           $TMPDIR/compare): each series tree's decode CUDA tests (decode-splits: those of
#           the kernel's own split and every forced one; decode-direct: those of a split of 1
#           and the epilogue's options), and the outputs of forced splits of 1, which
#           decode-direct and both series together must give bit for bit as main's tree
#           (main first):
#           for t in "$PWD" "${TMPDIR:-/tmp}"/compare/*/; do (cd "$t" && PYTHONPATH="$t${PYTHONPATH:+:$PYTHONPATH}" bash dev/gpu-pending/decode-session.sh B); done
#   there, run C (the same loop with C): the fused decode loop, NVFP4 weight-only at batch 1,
#           in every tree; in the tree of both series, every decode GEMM and decode-fusion CUDA
#           test.
#   `pack` packs a third tree besides the two series: both applied, the tree that lands if both
#   do.
#
# Settings (read once, here): TMPDIR as for compare_builds.sh.
set -uo pipefail

# The series this tree holds, from what each adds.
series() {
  local f=csrc/decode_gemm_cuda.cu
  if grep -q "kSplitStages" $f && grep -q "store_out(" $f; then echo both
  elif grep -q "kSplitStages" $f; then echo decode-splits
  elif grep -q "store_out(" $f; then echo decode-direct
  else echo main; fi
}

case "${1:-}" in
  pack)
    git diff --quiet && git diff --cached --quiet || { echo "decode-session: commit first" >&2; exit 1; }
    base=$(git rev-parse HEAD)
    revs=()
    for s in decode-splits decode-direct; do
      git am -q "dev/gpu-pending/$s"/*.patch || { git am --abort; exit 1; }
      revs+=("$(git rev-parse --short HEAD)")
      echo "$s: ${revs[-1]}"
      git reset -q --hard "$base"
    done
    # Both series together: the tree that lands if both do.
    git am -q dev/gpu-pending/decode-splits/*.patch dev/gpu-pending/decode-direct/*.patch \
      || { git am --abort; exit 1; }
    revs+=("$(git rev-parse --short HEAD)")
    echo "both: ${revs[-1]}"
    git reset -q --hard "$base"
    rm -rf .whl/compare
    dev/compare_builds.sh pack .whl/compare "${revs[@]}"
    ;;
  A)
    echo "series: $(series)"
    # A forced split runs the same kernel in every tree, so decode-splits' tree measures its own
    # choice (column 0) beside the forced splits; the other trees only their times.
    if [ "$(series)" = decode-splits ]; then
      timeout 170 python3 dev/experiments/decode_launches.py splits \
        --shapes 4096x4096,6144x4096,4096x1024,4096x14336 --ms 1,4,8,16,32 --splits 2,3,4,7,8
    fi
    timeout 90 python3 dev/experiments/decode_launches.py times \
      --shapes 8192x8192,28672x8192,8192x28672,28672x4096,4096x4096
    ;;
  B)
    echo "== series: $(series) ($PWD)"
    case "$(series)" in
      decode-splits)
        timeout 150 python3 -m pytest -m cuda -q -x tests/test_decode_gemm.py \
          -k "every_split or kernel_options or matches_reference or two_row_tiles or overlapped" \
          2>&1 | tail -n 5 ;;
      decode-direct)
        timeout 150 python3 -m pytest -m cuda -q -x tests/test_decode_gemm.py \
          -k "one_k_range or every_split or kernel_options or matches_reference or two_row_tiles" \
          2>&1 | tail -n 5 ;;
    esac
    # Forced splits of 1 at 1, 9 and 16 tokens (one and two row tiles a warp), saved per tree:
    # decode-direct must give main's bits (main's tree runs first and only saves them).
    case "$(series)" in
      main|decode-direct|both)
        timeout 120 python3 - "$(series)" "${TMPDIR:-/tmp}/compare" <<'PY'
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_gemm import packed_weights  # noqa: E402

from qtensor.ops import decode_mm as dmm  # noqa: E402

series, where = sys.argv[1], sys.argv[2]
g = torch.Generator(device="cuda").manual_seed(0)
outs = {}
for n, k in ((200, 1088), (16384, 8192)):  # the second: two row tiles a warp from 9 tokens
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    for fmt, (codes, scales, amax) in packed_weights(w).items():
        for m in (1, 9, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            outs[f"{n}x{k} {fmt} M={m}"] = dmm._launch(x, codes, scales, amax, None, fmt, n, k,
                                                       448, torch.float32, splits=1).cpu()
torch.save(outs, f"{where}/split1_{series}.pt")
if series != "main":
    main = torch.load(f"{where}/split1_main.pt")
    differ = [key for key in outs if not torch.equal(outs[key], main[key])]
    print(f"split 1, {series} against main: {len(outs) - len(differ)} of {len(outs)} outputs "
          f"bitwise equal" + (f"; differ: {differ}" if differ else ""))
PY
        ;;
    esac
    ;;
  C)
    echo "== series: $(series) ($PWD)"
    timeout 120 python3 benchmarks/bench_decode.py --loop-only --configs nvfp4_weight_only \
      --batches 1 --modes fused 2>&1 | tail -n 8
    # The tree that lands if both series do: every decode GEMM and decode-fusion CUDA test.
    if [ "$(series)" = both ]; then
      timeout 300 python3 -m pytest -m cuda -q -x tests/test_decode_gemm.py tests/test_decode_fusion.py \
        2>&1 | tail -n 5
    fi
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
