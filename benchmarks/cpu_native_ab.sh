#!/usr/bin/env bash
# Portable against -march=native builds of fusedres._C (setup.py's FUSEDRES_CPU_NATIVE): builds
# the extension both ways into build/native-ab/, then runs benchmarks/cpu_native_ab.py against
# each, alternating (ROUNDS rounds; the lower median of each figure is kept), and leaves the
# portable build in place. ~6 minutes on 2 cores. Usage: bash benchmarks/cpu_native_ab.sh
# [ROUNDS] (default 2); the figures are in benchmarks/NATIVE.md. rm -r build/native-ab to rebuild.
set -euo pipefail
rounds=${1:-2}
py=${PY:-.venv/bin/python}
ab=build/native-ab
so=$($py -c "import sysconfig; print('fusedres/_C' + sysconfig.get_config_var('EXT_SUFFIX'))")
mkdir -p "$ab"
# The CPU kernels only (no nvcc copy of csrc/cuda); a build already in build/native-ab/ is reused.
for native in 1 0; do
  [ -f "$ab/native-$native.so" ] && continue
  FUSEDRES_BUILD_EXT=1 FUSEDRES_BUILD_CUDA=0 FUSEDRES_CPU_NATIVE=$native \
    $py setup.py -q build_ext --inplace >/dev/null
  cp "$so" "$ab/native-$native.so"
done
# The benchmark's own small extension (cpu_kernels.py) outside the shared torch cache.
export TORCH_EXTENSIONS_DIR=$PWD/$ab/torch-extensions
for r in $(seq "$rounds"); do
  for native in 0 1; do
    cp "$ab/native-$native.so" "$so"
    PYTHONPATH=benchmarks $py benchmarks/cpu_native_ab.py --label "native=$native" \
      | tee -a "$ab/runs.jsonl"
  done
done
cp "$ab/native-0.so" "$so"
PYTHONPATH=benchmarks $py benchmarks/cpu_native_ab.py --table "$ab/runs.jsonl"
