"""fusedres train's recipe options (AdamW and the weight-decay groups, label smoothing, EMA,
the schedules' resume), each against a plain PyTorch oracle written here; bad values exit 2
naming the flag; an interrupted run with every option on resumes to the bit."""

from __future__ import annotations

import contextlib
import copy
import json
import signal
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from fusedres import models
from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train import main
from fusedres.apps.train.build import _optimizer, _param_groups
from fusedres.apps.train.config import resolve
from fusedres.apps.train.loop import Run
from fusedres.apps.train.step import TrainStep, lr_tensor

TINY = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "8", "--threads", "1",
        "--pad", "1", "--no-flip", "--warmup-iters", "2", "--milestones", "0.5",
        "--no-progress", "--no-tensorboard", "--log-every", "2", "--batch-size", "32"]
RECIPE = ["--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.05", "--schedule",
          "cosine", "--min-lr", "0.0001", "--label-smoothing", "0.1", "--ema-decay", "0.8",
          "--accum-steps", "2", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the step

def _smoothed_ce(logits: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    """Label smoothing written out (Szegedy et al. 2016): the target is 1 - eps on the label
    plus eps spread evenly over all K classes. In float64, rounded to float32, as the trainer's
    step takes it (TrainStep.loss)."""
    log_p = logits.double().log_softmax(1)
    return ((1 - eps) * -log_p.gather(1, y[:, None])[:, 0] - eps * log_p.mean(1)).mean().float()


@pytest.mark.parametrize("optimizer,accum", [("sgd", 1), ("adamw", 1), ("sgd", 2),
                                             ("adamw", 4)])
def test_step_matches_a_plain_pytorch_loop(optimizer, accum):
    """The trainer's step (fused torch optimizer with a device lr, the trainer's decay groups,
    CrossEntropyLoss's label smoothing) against a plain loop: torch's non-fused optimizer,
    decay on the >1-dim weights only (in this network exactly the convolutions' and the
    classifier's), the smoothed loss written out, accumulated by hand over ``accum``
    micro-batches (loss / accum each, one optimizer step). Same weights after three steps at
    three rates."""
    torch.manual_seed(0)
    model = models.preact_resnet(8, num_classes=3, fused=False)
    oracle = copy.deepcopy(model)
    cfg = {"weight_decay": 0.05, "bn_weight_decay": False, "bias_weight_decay": False,
           "optimizer": optimizer, "momentum": 0.9, "nesterov": False, "betas": [0.8, 0.99],
           "cuda_graphs": False}
    lr = lr_tensor(0.1, torch.device("cpu"))
    step = TrainStep(model, _optimizer(_param_groups(model, cfg), lr, cfg),
                     torch.amp.GradScaler("cpu", enabled=False), None, "cpu",
                     label_smoothing=0.2, accum_steps=accum)
    decay = [p for p in oracle.parameters() if p.dim() > 1]
    rest = [p for p in oracle.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}]
    opt = (torch.optim.AdamW(groups, lr=0.1, betas=(0.8, 0.99), foreach=False)
           if optimizer == "adamw" else torch.optim.SGD(groups, lr=0.1, momentum=0.9,
                                                        foreach=False))
    g = torch.Generator().manual_seed(1)
    for i, rate in enumerate((0.1, 0.05, 0.02)):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        lr.fill_(rate)
        loss, _ = step(x, y)
        for group in opt.param_groups:
            group["lr"] = rate
        opt.zero_grad()
        ref = 0.0
        for j in range(accum):
            part = slice(j * 4 // accum, (j + 1) * 4 // accum)
            micro = _smoothed_ce(oracle(x[part]), y[part], 0.2) / accum
            micro.backward()
            ref += micro.detach()
        opt.step()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), i
    # Float32 rounding of the fused vs the plain kernels, which Adam's division by sqrt(v)
    # magnifies where v is tiny; a decay on the wrong group would move a weight by
    # lr * decay * |w|, about 2.5e-4 here.
    for (name, p), q in zip(model.named_parameters(), oracle.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5, msg=name)
    # Without smoothing the two losses would differ: the check can fail.
    assert _smoothed_ce(oracle(x), y, 0.0).item() != pytest.approx(
        _smoothed_ce(oracle(x), y, 0.2).item(), rel=1e-3)


# --------------------------------------------------------------------------- EMA

def test_ema_is_averaged_model_run_by_hand_and_is_what_is_evaluated(tmp_path):
    """--ema-decay 0.8: the checkpoint's EMA after each iteration equals the average written
    out from the model's weights and buffers at each iteration (the first copied, then at
    iteration i lerped by 1 - d_i with the warm-up's d_i = min(0.8, 1 - i ** (-2/3)): 0.37,
    0.52, 0.60, 0.66); the evaluation is of those weights, not the model's."""
    out = tmp_path / "run"
    n = 5
    assert main([*TINY, *RECIPE, "--max-iters", str(n), "--checkpoint-every", "1",
                 "--keep-checkpoints", "10", "--eval-every", str(n), "--out", str(out)]) == 0
    states = [ckpt.load(p) for p in ckpt.list_checkpoints(out)]
    assert [s["iteration"] for s in states] == list(range(1, n + 1))
    ema = None
    for s in states:
        current = s["model"]
        if ema is None:
            ema = {k: v.clone() for k, v in current.items()}
        else:
            d = min(0.8, 1 - s["iteration"] ** (-2 / 3))
            for k, v in current.items():
                ema[k] = (ema[k].lerp(v, 1 - d) if v.is_floating_point()
                          else (ema[k] * d + v * (1 - d)).to(v.dtype))
        saved = s["ema"]
        assert int(saved["n_averaged"]) == s["iteration"]
        for k, v in ema.items():
            assert torch.equal(saved[f"module.{k}"], v), (s["iteration"], k)
    # The EMA is not the model (the check below can tell them apart).
    last = states[-1]
    assert not torch.equal(last["model"]["fc.weight"], last["ema"]["module.fc.weight"])

    # The final evaluation, recomputed on the EMA weights and on the model's.
    cfg, explicit = resolve([*TINY, *RECIPE, "--max-iters", str(n), "--out",
                             str(tmp_path / "probe")])
    with contextlib.ExitStack() as scope:
        run = Run(cfg, explicit, scope)
        run.ema.module.load_state_dict({k[len("module."):]: v for k, v in last["ema"].items()
                                        if k.startswith("module.")})
        run.model.load_state_dict(last["model"])
        on_ema = run.evaluate()
        run.ema = None
        on_model = run.evaluate()
    evals = [r for r in last["metrics"] if r["kind"] == "eval"]
    assert evals[-1]["test_loss"] == on_ema[0] and evals[-1]["test_error"] == on_ema[1]
    assert on_model[0] != on_ema[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"]["ema_decay"] == 0.8
    assert summary["recipe"]["optimizer"] == "adamw"
    saved_cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved_cfg["ema_decay"], saved_cfg["label_smoothing"], saved_cfg["optimizer"]) == (
        0.8, 0.1, "adamw")


# --------------------------------------------------------------------------- resume

def _interrupted(cfg_argv, out, at: int) -> int:
    """Run in this process and stop as a SIGTERM would after iteration ``at`` (the loop's own
    stop path: checkpoint, exit 143)."""
    cfg, explicit = resolve([*cfg_argv, "--out", str(out)])
    with contextlib.ExitStack() as scope:
        run = Run(cfg, explicit, scope)

        def stop() -> bool:
            if run.iteration >= at:
                run.stop_signal = signal.SIGTERM
            return run.stop_signal is not None

        run._stop_requested = stop
        return run.train()


def test_interrupted_run_with_every_recipe_option_resumes_bit_exact(tmp_path):
    """AdamW, cosine schedule with warm-up, label smoothing, EMA: stopped at iteration 5
    (between checkpoints, mid-epoch) and resumed, the run ends with exactly the uninterrupted
    run's weights, AdamW state, EMA, learning rates and evaluations."""
    argv = [*TINY, *RECIPE, "--max-iters", "14", "--checkpoint-every", "4", "--eval-every", "3",
            "--log-every", "1"]
    ref = tmp_path / "ref"
    assert main([*argv, "--out", str(ref)]) == 0
    run = tmp_path / "run"
    assert _interrupted(argv, run, 5) == 128 + signal.SIGTERM
    assert ckpt.load(ckpt.latest(run))["iteration"] == 5
    assert main(["--out", str(run), "--resume"]) == 0
    a, b = ckpt.load(ckpt.latest(ref)), ckpt.load(ckpt.latest(run))
    assert a["iteration"] == b["iteration"] == 14
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for k, v in a["ema"].items():
        assert torch.equal(v, b["ema"][k]), k
    for pid, s in a["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s[name], b["optimizer"]["state"][pid][name]), (pid, name)
    assert a["lr_scheduler"] == b["lr_scheduler"]
    lrs = [(r["iteration"], r["lr"]) for r in a["metrics"] if r["kind"] == "train"]
    assert lrs == [(r["iteration"], r["lr"]) for r in b["metrics"] if r["kind"] == "train"]
    # Warm-up and cosine: a new rate every iteration but the peak, held at the warm-up's last
    # iteration and the cosine's first.
    assert len({lr for _, lr in lrs}) == 13
    evals = [r for r in a["metrics"] if r["kind"] == "eval"]
    assert evals == [r for r in b["metrics"] if r["kind"] == "eval"]


# --------------------------------------------------------------------------- bad values

@pytest.mark.parametrize("flags,flag", [
    (["--label-smoothing", "1"], "--label-smoothing"),
    (["--label-smoothing", "-0.1"], "--label-smoothing"),
    (["--ema-decay", "1"], "--ema-decay"),
    (["--ema-decay", "0"], "--ema-decay"),
    (["--betas", "0.9", "1.5"], "--betas"),
    (["--min-lr", "1"], "--min-lr"),
    (["--min-lr", "-1"], "--min-lr"),
    (["--poly-power", "0"], "--poly-power"),
    (["--schedule", "linear"], "--schedule"),
    (["--optimizer", "lamb"], "--optimizer"),
    (["--optimizer", "adamw", "--nesterov"], "--nesterov"),
    (["--accum-steps", "0"], "--accum-steps"),
    (["--accum-steps", "3"], "--accum-steps"),  # 32 does not split in 3
    (["--mixup-alpha", "-1"], "--mixup-alpha"),
    (["--cutmix-alpha", "-0.5"], "--cutmix-alpha"),
    (["--warmup-lr", "0.5"], "--warmup-lr"),  # above --lr 0.1
    (["--warmup-lr", "0"], "--warmup-lr"),
])
def test_bad_recipe_values_exit_2_naming_the_flag(tmp_path, capsys, flags, flag):
    out = tmp_path / "run"
    with contextlib.suppress(SystemExit):  # argparse's choices exit 2 themselves
        assert main([*TINY, "--max-iters", "2", "--out", str(out), *flags]) == 2
    assert flag in capsys.readouterr().err
    assert not out.exists()


def test_bad_recipe_values_in_a_config_file_name_the_key(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("ema_decay: true\n")
    assert main([*TINY, "--config", str(path), "--out", str(tmp_path / "r")]) == 2
    assert "--ema-decay: expected a number" in capsys.readouterr().err
    path.write_text("betas: 0.9\n")
    assert main([*TINY, "--config", str(path), "--out", str(tmp_path / "r")]) == 2
    assert "--betas: expected two numbers" in capsys.readouterr().err


def test_resume_needs_the_ema_it_continues(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "2", "--out", str(out)]) == 0
    assert main(["--out", str(out), "--resume", "--max-iters", "3", "--ema-decay", "0.9"]) == 2
    assert "no EMA weights" in capsys.readouterr().err


def test_label_smoothing_changes_only_the_training_loss():
    x = torch.randn(6, 4)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    assert nn.CrossEntropyLoss(label_smoothing=0.3)(x, y).item() == pytest.approx(
        _smoothed_ce(x, y, 0.3).item(), rel=1e-6)
    assert F.cross_entropy(x, y).item() == pytest.approx(_smoothed_ce(x, y, 0.0).item(),
                                                         rel=1e-6)


# --------------------------------------------------------------------------- fusedres evaluate

def _by_hand(model_state: dict, cfg: dict) -> tuple[float, float, float]:
    """The oracle: the run's network built anew, the weights loaded, the digits test set
    normalised with the training set's per-channel mean and std, plain cross-entropy and
    top-1/top-5 hits summed over it in one batch."""
    from fusedres.apps.train.build import build_model
    from fusedres.apps.train.data import load

    data = load("digits", "data", False, False)
    model = build_model(cfg, data.image_shape[0], data.num_classes)
    model.load_state_dict(model_state)
    model.eval()

    def scaled(x):
        return x.float() / 255 if x.dtype == torch.uint8 else x.float()

    x = scaled(data.train_x).double()
    mean = x.mean((0, 2, 3), keepdim=True)
    std = x.std((0, 2, 3), keepdim=True)
    with torch.no_grad():
        out = model(((scaled(data.test_x) - mean) / std).float()).double()
    y = data.test_y
    top5 = (out.topk(5, 1).indices == y[:, None]).any(1).double().mean().item()
    return (F.cross_entropy(out, y).item(), 1 - (out.argmax(1) == y).double().mean().item(),
            1 - top5)


def test_evaluate_gives_the_runs_last_evaluation_and_the_oracles(tmp_path, capsys):
    from fusedres.apps.cli import main as cli

    out = tmp_path / "run"
    assert main([*TINY, *RECIPE, "--max-iters", "6", "--out", str(out)]) == 0
    capsys.readouterr()
    report = tmp_path / "eval.json"
    assert cli(["evaluate", str(out), "--threads", "1", "--no-progress", "--json",
                str(report)]) == 0
    text = capsys.readouterr().out
    assert "| model |" in text and "| ema |" in text and "top-5 error" in text
    rows = json.loads(report.read_text())["results"]
    state = ckpt.load(ckpt.latest(out))
    last = [r for r in state["metrics"] if r["kind"] == "eval"][-1]
    # The trainer evaluates its EMA: the same sums, the same floats.
    assert (rows["ema"]["test_loss"], rows["ema"]["top1_error"]) == (last["test_loss"],
                                                                      last["test_error"])
    assert rows["model"]["test_loss"] != rows["ema"]["test_loss"]
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    ema = {k[len("module."):]: v for k, v in state["ema"].items() if k.startswith("module.")}
    for name, weights in (("model", state["model"]), ("ema", ema)):
        loss, top1, top5 = _by_hand(weights, cfg)
        assert rows[name]["test_loss"] == pytest.approx(loss, rel=1e-4), name
        assert rows[name]["top1_error"] == pytest.approx(top1, abs=1e-9), name
        assert rows[name]["top5_error"] == pytest.approx(top5, abs=1e-9), name
        assert rows[name]["images"] == 364


def test_evaluate_bad_requests_exit_2(tmp_path, capsys):
    from fusedres.apps.cli import main as cli

    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli(["evaluate", str(out), "--weights", "ema"]) == 2
    assert "--weights ema:" in capsys.readouterr().err
    assert cli(["evaluate", str(tmp_path / "nowhere")]) == 2
    assert "RUN" in capsys.readouterr().err
    assert cli(["evaluate", str(out), "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err


# --------------------------------------------------------------------------- MixUp / CutMix

def _mixup_by_hand(x, y, k, alpha):
    """Zhang et al. 2018 as torchvision pairs the samples: each with its predecessor in the
    batch (roll by one), lam ~ Beta(alpha, alpha) from torch's global generator."""
    lam = float(torch.distributions.Beta(torch.tensor([alpha]), torch.tensor([alpha])).sample(()))
    t = F.one_hot(y, k).float()
    return lam * x + (1 - lam) * x.roll(1, 0), lam * t + (1 - lam) * t.roll(1, 0)


def _cutmix_by_hand(x, y, k, alpha):
    """Yun et al. 2019: a box of area (1 - lam) of the image, centred at a uniform point and
    clipped to the image, pasted from the predecessor; the labels mixed by the area kept."""
    import math

    lam = float(torch.distributions.Beta(torch.tensor([alpha]), torch.tensor([alpha])).sample(()))
    h, w = x.shape[-2:]
    cx, cy = int(torch.randint(w, (1,))), int(torch.randint(h, (1,)))
    r = 0.5 * math.sqrt(1 - lam)
    hw, hh = int(r * w), int(r * h)
    x1, x2, y1, y2 = max(cx - hw, 0), min(cx + hw, w), max(cy - hh, 0), min(cy + hh, h)
    out = x.clone()
    out[..., y1:y2, x1:x2] = x.roll(1, 0)[..., y1:y2, x1:x2]
    kept = 1 - (x2 - x1) * (y2 - y1) / (w * h)
    t = F.one_hot(y, k).float()
    return out, kept * t + (1 - kept) * t.roll(1, 0)


@pytest.mark.parametrize("which", ["mixup", "cutmix"])
def test_mixup_and_cutmix_are_the_papers_by_hand(tmp_path, which):
    flag = {"mixup": "--mixup-alpha", "cutmix": "--cutmix-alpha"}[which]
    cfg, explicit = resolve([*TINY, flag, "0.7", "--max-iters", "2", "--out",
                             str(tmp_path / "r")])
    with contextlib.ExitStack() as scope:
        run = Run(cfg, explicit, scope)
        x, y = run.batches.train_batch(0)
        for seed in range(4):
            torch.manual_seed(seed)
            got_x, got_y = run.mixed(x, y)
            torch.manual_seed(seed)
            by_hand = _mixup_by_hand if which == "mixup" else _cutmix_by_hand
            want_x, want_y = by_hand(x, y, 10, 0.7)
            torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got_y, want_y, rtol=1e-6, atol=1e-6)
            assert got_x.is_contiguous(memory_format=torch.channels_last) == bool(
                cfg["channels_last"])
            assert not torch.equal(got_x, x)


def test_soft_targets_train_with_the_soft_cross_entropy():
    """The step with MixUp's soft targets and label smoothing: torch's loss of probability
    targets, -sum(t' log p) with t' = (1 - eps) t + eps / K, written out."""
    torch.manual_seed(0)
    model = models.preact_resnet(8, num_classes=3, fused=False)
    cfg = {"weight_decay": 0.0, "bn_weight_decay": False, "bias_weight_decay": False,
           "optimizer": "sgd", "momentum": 0.0, "nesterov": False, "betas": [0.9, 0.999]}
    step = TrainStep(model, _optimizer(_param_groups(model, cfg),
                                       lr_tensor(0.0, torch.device("cpu")), cfg),
                     torch.amp.GradScaler("cpu", enabled=False), None, "cpu",
                     label_smoothing=0.1)
    x = torch.randn(4, 3, 8, 8)
    t = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.2, 0.8], [1.0, 0.0, 0.0], [0.5, 0.0, 0.5]])
    loss, correct = step(x, t)
    with torch.no_grad():
        model.train()
        log_p = model(x).log_softmax(1)
    smoothed = 0.9 * t + 0.1 / 3
    assert loss.item() == pytest.approx(-(smoothed * log_p).sum(1).mean().item(), rel=1e-5)
    assert correct.item() == (log_p.argmax(1) == t.argmax(1)).sum().item()


