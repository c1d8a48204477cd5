"""Rewriters: how :func:`fusedres.fuse` fuses the modules of known classes, in place.

A rewriter is registered for one module class (by its import path, so that registering costs
no import of timm or torchvision). It says why an instance cannot be fused (or None), which
BatchNorm -> ReLU -> conv chains fusing it runs through the fused op (for the report), and
applies the fusion to the instance in place: the instance keeps its identity, its submodules,
parameters and buffers (so ``state_dict`` keys and values), its attributes and its methods.

Two ways of applying, both keeping every attribute and method:

* ``swap``: the instance's class becomes a subclass of its own class whose ``forward`` (and
  any method the rewriter names) runs the chains through the fused op. ``isinstance`` still
  holds; ``copy.deepcopy`` and pickling rebuild the same subclass (:func:`fused_class`).
* ``apply``: anything else in place (fusedres's own blocks swap their layer:
  ``block.layer = FUSED``, the blocks' own switch between fused and plain).

Built in: fusedres's :class:`~fusedres.modules.ResidualBlock` and
:class:`~fusedres.models.PreActResNet`; timm's ResNetV2 pre-activation blocks
(``PreActBottleneck``, ``PreActBasic``) and ``ResNetStage`` (its ``grad_checkpointing``
recomputes the blocks with :func:`fusedres.memory.activation_checkpoint.checkpoint`, which counts a
batch in the BatchNorm running statistics once, where timm's ``checkpoint_seq`` counts it
twice); torchvision's ``BasicBlock``, ``Bottleneck``, DenseNet's ``_DenseLayer`` (its
``memory_efficient`` recompute kept, BatchNorm-safe) and ``_Transition``.
:func:`register_rewriter` adds one for a user's own class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import modules as _m
from ..memory.activation_checkpoint import checkpoint, checkpoint_segments

__all__ = ["Chain", "Rewriter", "fused_class", "is_fused", "register_rewriter", "rewriter_for",
           "rewriters"]


@dataclass(frozen=True)
class Chain:
    """A BatchNorm -> ReLU -> conv chain of a module, names relative to it: ``bn`` feeds
    ``convs`` (one statistics pass for all); ``residual``: the last conv takes the block's
    residual add in its epilogue; ``reason``: why it stays plain (empty: fused)."""

    bn: str
    convs: tuple[str, ...] = ()
    residual: bool = False
    reason: str = ""


@dataclass
class Rewriter:
    """How :func:`fusedres.fuse` fuses instances of one class (see the module docstring).

    ``name``: shown in the report. ``reason(m)``: why ``m`` cannot be fused, None when it can.
    ``chains(m)``: its chains (fused ones, and those it leaves with a reason). ``swap``: methods
    of the fused subclass (``forward`` at least), or ``apply(m)``: an in-place change.
    ``fused(m)``: whether ``m`` already runs fused (then nothing is done). ``visit_children``:
    whether :func:`fusedres.fuse` also looks inside ``m`` (containers; a block's own children
    are its rewriter's business).
    """

    name: str
    reason: Callable[[nn.Module], str | None]
    chains: Callable[[nn.Module], list[Chain]]
    swap: dict[str, Callable] = field(default_factory=dict)
    apply: Callable[[nn.Module], None] | None = None
    fused: Callable[[nn.Module], bool] | None = None
    visit_children: bool = False

    def __post_init__(self):
        if bool(self.swap) == (self.apply is not None):
            raise ValueError(f"rewriter {self.name!r}: expected exactly one of swap= and apply=")
        if self.swap and "forward" not in self.swap:
            raise ValueError(f"rewriter {self.name!r}: swap= must give forward")

    def is_fused(self, m: nn.Module) -> bool:
        if self.fused is not None:
            return self.fused(m)
        return getattr(type(m), "_fusedres_rewriter", None) == self.name

    def rewrite(self, m: nn.Module) -> None:
        if self.apply is not None:
            self.apply(m)
        else:
            m.__class__ = fused_class(type(m), self)


_REGISTRY: dict[str, Rewriter] = {}   # "module.QualName" of the class -> rewriter
_BY_NAME: dict[str, Rewriter] = {}


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_rewriter(cls: type | str, rewriter: Rewriter) -> None:
    """Use ``rewriter`` for instances of exactly ``cls`` (a class, or its ``"module.QualName"``
    path: no import needed). Subclasses are not matched: they may run another forward."""
    if not isinstance(rewriter, Rewriter):
        raise TypeError(f"rewriter: expected a fusedres.convert.rewriters.Rewriter, got "
                        f"{type(rewriter).__name__}")
    if isinstance(cls, type):
        key = _key(cls)
    elif isinstance(cls, str) and "." in cls:
        key = cls
    else:
        raise TypeError(f"cls: expected a class or a 'module.QualName' string, got {cls!r}")
    _REGISTRY[key] = rewriter
    _BY_NAME[rewriter.name] = rewriter


def rewriter_for(m: nn.Module) -> Rewriter | None:
    """The rewriter registered for ``m``'s class (or, for a module fused by one, for the class
    it was fused from)."""
    cls = type(m)
    base = getattr(cls, "_fusedres_base", None)
    return _REGISTRY.get(_key(base if base is not None else cls))


def rewriters() -> dict[str, Rewriter]:
    """The registered rewriters by class path (a copy)."""
    return dict(_REGISTRY)


# --------------------------------------------------------------------------- fused subclasses

class _FusedMixin:
    """Base of every class made by :func:`fused_class`: pickles and deep-copies as the
    original class fused by the same rewriter (the generated class is not importable)."""

    _fusedres_base: type
    _fusedres_rewriter: str

    def __reduce_ex__(self, protocol):
        return (_fused_instance, (self._fusedres_base, self._fusedres_rewriter), self.__dict__)


_CLASSES: dict[tuple[type, str], type] = {}


def fused_class(base: type, rewriter: Rewriter) -> type:
    """The subclass of ``base`` that ``rewriter`` swaps in (made once per pair). It keeps
    ``base``'s name, so a printed model reads as before, and every method ``rewriter.swap``
    does not replace."""
    key = (base, rewriter.name)
    cls = _CLASSES.get(key)
    if cls is None:
        body = dict(rewriter.swap)
        body.update(_fusedres_base=base, _fusedres_rewriter=rewriter.name,
                    __module__=base.__module__, __qualname__=base.__qualname__,
                    __doc__=base.__doc__)
        cls = type(base.__name__, (_FusedMixin, base), body)
        _CLASSES[key] = cls
    return cls


def _fused_instance(base: type, name: str):
    rewriter = _BY_NAME.get(name)
    if rewriter is None:
        raise RuntimeError(f"a {base.__name__} fused by the rewriter {name!r}: register that "
                           "rewriter (fusedres.convert.rewriters.register_rewriter) before "
                           "loading it")
    cls = fused_class(base, rewriter)
    return cls.__new__(cls)


def is_fused(m: nn.Module) -> bool:
    """Whether ``m`` already runs its chains through the fused op: fusedres's fused modules,
    and modules a rewriter or the torch.fx fallback of :func:`fusedres.fuse` rewrote."""
    if isinstance(m, _FusedMixin) or getattr(type(m), "_fusedres_fx", False):
        return True
    if isinstance(m, _m.BNReLUConv2d):
        return True
    return isinstance(m, _m.ResidualBlock) and m.fused


# --------------------------------------------------------------------------- what fuses

def is_norm_act(m: nn.Module) -> bool:
    """A BatchNorm2d subclass with an ``act`` ReLU and an identity (or absent, or p=0) ``drop``:
    timm's ``BatchNormAct2d`` convention, BatchNorm and ReLU in one module."""
    act = getattr(m, "act", None)
    drop = getattr(m, "drop", None)
    return (isinstance(m, nn.BatchNorm2d) and isinstance(act, nn.ReLU)
            and (drop is None or isinstance(drop, nn.Identity)
                 or (isinstance(drop, nn.Dropout) and drop.p == 0)))


