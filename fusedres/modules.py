"""Drop-in modules. Parameters, buffers and state_dict keys are those of the plain PyTorch blocks
(``nn.BatchNorm2d`` and ``nn.Conv2d`` submodules), so checkpoints move both ways."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import functional as FR
from .distributed import prepare_batch_norm_sync

__all__ = ["BNReLUConv2d", "PreActBasicBlock", "PreActBottleneck"]


def _synchronised(bn: nn.BatchNorm2d) -> bool:
    return isinstance(bn, nn.SyncBatchNorm) and dist.is_available() and dist.is_initialized()


def wants_stats(bn: nn.BatchNorm2d) -> bool:
    """Whether ``prepare(bn, x, stats)`` would use the local batch statistics of ``x`` (a
    training-mode BatchNorm that is not synchronised): then the producer of ``x`` should return
    them (``conv(..., return_stats=True)``)."""
    return ((bn.training or bn.running_mean is None) and getattr(bn, "fused_prepare", None) is None
            and not _synchronised(bn))


def prepare(bn: nn.BatchNorm2d, x: Tensor, stats=None) -> FR.BatchNormState:
    """Statistics and running-stats update of ``bn`` for input ``x`` (one pass, once).

    ``stats``: the batch (mean, biased variance) of ``x`` when its producer computed them
    (:func:`conv` with ``return_stats=True``); then no statistics pass runs.
    A BatchNorm with a ``fused_prepare(x)`` method (``fusedres.distributed.SyncBatchNorm2d``)
    prepares itself; an ``nn.SyncBatchNorm`` in a running process group synchronises its
    statistics across processes (``fusedres.distributed.prepare_batch_norm_sync``); both ignore
    ``stats``.
    """
    custom = getattr(bn, "fused_prepare", None)
    if custom is not None:
        return custom(x)
    if _synchronised(bn):
        return prepare_batch_norm_sync(x, bn, bn.process_group)
    return FR.prepare_batch_norm(
        x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked,
        training=bn.training, momentum=bn.momentum, eps=bn.eps, stats=stats,
    )


def check_convs(*convs: nn.Conv2d | None) -> None:
    """Refuse convolutions the fused op cannot run, before any BatchNorm state changes."""
    for c in convs:
        if c is None:
            continue
        if c.groups != 1:
            raise ValueError(f"conv.groups: fusedres supports groups=1, got {c.groups}")
        if c.padding_mode != "zeros":
            raise ValueError(
                f"conv.padding_mode: fusedres supports 'zeros', got {c.padding_mode!r}")


def check_inputs(x: Tensor, *convs: nn.Conv2d | None) -> None:
    """Everything that could make ``conv(prepare(bn, x), c)`` fail for the convs ``x`` feeds,
    checked before ``prepare`` touches the running statistics."""
    check_convs(*convs)
    for c in convs:
        if c is not None:
            FR.check_conv_args(x, c.weight, c.bias, None, c.stride, c.padding, c.dilation)


def conv(state: FR.BatchNormState, conv: nn.Conv2d, residual: Tensor | None = None,
         return_stats: bool = False):
    """``conv(relu(bn(x))) + residual`` through the fused op, for a prepared BatchNorm; with
    ``return_stats`` also the batch statistics of the output (see
    :func:`fusedres.functional.conv2d_from_prepared`)."""
    check_convs(conv)
    return FR.conv2d_from_prepared(state, conv.weight, conv.bias, stride=conv.stride,
                                   padding=conv.padding, dilation=conv.dilation,
                                   residual=residual, return_stats=return_stats)


def conv_into(state: FR.BatchNormState, c: nn.Conv2d, bn: nn.BatchNorm2d) -> FR.BatchNormState:
    """``prepare(bn, conv(state, c))``: the output's statistics come from the convolution
    (its epilogue on the Triton backend) whenever ``bn`` uses local batch statistics."""
    if wants_stats(bn):
        out, stats = conv(state, c, return_stats=True)
        return prepare(bn, out, stats)
    return prepare(bn, conv(state, c))


class BNReLUConv2d(nn.Module):
    """``conv(relu(bn(x))) + residual`` in one fused op.

    Submodules ``bn`` (``nn.BatchNorm2d(in_channels)``) and ``conv`` (``nn.Conv2d``), with the
    usual meanings of every argument. ``forward(x, residual=None)``: x (N, C, H, W), residual
    (N, out_channels, Ho, Wo).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, bias: bool = False, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.bn = nn.BatchNorm2d(in_channels, eps, momentum, affine, track_running_stats, **kw)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation,
                              bias=bias, **kw)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        c = self.conv
        check_convs(c)
        geometry = FR.check_conv_args(x, c.weight, c.bias, residual, c.stride, c.padding,
                                      c.dilation)
        # The convolution's arguments are checked (before prepare touches the running stats):
        # given their geometry, conv2d_from_prepared does not check them again.
        return FR.conv2d_from_prepared(prepare(self.bn, x), c.weight, c.bias, residual=residual,
                                       geometry=geometry)


