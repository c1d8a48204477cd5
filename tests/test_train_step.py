"""The trainer's training step (fusedres.apps.train.step): what keeps it capturable in a CUDA graph,
checked on CPU on every backend here, and its graphed replay.

* No device-to-host sync: one step of every model and variant under torch.profiler shows none
  of the ops that read a value back to the host (``SYNC_OPS``). A sync under CUDA graph capture
  is an error, and in an eager GPU step it stalls the host's launches.
* The same work every step: consecutive steps, with other learning rates and other data,
  dispatch the same ops with the same shapes, strides and non-tensor arguments (a captured
  graph replays what its capture recorded, nothing else).
* The graphed driver (:class:`GraphedStep`) on CPU, its capture replaced by running the
  captured function itself, gives the eager step's results to the bit.

On a GPU (``torch.cuda.is_available()``) the last test captures with ``torch.cuda.graph`` and
compares the replay with the eager step; it cannot run here.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import fusedres
from fusedres import models
from fusedres.apps.train.build import _optimizer, _param_groups
from fusedres.apps.train.step import GraphedStep, TrainStep, lr_tensor, sgd

# The ops through which a value reaches the host: Tensor.item() and bool(t) (is_nonzero goes
# through item, item through _local_scalar_dense), and nonzero (its output's shape is data).
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero")
# Where the profile's host reads are not syncs on a GPU: torch's fused SGD kernel on CPU reads
# its tensor learning rate on the host (lr.item(): a CPU tensor), the CUDA kernel reads it on
# the device (lr.data_ptr<float>() in aten/src/ATen/native/cuda/FusedSgdKernel.cu).
# AdamW's likewise (the CUDA kernel's tensor-lr overload reads it on the device:
# aten/src/ATen/native/cuda/FusedAdamWKernel.cu).
CPU_ONLY_READS = ("aten::_fused_sgd_", "aten::_fused_adamw_")

BACKENDS = fusedres.available_backends("cpu")
_CFG = {"weight_decay": 1e-4, "bn_weight_decay": False, "bias_weight_decay": False}


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread: these steps are tiny, and two threads on a loaded 2-core machine spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer_step(model: nn.Module, amp: torch.dtype | None = None, lr: float = 0.1,
                  nesterov: bool = False, optimizer: str = "sgd", label_smoothing: float = 0.0,
                  accum_steps: int = 1) -> tuple[TrainStep, torch.Tensor]:
    """The trainer's step for ``model`` (fusedres.apps.train.run_setup builds it so) and its lr
    tensor."""
    lr_t = lr_tensor(lr, torch.device("cpu"))
    cfg = dict(_CFG, optimizer=optimizer, momentum=0.9, nesterov=nesterov, betas=[0.9, 0.999],
               cuda_graphs=False)
    opt = _optimizer(_param_groups(model, _CFG), lr_t, cfg)
    scaler = torch.amp.GradScaler("cpu", enabled=amp == torch.float16)
    return TrainStep(model, opt, scaler, amp, "cpu", label_smoothing=label_smoothing,
                     accum_steps=accum_steps), lr_t


def _syncs(prof) -> list[str]:
    """The sync ops in ``prof``, but those inside the ops of CPU_ONLY_READS."""
    found = []
    for e in prof.events():
        if e.name not in SYNC_OPS:
            continue
        parent, inside = e.cpu_parent, False
        while parent is not None:
            inside |= parent.name in CPU_ONLY_READS
            parent = parent.cpu_parent
        if not inside:
            found.append(e.name)
    return found


class _OpTrace(TorchDispatchMode):
    """The dispatched ops, each as (name, its arguments with tensors as (shape, stride,
    dtype)): what a capture records, less the tensors' values and addresses."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    @staticmethod
    def _arg(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), a.stride() if a.layout == torch.strided else None,
                    a.dtype, a.device.type)
        if isinstance(a, (list, tuple)):
            return tuple(_OpTrace._arg(b) for b in a)
        if isinstance(a, torch.ScriptObject):
            return type(a).__name__
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "profiler":  # the profiler's own record_function markers
            self.ops.append((str(func), self._arg(args),
                             tuple((k, self._arg(v)) for k, v in sorted(kwargs.items()))))
        return func(*args, **kwargs)