def _bn_problem(name: str, bn: nn.Module, with_act: bool) -> str | None:
    """None when ``bn`` is a BatchNorm the fused op prepares (``with_act``: a norm+act module
    whose act is a ReLU), else why not."""
    if with_act:
        if not is_norm_act(bn):
            return (f"{name} is a {type(bn).__name__}, not a BatchNorm2d with a ReLU act "
                    f"(e.g. GroupNormAct)")
        return None
    if type(bn) in (nn.BatchNorm2d, nn.SyncBatchNorm) or callable(getattr(bn, "fused_prepare",
                                                                           None)):
        return None
    return f"{name} is a {type(bn).__name__}, not an nn.BatchNorm2d"


def conv_problem(name: str, c: nn.Module) -> str | None:
    """None when ``c`` is a convolution the fused op runs: an ``nn.Conv2d`` (its own forward,
    not a subclass with another: timm's StdConv2d, Conv2dSame), groups=1, explicit zero
    padding; else why not."""
    if not isinstance(c, nn.Conv2d) or type(c).forward is not nn.Conv2d.forward:
        return f"{name} is a {type(c).__name__}, not an nn.Conv2d"
    if c.groups != 1:
        return f"{name} has groups={c.groups} (the fused op supports groups=1)"
    if c.padding_mode != "zeros":
        return f"{name} has padding_mode={c.padding_mode!r} (fused op: zeros)"
    if isinstance(c.padding, str):
        return f"{name} has padding={c.padding!r} (fused op: explicit padding)"
    return None


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


