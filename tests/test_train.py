"""fusedres train: configuration, data and augmentation, schedule, checkpoints, bad inputs,
and the embedded digits run reaching its stated accuracy."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train import main
from fusedres.apps.train.build import _param_groups, milestones
from fusedres.apps.train.config import DEFAULTS, UsageError, parse_bytes, resolve
from fusedres.apps.train.data import Batches, Data, augment
from fusedres.apps.train.schedule import lr_sequence

REPO = Path(__file__).resolve().parents[1]
TINY = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "8", "--threads", "1",
        "--pad", "1", "--no-flip", "--warmup-iters", "2", "--milestones", "0.5",
        "--no-progress", "--log-every", "2", "--checkpoint-every", "3"]


# --------------------------------------------------------------------------- configuration

def test_defaults_are_he_et_al_cifar_recipe():
    cfg, explicit = resolve([])
    assert explicit == set()
    assert (cfg["batch_size"], cfg["lr"], cfg["momentum"], cfg["weight_decay"]) == (
        128, 0.1, 0.9, 1e-4)
    assert (cfg["warmup_iters"], cfg["milestones"], cfg["max_iters"]) == (400, [32000, 48000],
                                                                          64000)
    assert (cfg["pad"], cfg["flip"], cfg["bn_weight_decay"]) == (4, True, False)


def test_yaml_sets_defaults_and_flags_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch-size: 64\nlr: 0.05\nflip: false\nmilestones: [10, 20]\n")
    cfg, explicit = resolve(["--config", str(path), "--lr", "0.2", "--flip"])
    assert (cfg["batch_size"], cfg["lr"], cfg["flip"], cfg["milestones"]) == (64, 0.2, True,
                                                                              [10, 20])
    assert {"batch_size", "lr", "flip", "milestones"} <= explicit
    assert cfg["momentum"] == DEFAULTS["momentum"]
    # The repository's configs resolve by name too.
    cfg, _ = resolve(["--config", "digits"])
    assert cfg["dataset"] == "digits" and cfg["model"] == "preact_resnet20"


def test_flags_win_over_the_config_file_and_replace_what_they_conflict_with(tmp_path):
    # digits sets epochs: 40; --max-iters on the command line replaces it.
    cfg, explicit = resolve(["--config", "digits", "--max-iters", "12"])
    assert (cfg["max_iters"], cfg["epochs"]) == (12, None) and "epochs" in explicit
    cfg, _ = resolve(["--config", "digits", "--epochs", "3"])
    assert cfg["epochs"] == 3
    # --depth over the config's named model: preact_resnet of that depth, same family.
    cfg, explicit = resolve(["--config", "digits", "--depth", "56"])
    assert (cfg["model"], cfg["depth"], cfg["variant"]) == ("preact_resnet", 56, "cifar")
    assert {"model", "variant"} <= explicit
    # A named --model over a config's preact_resnet/depth/variant drops them.
    path = tmp_path / "c.yaml"
    path.write_text("model: preact_resnet\ndepth: 56\nvariant: cifar\n")
    cfg, _ = resolve(["--config", str(path), "--model", "preact_resnet20"])
    assert (cfg["model"], cfg["depth"], cfg["variant"]) == ("preact_resnet20", None, None)
    # A file may hold both epochs and max_iters (a saved run's config.yaml does): epochs wins.
    path.write_text("epochs: 2\nmax_iters: 64000\n")
    cfg, _ = resolve(["--config", str(path)])
    assert (cfg["epochs"], cfg["max_iters"]) == (2, 64000)


@pytest.mark.parametrize("argv, match", [
    (["--epochs", "3", "--max-iters", "12"], "--epochs and --max-iters: give one of them"),
    (["--model", "preact_resnet20", "--depth", "56"],
     "--depth: only with --model preact_resnet (preact_resnet20 fixes the depth)"),
    (["--model", "preact_resnet50", "--variant", "cifar"],
     "--variant: only with --model preact_resnet (preact_resnet50 fixes the variant)"),
    (["--drop-path-mode", "batch"], "--drop-path-mode: only with a --drop-path-rate above 0"),
    (["--drop-path-mode", "row", "--drop-path-rate", "0"],
     "--drop-path-mode: only with a --drop-path-rate above 0"),
])
def test_conflicting_flags_are_an_error(argv, match, capsys):
    with pytest.raises(UsageError, match=match.replace("(", r"\(").replace(")", r"\)")):
        resolve(argv)
    assert main([*argv, "--dataset", "digits", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_conflict_inside_a_config_file_names_the_option(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: preact_resnet20\ndepth: 56\n")
    with pytest.raises(UsageError, match="--depth: only with --model preact_resnet .*--config"):
        resolve(["--config", str(path)])


def test_max_iters_flag_wins_over_config_epochs_in_a_run_and_on_resume(tmp_path):
    """The bug of issue 10: under --config digits (epochs: 40) --max-iters was ignored."""
    out = tmp_path / "run"
    tiny = ["--config", "digits", "--depth", "8", "--no-progress", "--checkpoint-every", "100",
            "--log-every", "5"]
    assert main([*tiny, "--max-iters", "3", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["iterations"] == 3
    # A run stopped by epochs (1 epoch = 11 iterations), resumed with --max-iters: the flag
    # replaces the saved config's epochs.
    out2 = tmp_path / "run2"
    assert main([*tiny, "--epochs", "1", "--out", str(out2)]) == 0
    assert json.loads((out2 / "summary.json").read_text())["iterations"] == 11
    assert main(["--out", str(out2), "--resume", "--max-iters", "13", "--no-progress"]) == 0
    assert ckpt.load(ckpt.latest(out2))["iteration"] == 13
    saved = yaml.safe_load((out2 / "config.yaml").read_text())
    assert (saved["epochs"], saved["max_iters"]) == (None, 13)


def test_a_runs_saved_config_reruns_it(tmp_path, capsys):
    """A run's config.yaml is a --config file: the rerun resolves to the same settings."""
    out = tmp_path / "run"
    assert main(["--config", "digits", "--depth", "8", "--max-iters", "1", "--threads", "1",
                 "--no-progress", "--log-every", "1", "--out", str(out)]) == 0
    path = out / "config.yaml"
    text = path.read_text()
    saved = yaml.safe_load(text)
    saved.pop("provenance")  # the run's record of its commit (not an option): test_train_recipes
    # The file the run was given is a comment, not a key: a config file cannot include another.
    assert "config" not in saved and "# --config digits\n" in text
    cfg, _ = resolve(["--config", str(path)])
    assert {k: cfg[k] for k in saved} == saved
    # Rerun (a new --out: the saved one already holds the run).
    assert main(["--config", str(path)]) == 2
    assert "--out: " in capsys.readouterr().err
    again = tmp_path / "again"
    assert main(["--config", str(path), "--out", str(again)]) == 0
    assert json.loads((again / "summary.json").read_text())["iterations"] == 1
    rerun = yaml.safe_load((again / "config.yaml").read_text())
    rerun.pop("provenance")
    assert rerun.pop("out") == str(again) and saved.pop("out") == str(out)
    assert rerun == saved
    assert f"# --config {path}\n" in (again / "config.yaml").read_text()