def test_mixup_and_cutmix_refuse_cuda_graphs(tmp_path, capsys):
    for flag in ("--mixup-alpha", "--cutmix-alpha"):
        assert main([*TINY, "--max-iters", "2", "--out", str(tmp_path / "r"), flag, "0.2",
                     "--cuda-graphs"]) == 2
        assert f"{flag}: not with --cuda-graphs" in capsys.readouterr().err


def test_memory_plan_counts_the_ema_copy(tmp_path, monkeypatch):
    """--memory-budget with --ema-decay: the plan holds the average's weights and buffers as
    resident beside the step (their bytes, counted by hand from the model). The data's share
    of the resident figure is pinned (on CPU it is what loading it added to the process, which
    the first load in a process inflates)."""
    monkeypatch.setattr(Run, "_resident_bytes", lambda self: 1000)
    resident = []
    for extra in ([], ["--ema-decay", "0.9"]):
        cfg, explicit = resolve([*TINY, "--max-iters", "2", "--memory-budget", "8GiB",
                                 *extra, "--out", str(tmp_path / f"r{len(extra)}")])
        with contextlib.ExitStack() as scope:
            run = Run(cfg, explicit, scope)
            resident.append(run.plan_summary.step.resident)
            model = run.model
    ema_bytes = sum(4 * p.numel() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    assert resident[1] - resident[0] == ema_bytes


def test_checkpoint_without_scheduler_state_replays_the_schedule(tmp_path, monkeypatch):
    """A checkpoint of an older fusedres (no ``lr_scheduler`` key) resumes with the schedule
    run up to its iteration: the same rates as the uninterrupted run."""
    argv = [*TINY, "--schedule", "cosine", "--max-iters", "8", "--checkpoint-every", "4",
            "--log-every", "1"]
    ref = tmp_path / "ref"
    assert main([*argv, "--out", str(ref)]) == 0
    old_state = Run._state

    def without_scheduler(self):
        state = old_state(self)
        del state["lr_scheduler"]
        return state

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(Run, "_state", without_scheduler)
        assert _interrupted(argv, run, 3) == 128 + signal.SIGTERM
    assert "lr_scheduler" not in ckpt.load(ckpt.latest(run))
    assert main(["--out", str(run), "--resume"]) == 0
    a, b = ckpt.load(ckpt.latest(ref)), ckpt.load(ckpt.latest(run))
    assert [r["lr"] for r in a["metrics"] if r["kind"] == "train"] == [
        r["lr"] for r in b["metrics"] if r["kind"] == "train"]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


# --------------------------------------------------------------------------- warm-up, provenance

def test_constant_warmup_is_he_et_als_then_the_step_schedule():
    """--warmup-lr 0.01 over 400 iterations, then 0.1 until the first milestone (He et al.
    2015/2016's ResNet-110 and 1001 warm-up); without it, the linear ramp that starts at
    lr / warmup."""
    from fusedres.apps.train.schedule import lr_sequence

    cfg, _ = resolve(["--config", "he2016_cifar10_resnet110"])
    assert cfg["warmup_lr"] == 0.01 and cfg["warmup_iters"] == 400
    lrs = lr_sequence(cfg, 64000, [32000, 48000], 32001)
    assert set(lrs[:400]) == {0.01}
    assert lrs[400] == lrs[31999] == pytest.approx(0.1)
    assert lrs[32000] == pytest.approx(0.01)
    linear = lr_sequence({**cfg, "warmup_lr": None}, 64000, [32000, 48000], 401)
    assert linear[0] == pytest.approx(0.1 / 400) and linear[399] == pytest.approx(0.1)


def test_paper_recipes_decay_every_parameter(tmp_path):
    """He et al., Huang et al. and Li et al. decay all parameters (their optimisers take the
    whole parameter list): the configs put BatchNorm's and the biases in the decayed group."""
    model = models.preact_resnet(8, num_classes=3, fused=False, unit="original")
    for name in ("he2016_cifar10_resnet110", "he2016_cifar10_shortcuts", "cifar10_resnet164",
                 "cifar10_resnet1001", "cifar100_resnet164", "huang2016_cifar10_resnet110_sd",
                 "li2018_cifar10_resnet56"):
        cfg, _ = resolve(["--config", name])
        groups = _param_groups(model, cfg)
        assert len(groups) == 1 and groups[0]["weight_decay"] == cfg["weight_decay"], name
        assert len(groups[0]["params"]) == len(list(model.parameters()))


def test_a_run_records_its_commit_versions_and_device(tmp_path):
    """config.yaml and summary.json hold the provenance list: the commit of this checkout,
    whether its code had changes, the versions, the device; --config reads the file back
    (the record is not an option) and a resumed run appends its own entry."""
    import subprocess

    from fusedres.apps.train import provenance

    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "2", "--checkpoint-every", "2", "--out", str(out)]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    summary = json.loads((out / "summary.json").read_text())
    (entry,) = saved["provenance"]
    assert summary["provenance"] == saved["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(provenance.__file__).parent)
    assert entry["commit"] == head.stdout.strip() and isinstance(entry["dirty"], bool)
    assert entry["versions"]["torch"] == torch.__version__
    assert entry["device"].startswith("cpu: ") and entry["from_iteration"] == 0
    assert provenance.read(out) == saved["provenance"]
    cfg, _ = resolve(["--config", str(out / "config.yaml"), "--out", str(tmp_path / "again")])
    assert "provenance" not in cfg
    assert main([*TINY, "--max-iters", "4", "--out", str(out), "--resume"]) == 0
    entries = yaml.safe_load((out / "config.yaml").read_text())["provenance"]
    assert [e["from_iteration"] for e in entries] == [0, 2]
    assert json.loads((out / "summary.json").read_text())["provenance"] == entries