def _relu_problem(name: str, r: nn.Module) -> str | None:
    return None if type(r) is nn.ReLU else f"{name} is a {type(r).__name__}, not an nn.ReLU"


def _class_path(m: nn.Module) -> str:
    cls = getattr(type(m), "_fusedres_base", type(m))
    return _key(cls)


# --------------------------------------------------------------------------- fusedres's own

def _block_chains(b: _m.ResidualBlock) -> list[Chain]:
    if b.norm == "none":
        return []
    k = b.num_convs
    if b.unit == "preact":
        out = []
        for i in range(1, k + 1):
            convs = (f"conv{i}",) + (("shortcut",) if i == 1 and b.shortcut is not None else ())
            out.append(Chain(f"bn{i}", convs, residual=(
                i == k and b.gate is None and b.path != "none")))
        return out
    chains = [Chain(f"bn{i}", (f"conv{i + 1}",)) for i in range(1, k)]
    chains.append(Chain(f"bn{k}", reason="; ".join(b.plain_parts)))
    if b.shortcut_bn is not None:
        chains.append(Chain("shortcut_bn", reason="after the projection shortcut, no ReLU -> "
                                                 "conv after it"))
    return chains


def _block_reason(b: _m.ResidualBlock) -> str | None:
    # By class, not identity: copy.deepcopy copies the PLAIN / FUSED layer objects.
    if type(b.layer) in (_m.PlainBNReLUConv, _m.FusedBNReLUConv):
        return None
    return f"its layer is a custom {type(b.layer).__name__}, left to its author"


def _fuse_block(b: _m.ResidualBlock) -> None:
    b.layer = _m.FUSED


def _resnet_chains(net: nn.Module) -> list[Chain]:
    out = []
    if getattr(net, "stem_bn", None) is not None:
        out.append(Chain("stem_bn", reason="the stem's BatchNorm (its ReLU and the first unit's "
                                           "conv are in other modules)"))
    if getattr(net, "bn", None) is not None:
        out.append(Chain("bn", reason="the final BatchNorm-ReLU feeds the pooling, not a conv"))
    return out


def _fuse_resnet(net: nn.Module) -> None:
    # The units were fused first (children before their container): record it.
    net.fused = all(u.fused for u in net.units())