@pytest.mark.parametrize("text, match", [
    ("bogus: 1\n", "unknown option 'bogus'"),
    ("config: other.yaml\n", "--config: .* sets 'config': a config file cannot include"),
    ("batch_size: many\n", "--batch-size: expected an integer"),
    ("- a\n- b\n", "must hold a mapping"),
    ("lr: [\n", "not valid YAML"),
])
def test_bad_yaml(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=match):
        resolve(["--config", str(path)])


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1.5 KiB") == 1536
    for bad in ("4 parsecs", "-1GiB", "0", "lots"):
        with pytest.raises(UsageError):
            parse_bytes(bad)


def test_schedule_warmup_then_step_decays():
    cfg, _ = resolve(["--max-iters", "1000", "--warmup-iters", "4", "--milestones", "0.5,800"])
    steps = milestones(cfg, 1000)
    assert steps == [500, 800]
    lrs = lr_sequence(cfg, 1000, steps, 1000)
    expected = [0.025, 0.05, 0.1, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001]
    assert [lrs[i] for i in (0, 1, 3, 4, 499, 500, 799, 800, 999)] == pytest.approx(
        expected, rel=1e-12)


def _oracle_lrs(kind: str, n: int, warmup: int, **kw) -> list[float]:
    """A plain PyTorch loop: torch's schedulers on an SGD, stepped after each iteration as
    the torch docs order it, the rate read from the group before each step."""
    from torch.optim import lr_scheduler as S

    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.4)
    main = {"step": lambda: S.MultiStepLR(opt, [m - warmup for m in kw.get("ms", [])], 0.1),
            "cosine": lambda: S.CosineAnnealingLR(opt, n - warmup, eta_min=0.01),
            "poly": lambda: S.PolynomialLR(opt, n - warmup, power=2.0)}[kind]()
    warm = S.LinearLR(opt, 1 / warmup, 1.0, warmup - 1)
    sched = S.SequentialLR(opt, [warm, main], [warmup])
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(1)
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["step", "cosine", "poly"])
def test_schedule_is_torchs_scheduler_run_by_hand(kind, tmp_path):
    """The trainer's rate at every iteration, as it writes them to metrics (log-every 1), is
    the oracle's: torch's schedulers run by hand in a plain loop; the ends are the rule's."""
    n, warmup = 12, 3
    out = tmp_path / kind
    code = main([*TINY, "--max-iters", str(n), "--warmup-iters", str(warmup), "--log-every",
                 "1", "--lr", "0.4", "--schedule", kind, "--milestones", "6,9", "--min-lr",
                 "0.01", "--poly-power", "2", "--batch-size", "16", "--no-tensorboard",
                 "--out", str(out)])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if r["kind"] == "train"]
    expected = _oracle_lrs(kind, n, warmup, ms=[6, 9])
    assert lrs == expected  # the same floats: the same scheduler arithmetic
    assert lrs[0] == pytest.approx(0.4 / 3) and lrs[2] == pytest.approx(0.4)
    if kind == "step":
        assert lrs[5] == pytest.approx(0.4) and lrs[6] == pytest.approx(0.04)
        assert lrs[9] == pytest.approx(0.004)
    elif kind == "cosine":
        assert lrs[-1] > 0.01 and lrs[-1] == pytest.approx(
            0.01 + 0.39 * (1 + math.cos(math.pi * 8 / 9)) / 2)
    else:
        assert lrs[-1] == pytest.approx(0.4 * (1 - 8 / 9) ** 2)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert (cfg["schedule"], cfg["min_lr"], cfg["poly_power"]) == (kind, 0.01, 2.0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"]["schedule"] == kind


def test_weight_decay_skips_norms_and_biases_unless_asked():
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.Linear(5, 2),
                          nn.GroupNorm(1, 2))
    cfg, _ = resolve([])
    decay, no_decay = _param_groups(model, cfg)
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 1e-4
    cfg, _ = resolve(["--bias-weight-decay"])
    decay, no_decay = _param_groups(model, cfg)
    assert {id(p) for p in no_decay["params"]} == {id(model[1].weight), id(model[1].bias),
                                                   id(model[3].weight), id(model[3].bias)}
    cfg, _ = resolve(["--bn-weight-decay", "--bias-weight-decay"])
    (only,) = _param_groups(model, cfg)
    assert len(only["params"]) == len(list(model.parameters()))


