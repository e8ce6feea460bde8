#!/usr/bin/env bash
# One GPU call of the training-speed probes: build csrc if this tree has no build, then each
# named step with its own limit; everything under $OUT/r (packed into $OUT/r.tgz after each step,
# as a call brings back at most 8 files).
#   OUT=$OUT bash dev/train_probes/run.sh [tests] [fp8] [gemm] [bench]
#   tests: the CUDA tests of the training GEMMs and the FP8 block paths
#   fp8:   fp8_block_probe.py, the scale layouts of torch._scaled_mm's FP8 block GEMM
#   gemm:  gemm_probe.py, the large products' parts and the persistent kernel's configs
#   bench: benchmarks/bench_training.py --sections "$SECTIONS" (COMPILED: its --compiled)
#   native: native_fp8_compile_probe.py, why a compiled QAT step with native FP8 GEMMs differed
#   gpt:   gpt_profile.py "$r/gpt" $GPT_ARGS, where the small GPT's (and MoE's) step time goes
#   train: the CUDA tests of the training linear and its compiled steps (a shorter `tests`)
#   plans: the dense and grouped GEMMs' and the training linears' CUDA tests
#   host:  bench_training.py --sections host, a training linear's host time a step on the GPU
#   grouped: the grouped GEMM's CUDA tests, then grouped_probe.py (persistent vs tiled kernel)
#   step:  host_probe.py --step, a training linear's step split, profiled
#   gptab: codes_probe.py --gpt-only, the small GPT's eager step with and without codes products
#   pieces: host_probe.py, a training linear's host time on the GPU piece by piece
#   layers: layers_probe.py, fprop's and a cast's host time call by call, and in the backward
#   glue:  glue_probe.py, the step's host time outside its casts and products
#   moe:   the grouped linear's and grouped GEMM's CUDA tests, then bench_training.py --sections moe
#   syncs: sync_probe.py $SYNC_RECIPES, the host syncs of the small GPT's eager step per recipe
#   gluepinned: glue_probe.py with the process pinned to one core (taskset), engine's thread too
#   (thread_probe.py, the same question on the CPU with a worker thread, needs no GPU)
#   codesgpu: codes_gpu_probe.py, products on codes vs decoded first, GPU time alone (graphed)
#   moeprof: moe_profile.py row and nvfp4, where a GroupedLinear MoE step's time goes
#   kgrouped: the wgrad kernel grouped along K's CUDA tests, then grouped_k_probe.py (configs)
#   codes: the dense GEMM's CUDA tests, then codes_probe.py --gpt (products on codes vs decoded
#          first, the persistent kernels' direct launch, the small GPT's eager step each way)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
r=$OUT/r
mkdir -p "$r"
pack() { tar czf "$OUT/r.tgz" -C "$OUT" r; }
if ! python -c "import qtensor._C" 2>/dev/null; then
  start=$(date +%s)
  python setup.py build_ext --inplace >"$r/build.log" 2>&1 || { tail -30 "$r/build.log"; pack; exit 1; }
  echo "build $(( $(date +%s) - start )) s"
