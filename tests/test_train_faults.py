"""fusedres train under injected faults: damaged and malformed checkpoints, a full disk inside
torch.save, files a killed run left, signals at any moment, numbers out of range. Each ends in
a clean refusal (one line, exit 2; a write failure: exit 1) or a correct result, never in a
signal, a traceback or a run that trains on bad state (issue 48). In-process but for the
signal tests, which need a process of their own to receive them."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train import main
from fusedres.apps.train.loop import Run

TINY = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "8", "--threads", "1",
        "--pad", "1", "--no-flip", "--warmup-iters", "2", "--milestones", "0.5",
        "--no-progress", "--log-every", "2", "--checkpoint-every", "3", "--seed", "7",
        "--no-tensorboard"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of 6 iterations: checkpoints at 3 and 6. Tests work on copies."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main([*TINY, "--max-iters", "6", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _snapshot(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock"}


def _last(out: Path) -> Path:
    return out / "checkpoints" / "iter_00000006.pt"


def _rewrite(path: Path, edit) -> None:
    """``edit`` the checkpoint's payload and save it with a matching digest: a malformed file
    that is not damaged (written so, or edited by hand)."""
    payload = torch.load(path, weights_only=True)
    edit(payload)
    payload.pop(ckpt.DIGEST, None)
    payload[ckpt.DIGEST] = ckpt.content_digest(payload)
    torch.save(payload, path)


def _key(state: dict, suffix: str) -> str:
    return next(k for k in state["model"] if k.endswith(suffix))


# --------------------------------------------------------------------------- damaged files

def test_a_flipped_byte_is_refused_and_resume_falls_back_to_the_intact_one(run, capsys):
    """One byte flipped inside a weight of the newest checkpoint (a disk error after the fact):
    its digest no longer matches. --resume says so on one line naming it, resumes from the
    checkpoint before it and ends with the very weights the damaged file held before the flip;
    --resume naming the file refuses it (exit 2) and names the intact one."""
    last, prev = _last(run), run / "checkpoints" / "iter_00000003.pt"
    good = ckpt.load(last)
    weight = good["model"][_key(good, "conv1.weight")]
    data = bytearray(last.read_bytes())
    at = data.find(weight.numpy().tobytes()) + weight.numel() * 2  # mid-tensor
    assert at > weight.numel() * 2
    data[at] ^= 0x10
    last.write_bytes(bytes(data))
    damaged = (f"checkpoint {str(last)!r} is damaged: its content does not match the digest "
               "written with it")
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(last)
    assert str(e.value) == damaged

    before = _snapshot(run)
    assert main([*TINY, "--out", str(run), "--resume", str(last)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fusedres train: error: {damaged}; the previous checkpoint {str(prev)!r} "
                   f"is intact: --resume {prev}")
    assert _snapshot(run) == before

    assert main([*TINY, "--out", str(run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert (f"fusedres train: warning: {damaged}; resuming from the newest intact checkpoint, "
            f"{str(prev)!r}\n") in err
    assert "resumed at iteration 3" in err
    again = ckpt.load(last)
    for k, v in good["model"].items():
        assert torch.equal(again["model"][k], v), k


def test_no_intact_checkpoint_is_one_line(run, capsys):
    for p in ckpt.list_checkpoints(run):
        p.write_bytes(p.read_bytes()[:300])
    before = _snapshot(run)
    assert main([*TINY, "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fusedres train: error: --resume: no intact checkpoint: checkpoint "
                          f"{str(_last(run))!r} cannot be loaded: it is truncated or corrupt")
    assert err.endswith("(1 older refused too)") and len(err.splitlines()) == 1, err
    assert _snapshot(run) == before


def _momentum_of_wrong_shape(s):  # SIGSEGV in fused SGD's step before the checks
    s["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(2)


def _negative_running_var(s):  # NaN test loss, written into metrics.jsonl as a bare NaN
    s["model"][_key(s, "running_var")].fill_(-1.0)


def _nan_weight(s):  # trained on with one divergence warning
    s["model"][_key(s, "conv1.weight")].view(-1)[0] = float("nan")


def _set(*path, value):
    def edit(s):
        for k in path[:-1]:
            s = s[k]
        s[path[-1]] = value
    return edit


MALFORMED = [
    ("momentum_shape", _momentum_of_wrong_shape,
     "optimizer['state'][0] (parameter 'conv1.weight')['momentum_buffer']: expected shape "
     "(16, 1, 3, 3) (its parameter's), got (2,)"),
    ("momentum_dtype", lambda s: s["optimizer"]["state"][0].update(
        momentum_buffer=s["optimizer"]["state"][0]["momentum_buffer"].double()),
     "['momentum_buffer']: expected dtype torch.float32 (its parameter's), got torch.float64"),
    ("iteration_past_the_run", _set("iteration", value=10**6),
     "iteration: 1000000 is beyond this run's 9 iterations"),
    ("iteration_text", _set("iteration", value="ten"),
     "iteration: expected an integer, got str 'ten'"),
    ("negative_running_var", _negative_running_var,
     "running_var']: expected values >= 0 (a variance), got -1.0"),
    ("nan_weight", _nan_weight, "conv1.weight']: expected finite values, got 1 of 144 not finite"),
    ("weight_dtype", lambda s: s["model"].update({_key(s, "fc.weight"):
                                                  s["model"][_key(s, "fc.weight")].double()}),
     "model['fc.weight']: expected dtype torch.float32, got torch.float64"),
    ("accum_text", _set("accum", value="zzz"), "accum: expected a mapping, got str 'zzz'"),
    ("rng_size", _set("rng", "torch", value=torch.zeros(2, dtype=torch.uint8)),
     "rng['torch']: Expected a CPUGeneratorImplState of size 5056 but found the input RNG "
     "state size to be 2"),
    ("metrics_number", _set("metrics", value=5), "metrics: expected a list, got int 5"),
    ("record_without_loss", lambda s: s["metrics"][0].pop("loss"),
     "metrics[0]['loss']: expected a number, got NoneType None"),
    ("momentum_hyperparameter", _set("optimizer", "param_groups", 0, "momentum",
                                     value=float("nan")),
     "optimizer['param_groups'][0]['momentum']: expected a finite number, got nan"),
    ("scheduler_count", _set("lr_scheduler", "scheduler", "last_epoch", value=2),
     "lr_scheduler['scheduler']['last_epoch']: expected 6 (the checkpoint's iteration), got 2"),
    ("scheduler_milestone", lambda s: s["lr_scheduler"]["scheduler"]["_schedulers"][1][
        "milestones"].__setitem__(3, "x"),
     "lr_scheduler['scheduler']['_schedulers'][1]['milestones'][3]: expected a number"),
    ("config_number", _set("config", value=5), "config: expected a mapping, got int 5"),
]


@pytest.mark.parametrize("edit, message", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_a_malformed_field_is_one_line_exit_2_and_nothing_is_touched(run, capsys, edit,
                                                                     message):
    """Each field a resume reads, wrong in type, shape or range in a checkpoint whose digest
    matches: refused before anything of it is applied (exit 2, one line naming the file and the
    field), the run directory unchanged, though the run has iterations left to train. A momentum
    buffer of the wrong shape ended the process with SIGSEGV (torch.optim's load_state_dict
    checks no shapes; the fused step wrote past the buffer)."""
    last = _last(run)
    _rewrite(last, edit)
    before = _snapshot(run)
    assert main([*TINY, "--out", str(run), "--resume", str(last), "--max-iters", "9"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fusedres train: error: ") and str(last) in err, err
    assert message in err, err
    assert _snapshot(run) == before


# --------------------------------------------------------------------------- writes

def test_torch_saves_runtime_error_on_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    """torch.save reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc]
    ... unexpected pos`` (its zip writer's, raised from the file's OSError): one line naming the
    file and the cause, exit 1, the previous checkpoint intact; no traceback."""
    out = tmp_path / "run"
    real_save, calls = torch.save, []

    class FullDisk:  # a file whose disk fills after 4 KiB
        def __init__(self, f):
            self.f, self.left = f, 4096

        def write(self, b):
            if len(b) > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(b)
            return self.f.write(b)

        def flush(self):
            self.f.flush()

    def save(obj, f):
        calls.append(f)
        return real_save(obj, f if len(calls) == 1 else FullDisk(f))

    monkeypatch.setattr(torch, "save", save)
    code = main([*TINY, "--max-iters", "6", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    prev = out / "checkpoints" / "iter_00000003.pt"
    assert code == 1, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"fusedres train: error: cannot write checkpoint {str(_last(out))!r}: "
        f"{os.strerror(errno.ENOSPC)}; the previous checkpoint {str(prev)!r} is intact")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [prev.name]


def test_stale_temporary_files_are_removed_at_start_and_resume(tmp_path, capsys):
    """A kill between a temporary file's creation and its rename leaves it: the next start (no
    checkpoint yet) and the next resume remove them; nothing else of the directory."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    stale = [out / "checkpoints" / ".tmp-a1b2.pt", out / ".tmp-c3d4.yaml",
             out / "metrics.jsonl.tmp"]
    for p in stale:
        p.write_bytes(b"")
    (out / "notes.txt").write_text("mine")
    assert main([*TINY, "--max-iters", "3", "--out", str(out)]) == 0
    assert "removed 3 temporary file(s)" in capsys.readouterr().err
    assert not any(p.exists() for p in stale)
    assert (out / "notes.txt").read_text() == "mine"
    stale[0].write_bytes(b"PK\x03\x04")
    assert main(["--out", str(out), "--resume", "--max-iters", "4", "--no-progress"]) == 0
    assert not stale[0].exists()


