"""The trainer's training step as one function of the batch (:class:`TrainStep`), and its replay
from a CUDA graph (:class:`GraphedStep`, ``fusedres train --cuda-graphs``).

A captured CUDA graph replays the kernels its capture recorded, with the arguments they had
then; the host runs nothing in between. So the step the trainer runs, eager or graphed (one
function, :class:`TrainStep`), keeps two rules on every step:

* It reads no value back on the host: no device-to-host sync (a sync is an error under
  capture, and it stalls the host's launches in an eager step). The learning rate is a
  one-element tensor that the loop fills in place before each step and the optimizer reads on
  the device (``torch.optim.SGD(fused=True)`` with a tensor ``lr``); fp16 loss scaling keeps its
  inf check and its scale update on the device (GradScaler hands ``found_inf`` to the fused
  kernel, which skips the update itself: no ``.item()``); batch-mode stochastic depth draws on
  the device (``fusedres.modules``, ``drop_path_mode="batch"``).
* It issues the same kernels with the same host arguments whatever the data and the schedule:
  the SGD momentum buffers exist from the start (zeros, so the first update's ``0 * m + g`` is
  the gradient, the buffer torch's first step would make) and the fused kernel's
  ``is_first_step`` never changes; autocast runs without its weight cache (casts made inside a
  capture must not be cached for use outside it).

``tests/test_train_step.py`` checks both on CPU for every backend here: zero sync ops in the
profile, and the same dispatched ops with the same non-tensor arguments on consecutive steps
with different learning rates and data. What only a GPU checks: the capture itself
(``torch.cuda.graph``) and the replay's equality with the eager step (the same test file, run
where CUDA is available).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["GraphedStep", "TrainStep", "WARMUP_STEPS", "adamw", "cuda_graph_capture",
           "float_lr_state", "lr_tensor", "sgd", "start_momentum", "use_lr"]

# Eager steps before the capture, on a side stream: cuDNN's benchmark picks its algorithms,
# Triton compiles and autotunes, autograd and the allocator set up their state there, none of
# which a capture may do. PyTorch's whole-network capture example warms up with 3 iterations
# (DistributedDataParallel would need 11; the trainer graphs one process only).
WARMUP_STEPS = 3


def lr_tensor(lr: float, device: torch.device) -> Tensor:
    """The learning rate as the one-element tensor the optimizer reads: float32 on a GPU (the
    fused CUDA kernel reads it as ``float*`` on the device), float64 elsewhere (the CPU kernel
    reads it on the host as a double: a float64 tensor holds the Python float exactly, as a float
    ``lr`` did)."""
    dtype = torch.float32 if device.type == "cuda" else torch.float64
    return torch.tensor(lr, dtype=dtype, device=device)


def sgd(param_groups: list[dict], lr: Tensor, momentum: float, nesterov: bool
        ) -> torch.optim.SGD:
    """torch.optim.SGD's fused implementation with a tensor learning rate: one kernel over all
    parameters, no host read (see the module's rules). Momentum buffers are made at once
    (:func:`start_momentum`)."""
    opt = torch.optim.SGD(param_groups, lr=lr, momentum=momentum, nesterov=nesterov, fused=True)
    start_momentum(opt)
    return opt


def adamw(param_groups: list[dict], lr: Tensor, betas: tuple[float, float],
          capturable: bool = False) -> torch.optim.AdamW:
    """torch.optim.AdamW's fused implementation with a tensor learning rate (the rules of
    :func:`sgd`). Its step count is a device tensor in the fused implementation, so the bias
    corrections need no host read either; its state appears at the first step, which a CUDA
    graph's eager warm-up steps run before the capture.

    ``capturable``: the optimizer will be captured in a CUDA graph (``--cuda-graphs``).
    torch's Adam family refuses a ``step()`` under capture unless every group says so
    (``Optimizer._cuda_graph_capture_health_check``); SGD has no such flag. torch allows it for
    CUDA parameters only, so it is off for an eager step."""
    return torch.optim.AdamW(param_groups, lr=lr, betas=tuple(betas), fused=True,
                             capturable=capturable)


def start_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without one a zero momentum buffer, of its strides (in place of the
    buffer SGD's first step would make: ``momentum * 0 + g`` is ``g``). Also what keeps fp16
    safe: the fused kernel skips a step with an inf gradient before it writes, and a buffer it
    had just allocated for its first step would stay uninitialised."""
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def use_lr(optimizer: torch.optim.Optimizer, lr: Tensor) -> None:
    """Point every parameter group at ``lr`` (after ``load_state_dict``, which puts back the
    checkpoint's plain float)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def float_lr_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with each group's ``lr`` a Python float: a checkpoint holds no
    device tensor in its hyperparameters, so it loads on any device and into an older
    fusedres."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        if torch.is_tensor(group["lr"]):
            group["lr"] = float(group["lr"])
    return state


class TrainStep:
    """One training step of ``model``: gradients to None, forward under autocast
    (``amp_dtype``, None for none), cross-entropy (``label_smoothing``) computed in float64 and
    returned in float32 (:meth:`loss`), backward
    through ``scaler``, ``optimizer`` step, scaler update. ``step(x, y)`` returns (loss,
    correct) as 0-dim device tensors (the mean loss, float32; the count of correct
    predictions, int64).

    The function the trainer runs eagerly and the one :class:`GraphedStep` captures. Its
    optimizer must read its learning rate from a tensor (:func:`sgd`, :func:`adamw`);
    ``mark_step``: tell torch.compile's CUDA graphs that a new iteration begins (``--compile
    reduce-overhead``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, amp_dtype: torch.dtype | None,
                 device_type: str, mark_step: bool = False, label_smoothing: float = 0.0,
                 accum_steps: int = 1, probe=None):
        if accum_steps < 1:
            raise ValueError(f"accum_steps: expected at least 1, got {accum_steps}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.accum_steps = accum_steps
        # --label-smoothing: torch's own loss (its smoothing is a device computation).
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.amp_dtype, self.device_type, self.mark_step = amp_dtype, device_type, mark_step
        # --log-grad-norms: a fusedres.apps.train.gradnorms.GradNormProbe; when armed, it measures
        # the gradients between the backward and the optimizer step (on the device).
        self.probe = probe

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        """The mean cross-entropy of logits ``out`` (B, K) against labels ``y`` (B,) or soft
        targets (B, K), float32. Computed in float64: the log-softmax sums over the K classes
        in an order set by the vector width of the CPU's ATen kernels (AVX2, AVX-512), and in
        float32 that order changes the loss and its gradient in the last bit, which a training
        run amplifies into another final accuracy. Rounded from float64, both come out the same
        on every capability (the digits demo is bit-identical under ATEN_CPU_CAPABILITY=avx2
        and avx512)."""
        target = y.double() if y.is_floating_point() else y
        return self.criterion(out.double(), target).float()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype, cache_enabled=False)

    def __call__(self, x: Tensor, y: Tensor,
                 forward_context: contextlib.AbstractContextManager | None = None
                 ) -> tuple[Tensor, Tensor]:
        """``forward_context``: entered around the forward only (the trainer's saved-bytes
        counter on the first step)."""
        if self.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        # The previous step's gradients go before the forward, not after: they would otherwise
        # be alive beside every saved activation (fusedres.memory.accounting simulates this order).
        # Under capture this records nothing: the backward then writes gradients the graph owns.
        self.optimizer.zero_grad(set_to_none=True)
        k = self.accum_steps
        if k == 1:
            with forward_context or contextlib.nullcontext(), self.autocast():
                out = self.model(x)
                loss = self.loss(out, y)
            self.scaler.scale(loss).backward()
            total, correct = loss.detach(), _hits(out, y)
        else:
            # Gradient accumulation: the batch in k equal micro-batches, one after the other,
            # each loss / k so that the summed gradients are the batch mean's; only the last
            # backward all-reduces under DistributedDataParallel (no_sync on the others).
            # The same kernels every step: the split is by shape, not data.
            if x.shape[0] % k:
                raise ValueError(f"accum_steps: the batch of {x.shape[0]} does not split into "
                                 f"{k} equal micro-batches")
            total = correct = None
            no_sync = getattr(self.model, "no_sync", None)
            for i, (xi, yi) in enumerate(zip(x.chunk(k), y.chunk(k))):
                ctx = (forward_context if i == 0 and forward_context is not None
                       else contextlib.nullcontext())
                sync = no_sync() if no_sync is not None and i < k - 1 \
                    else contextlib.nullcontext()
                with sync:
                    with ctx, self.autocast():
                        out = self.model(xi)
                        loss = self.loss(out, yi) / k
                    self.scaler.scale(loss).backward()
                hits = _hits(out, yi)
                total = loss.detach() if total is None else total + loss.detach()
                correct = hits if correct is None else correct + hits
        if self.probe is not None and self.probe.armed:
            self.probe.after_backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return total, correct