# --------------------------------------------------------------------------- data

def _tiny_data(n=20, c=3, h=7):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, c, h, h), generator=g, dtype=torch.uint8)
    y = torch.arange(n) % 5
    return Data("tiny", x, y, x[:6], y[:6], torch.full((c,), 0.5), torch.full((c,), 0.25), 5)


def test_augment_matches_a_per_image_loop():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 7, 13, generator=g)
    pad = 2
    offsets = torch.randint(0, 2 * pad + 1, (5, 2), generator=g)
    flips = torch.tensor([True, False, True, False, False])
    got = augment(x, offsets, flips, pad)
    for i in range(5):
        padded = torch.nn.functional.pad(x[i], (pad, pad, pad, pad))
        oy, ox = offsets[i].tolist()
        want = padded[:, oy:oy + 7, ox:ox + 13]
        if flips[i]:
            want = want.flip(2)
        assert torch.equal(got[i], want)
    assert torch.equal(augment(x, torch.full((5, 2), pad), None, pad), x)  # centre, no flip


def test_batches_are_a_function_of_seed_and_iteration_and_split_over_processes():
    data = _tiny_data()
    one = Batches(data, 8, seed=4, pad=1, flip=True)
    assert one.iters_per_epoch == 2
    again = Batches(data, 8, seed=4, pad=1, flip=True)
    for it in (3, 0, 5):  # any order: no hidden state
        xa, ya = one.train_batch(it)
        xb, yb = again.train_batch(it)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # An epoch visits distinct images.
    seen = torch.cat([one.train_batch(i)[1] for i in range(2)])
    assert len(seen) == 16
    # Two processes' halves make the one-process global batch.
    halves = [Batches(data, 8, seed=4, pad=1, flip=True, rank=r, world=2) for r in (0, 1)]
    x, y = one.train_batch(3)
    parts = [h.train_batch(3) for h in halves]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert not torch.equal(one.train_batch(0)[0], one.train_batch(1)[0])
    with pytest.raises(UsageError, match="does not split over 3"):
        Batches(data, 8, seed=0, pad=1, flip=True, world=3)


