"""Memory accounting of a training step: the one place the planner, the trainer and the
benchmarks read (imports run one way: ``accounting`` <- ``planner`` <- ``memory``).

Two kinds of figure, both counts of tensor storages (each storage once, however many views):

* saved activations: what autograd keeps between forward and backward
  (:class:`SavedTensorCounter`, :func:`saved_bytes`); exact and the same on every machine.
* live bytes: the storages alive at once (:class:`LiveTensorTracker`), whose peak over a whole
  training step is what a device's memory must hold.

:func:`simulate_step` runs one whole training step (forward, loss, backward, optimizer step,
optionally the evaluation forward) on fake tensors under the tracker: nothing is allocated,
and the peak it reports is the peak the tracker measures on the real step (tests/test_memory.py
checks them against each other). :class:`StepMemory` itemises that peak.

What the tracker cannot see, and how it is treated:

* buffers a kernel allocates and frees inside one op (the cpu backend's tile buffers in
  ``csrc/cpu/bn_relu_conv2d.cpp``, oneDNN's scratch inside them; cuDNN's and cuBLAS's) do not
  reach the dispatcher. For the cpu backend's fused ops they are a predicted term,
  :func:`cpu_op_workspace_bytes` (an upper bound per call from the kernel's tiling rule; the
  step's term is the largest call's, added to the tensor peak), checked separately against the
  process's peak resident memory around single op calls, with glibc's mmap threshold fixed so
  that freed buffers leave the resident set (tests/test_memory.py). Not modelled: the scratch
  of plain PyTorch ops (oneDNN convolutions of the plain blocks), cuDNN and cuBLAS workspaces.
* CUDA: ``torch.cuda.max_memory_allocated`` counts the caching allocator's blocks, each
  allocation rounded up to a multiple of 512 bytes (``CUDA_BLOCK_BYTES``; an empty tensor
  allocates nothing). :func:`simulate_step` with ``cuda_rules=True`` counts that way and runs
  the optimizer as on a GPU (``foreach`` kernels, whose temporaries are alive together). It
  runs on meta tensors (fake CPU tensors under autocast): torch's autograd engine needs a CUDA
  driver to run a backward on fake CUDA tensors. Not counted here: cuDNN and cuBLAS workspaces
  (cuBLAS's is allocated through the caching allocator and counted by
  ``max_memory_allocated``), the CUDA context (not counted there);
  :mod:`fusedres.memory.cuda_memory` replays the step's allocations (``StepMemory.events``) through
  the allocator's rules for the reserved memory, and states the workspaces and the context beside
  it.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..ops import _extension
from ..ops.opdefs import ConvGeometry, bind, suggests_channels_last

__all__ = ["CUDA_BLOCK_BYTES", "LiveTensorTracker", "SavedTensor", "SavedTensorCounter",
           "StepMemory", "cpu_op_workspace_bytes", "format_bytes", "optimizer_spec", "saved_bytes",
           "saved_tensors", "simulate_step", "storage_key"]

GiB = 2 ** 30
MiB = 2 ** 20
CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to this


def format_bytes(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if abs(n) >= 0.1 * GiB else f"{n / MiB:.2f} MiB"


# --------------------------------------------------------------------------- storage counting

@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int


def storage_key(t: torch.Tensor) -> int:
    # The StorageImpl pointer identifies a storage on every device, meta included.
    return t.untyped_storage()._cdata


class SavedTensorCounter:
    """Context manager recording the distinct storages autograd saves inside the block.

    ``exclude``: a module whose parameters and buffers are not counted (they are kept whether or
    not autograd saves them). After the block, :attr:`saved` lists one :class:`SavedTensor` per
    storage and :attr:`total_bytes` sums them. Usable around a real training step: the counted
    tensors are released when the block ends, the graph keeps what it needs.
    """

    def __init__(self, exclude: nn.Module | None = None):
        self._excluded = set()
        if exclude is not None:
            self._excluded = {storage_key(t) for t in (*exclude.parameters(), *exclude.buffers())}
        self._found: dict[int, SavedTensor] = {}
        self._kept: list[torch.Tensor] = []  # no storage address is reused while counting
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        self._kept.append(t)
        if key not in self._excluded and key not in self._found:
            self._found[key] = SavedTensor(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._kept.clear()

    @property
    def saved(self) -> list[SavedTensor]:
        return list(self._found.values())

    @property
    def total_bytes(self) -> int:
        return sum(s.storage_bytes for s in self._found.values())


class LiveTensorTracker(TorchDispatchMode):
    """Context manager measuring the bytes of tensor storages created inside the block that are
    alive at once, on any device (meta and fake tensors included).

    Every storage an op run under it returns is counted from its creation until it is freed
    (a finalizer on the storage), each storage once however many views share it. Storages that
    existed before the block (parameters, the input) are not counted unless handed to
    :meth:`count`; buffers a kernel allocates and frees inside one op are never counted (they
    do not reach the dispatcher).

    The whole-step peak of a training step, on any device::

        with LiveTensorTracker() as live:
            live.count(model, optimizer, x)       # parameters, buffers, grads, optimizer state
            loss_fn(model(x), y).backward(); optimizer.step()
        live.peak_bytes

    :attr:`current_bytes` is what is alive now, :attr:`peak_bytes` the most that was alive at
    any point since entering; :meth:`reset_peak` restarts the peak from the current figure.

    ``round_to``: count each storage rounded up to a multiple of this many bytes (512: the CUDA
    caching allocator's blocks, as ``torch.cuda.max_memory_allocated`` counts; an empty storage
    counts 0). ``device_type``: count only storages on that device type (e.g. ``"cuda"``).
    ``keep_peak_set``: keep, in :attr:`peak_storages`, the storages (key -> bytes) alive at the
    peak, to itemise it.
    """

    def __init__(self, *, round_to: int = 1, device_type: str | None = None,
                 keep_peak_set: bool = False):
        super().__init__()
        if not isinstance(round_to, int) or round_to < 1:
            raise ValueError(f"round_to: expected a positive number of bytes, got {round_to!r}")
        self._live: dict[int, int] = {}
        self._round = round_to
        self._device_type = device_type
        self._keep = keep_peak_set
        self.peak_storages: dict[int, int] = {}
        self.tag = "transient"  # what storages created from now on are (see peak_by_tag)
        self._tags: dict[int, str] = {}
        self._peak_tags: dict[int, str] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        # When a list: ("alloc", key, nbytes) and ("free", key) in order, nbytes unrounded
        # (the allocator replay of fusedres.memory.cuda_memory reads it).
        self.events: list[tuple] | None = None

    def _free(self, key: int) -> None:
        if self.events is not None and key in self._live:
            self.events.append(("free", key))
        self.current_bytes -= self._live.pop(key, 0)
        self._tags.pop(key, None)

    def _snapshot(self) -> None:
        self.peak_storages = dict(self._live)
        self._peak_tags = dict(self._tags)

    def _bump(self) -> None:
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            if self._keep:
                self._snapshot()

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        if self._keep:
            self._snapshot()

    def retag(self, t: torch.Tensor | None, tag: str) -> None:
        """Label ``t``'s storage (when it is counted) ``tag`` from now on."""
        if t is not None and storage_key(t) in self._live:
            self._tags[storage_key(t)] = tag

    def retag_all(self, old: str, new: str, keep: Sequence[torch.Tensor] = ()) -> None:
        """Label every live storage tagged ``old`` as ``new``, except those of ``keep``."""
        skip = {storage_key(t) for t in keep}
        for k, tag in self._tags.items():
            if tag == old and k not in skip:
                self._tags[k] = new

    def peak_by_tag(self) -> dict[str, int]:
        """Bytes alive at the peak per tag (``keep_peak_set=True``); storages are tagged with
        :attr:`tag` as it was when they were created, or by :meth:`retag`."""
        out: dict[str, int] = {}
        for k, n in self.peak_storages.items():
            tag = self._peak_tags.get(k, "transient")
            out[tag] = out.get(tag, 0) + n
        return out

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage from now until it is freed (once per storage)."""
        if self._device_type is not None and t.device.type != self._device_type:
            return
        st = t.untyped_storage()
        key = storage_key(t)
        if key in self._live:
            return
        n = st.nbytes()
        if self.events is not None:
            self.events.append(("alloc", key, n))
        if self._round > 1:
            n = -(-n // self._round) * self._round
        self._live[key] = n
        self._tags[key] = self.tag
        self.current_bytes += n
        self._bump()
        weakref.finalize(st, self._free, key)

    def count(self, *objs: torch.Tensor | nn.Module | torch.optim.Optimizer) -> None:
        """Count storages that already exist: tensors, a module's parameters, buffers and
        gradients, an optimizer's state tensors (each storage once, until freed)."""
        for obj in objs:
            for t in _tensors_of(obj, "count(*objs)"):
                self.track(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def _tensors_of(obj, what: str) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, nn.Module):
        tensors = [*obj.parameters(), *obj.buffers()]
        return tensors + [p.grad for p in obj.parameters() if p.grad is not None]
    if isinstance(obj, torch.optim.Optimizer):
        return [v for state in obj.state.values() for v in tree_flatten(state)[0]
                if isinstance(v, torch.Tensor)]
    raise TypeError(f"{what}: expected tensors, modules or optimizers, got {type(obj).__name__}")


