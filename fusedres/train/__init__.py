"""``fusedres train``: He et al.'s CIFAR recipe for pre-activation ResNets, with fused
BN-ReLU-conv blocks, on one device or many (torchrun), never losing a run.

    python -m fusedres.train --config digits --out runs/digits
    torchrun --nproc_per_node 2 -m fusedres.train --model preact_resnet1001 --sync-bn ...

:func:`main` returns the exit code: 0 done, 2 a bad request (one line on stderr, nothing of an
existing run touched), 128 + signal number when stopped by SIGTERM/SIGINT after checkpointing.
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``fusedres train`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    import torch.distributed as dist

    from fusedres import BackendUnavailableError

    from .config import UsageError, resolve

    initialised = False
    try:
        cfg, explicit = resolve(argv)
        from .loop import Run

        initialised = _init_distributed(cfg)
        with contextlib.ExitStack() as scope:  # the backend choice ends with the run
            run = Run(cfg, explicit, scope)
            return run.train()
    except (UsageError, BackendUnavailableError) as e:
        print(f"fusedres train: error: {e}", file=sys.stderr)
        return 2
    finally:
        if initialised:
            dist.destroy_process_group()


def _init_distributed(cfg) -> bool:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1)."""
    import os

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    use_cuda = cfg["device"] != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return True