# --------------------------------------------------------------------------- checkpoints

def test_checkpoint_round_trip_and_atomic_failure(tmp_path, monkeypatch):
    state = {"model": {"w": torch.arange(3.0)}, "optimizer": {}, "config": {"lr": 0.1},
             "rng": ckpt.rng_state()}
    ckpt.save(tmp_path, state, 5, keep=2)
    ckpt.save(tmp_path, state, 9, keep=2)
    ckpt.save(tmp_path, state, 12, keep=2)
    assert _its(tmp_path) == [9, 12]
    loaded = ckpt.load(ckpt.latest(tmp_path))
    assert loaded["iteration"] == 12 and torch.equal(loaded["model"]["w"], torch.arange(3.0))
    ckpt.set_rng_state(loaded["rng"])

    def failing_save(obj, f):  # dies half-way through writing
        f.write(b"PK\x03\x04partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(tmp_path, state, 15, keep=2)
    assert _its(tmp_path) == [9, 12]  # the previous good ones are kept
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "iter_00000009.pt", "iter_00000012.pt"]  # no temporary file left behind


def _its(run):
    return [int(p.stem.split("_")[1]) for p in ckpt.list_checkpoints(run)]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("kind", ["truncated", "empty", "pickled-object", "foreign"])
def test_bad_checkpoint_files_give_clear_errors(tmp_path, kind):
    path = tmp_path / "x.pt"
    if kind == "truncated":
        good = ckpt.save(tmp_path, {"model": {}, "optimizer": {}, "config": {}}, 1, keep=1)
        path.write_bytes(good.read_bytes()[:200])
        match = "truncated or corrupt"
    elif kind == "empty":
        path.write_bytes(b"")
        match = "empty"
    elif kind == "pickled-object":
        torch.save({"format": ckpt.FORMAT, "payload": _Evil()}, path)
        match = "pickled objects"
    else:
        torch.save({"w": torch.ones(2)}, path)  # a plain state_dict
        match = "not a fusedres training checkpoint"
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load(path)


# --------------------------------------------------------------------------- bad inputs

