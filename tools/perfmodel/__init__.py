"""A GPU performance model read from the compiled SASS, calibrated against published GEMM
measurements: ``python -m tools.perfmodel`` (see benchmarks/GPU_MODEL.md). Modules: sass
(disassembly, loops, counts), devices (A100/H100 spec sheets), model (bounds, waves, time),
gemm + published + calibrate (the calibration), launches (the fused unit's launches, compiled
as the JIT specialises them), units (fused vs plain per unit), report (the markdown)."""
