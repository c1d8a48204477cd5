"""``fusedres.fuse``: rewrite BatchNorm -> ReLU -> Conv2d (+ residual add) chains of any model to
the fused op, by data flow (torch.fx), not by the names of the user's classes.

What is matched, in the traced graph:

* a BatchNorm node: a call of an ``nn.BatchNorm2d`` module (or of a subclass that prepares
  itself for the fused op with ``fused_prepare(x)``, e.g. ``fusedres.distributed.
  SyncBatchNorm2d``), or of a norm+activation module
  (a ``BatchNorm2d`` subclass with an ``act`` ReLU and an identity or absent ``drop``, the
  convention of timm's ``BatchNormAct2d``), which then counts as BatchNorm and ReLU at once;
* its ReLU: ``nn.ReLU`` (in place or not), ``F.relu`` / ``torch.relu`` / ``relu_`` or the
  ``.relu()`` / ``.relu_()`` methods, the BatchNorm's only user;
* every user of the activation is a ``nn.Conv2d`` (groups=1, zero padding) taking it as input:
  one statistics pass and one running-stats update then serve all of them (He et al.'s
  projection shortcut);
* a conv whose only user is an addition of another tensor takes it as the fused residual
  (checked at run time: a tensor of another shape is added outside, as before).

Parameters and buffers stay in the modules they belong to, under the same names, so
``state_dict`` keys and values are unchanged and checkpoints load both ways. A chain that does
not match is left as it was and reported with the reason; a module ``torch.fx`` cannot trace
is searched submodule by submodule instead.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import modules as _modules
from .functional import BatchNormState
from .opdefs import out_shape

__all__ = ["FuseReport", "fuse"]

_RELU_FUNCTIONS = {F.relu, torch.relu, torch.relu_, getattr(F, "relu_", None)} - {None}
_RELU_METHODS = {"relu", "relu_"}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_FUNCTIONAL_BN = {F.batch_norm, torch.batch_norm}


# --------------------------------------------------------------------------- run-time helpers
# The rewritten graph calls these; they take the original modules (get_attr nodes), so
# train()/eval() and the BatchNorm's hyper-parameters are read at run time.

def check_and_prepare(bn: nn.BatchNorm2d, x: Tensor, *convs: nn.Conv2d) -> BatchNormState:
    """One statistics pass and running-stats update of ``bn`` for ``x``, after checking that
    every conv ``x`` feeds can run (a bad input must leave the running statistics alone)."""
    _modules.check_inputs(x, *convs)
    return _modules.prepare(bn, x)


def fused_conv(state: BatchNormState, conv: nn.Conv2d, residual=None) -> Tensor:
    """``conv(relu(bn(x))) (+ residual)`` for a prepared BatchNorm; a residual that is not a
    tensor of the conv output's exact shape is added outside the fused op, as ``+`` would."""
    if residual is None:
        return _modules.conv(state, conv)
    if isinstance(residual, Tensor) and residual.dim() == 4:
        x, w = state.x, conv.weight
        shape = out_shape(x, w, conv.stride, conv.padding, conv.dilation)
        if tuple(residual.shape) == shape and residual.device == x.device:
            return _modules.conv(state, conv, residual)
    return _modules.conv(state, conv) + residual


# --------------------------------------------------------------------------- report

@dataclass
class ChainResult:
    """One BatchNorm found in the graph: where, and what became of it."""

    path: str
    fused: bool
    convs: list[str] = field(default_factory=list)
    residual_adds: int = 0
    reason: str = ""


@dataclass
class FuseReport:
    """What :func:`fuse` found: ``chains`` (one per BatchNorm call), ``untraced`` (modules
    torch.fx could not trace, with the error; their children were searched instead)."""

    chains: list[ChainResult] = field(default_factory=list)
    untraced: list[tuple[str, str]] = field(default_factory=list)

    @property
    def found(self) -> int:
        return len(self.chains)

    @property
    def fused(self) -> int:
        return sum(c.fused for c in self.chains)

    @property
    def left(self) -> list[ChainResult]:
        return [c for c in self.chains if not c.fused]

    @property
    def fused_convs(self) -> int:
        return sum(len(c.convs) for c in self.chains if c.fused)

    @property
    def fused_residual_adds(self) -> int:
        return sum(c.residual_adds for c in self.chains if c.fused)

    def __str__(self) -> str:
        lines = [f"fusedres.fuse: {self.found} BatchNorm chains found, {self.fused} fused "
                 f"({self.fused_convs} convs, {self.fused_residual_adds} residual adds), "
                 f"{len(self.left)} left"]
        for c in self.left:
            lines.append(f"  left {c.path}: {c.reason}")
        for path, err in self.untraced:
            lines.append(f"  not traceable {path}: {err} (searched its submodules instead)")
        return "\n".join(lines)


