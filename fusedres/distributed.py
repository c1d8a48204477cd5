"""Synchronised BatchNorm for the fused op: one process with the whole batch, on many processes.

Every process holds ``n_r`` samples of the global batch (``M = sum n_r`` values per channel).

Forward: each process computes its per-channel mean and variance (the ``batch_stats`` op, stable
in float32), turns them into the sum and the sum of squares in float64, and one ``all_reduce``
of ``[sum, sum of squares, count]`` gives the global mean and biased variance; the running
statistics are updated once, with the global count in the unbiased correction.

Backward: the fused op is called with ``batch_stats=False``, so it returns
``dx_local = scale * dz`` and the local sums ``sum(dz * xhat)`` (as the BN weight gradient) and
``sum(dz)`` (as the BN bias gradient). :class:`_GlobalBatchNormGrad` sits between the module's
tensors and the op; its backward all-reduces the two sums and adds the missing term of the
training-mode BatchNorm gradient::

    dx = scale * (dz - S_dz / M - xhat * S_dzxhat / M)        (S_*: sums over all processes)

while the parameter gradients stay local (DistributedDataParallel averages them, as it does for
every parameter). No new kernel, no extra saved activation: ``x`` is the tensor the op saves.

``SyncBatchNorm2d`` is a drop-in ``nn.BatchNorm2d`` whose plain ``forward`` synchronises too
(on CPU as well, which ``nn.SyncBatchNorm`` does not do), and whose ``fused_prepare(x)`` is what
the fused modules call instead of the local statistics pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from . import functional as FR
from . import ops

__all__ = [
    "SyncBatchNorm2d",
    "SyncBatchNormAct2d",
    "convert_sync_batchnorm",
    "prepare_batch_norm_sync",
    "sync_active",
]


def _group_size(process_group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def sync_active(bn: nn.Module, process_group=None) -> bool:
    """True when ``bn`` normalises with batch statistics and there is more than one process."""
    use_batch = bn.training or bn.running_mean is None
    return use_batch and _group_size(process_group) > 1


@torch.no_grad()
def _global_stats(x: Tensor, process_group) -> tuple[Tensor, Tensor, int]:
    """Global per-channel (mean, biased var) in the statistics dtype, and the global count."""
    c = x.shape[1]
    local_mean, local_var = torch.ops.fusedres.batch_stats(x.detach())
    n = x.numel() // c
    mean64, var64 = local_mean.double(), local_var.double()
    packed = torch.cat([mean64 * n, (var64 + mean64 * mean64) * n,
                        torch.full((1,), float(n), dtype=torch.float64, device=x.device)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=process_group)
    count = int(round(packed[-1].item()))
    mean = packed[:c] / count
    var = (packed[c:2 * c] / count - mean * mean).clamp_min_(0.0)
    sdt = ops.stats_dtype(x.dtype)
    return mean.to(sdt), var.to(sdt), count


@torch.no_grad()
def _update_running(bn: nn.Module, mean: Tensor, var: Tensor, count: int) -> None:
    if bn.running_mean is None or not bn.training:
        return
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    if bn.momentum is None:
        factor = 1.0 / bn.num_batches_tracked.to(bn.running_mean.dtype)
    else:
        factor = bn.momentum
    unbiased = var * (count / max(count - 1, 1))
    bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype) * factor)
    bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype) * factor)


class _GlobalBatchNormGrad(torch.autograd.Function):
    """Identity on (x, bn_weight, bn_bias); backward completes dx with the all-reduced sums.

    The op downstream runs with ``batch_stats=False``: the gradients that reach this node are
    ``scale * dz`` for x and the local ``sum(dz * xhat)``, ``sum(dz)`` for the BN parameters.
    """

    @staticmethod
    def forward(ctx, x, bn_weight, bn_bias, mean, invstd, count, process_group):
        ctx.save_for_backward(x, bn_weight, mean, invstd)
        ctx.count = count
        ctx.process_group = process_group
        return x.view_as(x), bn_weight.view_as(bn_weight), bn_bias.view_as(bn_bias)

    @staticmethod
    def backward(ctx, grad_x, grad_w, grad_b):
        x, bn_weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        zeros = mean.new_zeros((c,))
        local = torch.cat([zeros if grad_b is None else grad_b.to(mean.dtype),
                           zeros if grad_w is None else grad_w.to(mean.dtype)])
        sums = local.clone()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.process_group)
        dx = None
        if ctx.needs_input_grad[0]:
            scale = (bn_weight * invstd).view(1, c, 1, 1)
            mean_dz = (sums[:c] / ctx.count).view(1, c, 1, 1)
            mean_dz_xhat = (sums[c:] / ctx.count).view(1, c, 1, 1)
            xhat = (x.to(mean.dtype) - mean.view(1, c, 1, 1)) * invstd.view(1, c, 1, 1)
            correction = scale * (mean_dz + xhat * mean_dz_xhat)
            if grad_x is None:
                dx = (-correction).to(x.dtype)
            else:
                dx = (grad_x.to(mean.dtype) - correction).to(x.dtype)
        return dx, grad_w, grad_b, None, None, None, None


def prepare_batch_norm_sync(x: Tensor, bn: nn.Module, process_group=None) -> FR.BatchNormState:
    """``prepare_batch_norm`` for ``bn`` with statistics over every process of ``process_group``.

    x: (N_local, C, H, W). ``bn``: ``nn.BatchNorm2d``, ``nn.SyncBatchNorm`` or
    :class:`SyncBatchNorm2d`. With one process, or when ``bn`` uses its running statistics
    (eval), this is the ordinary local ``prepare_batch_norm``. Otherwise it runs one
    ``all_reduce`` in forward and one in backward; feed the result to
    ``functional.conv2d_from_prepared`` as usual (any number of convolutions).
    """
    if sync_active(bn, process_group):
        return _prepare_synced(x, bn, process_group)
    return FR.prepare(FR.batch_norm_args(bn), x)


def _prepare_synced(x: Tensor, bn: nn.Module, process_group) -> FR.BatchNormState:
    """:func:`prepare_batch_norm_sync` with more than one process and batch statistics."""
    FR.check_x(x)
    c = x.shape[1]
    if c != bn.num_features:
        raise ValueError(f"x: expected {bn.num_features} channels (bn.num_features), got {c}")
    mean, var, count = _global_stats(x, process_group)
    if count <= 1:
        raise ValueError("x: expected more than 1 value per channel over all processes when "
                         f"training, got {count}")
    _update_running(bn, mean, var, count)
    invstd = torch.rsqrt(var + bn.eps)
    sdt = mean.dtype
    # Placeholders when affine=False: the op must still return the two sums the backward needs.
    w = bn.weight.to(sdt) if bn.weight is not None else torch.ones(
        c, dtype=sdt, device=x.device, requires_grad=True)
    b = bn.bias.to(sdt) if bn.bias is not None else torch.zeros(
        c, dtype=sdt, device=x.device, requires_grad=True)
    if not w.requires_grad:  # frozen BN parameters: the sums are needed all the same
        w = w.detach().requires_grad_()
    if not b.requires_grad:
        b = b.detach().requires_grad_()
    if torch.is_grad_enabled():
        xs, w, b = _GlobalBatchNormGrad.apply(x, w, b, mean, invstd, count, process_group)
    else:
        xs = x
    return FR.BatchNormState(xs, w, b, mean, invstd, False)


class _AllReduceSum(torch.autograd.Function):
    """Sum over processes; its gradient is the sum of the processes' gradients."""

    @staticmethod
    def forward(ctx, t, process_group):
        ctx.process_group = process_group
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=process_group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.process_group)
        return grad, None


