"""``fusedres.fuse``: run a model's BatchNorm -> ReLU -> Conv2d (+ residual add) chains through
the fused op, in place: the model keeps its identity, class, attributes and methods (timm's
``set_grad_checkpointing``, ``forward_features``, ``reset_classifier``, ``pretrained_cfg``...).

Two ways, tried in this order for every module, children before their parent:

1. A rewriter registered for the module's class (:mod:`fusedres.convert.rewriters`: fusedres's own
   blocks, timm's ResNetV2 pre-activation blocks and stages, torchvision's ResNet blocks and
   DenseNet layers). It knows the block: its fused forward keeps what the original does
   (drop-path, the model's checkpointing) and runs every chain it can through the fused op.
2. For code no rewriter knows, torch.fx: the module's forward is traced (BatchNorms, modules
   already fused and modules that cannot be traced kept as calls), its chains matched by data
   flow, and the module's class swapped for a subclass whose forward is the rewritten graph.
   A module is traced only where a BatchNorm below it is not yet in a fused module.

What the fx fallback matches, in the traced graph:

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
not match is left as it was and reported with the reason (:class:`FuseReport`).

A module whose class was swapped (by a rewriter or by the fx fallback) is a subclass of its
class: ``isinstance`` holds, and ``copy.deepcopy`` and pickling rebuild it fused (the fx
fallback traces the module again when it is loaded).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import modules as _modules
from ..functional import BatchNormState
from ..ops.opdefs import out_shape
from .rewriters import Rewriter, conv_problem, is_fused, is_norm_act, rewriter_for

__all__ = ["ChainResult", "FuseReport", "fuse"]

FX = "torch.fx"
_RELU_FUNCTIONS = {F.relu, torch.relu, torch.relu_, getattr(F, "relu_", None)} - {None}
_RELU_METHODS = {"relu", "relu_"}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_FUNCTIONAL_BN = {F.batch_norm, torch.batch_norm}
_BatchNorm = nn.modules.batchnorm._BatchNorm


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
    """One BatchNorm found: where, what became of it, and which way (``by``: a rewriter's name
    or ``"torch.fx"``)."""

    path: str
    fused: bool
    convs: list[str] = field(default_factory=list)
    residual_adds: int = 0
    reason: str = ""
    by: str = ""


@dataclass
class FuseReport:
    """What :func:`fuse` found and did.

    ``chains``: one per BatchNorm (a BatchNorm seen again by a parent's trace is reported as
    the parent saw it). ``rewritten``: (module path, rewriter name or ``"torch.fx"``) of every
    module rewritten. ``declined``: (path, rewriter, reason) of modules of a known class that
    could not be fused as a whole (the fx fallback then took what it could). ``already``:
    modules that already ran fused. ``untraced``: (path, error) of modules torch.fx could not
    trace (their children were searched on their own).
    """

    chains: list[ChainResult] = field(default_factory=list)
    untraced: list[tuple[str, str]] = field(default_factory=list)
    rewritten: list[tuple[str, str]] = field(default_factory=list)
    declined: list[tuple[str, str, str]] = field(default_factory=list)
    already: list[str] = field(default_factory=list)

    def add(self, result: ChainResult) -> None:
        for i, c in enumerate(self.chains):
            if c.path == result.path:
                self.chains[i] = result
                return
        self.chains.append(result)

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
        by: dict[str, int] = {}
        for _, name in self.rewritten:
            by[name] = by.get(name, 0) + 1
        lines = [f"fusedres.fuse: {self.found} BatchNorm chains found, {self.fused} fused "
                 f"({self.fused_convs} convs, {self.fused_residual_adds} residual adds), "
                 f"{len(self.left)} left"]
        if by:
            lines.append("  rewritten: " + ", ".join(f"{n} x{k}" for n, k in by.items()))
        if self.already:
            lines.append(f"  already fused: {len(self.already)} modules")
        for c in self.left:
            lines.append(f"  left {c.path}: {c.reason}")
        for path, name, reason in self.declined:
            lines.append(f"  not rewritten {path} ({name}): {reason}")
        for path, err in self.untraced:
            lines.append(f"  not traceable {path}: {err} (searched its submodules instead)")
        return "\n".join(lines)


# --------------------------------------------------------------------------- tracing

class _Tracer(fx.Tracer):
    """Keeps as single calls: every BatchNorm (subclasses included, e.g. norm+act modules),
    modules that already run fused, and the modules named in ``leaves`` (qualified names
    relative to the traced root: those that could not be traced)."""

    def __init__(self, leaves=()):
        super().__init__()
        self._leaves = set(leaves)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, _BatchNorm) or is_fused(m) or qualname in self._leaves:
            return True
        return super().is_leaf_module(m, qualname)


def _trace(root: nn.Module, leaves=()) -> fx.GraphModule:
    tracer = _Tracer(leaves)
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
    """None when ``node`` is a Conv2d call the fused op can run on ``act``; else why not. The
    module rules are the rewriters' (one place: a Conv2d subclass with its own forward, such as
    timm's StdConv2d or Conv2dSame kept as a leaf, is refused on both paths)."""
    m = _module(gm, node)
    if not isinstance(m, nn.Conv2d):
        return f"the activation is also used by {_describe(gm, node)}, which is not a Conv2d"
    if len(node.args) != 1 or node.args[0] is not act or node.kwargs:
        return f"{node.target} is called with other arguments"
    return conv_problem(str(node.target), m)


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