# --------------------------------------------------------------------------- tracing

def _is_norm_act(m: nn.Module) -> bool:
    act = getattr(m, "act", None)
    drop = getattr(m, "drop", None)
    return (isinstance(m, nn.BatchNorm2d) and isinstance(act, nn.ReLU)
            and (drop is None or isinstance(drop, nn.Identity)
                 or (isinstance(drop, nn.Dropout) and drop.p == 0)))


def _is_already_fused(m: nn.Module) -> bool:
    return isinstance(m, _modules.BNReLUConv2d) or (
        isinstance(m, (_modules.PreActBasicBlock, _modules.PreActBottleneck))
        and getattr(m, "fused", False))


class _Tracer(fx.Tracer):
    """Keeps every BatchNorm (subclasses included, e.g. norm+act modules) and the modules that
    already run the fused op as single calls in the graph."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, nn.modules.batchnorm._BatchNorm) or _is_already_fused(m):
            return True
        return super().is_leaf_module(m, qualname)


def _trace(root: nn.Module) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(root)
    return fx.GraphModule(tracer.root, graph, root.__class__.__name__)


# --------------------------------------------------------------------------- matching

def _module(gm: fx.GraphModule, node: fx.Node):
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    return None


def _is_relu(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return type(_module(gm, node)) is nn.ReLU
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS
    return node.op == "call_method" and node.target in _RELU_METHODS


def _describe(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target} ({type(_module(gm, node)).__name__})"
    if node.op in ("call_function", "call_method"):
        name = getattr(node.target, "__name__", str(node.target))
        return f"{name}()"
    return f"{node.op} {node.target}"


def _conv_problem(gm: fx.GraphModule, node: fx.Node, act: fx.Node) -> str | None:
    """None when ``node`` is a Conv2d call the fused op can run on ``act``; else why not."""
    m = _module(gm, node)
    if not isinstance(m, nn.Conv2d):
        return f"the activation is also used by {_describe(gm, node)}, which is not a Conv2d"
    if len(node.args) != 1 or node.args[0] is not act or node.kwargs:
        return f"{node.target} is called with other arguments"
    if m.groups != 1:
        return f"{node.target} has groups={m.groups} (the fused op supports groups=1)"
    if m.padding_mode != "zeros":
        return f"{node.target} has padding_mode={m.padding_mode!r} (fused op: zeros)"
    if isinstance(m.padding, str):
        return f"{node.target} has padding={m.padding!r} (fused op: explicit padding)"
    return None


def _residual_add(node: fx.Node):
    """(add node, other operand) when ``node``'s only user adds another value to it."""
    if len(node.users) != 1:
        return None
    add = next(iter(node.users))
    if add.op == "call_function" and add.target in _ADD_FUNCTIONS:
        if add.kwargs or len(add.args) != 2:
            return None
        a, b = add.args
        if add.target is operator.iadd and a is not node:
            return None  # other += conv: in place on the other operand
    elif add.op == "call_method" and add.target in ("add", "add_") and not add.kwargs \
            and len(add.args) == 2:
        a, b = add.args
        if add.target == "add_" and a is not node:
            return None  # other.add_(conv): in place on the other operand
    else:
        return None
    if a is node and b is not node:
        return add, b
    if b is node and a is not node:
        return add, a
    return None