def _batch(shape, classes, step, channels_last=False):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(shape, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, classes, (shape[0],), generator=g)


def _check_capturable(model: nn.Module, shape, amp=None, channels_last=False, steps=2,
                      **recipe):
    """Run ``steps`` trainer steps of ``model`` (other lr and data each); every one has no
    sync, and the last two dispatch the same ops (fp16's GradScaler makes its scale at the
    first step: three steps there; one step: the sync check alone)."""
    step, lr = _trainer_step(model, amp, **recipe)
    traces = []
    for i in range(steps):
        lr.fill_(0.1 * (i + 1) / steps)
        x, y = _batch(shape, 3, i, channels_last)
        trace = _OpTrace()
        with profile(activities=[ProfilerActivity.CPU]) as prof, trace:
            loss, _ = step(x, y)
        assert _syncs(prof) == [], f"step {i}: {_syncs(prof)}"
        assert torch.isfinite(loss)
        traces.append(trace.ops)
    if steps == 1:
        return
    assert len(traces[-1]) == len(traces[-2])
    for a, b in zip(traces[-2], traces[-1]):
        assert a == b, f"consecutive steps differ:\n{a}\n{b}"


def _tiny(depth=8, **kw):
    kw.setdefault("num_classes", 3)
    return models.preact_resnet(depth, **kw)


# One basic and one bottleneck network, with stochastic depth of both kinds: every backend.
# The Triton interpreter takes 10-30 s a step of these here: one step of each is checked for
# syncs (the bottleneck's in the full matrix); the traces it dispatches are the fusedres ops,
# compared step to step on the other backends.
BACKEND_CASES = {
    "basic-batch-drop": dict(depth=8, drop_path_rate=0.5, drop_path_mode="batch"),
    "bottleneck-row-drop": dict(depth=11, drop_path_rate=0.5, drop_path_mode="row"),
}
_BACKEND_PARAMS = (
    [pytest.param(name, case, 2) for name in BACKENDS if name != "triton"
     for case in BACKEND_CASES]
    + [pytest.param("triton", "basic-batch-drop", 1, id="triton-basic-batch-drop-1-step"),
       pytest.param("triton", "bottleneck-row-drop", 1, id="triton-bottleneck-row-drop-1-step",
                    marks=pytest.mark.full_matrix)])
_BACKEND_PARAMS = [p for p in _BACKEND_PARAMS if p.values[0] in BACKENDS]


@pytest.mark.parametrize("name,case,steps", _BACKEND_PARAMS)
def test_step_has_no_sync_and_repeats_its_ops(name, case, steps):
    torch.manual_seed(0)
    model = _tiny(**BACKEND_CASES[case], fused=name != "reference")
    with fusedres.use_backend(name):
        _check_capturable(model, (2, 3, 6, 6), steps=steps)


# Every unit, shortcut, normalisation and stochastic depth mode, plain and fused, the layouts
# and autocast dtypes: on the backends that run them fast here.
VARIANTS = (
    [{"unit": u} for u in ("original", "bn_after_add", "relu_before_add", "relu_only_preact")]
    + [{"shortcut": s} for s in ("scale", "exclusive_gate", "shortcut_gate", "conv1x1",
                                 "dropout", "none")]
    + [{"shortcut": "scale", "scale_branch": True}, {"norm": "none"},
       {"drop_path_rate": 0.5, "drop_path_mode": "row"},
       {"drop_path_rate": 0.5, "drop_path_mode": "batch"},
       {"unit": "original", "drop_path_rate": 0.5, "drop_path_mode": "batch"},
       {"stride_on": "conv2", "depth": 11}, {"fused": False},
       {"fused": False, "drop_path_rate": 0.5, "drop_path_mode": "batch"},
       {"amp": torch.bfloat16}, {"amp": torch.float16}, {"channels_last": True},
       # The recipe's options inside the step: AdamW (its state appears at the first step:
       # three steps), label smoothing.
       {"optimizer": "adamw", "steps": 3}, {"optimizer": "adamw", "amp": torch.float16},
       {"label_smoothing": 0.1}, {"accum_steps": 2}, {"accum_steps": 2, "amp": torch.float16},
       {"variant": "imagenet", "depth": 18}])