# --------------------------------------------------------------------------- signals

def _records(out: Path) -> list[dict]:
    keep = ("kind", "iteration", "epoch", "lr", "loss", "error", "test_loss", "test_error")
    return [{k: r[k] for k in keep if k in r}
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_a_stop_between_records_writes_no_record_of_its_own(tmp_path, monkeypatch, capsys):
    """SIGTERM at iteration 5 (no record is due: records every 2 and 3): the run checkpoints and
    exits 143 with no record for iteration 5; resumed, its log holds exactly the uninterrupted
    run's records (the window's sums travel in the checkpoint)."""
    ref = tmp_path / "ref"
    assert main([*TINY, "--max-iters", "9", "--out", str(ref)]) == 0
    step = Run._train_step

    def step_then_sigterm(self, x, y, lr):
        out = step(self, x, y, lr)
        if self.iteration == 4:  # the step that ends at iteration 5
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Run, "_train_step", step_then_sigterm)
    out = tmp_path / "run"
    assert main([*TINY, "--max-iters", "9", "--out", str(out)]) == 128 + signal.SIGTERM
    assert "SIGTERM received: checkpoint saved at iteration 5" in capsys.readouterr().err
    assert [r["iteration"] for r in _records(out)] == [2, 3, 4]
    monkeypatch.undo()
    assert main(["--out", str(out), "--resume", "--no-progress"]) == 0
    assert _records(out) == _records(ref)