def _snapshot(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A real (tiny) finished run: its files must survive every bad command below."""
    out = tmp_path_factory.mktemp("run")
    code = main([*TINY, "--max-iters", "6", "--out", str(out)])
    assert code == 0
    return out


def test_finished_run_has_its_outputs(finished_run):
    names = {p.name for p in finished_run.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "curves.png", "summary.json", "summary.md",
            "checkpoints"} <= names
    saved = yaml.safe_load((finished_run / "config.yaml").read_text())
    assert saved["depth"] == 8 and saved["max_iters"] == 6 and saved["resume"] is None
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["iterations"] == 6
    assert summary["saved_activation_bytes"] > 0 and summary["peak_memory_bytes"] > 0
    kinds = [json.loads(line)["kind"] for line in
             (finished_run / "metrics.jsonl").read_text().splitlines()]
    # Records at every log (2) and checkpoint (3) boundary; 6 iterations < 1 epoch (11), so one
    # evaluation and one (partial) epoch record, at the end.
    assert [k for k in kinds] == ["train"] * 4 + ["eval", "epoch"]
    assert _its(finished_run) == [3, 6]  # every 3 iterations, the newest 2 kept


@pytest.mark.parametrize("argv, match", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--batch-size", "0"], "--batch-size: expected a positive value"),
    (["--batch-size", "ten"], "argument --batch-size: invalid int value"),
    (["--amp", "fp8"], "argument --amp: invalid choice"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"],
     "--data-dir: '/nonexistent/cifar' does not exist"),
    (["--depth", "21"], "--depth 21: depth: the cifar variant cannot build depth 21"),
    (["--model", "resnet9000"], "--model: unknown model 'resnet9000'"),
    (["--memory-budget", "1KiB"], "--memory-budget 1KiB: "),
    (["--backend", "cuda"], "--backend cuda: cannot run on cpu"),
    (["--config", "/nonexistent.yaml"], "--config: cannot read"),
    (["--batch-size", "4096"], "--batch-size: 4096 is larger than the 1433 training images"),
    (["--unit", "postact"], "argument --unit: invalid choice: 'postact'"),
    (["--shortcut", "gated"], "argument --shortcut: invalid choice: 'gated'"),
    (["--drop-path-rate", "1"], "--drop-path-rate: expected a rate in [0, 1), got 1.0"),
    (["--gate-bias", "-6"], "--gate-bias: only the shortcut 'exclusive_gate' or "
                            "'shortcut_gate' takes it, got shortcut='identity'"),
    (["--shortcut", "none", "--drop-path-rate", "0.1"],
     "--drop-path-rate: a network without shortcuts (shortcut='none') cannot drop units"),
    (["--cuda-graphs"], "--cuda-graphs: needs a CUDA device; none is available here"),
    (["--cuda-graphs", "--device", "cpu"], "--cuda-graphs: needs a CUDA device; --device is cpu"),
    (["--cuda-graphs", "--compile"], "--compile default: not with --cuda-graphs"),
    (["--cuda-graphs", "--compile", "reduce-overhead"],
     "--compile reduce-overhead: not with --cuda-graphs"),
    (["--cuda-graphs", "--drop-path-rate", "0.2", "--drop-path-mode", "batch_skip"],
     "--drop-path-mode batch_skip: not with --cuda-graphs"),
    (["--cuda-graphs", "--memory-budget", "1GiB"], "--memory-budget: not with --cuda-graphs"),
    (["--cuda-graphs", "--activation-budget", "1GiB"],
     "--activation-budget: not with --cuda-graphs"),
    (["--compile", "fast"], "argument --compile: invalid choice: 'fast'"),
    # Numbers argparse takes that no range check refused (issue 48): --lr nan trained.
    (["--lr", "nan"], "--lr: expected a finite number, got nan"),
    (["--momentum", "inf"], "--momentum: expected a finite number, got inf"),
    (["--weight-decay=-inf"], "--weight-decay: expected a finite number, got -inf"),
    (["--betas", "0.9", "nan"], "--betas: expected a finite number, got nan"),
    (["--ema-decay", "nan"], "--ema-decay: expected a finite number, got nan"),
    (["--seed", str(2**70)], "--seed: expected a value whose magnitude is below 2^64, got "
                             f"{2**70}"),
    (["--threads", str(2**63)], "--threads: expected a value whose magnitude is below 2^63"),
    (["--max-iters", str(2**63)], "--max-iters: expected a value whose magnitude is below"),
])
def test_bad_input_is_one_line_exit_2_and_the_run_is_untouched(finished_run, capsys, argv,
                                                               match, monkeypatch):
    if "cuda" in argv:  # conftest runs the cuda backend on CPU (FUSEDRES_CUDA_ON_CPU=1): undo
        import functools

        from fusedres.backends import cuda as backend_cuda
        from fusedres.ops import _backend
        monkeypatch.setattr(backend_cuda, "ON_CPU", False)
        monkeypatch.setattr(_backend, "_unavailable_reason",
                            functools.cache(_backend._unavailable_reason.__wrapped__))
    before = _snapshot(finished_run)
    code = main([*TINY, "--out", str(finished_run), "--resume", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fusedres train: error: ") and match in err, err
    assert _snapshot(finished_run) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available")
def test_cuda_graphs_without_a_gpu_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "2", "--out", str(out), "--cuda-graphs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("fusedres train: error: --cuda-graphs: needs a CUDA device; none is "
                   "available here (torch.cuda.is_available() is False)")
    assert not out.exists()


def test_compile_and_cuda_graphs_from_a_config_file(tmp_path):
    """A config file's ``compile: true`` (an older config.yaml's) is the default mode; a mode
    by name is kept; with ``cuda_graphs: true`` the conflict names --compile."""
    path = tmp_path / "c.yaml"
    path.write_text("compile: true\n")
    assert resolve(["--config", str(path)])[0]["compile"] == "default"
    path.write_text("compile: max-autotune\n")
    assert resolve(["--config", str(path)])[0]["compile"] == "max-autotune"
    assert resolve(["--config", str(path), "--no-compile"])[0]["compile"] is False
    path.write_text("compile: fastest\n")
    with pytest.raises(UsageError, match="--compile: expected one of default, reduce-overhead, "
                                         "max-autotune"):
        resolve(["--config", str(path)])
    path.write_text("cuda_graphs: true\ncompile: reduce-overhead\n")
    with pytest.raises(UsageError, match="--compile reduce-overhead: not with --cuda-graphs"):
        resolve(["--config", str(path)])
    assert resolve(["--config", str(path), "--no-cuda-graphs"])[0]["cuda_graphs"] is False


@pytest.mark.parametrize("flags, mode", [(["--compile"], None),
                                         (["--compile", "default"], None),
                                         (["--compile", "reduce-overhead"], "reduce-overhead"),
                                         (["--compile", "max-autotune"], "max-autotune")])
def test_compile_mode_reaches_torch_compile(tmp_path, monkeypatch, capsys, flags, mode):
    """``--compile MODE``: the model compiled in that mode (torch.compile stood in for: a real
    compile is the full matrix's run below), said in the banner and the summary."""
    from fusedres.apps.train import run_setup

    calls = []

    def fake_compile(model, **kwargs):
        calls.append(kwargs)
        return model

    monkeypatch.setattr(run_setup.torch, "compile", fake_compile)
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "1", "--out", str(out), *flags]) == 0
    assert calls == [{"mode": mode}]
    name = flags[1] if len(flags) > 1 else "default"
    assert f"torch.compile, mode {name}" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compile"] == name and summary["cuda_graphs"] is False


