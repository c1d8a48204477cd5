"""fusedres train's memory layout: ``--channels-last auto|on|off`` (and the older flag spellings),
``auto`` resolved once per run with its reason printed and saved, a resumed run keeping its
layout, and a checkpoint resumed in the other layout."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import yaml

from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train import main
from fusedres.apps.train.config import UsageError, resolve, resolve_channels_last
from fusedres.apps.train.loop import Run

TINY = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "8", "--threads", "1",
        "--pad", "1", "--no-flip", "--warmup-iters", "2", "--no-progress", "--log-every", "1",
        "--checkpoint-every", "100"]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


@pytest.mark.parametrize("argv, value", [
    ([], "auto"),
    (["--channels-last"], True),
    (["--channels-last", "on"], True),
    (["--channels-last", "off"], False),
    (["--channels-last", "auto"], "auto"),
    (["--channels-last", "True"], True),
    (["--no-channels-last"], False),
    (["--channels-last", "--amp", "bf16"], True),  # the flag alone, before another flag
    (["--channels-last", "off", "--channels-last"], True),  # the last one wins
])
def test_channels_last_flag_spellings(argv, value):
    cfg, explicit = resolve(argv)
    assert cfg["channels_last"] == value and type(cfg["channels_last"]) is type(value)
    assert ("channels_last" in explicit) == bool(argv)


@pytest.mark.parametrize("text, value", [
    ("channels_last: auto\n", "auto"),
    ("channels-last: true\n", True),
    ("channels_last: false\n", False),
    ("channels_last: on\n", True),      # YAML 1.1: a boolean
    ("channels_last: 'off'\n", False),  # quoted: the string, read the same way
])
def test_config_file_accepts_true_false_and_auto(tmp_path, text, value):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    cfg, explicit = resolve(["--config", str(path)])
    assert cfg["channels_last"] == value and type(cfg["channels_last"]) is type(value)
    assert "channels_last" in explicit


@pytest.mark.parametrize("argv, text", [
    (["--channels-last", "sometimes"], None),
    ([], "channels_last: sometimes\n"),
    ([], "channels_last: 2\n"),
    ([], "channels_last:\n"),
])
def test_bad_channels_last_names_the_flag(tmp_path, capsys, argv, text):
    if text is not None:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(UsageError, match="--channels-last: expected auto, on or off"):
        resolve(argv)
    assert main([*argv, *TINY, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--channels-last" in err, err
    assert not (tmp_path / "run").exists()


def test_auto_resolution(monkeypatch):
    on, why = resolve_channels_last("auto", CPU)
    assert torch.backends.mkldnn.is_available() and on is True
    assert why.startswith("auto: ") and "oneDNN" in why and "NHWC natively" in why
    assert "benchmarks/RESULTS.md" in why
    assert resolve_channels_last("auto", CPU, torch.bfloat16)[0] is True
    on, why = resolve_channels_last("auto", CPU, torch.float16)
    assert on is False and "float16" in why
    on, why = resolve_channels_last("auto", CUDA)
    assert on is False and "CUDA" in why and "GPU kernels" in why
    # The user's choice is kept, on any device.
    assert resolve_channels_last(True, CUDA) == (True, "asked for (--channels-last on)")
    assert resolve_channels_last(False, CPU) == (False, "asked for (--channels-last off)")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    on, why = resolve_channels_last("auto", CPU)
    assert on is False and "no oneDNN" in why


def _layout_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("fusedres train: layout: ")]
    assert len(lines) == 1, err
    return lines[0][len("fusedres train: "):]


@pytest.fixture
def scope():
    """The scope a Run's backend choice (fusedres.use_backend) ends with, as in
    fusedres.apps.train.main: closed after the test. (Left open, the choice was popped whenever the
    garbage collector reached it, from whatever backend stack was in force then.)"""
    with contextlib.ExitStack() as stack:
        yield stack


def test_auto_on_cpu_trains_channels_last_and_says_why(tmp_path, capsys, scope):
    out = tmp_path / "run"
    cfg, explicit = resolve([*TINY, "--max-iters", "2", "--out", str(out)])
    run = Run(cfg, explicit, scope)
    line = _layout_line(capsys.readouterr().err)
    assert line.startswith("layout: channels_last (auto: on CPU oneDNN's convolutions")
    # Applied: the batches (one channel: both layouts at once) and the convolutions' weights.
    assert run.batches.memory_format == torch.channels_last
    conv = next(m for m in run.model.modules() if isinstance(m, torch.nn.Conv2d)
                and m.weight.shape[1] > 1 and m.weight.shape[-1] > 1)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert run.train() == 0
    s = json.loads((out / "summary.json").read_text())
    assert (s["channels_last"], s["channels_last_origin"]) == (True, "auto")
    assert s["layout_reason"] == line[len("layout: channels_last ("):-1]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["channels_last"] is True  # resolved, so that a resumed run keeps it
    assert f"# {line}" in (out / "config.yaml").read_text()
    state = ckpt.load(ckpt.latest(out))
    assert state["config"]["channels_last"] is True
    assert state["layout"] == {"channels_last": True, "origin": "auto",
                               "reason": s["layout_reason"]}


def test_no_channels_last_stays_nchw(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "1", "--no-channels-last", "--out", str(out)]) == 0
    assert _layout_line(capsys.readouterr().err) == ("layout: NCHW (asked for "
                                                     "(--channels-last off))")
    s = json.loads((out / "summary.json").read_text())
    assert (s["channels_last"], s["channels_last_origin"]) == (False, "set")
    assert yaml.safe_load((out / "config.yaml").read_text())["channels_last"] is False


def test_config_round_trip_with_auto_and_resume_keeps_the_layout(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("channels_last: auto\n")
    out = tmp_path / "run"
    assert main(["--config", str(path), *TINY, "--max-iters", "1", "--out", str(out)]) == 0
    first = _layout_line(capsys.readouterr().err)
    assert first.startswith("layout: channels_last (auto: ")
    # The saved config, read as a config file, resolves to the value the run used.
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["channels_last"] is True
    cfg, _ = resolve(["--config", str(out / "config.yaml")])
    assert cfg["channels_last"] is True
    # Resumed without the flag: the same layout, still marked as auto's choice.
    assert main(["--out", str(out), "--resume", "--max-iters", "2", "--no-progress"]) == 0
    line = _layout_line(capsys.readouterr().err)
    assert line == first.replace("(auto: ", "(as the run it resumes: auto: ")
    s = json.loads((out / "summary.json").read_text())
    assert (s["channels_last"], s["channels_last_origin"], s["iterations"]) == (True, "auto", 2)
    # Resumed again: the reason is not prefixed twice.
    assert main(["--out", str(out), "--resume", "--max-iters", "3", "--no-progress"]) == 0
    assert _layout_line(capsys.readouterr().err) == line


def test_resume_in_the_other_layout(tmp_path, capsys, scope):
    """A checkpoint written in NCHW resumed channels_last (state dicts are layout-agnostic):
    the weights and the optimizer's momentum load, the next step's SGD update uses that
    momentum, and the run goes on to its end.

    (Not compared: the weights against an NCHW resume. At this checkpoint the fused
    channels_last step's gradient of one convolution was measured 4% off the fused NCHW one,
    and plain PyTorch's float32 step as far off a float64 one, the same in either layout: an
    ill-conditioned step, likely a ReLU input within float32 rounding of zero, not the
    layout.)"""
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "3", "--no-channels-last", "--out", str(out)]) == 0
    saved = ckpt.load(ckpt.latest(out))
    assert saved["layout"]["channels_last"] is False
    momentum = saved["optimizer"]["state"]
    assert momentum and all("momentum_buffer" in v for v in momentum.values())
    capsys.readouterr()

    cfg, explicit = resolve(["--out", str(out), "--resume", "--max-iters", "5",
                             "--channels-last", "on", "--no-progress"])
    run = Run(cfg, explicit, scope)
    assert _layout_line(capsys.readouterr().err) == ("layout: channels_last (asked for "
                                                     "(--channels-last on))")
    conv = run.model.layer1[0].conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, saved["model"][k]), k
    state = run.optimizer.state_dict()["state"]
    assert state.keys() == momentum.keys()
    for k, v in momentum.items():
        assert torch.equal(state[k]["momentum_buffer"], v["momentum_buffer"])
    # The momentum takes its parameter's layout (the foreach/fused update's fast path).
    for p in run.model.parameters():
        buf = run.optimizer.state[p]["momentum_buffer"]
        assert buf.stride() == p.stride()
        assert (buf.is_contiguous(memory_format=torch.channels_last)
                == p.is_contiguous(memory_format=torch.channels_last))
    buf = run.optimizer.state[conv]["momentum_buffer"]
    assert buf.is_contiguous(memory_format=torch.channels_last) and not buf.is_contiguous()
    # One step: buf <- momentum * buf + grad + weight_decay * p, from the loaded buffers.
    params = [(p, g["weight_decay"]) for g in run.optimizer.param_groups for p in g["params"]]
    before = [(p.detach().clone(), run.optimizer.state[p]["momentum_buffer"].clone())
              for p, _ in params]
    x, y = run.batches.train_batch(run.iteration)
    run._train_step(x, y, 0.05)
    m = cfg["momentum"]
    for (p, wd), (p0, buf0) in zip(params, before):
        expect = m * buf0 + p.grad + wd * p0
        assert torch.allclose(run.optimizer.state[p]["momentum_buffer"], expect,
                              rtol=1e-5, atol=1e-7)
        assert torch.allclose(p, p0 - 0.05 * expect, rtol=1e-5, atol=1e-7)
    assert any((buf0 != 0).any() for _, buf0 in before)  # a loaded buffer, not a fresh one

    scope.close()  # the inspected Run ends, releasing its lock on --out, as a process would
    assert main(["--out", str(out), "--resume", "--max-iters", "5", "--channels-last", "on",
                 "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert (s["iterations"], s["channels_last"]) == (5, True)
    assert s["final_test_error"] == s["final_test_error"]  # not NaN
