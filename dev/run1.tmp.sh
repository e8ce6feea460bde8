#!/usr/bin/env bash
# Session run 1: the pending decode series; what the card allows.
set -u
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site QTENSOR_CUDA_ARCHS=90a MAX_JOBS=16
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); el "GPU: $gpu"
nvidia-smi --query-gpu=clocks.max.sm,clocks.max.mem --format=csv
if [[ $gpu == *H200* ]]; then
  dev/compare_builds.sh run .whl/decode "bash dev/gpu-pending/decode-session.sh P" > $OUT/run1_P.log 2>&1; el "P done"
  grep -v "^\s*$" $OUT/run1_P.log | tail -80
  timeout 200 bash dev/gpu-pending/decode-session.sh W > $OUT/run1_W.log 2>&1; el "W done"; cat $OUT/run1_W.log
  PYTHONPATH="$PWD:$PYTHONPATH" timeout 150 python3 benchmarks/bench_gemm.py --decode > $OUT/run1_bench_gemm_decode.log 2>&1; el "bench done"
  tail -60 $OUT/run1_bench_gemm_decode.log
else
  mkdir -p .whl/wide && mv .whl/decode/6f5d612.tar .whl/wide/
  dev/compare_builds.sh run .whl/wide "true" > $OUT/run1_build.log 2>&1; el "build done"; tail -5 $OUT/run1_build.log
  timeout 200 bash dev/gpu-pending/decode-session.sh W > $OUT/run1_W.log 2>&1; el "W done"; cat $OUT/run1_W.log
  timeout 280 bash dev/gpu-pending/decode-session.sh T > $OUT/run1_T.log 2>&1; el "T done"; cat $OUT/run1_T.log
  PYTHONPATH="$PWD:$PYTHONPATH" timeout 100 ncu --clock-control none -k regex:decode_gemm --launch-skip 1 --launch-count 1 \
    --section SourceCounters --page source --print-source sass --csv \
    python3 dev/experiments/decode_launches.py profile --shapes 28672x8192 --ms 64 > $OUT/run1_wg_src.csv 2>$OUT/run1_wg_ncu.err; el "ncu src done"
  python3 benchmarks/ncu_sass_regions.py $OUT/run1_wg_src.csv --elements 234881024 --top 25 > $OUT/run1_wg_regions.txt 2>&1; head -90 $OUT/run1_wg_regions.txt
  PYTHONPATH="$PWD:$PYTHONPATH" timeout 80 ncu --clock-control none -k regex:decode_gemm --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
    python3 dev/experiments/decode_launches.py profile --shapes 28672x8192 --ms 64 > $OUT/run1_wg_sections.txt 2>&1; el "ncu sections done"
  grep -v "^==PROF==" $OUT/run1_wg_sections.txt | tail -120
fi
el end
