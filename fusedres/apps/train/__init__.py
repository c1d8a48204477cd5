"""``fusedres train``: He et al.'s CIFAR and ImageNet recipes for pre-activation ResNets, with
fused BN-ReLU-conv blocks, on one device or many (torchrun), never losing a run.

    python -m fusedres.apps.train --config digits --out runs/digits
    torchrun --nproc_per_node 2 -m fusedres.apps.train --model preact_resnet1001 --sync-bn ...
    torchrun --nproc_per_node 8 -m fusedres.apps.train --config imagenet_resnet200 \
        --data-dir /data/imagenet --sync-bn ...   # ImageFolder trees streamed from disk

:func:`main` returns the exit code: 0 done, 2 a bad request (one line on stderr, nothing of an
existing run touched), 1 a file of the run that could not be written (a checkpoint, the
metrics log, config.yaml, the summary; a full disk: one line naming the file, the previous
checkpoint intact), 128 + signal number when stopped by SIGTERM/SIGINT (the first one during
training checkpoints the current iteration; a second one, or one before training starts, ends
the run at once).
The run directory is locked (``<out>/.lock``) while a run uses it.
"""

from __future__ import annotations

import contextlib
import signal
import sys

import torch.distributed as dist

from fusedres import BackendUnavailableError

from .checkpoint import RunWriteError
from .config import UsageError, resolve
from .loop import Run, Stopped

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``fusedres train`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    initialised = finished = False
    try:
        cfg, explicit = resolve(argv)
        initialised = _init_distributed(cfg)
        with contextlib.ExitStack() as scope:  # the backend choice ends with the run
            run = Run(cfg, explicit, scope)
            code = run.train()
        finished = True  # every process got here: done, or stopped together by a signal
        return code
    except Stopped as e:  # a second signal, or one before the first step: no checkpoint now
        print(f"fusedres train: {signal.Signals(e.code - 128).name} received: stopped",
              file=sys.stderr)
        return e.code
    except (UsageError, BackendUnavailableError) as e:
        print(f"fusedres train: error: {e}", file=sys.stderr)
        return 2
    except RunWriteError as e:  # a full disk: one line naming the file, checkpoints kept
        print(f"fusedres train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if initialised:
            _leave_distributed(dist, finished)


def _leave_distributed(dist, finished: bool) -> None:
    """Leave the process group so that the interpreter can exit cleanly.

    A gloo worker thread frees each finished collective's tensors itself, and freeing a tensor
    Python has already let go of takes the GIL. If that thread is still waiting for the GIL when
    the interpreter starts to finalise, CPython ends the thread and the C++ runtime aborts the
    process ("terminate called without an active exception", pytorch/pytorch#190489); torchrun
    then kills the other ranks. destroy_process_group() does not join those threads (torch keeps
    references to the default group), so instead the main thread gives up the GIL after the last
    collective: in a barrier (only when every process finished, else it could wait for a dead
    peer; bounded by a timeout, and never in the way of the exit code), then for a moment after
    leaving the group.
    """
    import datetime
    import time

    if finished:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
            else:
                dist.barrier()
        except RuntimeError as e:  # a peer gone: nothing left to wait for
            print(f"fusedres train: warning: final barrier: {str(e).splitlines()[0]}",
                  file=sys.stderr)
    dist.destroy_process_group()
    time.sleep(0.05)


def _init_distributed(cfg) -> bool:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1)."""
    import os

    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    use_cuda = cfg["device"] != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return True