def _variant_id(kw):
    return ",".join(f"{k}={str(v).replace('torch.', '')}" for k, v in kw.items())


@pytest.mark.parametrize("kw", VARIANTS, ids=[_variant_id(v) for v in VARIANTS])
def test_variant_step_has_no_sync_and_repeats_its_ops(kw):
    """The variants' code is the blocks' (fusedres.modules), the same on every backend: on the
    cpu backend (the portable op, where the compiled extension is missing)."""
    kw = dict(kw)
    amp, channels_last = kw.pop("amp", None), kw.pop("channels_last", False)
    recipe = {k: kw.pop(k) for k in ("optimizer", "label_smoothing", "accum_steps") if k in kw}
    steps = kw.pop("steps", 3 if amp == torch.float16 else 2)
    torch.manual_seed(0)
    model = _tiny(**kw)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    with fusedres.use_backend("cpu" if "cpu" in BACKENDS else "portable"):
        _check_capturable(model, (2, 3, 8, 8), amp, channels_last, steps=steps, **recipe)


# Every named model on the cpu backend; on portable and the plain reference all but
# ResNet-1001, whose units are ResNet-164's (a sync would not depend on the depth) and whose
# profiled step takes ~30 s here. The quick suite runs the smallest of each family.
_QUICK_ZOO = ("preact_resnet20", "preact_resnet18")
_ZOO = [pytest.param(name, model_name,
                     marks=[] if model_name in _QUICK_ZOO else [pytest.mark.full_matrix])
        for name in ("cpu", "portable", "reference") if name in BACKENDS
        for model_name in models.MODELS
        if name == "cpu" or model_name != "preact_resnet1001"]


@pytest.mark.parametrize("name,model_name", _ZOO)
def test_every_zoo_model_step_has_no_sync(name, model_name):
    """One profiled step of each named model with stochastic depth in batch mode (its decision
    was the one sync found in a step): no sync."""
    torch.manual_seed(0)
    model = models.MODELS[model_name](num_classes=3, drop_path_rate=0.2,
                                      drop_path_mode="batch", fused=name != "reference")
    size = 8 if model.variant == "cifar" else 32
    step, lr = _trainer_step(model, lr=0.01)
    x, y = _batch((2, 3, size, size), 3, 0)
    with fusedres.use_backend(name), profile(activities=[ProfilerActivity.CPU]) as prof:
        loss, _ = step(x, y)
    assert _syncs(prof) == []
    assert torch.isfinite(loss)


# --------------------------------------------------------------------------- the checks can fail