def _hits(out: Tensor, y: Tensor) -> Tensor:
    """Correct predictions: the label, or for mixed soft targets (MixUp/CutMix) the class of
    the largest weight."""
    label = y if y.dim() == 1 else y.argmax(1)
    return (out.detach().argmax(1) == label).sum()


def cuda_graph_capture(fn: Callable[[], None], stream: torch.cuda.Stream | None = None
                       ) -> Callable[[], None]:
    """Capture ``fn`` into a CUDA graph (nothing runs yet) on ``stream`` (default: torch's own
    capture stream); returns the graph's replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


class GraphedStep:
    """``step`` (a :class:`TrainStep`) replayed from a CUDA graph.

    The first ``warmup`` calls run ``step`` eagerly on a side stream (real training steps of
    their batches); the next one captures it with static input and target buffers, and every
    call from then on copies its batch into them and replays. A replay performs the whole step:
    forward, loss, backward, optimizer step, loss-scale update, and the random draws (stochastic
    depth, shortcut dropout) from the generator's state at that step, as the eager step would
    draw them. The batch must keep the captured shape, dtype and memory layout (the trainer's
    epochs drop the last partial batch). Returns (loss, correct): after the capture, the same two
    tensors every call, overwritten by the next replay (read or accumulate them before it).

    ``capture``: how ``fn`` becomes a replay; default :func:`cuda_graph_capture` on the warm-up
    steps' side stream (one stream for all of them).
    Whatever captures it, the function captured is ``step`` itself on the static buffers; tests
    pass ``capture=lambda fn: fn`` to run that very function eagerly on CPU.
    """

    def __init__(self, step: TrainStep, warmup: int = WARMUP_STEPS,
                 capture: Callable[[Callable[[], None]], Callable[[], None]] | None = None):
        if warmup < 1:
            raise ValueError(f"warmup: expected at least 1 eager step before the capture, "
                             f"got {warmup}")
        self.step, self.warmup = step, warmup
        self.capture = capture
        self.warmed = 0
        self.replay: Callable[[], None] | None = None
        # One side stream for every warm-up step and the capture: the caching allocator keeps
        # freed blocks per stream, so a new stream per step would reserve the step's
        # activations once more for each (3 warm-up steps: ~3x).
        self.side_stream: torch.cuda.Stream | None = None

    @property
    def captured(self) -> bool:
        return self.replay is not None

    def __call__(self, x: Tensor, y: Tensor,
                 forward_context: contextlib.AbstractContextManager | None = None
                 ) -> tuple[Tensor, Tensor]:
        if self.warmed < self.warmup:
            self.warmed += 1
            return self._eager(x, y, forward_context)
        if forward_context is not None:
            raise ValueError("forward_context: a replay runs no Python code; give it to one of "
                             "the warm-up steps")
        if self.replay is None:
            self._capture(x, y)
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        self.replay()
        return self.loss, self.correct

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(device)
        return self.side_stream

    def _eager(self, x, y, forward_context):
        if not x.is_cuda:
            out = self.step(x, y, forward_context)
        else:
            side = self._stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                out = self.step(x, y, forward_context)
            torch.cuda.current_stream(x.device).wait_stream(side)
        self._out_dtypes = (out[0].dtype, out[1].dtype)
        return out

    def _capture(self, x: Tensor, y: Tensor) -> None:
        # Static buffers of the batch's shape, dtype and memory layout (clone keeps strides);
        # the outputs, which each replay overwrites, made before the capture (the warm-up's
        # dtypes) so that they exist whatever the capture runs.
        self.static_x, self.static_y = x.clone(), y.clone()
        loss_dtype, correct_dtype = self._out_dtypes
        self.loss = torch.zeros((), dtype=loss_dtype, device=x.device)
        self.correct = torch.zeros((), dtype=correct_dtype, device=x.device)

        def captured() -> None:
            loss, correct = self.step(self.static_x, self.static_y)
            self.loss.copy_(loss)
            self.correct.copy_(correct)

        if self.capture is not None:
            self.replay = self.capture(captured)
            return
        # On the warm-up's stream (torch.cuda.graph would make one more). The capture allocates
        # from the graph's private pool; the blocks the warm-up steps freed stay cached for the
        # side stream, which nothing runs on any more: handed back to the device at once, so
        # that the replays hold the pool and not the pool plus the warm-up's step.
        self.replay = cuda_graph_capture(captured, self._stream(x.device))
        torch.cuda.empty_cache()
