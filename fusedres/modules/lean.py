"""The lean route of a fused pre-activation unit.

A fused pre-activation unit with the identity shortcut (most of a deep pre-activation ResNet)
runs :meth:`~fusedres.modules.ResidualBlock._forward_preact`'s calls with its checks and its
layers' Python between them: ~120 Python calls a chain on the C++ routes, where plain
PyTorch's block makes ~45. Once the checked route has run a key's arguments, later calls with
the same key skip the checks and call the route's fields in the same order on the same tensors
(the same kernels, the same results to the bit). :meth:`ResidualBlock.forward
<fusedres.modules.ResidualBlock.forward>` reads :func:`preact` from this module (patch it
here).
"""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
from torch import Tensor

from .. import functional as FR
from ..ops._backend import route
from ..ops.opdefs import UnitArgs
from .unit import FusedBNReLUConv

# Arguments the checked route ran without error, by what its checks read: the block's
# structure, x's and the statistics' metadata, and every BatchNorm's and convolution's
# settings and tensors' shape, dtype and device (tensors are read afresh at every call).
KEYS: set = set()
_NAMES = {k: tuple((f"bn{i}", f"conv{i}") for i in range(1, k + 1)) for k in (2, 3)}
_META = operator.attrgetter("shape", "dtype", "device")


def preact(block, x: Tensor, stats, return_stats: bool):
    """``(y, stats of y or None)`` of ``block._forward_preact(x, stats, return_stats)`` through
    the route's fields without the checks, for arguments whose key the checked route has run;
    None where this route does not apply (then the caller runs the checked one): a
    :data:`FUSED` pre-activation unit with the identity shortcut, two or three chains of plain
    ``nn.BatchNorm2d`` and ``nn.Conv2d`` (explicit padding), no drop-path draw this step, no
    autocast, a backend with a one-call BatchNorm preparation (cpu, cuda, triton), BatchNorm
    parameters in the statistics dtype."""
    names = _NAMES.get(block.num_convs)
    if (names is None or type(block.layer) is not FusedBNReLUConv or block.path != "identity"
            or block.gate is not None or (block.training and block._drop_path > 0)):
        return None
    mods = block._modules
    conv1 = mods["conv1"]
    if type(conv1) is not nn.Conv2d:
        return None
    r = route(x, conv1._parameters["weight"])
    if r.prepare_batch_norm is None or torch.is_autocast_enabled(x.device.type):
        return None
    keyed = _key(r, names, mods, x, stats, return_stats)
    if keyed is None:
        return None
    key, chain = keyed
    if key not in KEYS:
        out = block._forward_preact(x, stats, return_stats)  # checks every argument
        KEYS.add(key)
        return out
    return _run(r, chain, x, stats, return_stats)


def _key(r, names, mods, x: Tensor, stats, return_stats: bool):
    """(the key of these arguments, each chain's fields) for :func:`preact`, or None
    where a BatchNorm or convolution is not one the lean route runs."""
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # opdefs.stats_dtype
    key = [r.name, x.shape, x.stride(), x.dtype, x.device, return_stats,
           None if stats is None else (len(stats), *map(_META, stats)),
           torch.is_inference_mode_enabled()]  # with is_inference(): buffers it may write
    chain = []
    for bn_name, conv_name in names:
        bn, c = mods.get(bn_name), mods[conv_name]  # no bn under norm='none'
        if (type(bn) is not nn.BatchNorm2d or type(c) is not nn.Conv2d
                or type(c.padding) is not tuple or "fused_prepare" in bn.__dict__):
            return None
        bp, bb, cp = bn._parameters, bn._buffers, c._parameters
        g, b, rm, rv = bp["weight"], bp["bias"], bb["running_mean"], bb["running_var"]
        nbt, w, cb = bb["num_batches_tracked"], cp["weight"], cp["bias"]
        if (g is not None and g.dtype != sdt) or (b is not None and b.dtype != sdt):
            return None  # the checked route casts them
        key += (bn.training, bn.momentum, bn.eps, c.stride, c.padding, c.dilation, c.groups,
                c.padding_mode, _META(w), None if cb is None else _META(cb),
                None if g is None else _META(g), None if b is None else _META(b),
                None if rm is None else (_META(rm), rm.stride(), rm.requires_grad,
                                         rm.is_inference()),
                None if rv is None else (_META(rv), rv.stride(), rv.requires_grad,
                                         rv.is_inference()),
                None if nbt is None else (_META(nbt), nbt.is_inference()))
        chain.append((bn.training, bn.momentum, bn.eps, g, b, rm, rv, nbt, w, cb, c.stride,
                      c.padding, c.dilation))
    return tuple(key), chain


def _run(r, chain, x: Tensor, stats, return_stats: bool):
    """The lean route's run of ``chain`` (:func:`_key`'s) on ``x``: ``(y, stats of y
    or None)``."""
    prepare_affine, prepare_bn, prepares = r.prepare_affine, r.prepare_batch_norm, r.prepares
    # What _forward_preact runs for these arguments: each BatchNorm prepared as
    # functional.prepare_batch_norm's route branch does (with the statistics its producer
    # handed over when it uses batch statistics), each unit as functional.conv2d_from_prepared
    # runs it, conv1 handing the shortcut on where the route has that form.
    a = short = x
    last = len(chain) - 1
    for i, (training, momentum, eps, g, b, rm, rv, nbt, w, cb, stride, padding,
            dilation) in enumerate(chain):
        use_batch = training or rm is None
        given = stats if stats is not None and use_batch else (None, None)
        affine = None
        if prepares is not None and not prepares(a, rm, rv, training):
            state = FR.prepare_batch_norm(a, g, b, rm, rv, nbt, training=training,
                                          momentum=momentum, eps=eps,
                                          stats=stats if use_batch else None)
            mean, invstd = state.mean, state.invstd
        else:
            if prepare_affine is not None:
                mean, invstd, *affine = prepare_affine(a, g, b, rm, rv, nbt, training,
                                                       momentum, eps, *given)
            else:
                mean, invstd = prepare_bn(a, rm, rv, nbt, training, momentum, eps, *given)
            if given[0] is not None:
                mean = given[0]
        args = UnitArgs(a, w, cb, g, b, mean, invstd, short if i == last else None, stride,
                        padding, dilation, use_batch)
        if i == last:
            if return_stats:
                y, m, v = r.unit(args, True, affine)
                return y, (m, v)
            return r.unit(args, False, affine), None
        # The next BatchNorm takes this unit's statistics when it uses batch statistics.
        nxt = chain[i + 1]
        want = nxt[0] or nxt[5] is None
        if i == 0 and r.unit_with_shortcut is not None:
            a, short, *stats = r.unit_with_shortcut(*args, want)
        elif want:
            a, *stats = r.unit(args, True, affine)
        else:
            a = r.unit(args, False, affine)
        if not want:
            stats = None
    return None  # unreachable: the last chain returns
