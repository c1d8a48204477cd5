"""Developer tools, run from the repository root and never installed (setup.py packages only
``fusedres``): the GPU performance model (``python -m tools.perfmodel``), the nvcc compile
table of csrc/cuda (``python -m tools.cuda_aot``), the sanitizer drivers of the CUDA code on
the CPU (``tools.cuda_tsan``), the op fuzzer (``tools.opfuzz``), the Triton launch
specialiser (``tools.jit_spec``), the Triton ahead-of-time compile table
(``python -m tools.triton_aot``) and the generators of benchmarks/' committed tables
(``tools.tables``: MEMORY.md, FUSE.md, report-cpu-layouts/). They import the library and its
apps; nothing under ``fusedres/`` imports them, except the benchmark's optional MODELED column
(tests/layout.py's ``TOOL_IMPORTS``).
"""