# A run in a process of its own that sends itself signals: $1 the signal, $2 when ("twice": at
# iteration 2, then again as the run closes its log; "setup": while the data loads), $3 --out.
_DRIVER = """
import os, signal, sys
from fusedres.apps.train import data, main, metrics
from fusedres.apps.train.loop import Run
sig, when, out = getattr(signal, sys.argv[1]), sys.argv[2], sys.argv[3]
kill = lambda: os.kill(os.getpid(), sig)
if when == "twice":
    step, close = Run._train_step, metrics.MetricsLog.close
    def step_then_kill(self, *a):
        if self.iteration == 2:
            kill()
        return step(self, *a)
    def kill_then_close(self):
        kill()
        close(self)
    Run._train_step, metrics.MetricsLog.close = step_then_kill, kill_then_close
else:
    open_data = data.open_data
    def kill_then_open(*a):
        kill()
        return open_data(*a)
    data.open_data = kill_then_open
sys.exit(main(TINY + ["--max-iters", "6", "--out", out]))
"""


@pytest.mark.parametrize("sig, when", [("SIGTERM", "twice"), ("SIGINT", "twice"),
                                       ("SIGTERM", "setup")])
def test_the_exit_code_is_128_plus_the_signal_however_many_come(tmp_path, sig, when):
    """A second SIGTERM or SIGINT while the stopped run closes its files, or one before the
    first step: exit code 128 + the signal's number (a double SIGTERM gave -15: the default
    handler was back before the run ended), one line saying so, no traceback."""
    out = tmp_path / "run"
    code = f"TINY = {TINY!r}\n" + _DRIVER
    proc = subprocess.run([sys.executable, "-c", code, sig, when, str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    number = int(getattr(signal, sig))
    assert proc.returncode == 128 + number, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"fusedres train: {sig} received: stopped"
    if when == "twice":
        assert f"{sig} received: checkpoint saved at iteration 3" in proc.stderr
        assert ckpt.load(ckpt.latest(out))["iteration"] == 3
    else:
        assert not out.exists()