register_rewriter("fusedres.modules.ResidualBlock", Rewriter(
    "fusedres.ResidualBlock", _block_reason, _block_chains, apply=_fuse_block,
    fused=lambda b: b.fused))
for _cls in ("BasicBlock", "Bottleneck"):
    register_rewriter(f"fusedres.modules.{_cls}", _REGISTRY["fusedres.modules.ResidualBlock"])
register_rewriter("fusedres.models.preact_resnet.PreActResNet", Rewriter(
    "fusedres.PreActResNet", lambda net: None, _resnet_chains, apply=_fuse_resnet,
    fused=lambda net: False, visit_children=True))


# --------------------------------------------------------------------------- shared forwards

def _preact_unit(x: Tensor, norms: Sequence[nn.Module], convs: Sequence[nn.Conv2d],
                 short: nn.Conv2d | None, branch_scale: Tensor | None) -> Tensor:
    """A full pre-activation unit, ``h(x) + F(x)`` with ``F`` = (BN-ReLU-conv) x k and ``h``
    the identity or a 1x1 projection of the first BN-ReLU, as fusedres's own unit runs it
    (:meth:`fusedres.modules.ResidualBlock._forward_preact`): the projection and conv1 share
    one statistics pass (paired), the identity shortcut leaves from conv1's op,
    each conv hands its output's statistics to the next BatchNorm, the last conv adds the
    shortcut (scaled branch: drop-path) in its epilogue."""
    _m.check_inputs(x, convs[0], short)
    _m.check_convs(*convs[1:])
    a = _m.prepare(norms[0], x)
    # (fusedres's stacked route, one conv on both weights, needs a strided shortcut of conv1's
    # geometry: timm strides conv2, and PreActBasic's conv1 is a 3x3 beside a 1x1.)
    if short is None:
        h, a = _m.shortcut_conv_into(a, convs[0], norms[1])
    else:
        h, a = _m.paired_conv_into(a, short, convs[0], norms[1])
    for i in range(2, len(convs)):
        a = _m.conv_into(a, convs[i - 1], norms[i])
    return _m.conv(a, convs[-1], residual=h, branch_scale=branch_scale)


# --------------------------------------------------------------------------- timm

_TIMM = "timm.models.resnetv2"


def _timm_drop_path_scale(drop_path: nn.Module, x: Tensor) -> Tensor | None:
    """The per-sample factor timm's DropPath would multiply the branch by, drawn as timm draws
    it (``new_empty((N, 1, 1, 1)).bernoulli_(keep)``, divided by keep when ``scale_by_keep``),
    or None (identity, eval, p=0)."""
    p = float(getattr(drop_path, "drop_prob", 0.0) or 0.0)
    if not (drop_path.training and p > 0.0):
        return None
    keep = 1.0 - p
    noise = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    if keep > 0.0 and getattr(drop_path, "scale_by_keep", True):
        noise.div_(keep)
    return noise.reshape(x.shape[0])


def _timm_names(b: nn.Module) -> tuple[list[str], list[str]]:
    k = 3 if hasattr(b, "conv3") else 2
    return [f"norm{i}" for i in range(1, k + 1)], [f"conv{i}" for i in range(1, k + 1)]


def _timm_block_reason(b: nn.Module) -> str | None:
    norms, convs = _timm_names(b)
    problems = [_bn_problem(n, getattr(b, n), True) for n in norms]
    problems += [conv_problem(c, getattr(b, c)) for c in convs]
    ds = b.downsample
    if ds is not None:
        kind = _class_path(ds)
        if kind == f"{_TIMM}.DownsampleAvg" and not isinstance(ds.pool, nn.Identity):
            problems.append("downsample is a DownsampleAvg with a pooling (avg_down, strided): "
                            "the BN-ReLU output feeds the pooling")
        elif kind not in (f"{_TIMM}.DownsampleConv", f"{_TIMM}.DownsampleAvg"):
            problems.append(f"downsample is a {type(ds).__name__}, not timm's DownsampleConv")
        elif not isinstance(ds.norm, nn.Identity):
            problems.append("downsample has a norm (not a pre-activation projection)")
        else:
            problems.append(conv_problem("downsample.conv", ds.conv))
    dp = b.drop_path
    if not isinstance(dp, nn.Identity) and _class_path(dp) != "timm.layers.drop.DropPath":
        problems.append(f"drop_path is a {type(dp).__name__}, not timm's DropPath")
    return _first(*problems)


