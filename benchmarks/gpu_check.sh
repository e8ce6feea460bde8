#!/usr/bin/env bash
# The one GPU check of the project: build csrc for the GPU at hand, run the CUDA tests, run the
# benchmarks; full logs go to a folder, a short table comes last.
#
#   benchmarks/gpu_check.sh [LOG_DIR]      (default: $OUT, else ./gpu_logs)
#   QTENSOR_GPU_ONLY=fsdp benchmarks/gpu_check.sh   the build and the FSDP2 stanza only (2 GPUs)
#   QTENSOR_GPU_ONLY=decode benchmarks/gpu_check.sh the build and the decode GEMM stanza only
#   QTENSOR_GPU_ONLY=quant benchmarks/gpu_check.sh  the build, the quantizers' CUDA tests, bench_quantize
#     (QTENSOR_NCU=1 adds Nsight Compute on benchmarks/profile_quantize.py)
#
# To add a benchmark, add one `step NAME command...` line below: its output lands in
# LOG_DIR/NAME.log and its last line in the closing table.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu_logs}}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export QTENSOR_CUDA_ARCHS=${QTENSOR_CUDA_ARCHS:-90a}  # build only what this GPU runs
export MAX_JOBS=${MAX_JOBS:-16}
SUMMARY=()

step() {  # step NAME command... : run, log, remember rc, seconds and the last line
  local name=$1 start rc
  shift
  start=$(date +%s)
  "$@" >"$LOG/$name.log" 2>&1
  rc=$?
  SUMMARY+=("$(printf '%-16s rc=%-3s %5ss  %s' "$name" "$rc" "$(($(date +%s) - start))" "$(tail -n 1 "$LOG/$name.log" | cut -c1-110)")")
}

step build python3 setup.py build_ext --inplace
step env python3 -c "import torch, qtensor.ops.quant as q; print(torch.cuda.get_device_name(), torch.cuda.device_count(), torch.__version__, q.extension_status())"

# The quantization kernels (csrc/quant_cuda.cu, quant_rows_cuda.cu, convert_cuda.cu): every
# bit-exact CUDA test of the quantizers, then bench_quantize against the copy bandwidth.
if [ "${QTENSOR_GPU_ONLY:-}" = quant ]; then
  step quant_tests timeout 420 python3 -m pytest -m cuda -q -ra tests/test_kernels_quant.py tests/test_hybrid_gradient_cast.py tests/test_kernels_dispatch.py tests/test_training_linear.py
  step bench_quantize python3 benchmarks/bench_quantize.py --out "$LOG/bench_quantize.md" ${QTENSOR_BENCH_ARGS:-}
  # QTENSOR_NCU=1: Nsight Compute on one launch of each kernel (instructions, issue, occupancy).
  if [ "${QTENSOR_NCU:-}" = 1 ]; then
    step ncu_quantize ncu --clock-control none -k regex:"tile_kernel|rows_kernel|amax" --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --section InstructionStats python3 benchmarks/profile_quantize.py
  fi
  echo "== gpu_check (quant stanza only): logs in $LOG"
  printf '%s\n' "${SUMMARY[@]}"
  grep -E "passed|failed|error" "$LOG/quant_tests.log" | tail -n 3
  [ -f "$LOG/bench_quantize.md" ] && cat "$LOG/bench_quantize.md"
  exit 0
fi

# FSDP2 over NCCL on 2 GPUs (nvidia-h200-x2): the distributed tests (tests/test_fsdp_gpu.py:
# sharding of every format, quantize-before-all-gather training, DCP resume and a killed save,
# the all-gather bytes), the FSDP2 example's log, bf16 vs NVFP4 step time. With fewer than 2
# GPUs the tests skip and the other two are not run.
if [ "${QTENSOR_GPU_ONLY:-}" != decode ]; then
  GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  step fsdp_tests python3 -m pytest -m cuda -q -ra tests/test_fsdp_gpu.py
  if [ "$GPUS" -ge 2 ]; then
    step fsdp_example python3 examples/fsdp2_training.py --nproc 2 --device cuda
    step bench_fsdp python3 benchmarks/bench_fsdp.py --device cuda --out "$LOG/bench_fsdp.md"
  fi
  if [ "${QTENSOR_GPU_ONLY:-}" = fsdp ]; then
    echo "== gpu_check (FSDP2 stanza only): logs in $LOG"
    printf '%s\n' "${SUMMARY[@]}"
    [ -f "$LOG/bench_fsdp.md" ] && cat "$LOG/bench_fsdp.md"
    exit 0
  fi
fi

# The weight-only decode GEMM (docs/decode.md): its CUDA tests, its kernel against bf16 cuBLAS
# with the K-split sweep, and (decode stanza) the compiled end-to-end decode, by generate() and
# by the greedy loop without it.
# Under a time limit: a kernel whose barriers are wrong hangs rather than fails.
step decode_tests timeout 420 python3 -m pytest -m cuda -q -ra tests/test_decode_gemm.py tests/test_decode_weight.py tests/test_decode_fusion.py
step bench_gemm_decode python3 benchmarks/bench_gemm.py --decode --sweep --out "$LOG/bench_gemm_decode.md"
if [ "${QTENSOR_GPU_ONLY:-}" = decode ]; then
  # the loop's frozen and fused modes only: every config's compiles stay within one command
  step bench_decode python3 benchmarks/bench_decode.py --loop --batches 1 --modes frozen,fused --out "$LOG/bench_decode.md"
  echo "== gpu_check (decode stanza only): logs in $LOG"
  printf '%s\n' "${SUMMARY[@]}"
  [ -f "$LOG/bench_gemm_decode.md" ] && cat "$LOG/bench_gemm_decode.md"
  [ -f "$LOG/bench_decode.md" ] && cat "$LOG/bench_decode.md"
  exit 0
fi

step tests python3 -m pytest -m cuda -q -ra --continue-on-collection-errors --ignore=tests/test_fsdp_gpu.py --ignore=tests/test_decode_gemm.py --ignore=tests/test_decode_weight.py --ignore=tests/test_decode_fusion.py ${QTENSOR_GPU_TESTS:-tests/}
step demo_cuda python3 -m qtensor demo --device cuda
step bench_quantize python3 benchmarks/bench_quantize.py --out "$LOG/bench_quantize.md"
step bench_gemm python3 benchmarks/bench_gemm.py --out "$LOG/bench_gemm.md"
step bench_training python3 benchmarks/bench_training.py --out "$LOG/bench_training.json"
step bench_qat python3 benchmarks/bench_qat.py
step bench_overhead python3 benchmarks/bench_overhead.py --out "$LOG/bench_overhead.md"
step bench_decode python3 benchmarks/bench_decode.py --out "$LOG/bench_decode.md"

echo "== gpu_check: logs in $LOG"
printf '%s\n' "${SUMMARY[@]}"
[ -f "$LOG/bench_quantize.md" ] && cat "$LOG/bench_quantize.md"
[ -f "$LOG/bench_fsdp.md" ] && cat "$LOG/bench_fsdp.md"
exit 0
