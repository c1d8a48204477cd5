"""The trainer's learning-rate schedule, run by torch.optim.lr_scheduler.

The training step reads its learning rate from a one-element device tensor that the loop fills
in place before each step (``fusedres.apps.train.step``: no host read, the same kernels under a CUDA
graph). A torch scheduler, though, writes a Python float into its optimizer's ``param_groups``.
So the schedule here is torch's own scheduler driving a *shadow* optimizer (one placeholder
parameter, never stepped): :attr:`LRSchedule.lr` is its group's ``lr`` for the current
iteration, the loop copies it into the device tensor, and :meth:`LRSchedule.step` advances it,
exactly as ``scheduler.step()`` follows ``optimizer.step()`` in a plain PyTorch loop.

The schedules (``--schedule``), each after ``--warmup-iters`` of warm-up: linear by default
(``LinearLR`` from 1/warmup of the peak, reaching the peak at the last warm-up iteration), or
constant at ``--warmup-lr`` (``ConstantLR``; the peak from the first iteration after it), as
He et al. (2015, 2016) train their deepest CIFAR networks: 0.01 for 400 iterations, then 0.1:

* ``step``: ``MultiStepLR``, the rate times ``--lr-decay`` at each of ``--milestones``
  (iterations of the whole run, as He et al.'s recipe counts them);
* ``cosine``: ``CosineAnnealingLR`` from the peak down to ``--min-lr`` at the last iteration;
* ``poly``: ``PolynomialLR``, the peak times (1 - t/T) ** ``--poly-power`` (0 at the end).

Warm-up and the main schedule are chained by ``SequentialLR`` at the end of the warm-up. The
scheduler's ``state_dict`` goes into each checkpoint (key ``lr_scheduler``) and is loaded on
resume, with the shadow group's rate, so a resumed run continues the very same float sequence.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim import lr_scheduler as S

__all__ = ["SCHEDULES", "LRSchedule", "lr_sequence"]

SCHEDULES = ("step", "cosine", "poly")


class LRSchedule:
    """torch's scheduler for ``cfg`` over ``max_iters`` iterations; ``steps``: the step
    schedule's milestones as absolute iterations (``loop.milestones``)."""

    def __init__(self, cfg: dict[str, Any], max_iters: int, steps: list[int]):
        self._param = torch.nn.Parameter(torch.zeros(()))
        self.shadow = torch.optim.SGD([self._param], lr=float(cfg["lr"]))
        warmup = int(cfg["warmup_iters"])
        # The main schedule runs from the end of the warm-up (SequentialLR restarts its count).
        rest = max(max_iters - warmup, 1)
        kind = cfg["schedule"]
        if kind == "step":
            main = S.MultiStepLR(self.shadow, [max(m - warmup, 0) for m in steps],
                                 gamma=cfg["lr_decay"])
        elif kind == "cosine":
            main = S.CosineAnnealingLR(self.shadow, T_max=rest, eta_min=cfg["min_lr"])
        elif kind == "poly":
            main = S.PolynomialLR(self.shadow, total_iters=rest, power=cfg["poly_power"])
        else:  # the configuration refuses it first (config._check_values)
            raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {kind!r}")
        if warmup > 0:
            if cfg.get("warmup_lr") is not None:
                warm: S.LRScheduler = S.ConstantLR(
                    self.shadow, factor=float(cfg["warmup_lr"]) / float(cfg["lr"]),
                    total_iters=warmup)
            else:
                warm = S.LinearLR(self.shadow, start_factor=1.0 / warmup, end_factor=1.0,
                                  total_iters=max(warmup - 1, 1))
            with warnings.catch_warnings():
                # SequentialLR hands over with scheduler.step(0), which warns about the
                # deprecated epoch argument; it is torch's own call.
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler: S.LRScheduler = S.SequentialLR(self.shadow, [warm, main],
                                                               milestones=[warmup])
        else:
            self.scheduler = main

    @property
    def lr(self) -> float:
        """The learning rate of the current iteration."""
        return float(self.shadow.param_groups[0]["lr"])

    def step(self) -> None:
        """Advance to the next iteration (after the training step, as torch orders it)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # SequentialLR's step(0): see above
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "lr": self.lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        # The chained formulas (LinearLR, CosineAnnealingLR) go on from the group's rate.
        self.shadow.param_groups[0]["lr"] = state["lr"]


def lr_sequence(cfg: dict[str, Any], max_iters: int, steps: list[int], n: int) -> list[float]:
    """The first ``n`` learning rates of the schedule (the rate of iteration i at index i)."""
    sched, out = LRSchedule(cfg, max_iters, steps), []
    for _ in range(n):
        out.append(sched.lr)
        sched.step()
    return out
