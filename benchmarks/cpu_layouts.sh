#!/usr/bin/env bash
# The CPU figures of both memory layouts (benchmarks/RESULTS.md, "Both layouts"): the 40-shape
# BASIC_SWEEP and the bottleneck set on 2 threads and 1, and whole training steps. Run on a
# quiet machine (nothing else running); ~35 minutes on 2 cores. Usage: bash
# benchmarks/cpu_layouts.sh [OUT_DIR] (default benchmarks/report-cpu-layouts).
set -euo pipefail
out=${1:-benchmarks/report-cpu-layouts}
common=(--device cpu --baselines plain,channels_last --backends cpu --no-progress)
for t in 2 1; do
  fusedres bench units "${common[@]}" --threads "$t" --set basic-sweep --reps 15 --warmup 3 \
    --out "$out/sweep-${t}t"
  fusedres bench units "${common[@]}" --threads "$t" --set cifar,resnet50 --reps 9 --warmup 2 \
    --out "$out/bottleneck-${t}t"
done
fusedres bench step --device cpu --threads 2 --models 20,56,164 --batch 128 \
  --variants plain,fused --layouts nchw,channels_last --reps 5 --warmup 1 --no-progress \
  --out "$out/step-2t"
fusedres bench step --device cpu --threads 2 --models 1001 --batch 32 \
  --variants plain,fused --layouts nchw,channels_last --reps 3 --warmup 1 --no-progress \
  --out "$out/step-1001-2t"