def _timm_block_chains(b: nn.Module) -> list[Chain]:
    norms, convs = _timm_names(b)
    out = []
    for i, (n, c) in enumerate(zip(norms, convs)):
        extra = ("downsample.conv",) if i == 0 and b.downsample is not None else ()
        out.append(Chain(n, (c,) + extra, residual=i == len(convs) - 1))
    return out


def _timm_preact_forward(self, x: Tensor) -> Tensor:
    norms, convs = _timm_names(self)
    short = self.downsample.conv if self.downsample is not None else None
    return _preact_unit(x, [getattr(self, n) for n in norms], [getattr(self, c) for c in convs],
                        short, _timm_drop_path_scale(self.drop_path, x))


_TIMM_BLOCK = Rewriter("timm.PreAct", _timm_block_reason, _timm_block_chains,
                       swap={"forward": _timm_preact_forward})
register_rewriter(f"{_TIMM}.PreActBottleneck", _TIMM_BLOCK)
register_rewriter(f"{_TIMM}.PreActBasic", _TIMM_BLOCK)


def _timm_stage_forward(self, x: Tensor) -> Tensor:
    # timm's ResNetStage.forward with fusedres's checkpoint in place of checkpoint_seq: the
    # same segments (one block each), the running statistics counted once.
    if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
        blocks = list(self.blocks)
        return checkpoint_segments(blocks, x, [(i, i + 1) for i in range(len(blocks))])
    return self.blocks(x)


def _timm_stage_reason(stage: nn.Module) -> str | None:
    # Rewritten only where it holds a fused block (children are fused first); elsewhere
    # timm's own forward stays.
    if any(is_fused(b) for b in stage.blocks):
        return None
    return "no fused block in it (its checkpointing stays timm's)"


register_rewriter(f"{_TIMM}.ResNetStage", Rewriter(
    "timm.ResNetStage", _timm_stage_reason, lambda s: [],
    swap={"forward": _timm_stage_forward}, visit_children=True))


# --------------------------------------------------------------------------- torchvision

_TV_RESNET = "torchvision.models.resnet"
_TV_DENSENET = "torchvision.models.densenet"


def _tv_block_reason(b: nn.Module) -> str | None:
    k = 3 if hasattr(b, "conv3") else 2
    problems = [_relu_problem("relu", b.relu)]
    problems += [_bn_problem(f"bn{i}", getattr(b, f"bn{i}"), False) for i in range(1, k)]
    problems += [conv_problem(f"conv{i}", getattr(b, f"conv{i}")) for i in range(2, k + 1)]
    return _first(*problems)


def _tv_block_chains(b: nn.Module) -> list[Chain]:
    k = 3 if hasattr(b, "conv3") else 2
    out = [Chain(f"bn{i}", (f"conv{i + 1}",)) for i in range(1, k)]
    out.append(Chain(f"bn{k}", reason="post-activation: it feeds the residual add, not a "
                                      "ReLU -> conv"))
    if b.downsample is not None and isinstance(b.downsample, nn.Sequential):
        for name, m in b.downsample.named_children():
            if isinstance(m, nn.BatchNorm2d):
                out.append(Chain(f"downsample.{name}", reason="the projection's BatchNorm "
                                                              "feeds the residual add"))
    return out


