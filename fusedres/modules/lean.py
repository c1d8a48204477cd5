"""The lean route of a fused pre-activation unit.

A fused pre-activation unit with the identity shortcut (most of a deep pre-activation ResNet),
or with a projection shortcut that the route's ``pair`` runs beside conv1 (where a stage
begins; cpu, cuda), runs :meth:`~fusedres.modules.ResidualBlock._forward_preact`'s calls
with its checks and its layers' Python between them: ~120 Python calls a chain on the C++
routes, where plain PyTorch's block makes ~45. Once the checked route has run a key's
arguments, later calls with the same key skip the checks and call the route's fields in the
same order on the same tensors (the same kernels, the same results to the bit).
:meth:`ResidualBlock.forward <fusedres.modules.ResidualBlock.forward>` reads :func:`preact`
from this module (patch it here).
"""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
from torch import Tensor

from .. import functional as FR
from ..ops._backend import route
from ..ops.opdefs import BatchNormArgs, UnitArgs
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
    :data:`FUSED` pre-activation unit with the identity shortcut, or with a projection that
    the route's ``pair`` runs beside conv1 (:attr:`~fusedres.modules.ResidualBlock.
    paired_shortcut`, on a backend with one: cpu, cuda), two or three chains of plain
    ``nn.BatchNorm2d`` and ``nn.Conv2d`` (explicit padding), no drop-path draw this step, no
    autocast, a backend with a one-call BatchNorm preparation (cpu, cuda, triton), BatchNorm
    parameters in the statistics dtype."""
    names = _NAMES.get(block.num_convs)
    if (names is None or type(block.layer) is not FusedBNReLUConv
            or block.path not in ("identity", "projection")
            or block.gate is not None or (block.training and block._drop_path > 0)):
        return None
    mods = block._modules
    conv1 = mods["conv1"]
    if type(conv1) is not nn.Conv2d:
        return None
    r = route(x, conv1._parameters["weight"])
    if r.prepare_batch_norm is None or torch.is_autocast_enabled(x.device.type):
        return None
    short = None
    if block.path == "projection":
        short = _paired(block, r, mods)
        if short is None:
            return None
    keyed = _key(r, names, mods, x, stats, return_stats, short)
    if keyed is None:
        return None
    key, chain = keyed
    if key not in KEYS:
        out = block._forward_preact(x, stats, return_stats)  # checks every argument
        KEYS.add(key)
        return out
    return _run(r, chain, x, stats, return_stats, short)


def _paired(block, r, mods):
    """The projection shortcut's fields (weight, bias, stride, padding, dilation) where the
    checked route would run it beside conv1 through the route's ``pair``
    (modules.unit.paired_conv_into with functional.conv2d_pair_from_prepared's conditions), else
    None."""
    sc, conv1 = mods.get("shortcut"), mods["conv1"]
    if (r.pair is None or type(sc) is not nn.Conv2d or type(sc.padding) is not tuple
            or not block.paired_shortcut):
        return None
    w, b, w1, b1 = (sc._parameters["weight"], sc._parameters["bias"],
                    conv1._parameters["weight"], conv1._parameters["bias"])
    if w.dtype != w1.dtype or any(t is not None and t.dtype != w1.dtype for t in (b, b1)):
        return None
    return w, b, sc.stride, sc.padding, sc.dilation


def _key(r, names, mods, x: Tensor, stats, return_stats: bool, short=None):
    """(the key of these arguments, each chain's fields) for :func:`preact`, or None
    where a BatchNorm or convolution is not one the lean route runs; ``short``: the paired
    projection's fields (:func:`_paired`), keyed too."""
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # opdefs.stats_dtype
    key = [r.name, x.shape, x.stride(), x.dtype, x.device, return_stats,
           None if stats is None else (len(stats), *map(_META, stats)),
           torch.is_inference_mode_enabled()]  # with is_inference(): buffers it may write
    if short is not None:
        sc = mods["shortcut"]
        key += ("projection", sc.stride, sc.padding, sc.dilation, sc.groups, sc.padding_mode,
                _META(short[0]), None if short[1] is None else _META(short[1]))
    chain = []
    for bn_name, conv_name in names:
        bn, c = mods.get(bn_name), mods[conv_name]  # no bn under norm='none'
        if (type(bn) is not nn.BatchNorm2d or type(c) is not nn.Conv2d
                or type(c.padding) is not tuple or "fused_prepare" in bn.__dict__):
            return None
        # batch_norm_args(bn), without its Python calls (the function's and the NamedTuple
        # constructor's: two a chain a step); tuple.__new__ is what the constructor runs.
        args = tuple.__new__(BatchNormArgs, (*FR.BN_PARAMETERS(bn._parameters),
                                             *FR.BN_BUFFERS(bn._buffers), bn.training,
                                             bn.momentum, bn.eps))
        for p in args[:2]:  # the affine: the checked route casts it
            if p is not None and p.dtype != sdt:
                return None
        w, cb = c._parameters["weight"], c._parameters["bias"]
        key += (*args[5:], c.stride, c.padding, c.dilation, c.groups, c.padding_mode, _META(w),
                None if cb is None else _META(cb))
        for t in args[:5]:  # the BatchNorm's tensors: all that the checks and the update read
            key.append(None if t is None else (_META(t), t.stride(), t.requires_grad,
                                               t.is_inference()))
        chain.append((args, w, cb, c.stride, c.padding, c.dilation))
    return tuple(key), chain


def _run(r, chain, x: Tensor, stats, return_stats: bool, short_fields=None):
    """The lean route's run of ``chain`` (:func:`_key`'s) on ``x``: ``(y, stats of y
    or None)``; ``short_fields``: the paired projection's (:func:`_paired`), run beside
    conv1 through the route's ``pair``."""
    prepare_affine, prepare_bn, prepares = r.prepare_affine, r.prepare_batch_norm, r.prepares
    # What _forward_preact runs for these arguments: each BatchNorm prepared as
    # functional.prepare_batch_norm's route branch does (with the statistics its producer
    # handed over when it uses batch statistics), each unit as functional.conv2d_from_prepared
    # runs it, conv1 handing the shortcut on where the route has that form, or run beside the
    # projection as functional.conv2d_pair_from_prepared runs the pair.
    a = short = x
    last = len(chain) - 1
    for i, (bn, w, cb, stride, padding, dilation) in enumerate(chain):
        use_batch = bn.training or bn.running_mean is None
        given = stats if stats is not None and use_batch else (None, None)
        affine = None
        if prepares is not None and not prepares(a, bn.running_mean, bn.running_var,
                                                 bn.training):
            state = FR.prepare(bn, a, stats if use_batch else None)
            mean, invstd = state.mean, state.invstd
        else:
            if prepare_affine is not None:
                mean, invstd, *affine = prepare_affine(a, *bn, *given)
            else:
                mean, invstd = prepare_bn(a, *bn[2:], *given)
            if given[0] is not None:
                mean = given[0]
        if i == 0 and short_fields is not None:  # the projection beside conv1 (never last)
            nxt = chain[1][0]
            want = nxt.training or nxt.running_mean is None
            sw, sb, sstride, spadding, sdilation = short_fields
            short, a, *stats = r.pair(a, sw, sb, w, cb, bn.weight, bn.bias, mean, invstd,
                                      sstride, spadding, sdilation, stride, padding, dilation,
                                      use_batch, want)
            if not want:
                stats = None
            continue
        args = UnitArgs(a, w, cb, bn.weight, bn.bias, mean, invstd,
                        short if i == last else None, stride, padding, dilation, use_batch)
        if i == last:
            if return_stats:
                y, m, v = r.unit(args, True, affine)
                return y, (m, v)
            return r.unit(args, False, affine), None
        # The next BatchNorm takes this unit's statistics when it uses batch statistics.
        nxt = chain[i + 1][0]
        want = nxt.training or nxt.running_mean is None
        if i == 0 and r.unit_with_shortcut is not None:
            a, short, *stats = r.unit_with_shortcut(*args, want)
        elif want:
            a, *stats = r.unit(args, True, affine)
        else:
            a = r.unit(args, False, affine)
        if not want:
            stats = None
    return None  # unreachable: the last chain returns
