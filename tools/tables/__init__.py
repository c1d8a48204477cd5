"""The generators of benchmarks/' committed tables, run from the repository root:
``python -m tools.tables.memory_table`` and ``tools.tables.variant_memory`` (MEMORY.md),
``tools.tables.process_memory`` (MEMORY.md's process rows), ``tools.tables.fuse_memory``
(FUSE.md), ``bash tools/tables/cpu_layouts.sh`` (report-cpu-layouts/, RESULTS.md's current run).
"""