def _sync_batch_norm_plain(x: Tensor, bn: nn.Module, process_group) -> Tensor:
    """Differentiable BatchNorm with global statistics, for the plain (unfused) forward.

    Two passes (mean, then centred squares) through the autograd-aware all_reduce; the backward
    of an all_reduce of sums is an all_reduce of the gradients, which is exactly SyncBN's.
    """
    def all_reduce(t, group):
        return _AllReduceSum.apply(t, group)

    c = x.shape[1]
    sdt = ops.stats_dtype(x.dtype)
    xs = x.to(sdt)
    n = torch.full((1,), float(x.numel() // c), dtype=sdt, device=x.device)
    count = all_reduce(n, group=process_group)
    mean = all_reduce(xs.sum((0, 2, 3)), group=process_group) / count
    centred = xs - mean.view(1, c, 1, 1)
    var = all_reduce(centred.pow(2).sum((0, 2, 3)), group=process_group) / count
    _update_running(bn, mean.detach(), var.detach(), int(round(count.item())))
    y = centred * torch.rsqrt(var + bn.eps).view(1, c, 1, 1)
    if bn.weight is not None:
        y = y * bn.weight.to(sdt).view(1, c, 1, 1)
    if bn.bias is not None:
        y = y + bn.bias.to(sdt).view(1, c, 1, 1)
    return y.to(x.dtype)


class SyncBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with statistics over all processes of ``process_group`` (or the world)
    while training. Same parameters, buffers and state_dict keys; with one process it is exactly
    ``nn.BatchNorm2d``. Works on CPU (gloo) and GPU (nccl); the fused modules call
    :meth:`fused_prepare`."""

    def __init__(self, *args, process_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def fused_prepare(self, x: Tensor) -> FR.BatchNormState:
        return prepare_batch_norm_sync(x, self, self.process_group)

    def forward(self, x: Tensor) -> Tensor:
        if not sync_active(self, self.process_group):
            return super().forward(x)
        self._check_input_dim(x)
        return _sync_batch_norm_plain(x, self, self.process_group)


class SyncBatchNormAct2d(SyncBatchNorm2d):
    """A norm-act layer's synchronised copy (timm's ``BatchNormAct2d``: BatchNorm, then its
    ``drop``, then its ``act``, in one module with a BatchNorm's state_dict keys):
    :class:`SyncBatchNorm2d`, then the same ``drop`` and ``act`` modules. The fused blocks
    prepare it through :meth:`SyncBatchNorm2d.fused_prepare` as any synchronised BatchNorm."""

    def __init__(self, *args, drop: nn.Module, act: nn.Module, process_group=None, **kwargs):
        super().__init__(*args, process_group=process_group, **kwargs)
        self.drop, self.act = drop, act

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.drop(super().forward(x)))


# Norm-act classes whose forward is BatchNorm, then ``drop``, then ``act`` (module, class name):
# converted to SyncBatchNormAct2d. Other BatchNorm2d subclasses are refused: what their forward
# adds is unknown, and a plain synchronised BatchNorm would drop it.
_NORM_ACT = {("timm.layers.norm_act", "BatchNormAct2d"),
             ("timm.layers.norm_act", "SyncBatchNormAct")}


def _kind(module: nn.Module) -> str | None:
    """"bn" for a BatchNorm to synchronise, "norm_act" for a known norm-act layer, "other" for
    another BatchNorm subclass, None for anything else (and for what is synchronised already)."""
    cls = type(module)
    if isinstance(module, SyncBatchNorm2d) or not isinstance(module, (nn.BatchNorm2d,
                                                                      nn.SyncBatchNorm)):
        return None
    if cls in (nn.BatchNorm2d, nn.SyncBatchNorm):
        return "bn"
    return "norm_act" if (cls.__module__, cls.__name__) in _NORM_ACT else "other"


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every ``nn.BatchNorm2d`` (and ``nn.SyncBatchNorm``) in ``module`` by a
    :class:`SyncBatchNorm2d` holding the same parameters and buffers (returned module; the
    input is changed in place where possible, as ``nn.SyncBatchNorm.convert_sync_batchnorm``),
    and timm's norm-act layers by a :class:`SyncBatchNormAct2d` that keeps their ``drop`` and
    ``act``. Any other subclass of BatchNorm2d raises TypeError naming it, before anything is
    replaced: its forward may add what a synchronised BatchNorm would silently drop."""
    found = [(name or "the module", type(m)) for name, m in module.named_modules()
             if _kind(m) == "other"]
    if found:
        name, cls = found[0]
        raise TypeError(
            f"module: {name} is a {cls.__module__}.{cls.__qualname__}, a BatchNorm2d subclass "
            f"convert_sync_batchnorm does not know: converting it to a synchronised BatchNorm "
            f"would drop what its forward adds (known: nn.BatchNorm2d, nn.SyncBatchNorm, timm's "
            f"BatchNormAct2d); convert it yourself, or replace it first"
            + (f" ({len(found) - 1} more)" if len(found) > 1 else ""))
    return _convert(module, process_group)


def _convert(module: nn.Module, process_group) -> nn.Module:
    kind = _kind(module)
    if kind in ("bn", "norm_act"):
        args = (module.num_features, module.eps, module.momentum, module.affine,
                module.track_running_stats)
        if kind == "bn":
            new = SyncBatchNorm2d(*args, process_group=process_group)
        else:
            new = SyncBatchNormAct2d(*args, drop=module.drop, act=module.act,
                                     process_group=process_group)
        if module.affine:  # the same Parameter objects: optimisers and DDP see no change
            new.weight = module.weight
            new.bias = module.bias
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        converted = _convert(child, process_group)
        if converted is not child:
            setattr(module, name, converted)
    return module