def test_the_checks_catch_a_host_read_and_a_host_decision():
    """batch_skip reads each unit's draw on the host; a Python-float learning rate changes an
    argument of the optimizer's kernel from step to step: both are caught."""
    torch.manual_seed(0)
    model = _tiny(drop_path_rate=0.5, drop_path_mode="batch_skip")
    step, _ = _trainer_step(model)
    x, y = _batch((4, 3, 8, 8), 3, 0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(x, y)
    assert _syncs(prof).count("aten::is_nonzero") == 3  # one a unit

    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # a float lr
    step = TrainStep(model, opt, torch.amp.GradScaler("cpu", enabled=False), None, "cpu")
    traces = []
    for i in range(3):
        for group in opt.param_groups:
            group["lr"] = 0.1 * (i + 1)
        x, y = _batch((4, 3, 8, 8), 3, i)
        trace = _OpTrace()
        with trace:
            step(x, y)
        traces.append(trace.ops)
    assert traces[1] != traces[2]
    changed = [a for a, b in zip(traces[1], traces[2]) if a != b]
    assert changed and all("add_" in a[0] for a in changed)  # param.add_(grad, alpha=-lr)


# --------------------------------------------------------------------------- the graphed driver

def _state(model, opt):
    return ([t.detach().clone() for t in model.state_dict().values()]
            + [s["momentum_buffer"].clone() for s in opt.state.values()])


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_graphed_driver_replays_the_eager_step(mode):
    """GraphedStep with its capture replaced by the captured function itself (run eagerly:
    there is no CUDA here): warm-up steps, the static buffers, the outputs a replay writes,
    the learning rate changed in place between replays; to the bit the eager step's results,
    drop-path draws included."""
    torch.manual_seed(0)
    eager_model = _tiny(drop_path_rate=0.5, drop_path_mode=mode)
    graph_model = copy.deepcopy(eager_model)
    eager, eager_lr = _trainer_step(eager_model)
    graphed_step, graph_lr = _trainer_step(graph_model)
    calls = []

    def capture(fn):  # what torch.cuda.graph would record: this very function
        calls.append(fn)
        return fn

    graphed = GraphedStep(graphed_step, warmup=2, capture=capture)
    outputs = []
    for i in range(6):
        x, y = _batch((4, 3, 8, 8), 3, i)
        results = []
        for step, lr in ((eager, eager_lr), (graphed, graph_lr)):
            lr.fill_(0.1 / (i + 1))
            torch.manual_seed(1000 + i)
            loss, correct = step(x, y)
            results.append((loss.clone(), correct.clone()))
            if step is graphed:
                outputs.append((loss, correct))
        assert graphed.captured == (i >= 2)
        (le, ce), (lg, cg) = results
        assert torch.equal(le, lg) and torch.equal(ce, cg), i
        for a, b in zip(_state(eager_model, eager.optimizer),
                        _state(graph_model, graphed_step.optimizer)):
            assert torch.equal(a, b), i
    assert len(calls) == 1
    with pytest.raises(ValueError, match="forward_context: a replay runs no Python code"):
        graphed(x, y, contextlib.nullcontext())
    # After the capture the outputs are the same two tensors, overwritten by each replay.
    assert all(o[0] is outputs[2][0] and o[1] is outputs[2][1] for o in outputs[2:])
    assert graphed.static_x.shape == (4, 3, 8, 8)


# The recipe options a captured step runs (MixUp/CutMix are refused with --cuda-graphs).
_GRAPHED_RECIPE = ["--optimizer", "adamw", "--lr", "0.003", "--schedule", "cosine",
                   "--label-smoothing", "0.1", "--ema-decay", "0.9", "--accum-steps", "2"]


@pytest.mark.parametrize("recipe", [[], _GRAPHED_RECIPE], ids=["he-et-al", "recipe"])
def test_the_trainer_loop_with_the_graphed_driver_matches_the_eager_run(tmp_path, recipe):
    """The trainer's loop driving a GraphedStep (capture replaced as above: the loop's side of
    --cuda-graphs, which needs a GPU, run on CPU), against the eager run: the learning-rate
    schedule filled in place through warm-up, the outputs accumulated across replays,
    evaluations in between, checkpoints; the final checkpoints are equal to the bit, the loss
    records too. The checkpoint keeps the learning rate as a plain float."""
    from fusedres.apps.train import checkpoint as ckpt
    from fusedres.apps.train.config import resolve
    from fusedres.apps.train.loop import Run

    argv = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "8", "--threads", "1",
            "--pad", "1", "--warmup-iters", "3", "--milestones", "0.5", "--no-progress",
            "--no-tensorboard", "--log-every", "2", "--eval-every", "3", "--max-iters", "7",
            "--batch-size", "32", "--drop-path-rate", "0.5", "--drop-path-mode", "batch",
            *recipe]
    states, records = [], []
    for graphed in (False, True):
        out = tmp_path / ("graphed" if graphed else "eager")
        cfg, explicit = resolve([*argv, "--out", str(out)])
        # The scope ends the run's backend choice (fusedres.use_backend) with the run, as
        # fusedres.apps.train.main does: left open, it would pop whenever collected.
        with contextlib.ExitStack() as scope:
            run = Run(cfg, explicit, scope)
            if graphed:
                run.run_step = GraphedStep(run.step, capture=lambda fn: fn)
            assert run.train() == 0
        assert not graphed or run.run_step.captured
        state = ckpt.load(ckpt.latest(out))
        states.append(state)
        records.append([(r["kind"], r.get("loss"), r.get("test_loss")) for r in state["metrics"]])
    assert records[0] == records[1]
    for k, v in states[0]["model"].items():
        assert torch.equal(v, states[1]["model"][k]), k
    for k, v in states[0]["optimizer"]["state"].items():
        for name, t in v.items():  # momentum_buffer; AdamW's exp_avg, exp_avg_sq, step
            assert torch.equal(t, states[1]["optimizer"]["state"][k][name]), (k, name)
    for k, v in states[0].get("ema", {}).items():
        assert torch.equal(v, states[1]["ema"][k]), k
    assert ("ema" in states[0]) == bool(recipe)
    assert all(type(g["lr"]) is float for g in states[1]["optimizer"]["param_groups"])


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_adamw_under_cuda_graphs_passes_the_capture_check(monkeypatch, cuda_graphs):
    """torch's Adam family refuses ``step()`` under CUDA graph capture unless every group is
    capturable (``Optimizer._cuda_graph_capture_health_check``, called first thing in its
    step). CPU stand-in: the check is run as it would be inside a capture on a GPU. The trainer's
    AdamW for ``--cuda-graphs`` passes it; the eager one is not capturable (torch supports
    capturable on CUDA parameters only) and is refused, as it would be on a GPU."""
    cfg = {**_CFG, "optimizer": "adamw", "betas": (0.9, 0.999), "cuda_graphs": cuda_graphs}
    model = _tiny()
    opt = _optimizer(_param_groups(model, cfg), lr_tensor(0.1, torch.device("cpu")), cfg)
    assert all(g["capturable"] for g in opt.param_groups) == cuda_graphs
    # torch's check as a capture on a GPU would run it: a CUDA accelerator, its stream capturing.
    import types

    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_stream",
                        lambda device=None: types.SimpleNamespace(is_capturing=lambda: True))
    if cuda_graphs:
        opt._accelerator_graph_capture_health_check()
    else:
        with pytest.raises(RuntimeError, match="capturable is False"):
            opt._accelerator_graph_capture_health_check()