def _plain(bn: nn.BatchNorm2d, x: Tensor) -> Tensor:
    return F.relu(bn(x))


class PreActBasicBlock(nn.Module):
    """He et al.'s full pre-activation basic unit: (BN-ReLU-conv3x3) x 2 plus the shortcut.

    ``shortcut`` is a 1x1 conv when the stride or width changes, fed by the first BN-ReLU (one
    statistics pass serves both convolutions); otherwise the identity. ``fused=False`` builds
    the plain PyTorch block with the same state_dict keys.
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, fused: bool = True):
        super().__init__()
        self.fused = fused
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.shortcut = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride, bias=False)

    def forward(self, x: Tensor, stats=None, return_stats: bool = False):
        """``x`` (N, in_planes, H, W) -> (N, planes, H / stride, W / stride).

        ``stats``/``return_stats`` hand the batch statistics of the unit's output to the next
        fused unit (:class:`fusedres.models.PreActResNet` does): ``stats`` are the (mean,
        biased variance) of ``x`` when known, and ``return_stats=True`` returns
        ``(y, stats of y)``. Plain blocks ignore ``stats`` and return ``(y, None)``.
        """
        if not self.fused:
            a = _plain(self.bn1, x)
            short = self.shortcut(a) if self.shortcut is not None else x
            y = self.conv2(_plain(self.bn2, self.conv1(a))) + short
            return (y, None) if return_stats else y
        check_convs(self.conv2)
        check_inputs(x, self.conv1, self.shortcut)
        s1 = prepare(self.bn1, x, stats)
        short = conv(s1, self.shortcut) if self.shortcut is not None else x
        return conv(conv_into(s1, self.conv1, self.bn2), self.conv2, residual=short,
                    return_stats=return_stats)


class PreActBottleneck(nn.Module):
    """He et al.'s full pre-activation bottleneck: BN-ReLU-conv1x1, BN-ReLU-conv3x3,
    BN-ReLU-conv1x1 (to ``4 * planes``) plus the shortcut.

    ``stride_on="conv1"`` strides the first 1x1 conv (He et al.'s code); ``"conv2"`` the 3x3
    (torchvision, timm). The 1x1 projection ``shortcut`` exists when the stride or width changes
    and shares the first BN-ReLU. ``fused=False`` builds the plain block with identical keys.
    """

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, fused: bool = True,
                 stride_on: str = "conv1"):
        super().__init__()
        if stride_on not in ("conv1", "conv2"):
            raise ValueError(f"stride_on: expected 'conv1' or 'conv2', got {stride_on!r}")
        self.fused = fused
        out_planes = planes * self.expansion
        s1, s2 = (stride, 1) if stride_on == "conv1" else (1, stride)
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 1, s1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, s2, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.shortcut = None
        if stride != 1 or in_planes != out_planes:
            self.shortcut = nn.Conv2d(in_planes, out_planes, 1, stride, bias=False)

    def forward(self, x: Tensor, stats=None, return_stats: bool = False):
        """``x`` (N, in_planes, H, W) -> (N, 4 * planes, H / stride, W / stride); ``stats`` and
        ``return_stats`` as :meth:`PreActBasicBlock.forward`."""
        if not self.fused:
            a = _plain(self.bn1, x)
            short = self.shortcut(a) if self.shortcut is not None else x
            out = self.conv2(_plain(self.bn2, self.conv1(a)))
            y = self.conv3(_plain(self.bn3, out)) + short
            return (y, None) if return_stats else y
        check_convs(self.conv2, self.conv3)
        check_inputs(x, self.conv1, self.shortcut)
        s1 = prepare(self.bn1, x, stats)
        short = conv(s1, self.shortcut) if self.shortcut is not None else x
        s3 = conv_into(conv_into(s1, self.conv1, self.bn2), self.conv2, self.bn3)
        return conv(s3, self.conv3, residual=short, return_stats=return_stats)
