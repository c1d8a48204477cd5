"""``fusedres train --log-grad-norms``: per residual unit, gradient norms against depth.

Two norms per unit, in forward order (unit 1 nearest the input):

* ``input_grad_norm``: ||dL/dx_l||, the gradient of the batch's mean loss L with respect to the
  unit's input x_l (over the whole batch). This is the quantity the papers' argument is about:
  backpropagation multiplies it by one Jacobian per unit on its way from the loss to unit l. In
  a residual network, x_L = x_l + sum F, so dL/dx_l = dL/dx_L (1 + d(sum F)/dx_l) (He et al.
  2016, eq. 5): the identity term carries the gradient to every depth whatever the branches do.
  A plain network has only the product of the branches' Jacobians, so the norm grows or decays
  geometrically with depth (measured on digits: docs/experiments.md). It is what the figure of
  ``fusedres compare`` shows first.
* ``param_grad_norm``: the L2 norm of all of the unit's parameter gradients, what SGD steps by.
  Weaker as a diagnosis alone: behind BatchNorm a convolution's weight gradient scales as
  1/||w||, so it also moves with the weights' own norm.

Cheap: the probe is armed only on the steps whose end is a logged iteration; then a tensor hook
on each unit's input adds ||g||^2 into one device buffer during backward, and the parameter norms
are taken after backward (before the optimizer step) into another, all on the device. The loop
reads both at that iteration's log record, where it synchronises anyway; a step reads nothing
back on the host (``tests/test_train_step.py`` counts the syncs of an armed step). With
``--amp fp16`` both are divided by the loss scale the backward used.

Not with ``--cuda-graphs`` (a replay runs no Python: the hooks would be armed at capture or never)
nor ``--compile`` (the hooks would break the graph): the configuration refuses both.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["GradNormProbe", "residual_units"]


def residual_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, unit) of ``model``'s residual units in forward order: its ``units()``
    when it has that method (fusedres's zoo), else every :class:`fusedres.modules.ResidualBlock`
    not inside another, in module order."""
    from fusedres.modules import ResidualBlock

    names = {id(m): n for n, m in model.named_modules()}
    if callable(getattr(model, "units", None)):
        return [(names[id(u)], u) for u in model.units()]
    out, inside = [], ()
    for n, m in model.named_modules():
        if isinstance(m, ResidualBlock) and not n.startswith(inside):
            out.append((n, m))
            inside = tuple(name + "." for name, _ in out)
    return out


class GradNormProbe:
    """Hooks on ``model``'s residual units. ``arm(scaler)`` before a step, ``after_backward()``
    between its backward and its optimizer step (``TrainStep`` does), ``read()`` after it:
    ``{"units", "input_grad_norm", "param_grad_norm"}`` as lists (one host read), and the
    buffers zeroed for the next armed step."""

    def __init__(self, model: nn.Module):
        units = residual_units(model)
        if not units:
            raise ValueError("model: has no residual units (fusedres.modules.ResidualBlock) to "
                             "log gradient norms for")
        self.names = [n for n, _ in units]
        self.params = [[p for p in u.parameters() if p.requires_grad] for _, u in units]
        device = next(model.parameters()).device
        self.input_sq = torch.zeros(len(units), dtype=torch.float32, device=device)
        self.param_norm = torch.zeros(len(units), dtype=torch.float32, device=device)
        self.armed = False
        self.scaler: torch.amp.GradScaler | None = None
        self.handles = [u.register_forward_pre_hook(functools.partial(self._forward, i))
                        for i, (_, u) in enumerate(units)]

    def _forward(self, i: int, module: nn.Module, args: tuple) -> None:
        if not self.armed or not torch.is_grad_enabled() or not args:
            return
        # A unit recomputed in backward (activation checkpointing, --memory-budget's plan) runs
        # its forward again inside the autograd engine: its input's gradient is the one the
        # first forward's hook sees, so it is not hooked twice (torch.utils.checkpoint tells the
        # two apart the same way).
        if torch._C._current_graph_task_id() != -1:
            return
        x = args[0]
        if torch.is_tensor(x) and x.requires_grad:
            x.register_hook(functools.partial(self._backward, i))

    def _backward(self, i: int, grad: Tensor) -> None:
        # Summed over micro-batches under --accum-steps (each one's loss is already / k).
        g = grad.detach().float()
        scale = self._scale()
        if scale is not None:
            g = g / scale
        self.input_sq[i] += torch.linalg.vector_norm(g).square()

    def _scale(self) -> Tensor | None:
        """The loss scale this step's backward used (--amp fp16), as GradScaler holds it on the
        device: its public ``get_scale()`` reads it on the host. Read between the backward and
        ``scaler.update()``, which may change it."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return self.scaler._scale

    def arm(self, scaler: torch.amp.GradScaler | None = None) -> None:
        """The next step is measured; ``scaler``: the step's GradScaler (its scale is divided
        out under --amp fp16)."""
        self.armed, self.scaler = True, scaler

    @torch.no_grad()
    def after_backward(self) -> None:
        """Each unit's parameter-gradient norm, on the device (no host read)."""
        for i, params in enumerate(self.params):
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                self.param_norm[i] = 0.0
                continue
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            scale = self._scale()
            if scale is not None:
                norm = norm / scale
            self.param_norm[i] = norm
        self.armed = False

    def read(self) -> dict[str, list]:
        """The last armed step's norms; one device-to-host copy."""
        values = torch.cat([self.input_sq.sqrt(), self.param_norm]).tolist()
        n = len(self.names)
        self.input_sq.zero_()
        self.param_norm.zero_()
        return {"units": list(self.names), "input_grad_norm": values[:n],
                "param_grad_norm": values[n:]}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