@pytest.mark.full_matrix
def test_compile_reduce_overhead_trains(tmp_path):
    """A real --compile reduce-overhead run (Inductor's C++ code on CPU, where its CUDA graphs
    do not apply): ~1 minute here."""
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "2", "--out", str(out), "--compile",
                 "reduce-overhead"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["compile"] == "reduce-overhead"
    assert summary["final_test_error"] == summary["final_test_error"]  # not NaN


def test_the_banner_says_the_last_partial_batch_is_dropped(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "1", "--out", str(out)]) == 0
    # digits: 1433 training images, batch 128: 11 steps an epoch, 25 images left out.
    assert ("each epoch drops its last partial batch: 25 of the 1433 training images"
            in capsys.readouterr().err)


def test_out_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("mine")
    assert main([*TINY, "--out", str(path)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert path.read_text() == "mine"


def test_existing_run_needs_resume(finished_run, capsys):
    before = _snapshot(finished_run)
    assert main([*TINY, "--out", str(finished_run)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert _snapshot(finished_run) == before


def test_corrupt_latest_checkpoint_names_the_previous_good_one(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "6", "--out", str(out)]) == 0
    capsys.readouterr()
    first, last = ckpt.list_checkpoints(out)
    last.write_bytes(last.read_bytes()[:1000])  # a disk error after the fact
    before = _snapshot(out)
    # Named: refused, with the intact one named.
    assert main([*TINY, "--max-iters", "9", "--out", str(out), "--resume", str(last)]) == 2
    err = capsys.readouterr().err
    assert "truncated or corrupt" in err and f"--resume {first}" in err
    assert _snapshot(out) == before
    # --resume (the latest): the newest intact one, said on one warning line.
    assert main([*TINY, "--max-iters", "9", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert (f"fusedres train: warning: checkpoint {str(last)!r} cannot be loaded: it is "
            "truncated or corrupt") in err
    assert f"resuming from the newest intact checkpoint, {str(first)!r}" in err
    assert ckpt.load(ckpt.latest(out))["iteration"] == 9


def test_resume_extends_a_finished_run_and_csv_log(tmp_path):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "4", "--out", str(out), "--log-format", "csv"]) == 0
    # Resuming keeps the saved configuration (csv, depth 8) and takes the new flag.
    assert main(["--out", str(out), "--resume", "--max-iters", "6"]) == 0
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("kind,iteration")
    train_its = [int(r.split(",")[1]) for r in rows[1:] if r.startswith("train")]
    assert train_its == [2, 3, 4, 6]  # log (2) and checkpoint (3) boundaries, none twice


# --------------------------------------------------------------------------- the demo run

@pytest.mark.parametrize("flags", [["--amp", "bf16"], ["--amp", "fp16"], ["--channels-last"],
                                   ["--no-fused"], ["--sync-bn"], ["--backend", "portable"]],
                         ids=lambda f: " ".join(f))
def test_training_options_run(tmp_path, flags):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "2", "--out", str(out), *flags]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["saved_activation_bytes"] > 0
    assert summary["final_test_error"] == summary["final_test_error"]  # not NaN


@pytest.mark.parametrize("flags", [
    ["--unit", "original", "--shortcut", "exclusive_gate", "--gate-bias", "-2"],
    ["--unit", "relu_only_preact", "--shortcut", "scale", "--shortcut-scale", "0.7",
     "--scale-branch"],
    ["--shortcut", "none", "--norm", "none"],
    ["--drop-path-rate", "0.3", "--drop-path-mode", "batch"],
], ids=lambda f: " ".join(f))
def test_model_variants_train_and_are_saved(tmp_path, flags):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "2", "--out", str(out), *flags]) == 0
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    summary = json.loads((out / "summary.json").read_text())
    given = dict(zip(flags[::2], flags[1::2]))
    for flag, value in given.items():
        key = flag[2:].replace("-", "_")
        if value.startswith("--"):
            continue
        want = float(value) if key in ("gate_bias", "shortcut_scale", "drop_path_rate") else value
        assert cfg[key] == want and summary["variant"][key] == want, key
    # The saved config rebuilds the same network (what fusedres lesion/landscape do).
    state = ckpt.load(ckpt.latest(out))["model"]
    from fusedres.apps.train.build import build_model
    from fusedres.apps.train.config import merge_saved
    model = build_model(merge_saved(*resolve([]), cfg), 1, 10)
    model.load_state_dict(state)


def test_a_diverging_run_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "4", "--norm", "none", "--lr", "1e12", "--warmup-iters",
                 "0", "--out", str(out)]) == 0
    assert "the run has diverged" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged_at_iteration"] == 2
    assert "training loss not finite by iteration 2" in (out / "summary.md").read_text()


def test_memory_budget_plans_checkpointing_within_the_budget(tmp_path):
    def saved(*flags):
        out = tmp_path / "-".join(flags or ("none",))
        assert main([*TINY, "--max-iters", "1", "--out", str(out), *flags]) == 0
        return json.loads((out / "summary.json").read_text())

    plain = saved()["saved_activation_bytes"]
    budget = int(plain * 0.8)  # measured: checkpointing 2 of 3 units needs ~0.67 x
    planned = saved("--activation-budget", str(budget))  # saved activations only
    assert planned["saved_activation_bytes"] <= budget < plain
    assert planned["memory_plan"]