def _tv_basic_forward(self, x: Tensor) -> Tensor:
    identity = x
    out = self.conv1(x)
    _m.check_inputs(out, self.conv2)
    out = _m.conv(_m.prepare(self.bn1, out), self.conv2)
    out = self.bn2(out)
    if self.downsample is not None:
        identity = self.downsample(x)
    out += identity
    return self.relu(out)


def _tv_bottleneck_forward(self, x: Tensor) -> Tensor:
    identity = x
    out = self.conv1(x)
    _m.check_inputs(out, self.conv2)
    _m.check_convs(self.conv3)
    a = _m.conv_into(_m.prepare(self.bn1, out), self.conv2, self.bn2)
    out = self.bn3(_m.conv(a, self.conv3))
    if self.downsample is not None:
        identity = self.downsample(x)
    out += identity
    return self.relu(out)


register_rewriter(f"{_TV_RESNET}.BasicBlock", Rewriter(
    "torchvision.BasicBlock", _tv_block_reason, _tv_block_chains,
    swap={"forward": _tv_basic_forward}))
register_rewriter(f"{_TV_RESNET}.Bottleneck", Rewriter(
    "torchvision.Bottleneck", _tv_block_reason, _tv_block_chains,
    swap={"forward": _tv_bottleneck_forward}))


def _dense_reason(layer: nn.Module) -> str | None:
    return _first(_bn_problem("norm1", layer.norm1, False), _relu_problem("relu1", layer.relu1),
                  conv_problem("conv1", layer.conv1), _bn_problem("norm2", layer.norm2, False),
                  _relu_problem("relu2", layer.relu2), conv_problem("conv2", layer.conv2))


def _dense_bn_function(self, inputs: Sequence[Tensor]) -> Tensor:
    x = torch.cat(list(inputs), 1)
    _m.check_inputs(x, self.conv1)
    return _m.conv(_m.prepare(self.norm1, x), self.conv1)


def _dense_checkpoint_bottleneck(self, inputs: Sequence[Tensor]) -> Tensor:
    # torchvision recomputes the concatenation and conv1 in backward (memory_efficient); so
    # does this, with fusedres's checkpoint: norm1's running statistics counted once.
    return checkpoint(lambda *xs: self.bn_function(xs), *inputs, modules=[self.norm1])


def _dense_forward(self, input) -> Tensor:
    prev = [input] if isinstance(input, Tensor) else list(input)
    if self.memory_efficient and any(t.requires_grad for t in prev) and \
            torch.is_grad_enabled():
        bottleneck = self.call_checkpoint_bottleneck(prev)
        _m.check_inputs(bottleneck, self.conv2)
        a = _m.prepare(self.norm2, bottleneck)
    else:
        x = torch.cat(prev, 1)
        _m.check_inputs(x, self.conv1)
        _m.check_convs(self.conv2)
        a = _m.conv_into(_m.prepare(self.norm1, x), self.conv1, self.norm2)
    out = _m.conv(a, self.conv2)
    if self.drop_rate > 0:
        out = F.dropout(out, p=self.drop_rate, training=self.training)
    return out


register_rewriter(f"{_TV_DENSENET}._DenseLayer", Rewriter(
    "torchvision._DenseLayer", _dense_reason,
    lambda layer: [Chain("norm1", ("conv1",)), Chain("norm2", ("conv2",))],
    swap={"forward": _dense_forward, "bn_function": _dense_bn_function,
          "call_checkpoint_bottleneck": _dense_checkpoint_bottleneck}))


def _transition_forward(self, x: Tensor) -> Tensor:
    _m.check_inputs(x, self.conv)
    return self.pool(_m.conv(_m.prepare(self.norm, x), self.conv))


register_rewriter(f"{_TV_DENSENET}._Transition", Rewriter(
    "torchvision._Transition",
    lambda t: _first(_bn_problem("norm", t.norm, False), _relu_problem("relu", t.relu),
                     conv_problem("conv", t.conv)),
    lambda t: [Chain("norm", ("conv",))],
    swap={"forward": _transition_forward}))