def _drop_identities(gm: fx.GraphModule) -> None:
    """Bypass ``nn.Identity`` calls (stateless), so that e.g. timm's ``conv -> Identity
    (drop_path) -> + shortcut`` is seen as a conv followed by a residual add."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and type(_module(gm, node)) is nn.Identity \
                and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0],
                                                                           fx.Node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _rewrite(gm: fx.GraphModule, prefix: str, report: FuseReport) -> None:
    graph = gm.graph
    _drop_identities(gm)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _FUNCTIONAL_BN:
            report.chains.append(ChainResult(f"{prefix}{node.name}", False, reason=(
                "functional batch_norm (no module owns its state); use nn.BatchNorm2d")))
            continue
        m = _module(gm, node) if node.op == "call_module" else None
        if not isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        path = prefix + node.target
        result = ChainResult(path, False)
        report.chains.append(result)
        if not isinstance(m, nn.BatchNorm2d):
            result.reason = f"{type(m).__name__} is not a BatchNorm2d (e.g. SyncBatchNorm)"
            continue
        if type(m) is not nn.BatchNorm2d and not _is_norm_act(m) \
                and not callable(getattr(m, "fused_prepare", None)):
            result.reason = (f"{type(m).__name__} subclasses BatchNorm2d with its own forward "
                             f"and no `act` ReLU")
            continue
        if len(node.args) != 1 or node.kwargs:
            result.reason = "called with extra arguments"
            continue
        if _is_norm_act(m):
            act = node
        else:
            users = list(node.users)
            if len(users) != 1:
                result.reason = (f"its output has {len(users)} users"
                                 + ("" if not users else ": "
                                    + ", ".join(_describe(gm, u) for u in users)))
                continue
            act = users[0]
            if not _is_relu(gm, act):
                result.reason = f"followed by {_describe(gm, act)}, not a ReLU"
                continue
            if len(act.args) < 1 or act.args[0] is not node:
                result.reason = "the ReLU takes other arguments"
                continue
        convs = list(act.users)
        if not convs:
            result.reason = "the activation is not used"
            continue
        problems = [p for p in (_conv_problem(gm, c, act) for c in convs) if p]
        if problems:
            result.reason = problems[0]
            continue

        with graph.inserting_before(act if act is not node else node):
            bn_ref = graph.get_attr(node.target)
            conv_refs = tuple(graph.get_attr(c.target) for c in convs)
            state = graph.call_function(check_and_prepare, (bn_ref, node.args[0], *conv_refs))
        for conv in convs:
            added = _residual_add(conv)
            target = added[0] if added else conv
            with graph.inserting_before(target):
                conv_ref = graph.get_attr(conv.target)
                args = (state, conv_ref) + ((added[1],) if added else ())
                new = graph.call_function(fused_conv, args)
            target.replace_all_uses_with(new)
            graph.erase_node(target)
            if added:
                graph.erase_node(conv)
                result.residual_adds += 1
            result.convs.append(prefix + conv.target)
        if act is not node:
            graph.erase_node(act)
        graph.erase_node(node)
        result.fused = True
    graph.lint()
    gm.recompile()


def _restore_unused(gm: fx.GraphModule, original: nn.Module) -> None:
    """Put back submodules the graph does not reference (the trace drops them), so that the
    state_dict keeps every key of the original model."""
    have = set(gm.state_dict().keys())
    for name, mod in original.named_modules():
        if not name:
            continue
        own = {f"{name}.{k}" for k in mod.state_dict().keys()}
        if own and not own <= have:
            try:
                existing = gm.get_submodule(name)
            except AttributeError:
                existing = None
            if existing is None:
                gm.add_submodule(name, mod)
                have |= own


def _fuse_module(module: nn.Module, prefix: str, report: FuseReport) -> nn.Module:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) or _is_already_fused(module) or \
            not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return module
    try:
        gm = _trace(module)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds; any means "not traceable"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        report.untraced.append((prefix.rstrip(".") or "<root>", f"{type(e).__name__}: {msg}"))
        for name, child in list(module.named_children()):
            new = _fuse_module(child, f"{prefix}{name}.", report)
            if new is not child:
                setattr(module, name, new)
        return module
    _rewrite(gm, prefix, report)
    _restore_unused(gm, module)
    return gm


def fuse(model: nn.Module, *, verbose: bool = False, return_report: bool = False):
    """A copy of ``model`` in which every BatchNorm -> ReLU -> Conv2d chain (with a following
    residual add) runs through the fused op.

    The copy has the same ``state_dict`` (keys and values), outputs and gradients, and keeps
    ``nn.BatchNorm2d`` semantics (running statistics updated once per forward in training,
    used in eval). It is a ``torch.fx.GraphModule`` (or, when the model cannot be traced as a
    whole, the model with its traceable submodules replaced). Its ``fuse_report``
    (a :class:`FuseReport`) says what was found, fused and left, and why; ``verbose=True``
    prints it; ``return_report=True`` returns ``(model, report)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    report = FuseReport()
    out = _fuse_module(copy.deepcopy(model), "", report)
    out.fuse_report = report
    if verbose:
        print(report)
    return (out, report) if return_report else out