def _rewrite(gm: fx.GraphModule, prefix: str, report: FuseReport) -> int:
    """Rewrite every chain of ``gm``'s graph the fused op can run; report each BatchNorm call;
    return how many chains were fused."""
    graph = gm.graph
    fused = 0
    _drop_identities(gm)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _FUNCTIONAL_BN:
            report.add(ChainResult(f"{prefix}{node.name}", False, reason=(
                "functional batch_norm (no module owns its state); use nn.BatchNorm2d")))
            continue
        m = _module(gm, node) if node.op == "call_module" else None
        if not isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        path = prefix + node.target
        result = ChainResult(path, False, by=FX)
        report.add(result)
        if not isinstance(m, nn.BatchNorm2d):
            result.reason = f"{type(m).__name__} is not a BatchNorm2d (e.g. SyncBatchNorm)"
            continue
        if type(m) is not nn.BatchNorm2d and not is_norm_act(m) \
                and not callable(getattr(m, "fused_prepare", None)):
            result.reason = (f"{type(m).__name__} subclasses BatchNorm2d with its own forward "
                             f"and no `act` ReLU")
            continue
        if len(node.args) != 1 or node.kwargs:
            result.reason = "called with extra arguments"
            continue
        if is_norm_act(m):
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
        fused += 1
    graph.lint()
    gm.recompile()
    return fused


# --------------------------------------------------------------------------- fx install

class _FxMixin:
    """Base of the classes the fx fallback swaps in: the rewritten graph as ``forward``.
    Pickles (and deep-copies) as the original class, traced and rewritten again on load."""

    _fusedres_fx = True
    _fusedres_base: type

    def __reduce_ex__(self, protocol):
        return (_fx_instance, (self._fusedres_base,), self.__dict__)


class _PendingFx:
    """An instance being loaded: once its state is back, it is traced and rewritten again."""

    _fusedres_base: type

    def __setstate__(self, state):
        base = type(self)._fusedres_base
        base.__setstate__(self, state)
        self.__class__ = base
        _fuse_own_forward(self, "", FuseReport(), getattr(self, "_fusedres_fx_leaves", ()))


_PENDING: dict[type, type] = {}


def _fx_instance(base: type):
    cls = _PENDING.get(base)
    if cls is None:
        cls = _PENDING[base] = type(base.__name__, (_PendingFx, base),
                                    {"_fusedres_base": base, "__module__": base.__module__})
    return cls.__new__(cls)


