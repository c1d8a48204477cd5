#!/usr/bin/env bash
# The CPU figures of both memory layouts (benchmarks/RESULTS.md, its current section): the 40-shape
# BASIC_SWEEP and the bottleneck set on 2 threads and 1, and whole training steps. Run on a
# quiet machine (nothing else running); ~40 minutes on 2 cores. Usage: bash
# tools/tables/cpu_layouts.sh [OUT_DIR] (default benchmarks/report-cpu-layouts).
set -euo pipefail
out=${1:-benchmarks/report-cpu-layouts}
common=(--device cpu --baselines plain,channels_last --backends cpu --no-progress)
units() {  # threads, set, reps, name
  fusedres bench units "${common[@]}" --threads "$1" --set "$2" --reps "$3" --warmup 2 \
    --out "$out/$4"
}
step() {  # models, batch, reps, name, extra...
  fusedres bench step --device cpu --threads 2 --models "$1" --batch "$2" --variants plain,fused \
    --layouts nchw,channels_last --reps "$3" --warmup 1 --no-progress --out "$out/$4" "${@:5}"
}
units 2 basic-sweep 15 sweep-2t
units 2 cifar,resnet50 9 bottleneck-2t
step 20,56,164 128 15 step-2t
step 1001 32 5 step-1001-2t
step 56 128 5 step-56-malloc-default --malloc default
units 1 cifar,resnet50 7 bottleneck-1t
units 1 basic-sweep 15 sweep-1t
