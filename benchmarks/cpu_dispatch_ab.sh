#!/usr/bin/env bash
# benchmarks/NATIVE.md's table: the CPU kernels of the wheel (`make wheel-check`'s: run-time
# dispatch, every capability compiled in) against the in-place build they replace (REF, before
# run-time dispatch: the whole extension built with -march), on this CPU's best capability and
# on AVX2, emulated on an AVX-512 CPU by pinning every library to it (FUSEDRES_CPU_CAPABILITY,
# ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) against REF built with -march=x86-64-v3 (what
# -march=native gives on an AVX2 CPU). Sides, each run by benchmarks/cpu_dispatch_ab.py
# (pytest-benchmark medians of process CPU time, 1 torch thread) in a process of its own,
# alternating, ROUNDS rounds; each figure is a side's lowest median, the load average is logged
# before each run.
#
#   make wheel-check                                   # build/wheel-check/dist/*.whl
#   bash benchmarks/cpu_dispatch_ab.sh [ROUNDS] [REF]  # ROUNDS 2, REF 4010e29 (main before);
#                                                      # WHEEL=path for another wheel
#
# Work folder build/native-ab/: REF's tree and HEAD's (git archive), REF's two builds (kept:
# ~10 minutes on 2 cores each; rm them to rebuild), the JSON files, loads.txt and table.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
ROUNDS=${1:-2}
REF=${2:-4010e29}
PY=${PY:-$ROOT/.venv/bin/python}
AB=$ROOT/build/native-ab
SO=$($PY -c "import sysconfig; print('_C' + sysconfig.get_config_var('EXT_SUFFIX'))")
mkdir -p "$AB/runs"
wheel=${WHEEL:-$(ls "$ROOT"/build/wheel-check/dist/fusedres-*.whl)}

tree() {  # tree DIR REV: REV's tracked files in DIR (once)
    [ -d "$1" ] || { mkdir -p "$1"; git archive "$2" | tar -x -C "$1"; }
}
tree "$AB/ref" "$REF"
tree "$AB/head" HEAD
# REF's in-place builds: -march=native (FUSEDRES_CPU_NATIVE=1), and -march=x86-64-v3.
for kind in native avx2; do
    [ -f "$AB/ref-$kind.so" ] && continue
    if [ $kind = native ]; then flags=(FUSEDRES_CPU_NATIVE=1); else
        flags=(FUSEDRES_CPU_NATIVE=0 CFLAGS=-march=x86-64-v3); fi
    (cd "$AB/ref" && rm -rf build && env "${flags[@]}" FUSEDRES_BUILD_EXT=1 FUSEDRES_BUILD_CUDA=0 \
        FUSEDRES_BUILD_TEST_EXT=0 "$PY" setup.py -q build_ext --inplace > "$AB/ref-$kind.log" 2>&1)
    cp "$AB/ref/fusedres/$SO" "$AB/ref-$kind.so"
done
"$PY" -c "import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(
    'fusedres/' + sys.argv[2]))" "$wheel" "$SO" > "$AB/head/fusedres/$SO"

export TORCH_EXTENSIONS_DIR=$AB/torch-extensions
AVX2=(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)
run() {  # run SIDE ROUND TREE [ENV...]
    local side=$1 round=$2 tree=$3
    shift 3
    echo "$side round $round: $(uptime)" | tee -a "$AB/loads.txt"
    (cd "$tree" && env "$@" "$PY" -m pytest -c pyproject.toml --noconftest -p no:cacheprovider \
        -q "$ROOT/benchmarks/cpu_dispatch_ab.py" --benchmark-only \
        --benchmark-timer time.process_time \
        --benchmark-json="$AB/runs/$side-$round.json" > "$AB/runs/$side-$round.log" 2>&1) \
        || { tail -30 "$AB/runs/$side-$round.log"; exit 1; }
}
for r in $(seq "$ROUNDS"); do
    cp "$AB/ref-native.so" "$AB/ref/fusedres/$SO"
    run inplace "$r" "$AB/ref"
    run wheel "$r" "$AB/head"
    cp "$AB/ref-avx2.so" "$AB/ref/fusedres/$SO"
    run inplace_avx2 "$r" "$AB/ref" "${AVX2[@]}"
    run wheel_avx2 "$r" "$AB/head" FUSEDRES_CPU_CAPABILITY=avx2 "${AVX2[@]}"
done
echo "end: $(uptime)" | tee -a "$AB/loads.txt"
(cd "$ROOT/benchmarks" && "$PY" cpu_dispatch_ab.py --table "$AB/runs" --pair inplace wheel \
    --pair inplace_avx2 wheel_avx2) | tee "$AB/table.md"