def test_graphed_driver_needs_a_warm_up_step():
    step, _ = _trainer_step(_tiny())
    with pytest.raises(ValueError, match="warmup: expected at least 1"):
        GraphedStep(step, warmup=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_cuda_graph_replay_equals_the_eager_step(mode):
    """On a GPU: the step captured by torch.cuda.graph and replayed, against the same step run
    eagerly from the same state, seeds and batches; bit-identical (the fused kernels sum in a
    fixed order, cuDNN is made deterministic here)."""
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda")
    torch.manual_seed(0)
    eager_model = _tiny(drop_path_rate=0.5, drop_path_mode=mode).to(dev)
    graph_model = copy.deepcopy(eager_model)
    parts = []
    for model in (eager_model, graph_model):
        lr = lr_tensor(0.1, dev)
        opt = sgd(_param_groups(model, _CFG), lr, 0.9, False)
        parts.append((TrainStep(model, opt, torch.amp.GradScaler("cuda", enabled=False), None,
                                "cuda"), lr))
    (eager, eager_lr), (graphed_step, graph_lr) = parts
    graphed = GraphedStep(graphed_step, warmup=3)
    for i in range(8):
        x, y = (t.to(dev) for t in _batch((8, 3, 8, 8), 3, i))
        results = []
        for step, lr in ((eager, eager_lr), (graphed, graph_lr)):
            lr.fill_(0.1 / (i + 1))
            torch.manual_seed(1000 + i)
            loss, correct = step(x, y)
            results.append((loss.clone(), correct.clone()))
        (le, ce), (lg, cg) = results
        assert torch.equal(le, lg) and torch.equal(ce, cg), i
        for a, b in zip(_state(eager_model, eager.optimizer),
                        _state(graph_model, graphed_step.optimizer)):
            assert torch.equal(a, b), i
    assert graphed.captured


@pytest.mark.parametrize("amp,accum", [(None, 1), (torch.float16, 1), (None, 2)])
def test_grad_norm_probe_reads_nothing_back_and_measures_the_gradients(amp, accum):
    """--log-grad-norms: an armed step has no sync either (the norms stay on the device until
    the log record reads them), and what it measures is each unit's ||dL/dx|| and parameter
    gradient norm, loss scale divided out (fp16), input gradients summed in squares over
    micro-batches (--accum-steps), checked against torch.autograd.grad on a copy of the model.
    A disarmed step dispatches what a step without a probe does."""
    from fusedres.apps.train.gradnorms import GradNormProbe, residual_units

    torch.manual_seed(0)
    model = models.preact_resnet(8, num_classes=3, in_chans=3, shortcut="none")
    ref = copy.deepcopy(model)
    probe = GradNormProbe(model)
    assert probe.names == ["layer1.0", "layer2.0", "layer3.0"]
    step, lr = _trainer_step(model, amp, accum_steps=accum)
    step.probe = probe
    x, y = _batch((4, 3, 8, 8), 3, 0)
    probe.arm(step.scaler)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(x, y)
    assert _syncs(prof) == []
    assert not probe.armed
    got = probe.read()
    # The reference: the same micro-batch losses, gradients with respect to each unit's input
    # and parameters by torch.autograd.grad.
    units = [u for _, u in residual_units(ref)]
    params = [list(u.parameters()) for u in units]
    in_sq = torch.zeros(len(units))
    p_grads = [[torch.zeros_like(p) for p in ps] for ps in params]
    for xk, yk in zip(x.chunk(accum), y.chunk(accum)):
        inputs: list[torch.Tensor] = []
        hooks = [u.register_forward_pre_hook(lambda m, a, seen=inputs: seen.append(a[0]))
                 for u in units]
        with torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext():
            loss = nn.functional.cross_entropy(ref(xk).float(), yk) / accum
        for h in hooks:
            h.remove()
        grads = torch.autograd.grad(loss, inputs + [p for ps in params for p in ps])
        in_sq += torch.stack([g.float().norm() ** 2 for g in grads[:len(units)]])
        flat = iter(grads[len(units):])
        for acc in p_grads:
            for a in acc:
                a += next(flat)
    want_p = [torch.cat([g.float().flatten() for g in acc]).norm().item() for acc in p_grads]
    tol = 2e-2 if amp else 1e-4  # fp16: half-precision activations
    assert got["input_grad_norm"] == pytest.approx(in_sq.sqrt().tolist(), rel=tol)
    assert got["param_grad_norm"] == pytest.approx(want_p, rel=tol)
    assert probe.input_sq.abs().sum() == 0  # zeroed for the next armed step
    # Disarmed: the same dispatched ops as a step without a probe.
    traces = []
    for p in (probe, None):
        step.probe = p
        trace = _OpTrace()
        with trace:
            step(*_batch((4, 3, 8, 8), 3, 1))
        traces.append([op[0] for op in trace.ops])
    assert traces[0] == traces[1]