def _install(module: nn.Module, gm: fx.GraphModule, leaves: tuple[str, ...]) -> None:
    """Make ``gm``'s code ``module``'s forward. The code reads submodules, parameters and
    buffers by their paths from ``self``, the same in ``module`` as in ``gm``; constants the
    trace made (``_tensor_constant0``) are added as non-persistent buffers."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            head = node.target.split(".")[0]
            if not hasattr(module, head):
                module.register_buffer(head, getattr(gm, head), persistent=False)
    base = type(module)
    cls = type(base.__name__, (_FxMixin, base),
               {"forward": type(gm).forward, "_fusedres_base": base,
                "__module__": base.__module__, "__qualname__": base.__qualname__,
                "__doc__": base.__doc__})
    module.__class__ = cls
    module._fusedres_fx_leaves = leaves


def _fuse_own_forward(module: nn.Module, path: str, report: FuseReport, leaves) -> bool:
    """The fx fallback on ``module``'s own forward; False when it cannot be traced."""
    try:
        gm = _trace(module, leaves)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds; any means "not traceable"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        report.untraced.append((path or "<root>", f"{type(e).__name__}: {msg}"))
        return False
    prefix = f"{path}." if path else ""
    if _rewrite(gm, prefix, report):
        _install(module, gm, tuple(leaves))
        report.rewritten.append((path or "<root>", FX))
    return True


# --------------------------------------------------------------------------- the walk

def _open_batch_norm(m: nn.Module, closed: set[int]) -> bool:
    """Whether a BatchNorm below ``m`` is outside every fused (or untraceable) module."""
    for c in m.children():
        if isinstance(c, _BatchNorm):
            return True
        if is_fused(c) or id(c) in closed:
            continue
        if _open_batch_norm(c, closed):
            return True
    return False


def _apply(rw: Rewriter, m: nn.Module, path: str, report: FuseReport) -> None:
    rw.rewrite(m)
    report.rewritten.append((path or "<root>", rw.name))
    prefix = f"{path}." if path else ""
    for c in rw.chains(m):
        report.add(ChainResult(prefix + c.bn, not c.reason, [prefix + n for n in c.convs],
                               int(c.residual) if not c.reason else 0, c.reason, rw.name))


def _untraceable_below(m: nn.Module, closed: set[int]) -> tuple[str, ...]:
    return tuple(name for name, c in m.named_modules() if name and id(c) in closed)


def _visit(m: nn.Module, path: str, report: FuseReport, closed: set[int]) -> None:
    """Fuse ``m`` and everything below it, children first (a rewriter for a container, e.g.
    timm's ResNetStage, looks at its fused children)."""
    if is_fused(m):
        report.already.append(path or "<root>")
        return
    rw = rewriter_for(m)
    if rw is not None and not rw.visit_children:
        reason = rw.reason(m)
        if reason is None:
            _apply(rw, m, path, report)
            return
        report.declined.append((path or "<root>", rw.name, reason))
        rw = None  # the parts of it the fx fallback can take
    for name, child in m.named_children():
        _visit(child, f"{path}.{name}" if path else name, report, closed)
    if rw is not None:
        reason = rw.reason(m)
        if reason is None:
            _apply(rw, m, path, report)
            return
        report.declined.append((path or "<root>", rw.name, reason))
    if isinstance(m, _BatchNorm) or not _open_batch_norm(m, closed):
        return
    if not _fuse_own_forward(m, path, report, _untraceable_below(m, closed)):
        closed.add(id(m))


def fuse(model: nn.Module, *, verbose: bool = False, return_report: bool = False):
    """Run every BatchNorm -> ReLU -> Conv2d chain of ``model`` (with a following residual add)
    through the fused op, in place, and return ``model`` itself.

    The model keeps its class, attributes and methods; fused blocks keep theirs (their class
    becomes a subclass of it). ``state_dict`` (keys and values), outputs and gradients are
    unchanged, with ``nn.BatchNorm2d`` semantics (running statistics updated once per forward
    in training, used in eval), and so is the model's activation checkpointing (timm's
    ``set_grad_checkpointing``, torchvision's DenseNet ``memory_efficient``, fusedres's
    ``set_grad_checkpointing``), whose recomputation then counts a batch in the running
    statistics once. Fusing twice does nothing more.

    ``model.fuse_report`` (a :class:`FuseReport`) says what was found, fused and left, and
    why; ``verbose=True`` prints it; ``return_report=True`` returns ``(model, report)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    report = FuseReport()
    _visit(model, "", report, set())
    model.fuse_report = report
    if verbose:
        print(report)
    return (model, report) if return_report else model