fi
for p in "$@"; do
  case $p in
    tests) timeout 300 python -m pytest -q -m cuda tests/test_compile_gpu.py tests/test_tensors_fp8_block.py tests/test_qat_kernels.py tests/test_gemm_triton.py tests/test_qat_linear.py tests/test_training_linear.py tests/test_compile_training.py tests/test_grouped_mm.py tests/test_gemm_ops.py >"$r/tests.log" 2>&1; echo "tests rc=$?"; tail -15 "$r/tests.log" ;;
    bench) timeout ${BENCH_LIMIT:-300} python benchmarks/bench_training.py --sections "$SECTIONS" --compiled "${COMPILED-nvfp4,dgrad_mxfp8,4over6}" --out "$r/bench_training.json" --md "$r/bench_training.md" >"$r/bench_training.log" 2>&1; echo "bench rc=$?"; grep -v "^|\|^#\|^$" "$r/bench_training.log" | tail -40; cat "$r/bench_training.md" ;;
    plans) timeout 240 python -m pytest -q -m cuda tests/test_gemm_triton.py tests/test_gemm_ops.py tests/test_training_linear.py tests/test_training_grouped.py tests/test_grouped_mm.py >"$r/plans_tests.log" 2>&1; echo "plans tests rc=$?"; tail -8 "$r/plans_tests.log" ;;
    train) timeout ${TRAIN_LIMIT:-200} python -m pytest -q -m cuda tests/test_training_linear.py tests/test_training_modules.py tests/test_training_grouped.py tests/test_compile_gpu.py -k "training or default_recipe or share or graph" >"$r/train.log" 2>&1; echo "train rc=$?"; tail -8 "$r/train.log" ;;
    host) timeout 120 python benchmarks/bench_training.py --sections host --md "$r/host.md" >"$r/host.log" 2>&1; echo "host rc=$?"; cat "$r/host.md" ;;
    native) timeout 200 python dev/train_probes/native_fp8_compile_probe.py >"$r/native.log" 2>&1; echo "native rc=$?"; tail -20 "$r/native.log" ;;
    gpt) timeout ${GPT_LIMIT:-360} python dev/train_probes/gpt_profile.py "$r/gpt" ${GPT_ARGS:-} >"$r/gpt.log" 2>&1; echo "gpt rc=$?"; grep -v "^ *$" "$r/gpt.log" | tail -40 ;;
    grouped) timeout 200 python -m pytest -q -m cuda tests/test_grouped_mm.py tests/test_gemm_triton.py tests/test_training_grouped.py >"$r/grouped_tests.log" 2>&1; echo "grouped tests rc=$?"; tail -8 "$r/grouped_tests.log"
             timeout ${GROUPED_LIMIT:-240} python dev/train_probes/grouped_probe.py >"$r/grouped.log" 2>&1; echo "grouped rc=$?"; cat "$r/grouped.log" | tail -30 ;;
    codes) timeout 240 python -m pytest -q -m cuda tests/test_gemm_triton.py tests/test_grouped_mm.py tests/test_gemm_ops.py tests/test_training_linear.py >"$r/codes_tests.log" 2>&1; echo "codes tests rc=$?"; tail -8 "$r/codes_tests.log"
           timeout ${CODES_LIMIT:-300} python dev/train_probes/codes_probe.py --gpt >"$r/codes.log" 2>&1; echo "codes rc=$?"; cat "$r/codes.log" | tail -45 ;;
    step) timeout 120 python dev/train_probes/host_probe.py --step >"$r/step.log" 2>&1; echo "step rc=$?"; head -12 "$r/step.log"; grep -A22 "Self CPU %" "$r/step.log" | cut -c1-160 | head -26 ;;
    gptab) timeout 150 python dev/train_probes/codes_probe.py --gpt-only >"$r/gptab.log" 2>&1; echo "gptab rc=$?"; cat "$r/gptab.log" ;;
    pieces) timeout 150 python dev/train_probes/host_probe.py >"$r/pieces.log" 2>&1; echo "pieces rc=$?"; cat "$r/pieces.log" | tail -40 ;;
    layers) timeout 150 python dev/train_probes/layers_probe.py >"$r/layers.log" 2>&1; echo "layers rc=$?"; cat "$r/layers.log" | tail -60 ;;
    glue) timeout 150 python dev/train_probes/glue_probe.py >"$r/glue.log" 2>&1; echo "glue rc=$?"; head -26 "$r/glue.log"; grep -A36 "engine's backward" "$r/glue.log" | cut -c1-150 ;;
    moe) timeout 150 python -m pytest -q -m cuda tests/test_training_grouped.py tests/test_grouped_mm.py >"$r/moe_tests.log" 2>&1; echo "moe tests rc=$?"; tail -6 "$r/moe_tests.log"
         timeout 150 python benchmarks/bench_training.py --sections moe --warmup 5 --iters 25 --md "$r/moe.md" >"$r/moe.log" 2>&1; echo "moe rc=$?"; grep "^moe" "$r/moe.log" ;;
    syncs) timeout 200 python dev/train_probes/sync_probe.py ${SYNC_RECIPES:-} >"$r/syncs.log" 2>&1; echo "syncs rc=$?"; cat "$r/syncs.log" | tail -60 ;;
    gluepinned) timeout 150 taskset -c "${PIN_CORE:-2}" python dev/train_probes/glue_probe.py >"$r/glue_pinned.log" 2>&1; echo "gluepinned rc=$?"; grep "^|" "$r/glue_pinned.log" ;;
    codesgpu) timeout 150 python dev/train_probes/codes_gpu_probe.py >"$r/codesgpu.log" 2>&1; echo "codesgpu rc=$?"; cat "$r/codesgpu.log" | tail -20 ;;
    moeprof) for m in row nvfp4; do timeout 120 python dev/train_probes/moe_profile.py $m >"$r/moeprof_$m.log" 2>&1; echo "moeprof $m rc=$?"; head -1 "$r/moeprof_$m.log"; done ;;
    kgrouped) timeout 120 python -m pytest -q -m cuda tests/test_grouped_mm_k.py >"$r/kgrouped_tests.log" 2>&1; echo "kgrouped tests rc=$?"; tail -2 "$r/kgrouped_tests.log"
              timeout 150 python dev/train_probes/grouped_k_probe.py >"$r/kgrouped.log" 2>&1; echo "kgrouped rc=$?"; cat "$r/kgrouped.log" ;;
    fp8) timeout 120 python dev/train_probes/fp8_block_probe.py "$r" >"$r/fp8.log" 2>&1; echo "fp8 rc=$?"; grep -c MATCH "$r/fp8.log"; tail -8 "$r/fp8.log" ;;
    gemm) timeout 200 python dev/train_probes/gemm_probe.py "$r" >"$r/gemm.log" 2>&1; echo "gemm rc=$?"; grep "^|" "$r/gemm.log" | tail -10; grep -i "failed\|error" "$r/gemm.log" | head -5 ;;
  esac
  pack
done
