"""``fusedres bench``: how much time and memory the fused units save on this machine.

Subcommands (``fusedres bench --help``): ``units`` (single units against plain PyTorch,
channels_last, torch.compile and checkpointing), ``step`` (whole training steps of the zoo's
models), ``fit`` (what fits in a memory budget, found by running), ``gpu-report`` (all of it
plus the self-test, one report directory). Modules: :mod:`.shapes` (the one table of shapes the
benchmarks and the self-test share), :mod:`.measure` (timing and peak memory),
:mod:`.units`, :mod:`.step`, :mod:`.fit`, :mod:`.report`, :mod:`.runner`.
"""

from .cli import main

__all__ = ["main"]