def saved_tensors(fn: Callable[..., Any], *args, **kwargs) -> list[SavedTensor]:
    """Distinct storages saved for backward while ``fn(*args, **kwargs)`` runs, one entry per
    storage (views of one storage count once). When ``fn`` is an ``nn.Module`` its parameters
    and buffers are not counted: they are kept whether or not autograd saves them."""
    counter = SavedTensorCounter(fn if isinstance(fn, nn.Module) else None)
    with counter:
        out = fn(*args, **kwargs)
        del out
    return counter.saved


def saved_bytes(fn: Callable[..., Any], *args, **kwargs) -> int:
    """Bytes of the distinct storages saved for backward by ``fn(*args, **kwargs)``."""
    return sum(s.storage_bytes for s in saved_tensors(fn, *args, **kwargs))


# --------------------------------------------------------------------------- the whole step

@dataclass
class StepMemory:
    """The peak of one training step, itemised (bytes).

    The tensor terms are what is alive at the moment of the peak (``phase``: ``"forward"``,
    ``"backward"``, ``"optimizer step"`` or ``"eval forward"``): ``parameters`` (and buffers),
    ``gradients`` (parameter gradients), ``optimizer_state``, ``inputs`` (the batch and its
    labels), ``saved_activations`` (tensors the forward saved for backward, still alive),
    ``transient`` (everything else: a checkpointed segment being recomputed, the gradients in
    flight, an op's outputs). ``tensor_peak_bytes`` is their sum, the peak the
    :class:`LiveTensorTracker` measures on the real step. ``workspace``: kernel scratch the
    tracker cannot see (predicted, :func:`cpu_op_workspace_bytes`); ``resident``: other tensors the
    caller keeps on the device (the trainer's dataset). ``peak_bytes`` adds them all.
    ``saved_after_forward``: saved activations when the forward ends; ``train_peak_bytes`` /
    ``eval_peak_bytes``: the tensor peaks of the training step and of the evaluation forward.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    saved_activations: int
    transient: int
    phase: str
    workspace: int
    resident: int
    saved_after_forward: int
    train_peak_bytes: int
    eval_peak_bytes: int | None
    device: str
    cuda_rules: bool = False
    notes: list[str] = field(default_factory=list)
    # cuda_rules: the step's allocations and frees in order (LiveTensorTracker.events), for
    # fusedres.memory.cuda_memory's allocator replay.
    events: list[tuple] | None = field(default=None, repr=False)

    @property
    def tensor_peak_bytes(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_state + self.inputs
                + self.saved_activations + self.transient)

    @property
    def peak_bytes(self) -> int:
        return self.tensor_peak_bytes + self.workspace + self.resident

    def lines(self) -> list[str]:
        terms = [("parameters and buffers", self.parameters), ("gradients", self.gradients),
                 ("optimizer state", self.optimizer_state), ("batch", self.inputs),
                 ("saved activations", self.saved_activations),
                 ("transient (recompute, gradients in flight)", self.transient),
                 ("kernel workspace (predicted)", self.workspace),
                 ("resident (data on the device)", self.resident)]
        out = [f"peak {format_bytes(self.peak_bytes)} during the {self.phase}"
               + (" (CUDA allocator rules)" if self.cuda_rules else "") + ":"]
        out += [f"  {name:<44} {format_bytes(n):>12}" for name, n in terms if n]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def optimizer_spec(optimizer: torch.optim.Optimizer | None
                   ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """A factory building an optimizer like ``optimizer`` (same class, same hyperparameters per
    group, same grouping order) over other parameters; ``None``: the trainer's SGD with
    momentum 0.9. Used to simulate its state and step without touching it."""
    if optimizer is None:
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got "
                        f"{type(optimizer).__name__}")
    cls = type(optimizer)
    groups = [({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]])
              for g in optimizer.param_groups]

    def build(params_by_id: dict[int, nn.Parameter]) -> torch.optim.Optimizer:
        return cls([dict(hyper, params=[params_by_id[i] for i in ids]) for hyper, ids in groups])
    build.by_id = True  # takes {id(real parameter): stand-in}
    return build


# oneDNN's per-call scratchpad and primitive state beside the tiles: up to 180 KiB measured
# with one-sample tiles of a strided 1x1 convolution (tests/test_memory.py).
_ONEDNN_SLACK = 256 * 1024


def cpu_op_workspace_bytes(func, args, kwargs=None) -> int:
    """Bytes one call of a fused op allocates and frees inside the cpu backend
    (``csrc/cpu/bn_relu_conv2d.cpp``), an upper bound: tiles of ``nb`` samples (the kernel's own
    tiling rule, ``fusedres._C``'s ``cpu_tile_samples``), a the activation tile and o the output
    tile. Forward: a, o and a re-laid copy of the weight (plus oneDNN's own copy), and, for NCHW
    x, a second activation tile (a strided 1x1 convolution subsamples it). Backward: a whole
    copy of a grad_out that is not dense or not of the weight's dtype, with a branch scale one
    more output tile (grad_out's tile staged scaled), the weight copy and two weight-gradient
    accumulators (3w), the per-thread sums, and the tiles: for NCHW x the activation,
    data-gradient and layout-change buffers and what oneDNN's per-tile backward returns
    (4a + 4o); for channels_last x, which changes no layout, the activation tile and the data
    gradient's (2a) and an output tile for oneDNN's reorders (o). Both: 256 KiB for oneDNN's
    scratchpad. Checked against the process's peak resident memory around single op calls in
    both layouts (tests/test_memory.py: channels_last measured 2a plus the grad_out copy, the
    old NCHW-shaped bound was 3x that). 0 for other ops, and when the extension is not
    built."""
    bound = bind(func, args, kwargs)
    if bound is None or "weight" not in bound:
        return 0
    x, weight = bound["x"], bound["weight"]
    n, c, h, w = x.shape
    co, _, kh, kw = weight.shape
    ho, wo = ConvGeometry(bound["stride"], bound["padding"], bound["dilation"]).out_hw(h, w, kh, kw)
    size = weight.element_size()
    per_sample = (c * h * w + co * ho * wo) * size
    cl = suggests_channels_last(x)
    nb = _extension.cpu_tile_samples(n, per_sample, weight.numel() * size, cl)
    if nb is None:
        return 0
    a_tile, o_tile = nb * c * h * w * size, nb * co * ho * wo * size
    w_bytes = weight.numel() * max(size, 4)
    if "grad_out" in bound:
        go = bound["grad_out"]
        # A grad_out that is not dense (the expanded gradient of a sum()) or of another dtype
        # is first copied whole.
        dense = go.is_contiguous() or go.is_contiguous(memory_format=torch.channels_last)
        go_copy = 0 if dense and go.dtype == weight.dtype else n * co * ho * wo * size
        # A branch scale stages each grad_out tile scaled, in a tile buffer of its own.
        scaled = o_tile if bound.get("branch_scale") is not None else 0
        tiles = 2 * a_tile + o_tile if cl else 4 * a_tile + 4 * o_tile
        return (go_copy + scaled + tiles + 3 * w_bytes + torch.get_num_threads() * 2 * c * 8
                + _ONEDNN_SLACK)
    return (1 if cl else 2) * a_tile + o_tile + 2 * w_bytes + _ONEDNN_SLACK


class _StepTracker(LiveTensorTracker):
    """The tracker, plus the cpu backend's predicted in-op workspace (the largest of any call,
    :attr:`workspace_bytes`), when ``cpu_workspace``."""

    def __init__(self, cpu_workspace: bool, **kwargs):
        super().__init__(**kwargs)
        self._ws = cpu_workspace
        self.workspace_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._ws:
            self.workspace_bytes = max(self.workspace_bytes,
                                       cpu_op_workspace_bytes(func, args, kwargs))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in _BN_WITH_STATS and args[0].dtype in (torch.float16, torch.bfloat16):
            # The meta kernel gives a half input half-precision saved statistics; the CPU and
            # CUDA kernels give float32 ones (torch 2.14): count them at float32's size.
            for t in out[1:3]:
                key = storage_key(t)
                if key in self._live and t.dtype != torch.float32:
                    extra = t.untyped_storage().nbytes()
                    if self._round > 1:
                        extra = -(-2 * extra // self._round) * self._round - self._live[key]
                    self._live[key] += extra
                    self.current_bytes += extra
                    self._bump()
        return out


_BN_WITH_STATS = (torch.ops.aten.native_batch_norm.default,
                  torch.ops.aten._native_batch_norm_legit.default,
                  torch.ops.aten._native_batch_norm_legit_no_training.default)


def _fake_state(model: nn.Module, mode, param_dtype: torch.dtype | None):
    """Fake copies (CPU; meta tensors when ``mode`` is None) of the parameters and buffers;
    floating ones cast to ``param_dtype``."""
    state, by_id = {}, {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        dt = param_dtype if (param_dtype is not None and t.is_floating_point()) else t.dtype
        f = torch.empty_strided(t.shape, t.stride(), dtype=dt, device="meta")
        if mode is not None:
            f = mode.fake_tensor_converter.from_meta_and_device(mode, f, torch.device("cpu"))
        if isinstance(t, nn.Parameter):
            f = nn.Parameter(f, requires_grad=t.requires_grad)
            by_id[id(t)] = f
        state[name] = f
    return state, by_id


def simulate_step(model: nn.Module, input_shape: Sequence[int], *,
                  amp_dtype: torch.dtype | None = None, param_dtype: torch.dtype | None = None,
                  optimizer: torch.optim.Optimizer | None = None,
                  eval_batch_size: int | None = None, num_classes: int | None = None,
                  channels_last: bool = False, cuda_rules: bool = False,
                  resident_bytes: int = 0, workspace: bool = True) -> StepMemory:
    """Simulate one training step of ``model`` on fake tensors and return its itemised peak.

    The step is the trainer's: ``optimizer.zero_grad(set_to_none=True)``, forward under
    ``torch.autocast("cpu", amp_dtype)`` when ``amp_dtype`` is given, cross-entropy loss,
    backward, ``optimizer.step()``; then, when ``eval_batch_size`` is given, the evaluation
    forward (``no_grad``, eval mode) at that batch while the gradients are still alive. The
    model's checkpointing (``set_grad_checkpointing``) and backend are used as they are. The
    optimizer state is created first (one update from zero gradients, not counted), so the
    measured step is a steady-state one.

    ``input_shape``: (N, C, H, W); ``param_dtype``: cast floating parameters and the input (pure
    half-precision training; None keeps them). ``optimizer``: simulated by class and
    hyperparameters (:func:`optimizer_spec`; None: SGD with momentum). ``cuda_rules``: count as
    the CUDA caching allocator does (see the module docstring). ``resident_bytes``: added as is.
    Nothing real is allocated; the model is not modified.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if len(tuple(input_shape)) != 4:
        raise ValueError(f"input_shape: expected (N, C, H, W), got {tuple(input_shape)}")
    shape = tuple(int(s) for s in input_shape)
    if num_classes is None:
        fc = model.get_classifier() if callable(getattr(model, "get_classifier", None)) else None
        num_classes = fc.out_features if isinstance(fc, nn.Linear) else 10
    build = optimizer_spec(optimizer)
    # Autocast needs a device it runs on: fake CPU tensors. Without it the meta device runs the
    # same ops (meta kernels, the fused ops' fake kernels) about 20x faster.
    mode = FakeTensorMode(allow_non_fake_inputs=True) if amp_dtype is not None else None
    dev = "cpu" if mode is not None else "meta"
    state, by_id = _fake_state(model, mode, param_dtype)
    # A copy of the module tree holding the stand-ins (nothing real is copied), so that a
    # checkpointed segment recomputed during backward still sees them.
    memo = {id(t): state[name] for name, t in (*model.named_parameters(),
                                               *model.named_buffers())}
    sim = copy.deepcopy(model, memo)
    params = list(sim.parameters())
    opt = build(by_id) if getattr(build, "by_id", False) else build(params)
    if cuda_rules:
        for g in opt.param_groups:  # torch's default on a GPU: the foreach kernels
            if g.get("foreach") is None and not g.get("fused"):
                g["foreach"] = True
    in_dtype = param_dtype or torch.float32
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    autocast = (torch.autocast("cpu", dtype=amp_dtype) if amp_dtype is not None
                else contextlib.nullcontext())
    cpu_ws = False
    if workspace and not cuda_rules:
        from ..ops import _backend
        cpu_ws = _backend.resolve_backend(torch.device("cpu")) == "cpu"
    live = _StepTracker(cpu_ws, round_to=CUDA_BLOCK_BYTES if cuda_rules else 1,
                        keep_peak_set=True)
    if cuda_rules:
        live.events = []
    phases: dict[str, tuple[int, dict[str, int]]] = {}
    saved_after = 0
    hooks = [p.register_post_accumulate_grad_hook(lambda p: live.retag(p.grad, "gradients"))
             for p in params if p.requires_grad]

    def batch(n):
        x = torch.empty(n, *shape[1:], dtype=in_dtype, device=dev)
        return x.contiguous(memory_format=fmt), torch.empty(n, dtype=torch.int64, device=dev)

    def end(phase):
        phases[phase] = (live.peak_bytes, live.peak_by_tag())
        live.reset_peak()

    def step(x, y, tracked):
        nonlocal saved_after
        opt.zero_grad(set_to_none=True)
        with autocast:
            out = sim(x)
            loss = F.cross_entropy(out.float(), y)
        if tracked:
            # What the forward leaves alive, but its output and loss, is kept for backward.
            live.retag_all("transient", "saved activations", keep=(out, loss))
            saved_after = sum(n for k, n in live._live.items()
                              if live._tags.get(k) == "saved activations")
            end("forward")
        loss.backward()
        del loss, out
        if tracked:
            end("backward")
        opt.step()
        if tracked:
            end("optimizer step")

    try:
        sim.train()
        with mode if mode is not None else contextlib.nullcontext():
            x, y = batch(shape[0])
            # The optimizer state exists from the second step on: create it with one update
            # from zero gradients (cheaper than a whole first step), then measure a step.
            with torch.no_grad():
                for p in params:
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
                opt.step()
            with live:
                for tag, objs in (("parameters", state.values()), ("optimizer state", [opt]),
                                  ("batch", (x, y))):
                    live.tag = tag
                    live.count(*objs)
                live.tag = "transient"
                live.reset_peak()
                step(x, y, tracked=True)
                eval_peak = None
                if eval_batch_size is not None:
                    del x, y
                    sim.eval()
                    with torch.no_grad():
                        live.tag = "batch"
                        ex, ey = batch(eval_batch_size)
                        live.tag = "transient"
                        live.reset_peak()
                        with autocast:
                            out = sim(ex)
                        F.cross_entropy(out.float(), ey, reduction="sum")
                        del out
                    eval_peak = live.peak_bytes
                    end("eval forward")
    finally:
        for h in hooks:
            h.remove()
    phase, (peak, by_tag) = max(phases.items(), key=lambda kv: kv[1][0])
    train_peak = max(v[0] for k, v in phases.items() if k != "eval forward")
    terms = [by_tag.get(t, 0) for t in ("parameters", "gradients", "optimizer state", "batch",
                                        "saved activations", "transient")]
    assert sum(terms) == peak, (terms, peak)
    return StepMemory(*terms, phase=phase, workspace=live.workspace_bytes,
                      resident=int(resident_bytes), saved_after_forward=saved_after,
                      train_peak_bytes=train_peak, eval_peak_bytes=eval_peak,
                      device="cuda" if cuda_rules else "cpu", cuda_rules=cuda_rules,
                      events=None if live.events is None else list(live.events))
