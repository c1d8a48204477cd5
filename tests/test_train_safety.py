"""The trainer's run directory under stress: a full disk while a checkpoint is written, two
trainers on one --out, and every random generator through a resume."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train import main, runlock
from fusedres.apps.train.loop import Run
from fusedres.apps.train.runlock import LOCK_NAME, RunLock, RunLocked

TINY = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "8", "--threads", "1",
        "--pad", "1", "--no-flip", "--warmup-iters", "2", "--milestones", "0.5",
        "--no-progress", "--log-every", "2", "--checkpoint-every", "3", "--seed", "5"]


# --------------------------------------------------------------------------- full disk

def test_full_disk_is_one_line_naming_the_file_and_the_previous_checkpoint_is_intact(
        tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_save, calls, before = torch.save, [], {}

    def save_until_disk_full(obj, f):
        calls.append(getattr(f, "name", f))
        if len(calls) == 1:
            return real_save(obj, f)
        before["iter3"] = (out / "checkpoints" / "iter_00000003.pt").read_bytes()
        f.write(b"PK\x03\x04 half a checkpoint")  # the disk fills mid-write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", save_until_disk_full)
    code = main([*TINY, "--max-iters", "6", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert len(calls) == 2
    newer = out / "checkpoints" / "iter_00000006.pt"
    prev = out / "checkpoints" / "iter_00000003.pt"
    # The banner's lines (stderr), then this one line, the last; no traceback.
    lines = err.splitlines()
    assert "Traceback" not in err and not any("error" in line for line in lines[:-1]), err
    assert lines[-1] == (
        f"fusedres train: error: cannot write checkpoint {str(newer)!r}: "
        f"{os.strerror(errno.ENOSPC)}; the previous checkpoint {str(prev)!r} is intact"), err
    # The previous checkpoint byte for byte, no temporary file left, and it still resumes.
    assert prev.read_bytes() == before["iter3"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_00000003.pt"]
    assert ckpt.load(prev)["iteration"] == 3
    monkeypatch.setattr(torch, "save", real_save)
    assert RunLock(out).held  # the failed run let go of --out


def test_checkpoint_write_error_is_an_oserror_with_the_cause(tmp_path, monkeypatch):
    def failing_save(obj, f):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(ckpt.CheckpointWriteError, match="no earlier checkpoint exists") as e:
        ckpt.save(tmp_path, {"model": {}, "optimizer": {}, "config": {}}, 1, keep=1)
    assert e.value.errno == errno.EDQUOT and isinstance(e.value, OSError)
    assert os.strerror(errno.EDQUOT) in str(e.value) and "iter_00000001.pt" in str(e.value)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def _fsync_fails_for(monkeypatch, name: str) -> None:
    """The disk fills as ``name`` (config.yaml, summary.json: written to a temporary file with
    its suffix, then renamed) is flushed to disk; every other file is written."""
    real = os.fsync
    suffix = os.path.splitext(name)[1]

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(suffix):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _metrics_fill_disk(monkeypatch) -> None:
    """The disk fills as the metrics log appends its first record after the run started."""
    from fusedres.apps.train import metrics

    real = metrics.MetricsLog._write

    def write(self, f, record):
        if f is self._file:
            f.write('{"kind": "train", "iter')  # half a line, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, f, record)

    monkeypatch.setattr(metrics.MetricsLog, "_write", write)


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml", "summary.json"])
def test_full_disk_on_a_run_file_is_one_line_naming_it(tmp_path, monkeypatch, capfd, name):
    """Not only checkpoints: the metrics log, config.yaml and the summary end the run with one
    line naming the file and exit code 1, no traceback, no temporary file left, the lock let go."""
    out = tmp_path / "run"
    if name == "metrics.jsonl":
        _metrics_fill_disk(monkeypatch)
    else:
        _fsync_fails_for(monkeypatch, name)
    code = main([*TINY, "--max-iters", "3", "--out", str(out)])
    err = capfd.readouterr().err.strip()
    assert code == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.splitlines()[-1] == (f"fusedres train: error: cannot write {str(out / name)!r}: "
                                    f"{os.strerror(errno.ENOSPC)}"), err
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-") or p.suffix == ".tmp"]
    monkeypatch.undo()
    RunLock(out).release()  # the failed run let go of --out
    if name == "summary.json":  # the run's last checkpoint was written before the summary
        assert ckpt.load(out / "checkpoints" / "iter_00000003.pt")["iteration"] == 3


# --------------------------------------------------------------------------- the --out lock

def test_a_second_trainer_on_a_locked_out_exits_2_naming_it_and_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    # Another process holds the lock (runlock.py loaded by path: no torch import, fast).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import importlib.util as u, sys, time\n"
         "spec = u.spec_from_file_location('runlock', sys.argv[2])\n"
         "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
         "lock = m.RunLock(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(120)\n",
         str(out), runlock.__file__], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main([*TINY, "--max-iters", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err == (f"fusedres train: error: --out: {str(out)!r} is in use by another "
                       f"fusedres train (pid {holder.pid}); wait for it to end, or choose "
                       "another --out"), err
        assert not (out / "checkpoints").exists() and not (out / "config.yaml").exists()
    finally:
        holder.kill()  # a crash: no clean-up runs in the holder
        holder.wait()
    # The kernel dropped the dead holder's flock: the run can start now.
    assert main([*TINY, "--max-iters", "1", "--out", str(out)]) == 0


def test_the_lock_is_held_for_the_runs_life_and_released_at_its_end(tmp_path, monkeypatch):
    out = tmp_path / "run"
    seen = []
    step = Run._train_step

    def step_and_try_the_lock(self, x, y, lr):
        try:
            RunLock(out)
            seen.append("free")
        except RunLocked as e:
            seen.append(str(e))
        return step(self, x, y, lr)

    monkeypatch.setattr(Run, "_train_step", step_and_try_the_lock)
    assert main([*TINY, "--max-iters", "2", "--out", str(out)]) == 0
    assert seen == [f"--out: {str(out)!r} is in use by another fusedres train "
                    f"(pid {os.getpid()}); wait for it to end, or choose another --out"] * 2
    assert (out / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    lock = RunLock(out)  # released at the end
    lock.release()
    # Resuming takes it again (the lock file of the earlier run is no obstacle).
    assert main(["--out", str(out), "--resume", "--max-iters", "3", "--no-progress"]) == 0


# --------------------------------------------------------------------------- random generators

def _draws(monkeypatch) -> list[tuple[float, float, float]]:
    """Each training step draws from Python's, NumPy's and torch's generator (as a user's
    augmentation might); the list of draws, one tuple a step."""
    drawn = []
    step = Run._train_step

    def drawing_step(self, x, y, lr):
        drawn.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
        return step(self, x, y, lr)

    monkeypatch.setattr(Run, "_train_step", drawing_step)
    return drawn


def _scramble(seed: int) -> None:  # a process's generators in some other state
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_python_and_numpy_are_seeded_from_seed(tmp_path, monkeypatch):
    drawn = _draws(monkeypatch)
    _scramble(111)
    assert main([*TINY, "--max-iters", "1", "--out", str(tmp_path / "a")]) == 0
    assert drawn[0][0] == random.Random(5).random()
    assert drawn[0][1] == np.random.RandomState(5).rand()
    _scramble(222)
    assert main([*TINY, "--max-iters", "1", "--out", str(tmp_path / "b")]) == 0
    assert drawn[1] == drawn[0]


def test_resumed_run_matches_uninterrupted_in_every_generator(tmp_path, monkeypatch):
    drawn = _draws(monkeypatch)
    _scramble(111)
    assert main([*TINY, "--max-iters", "5", "--out", str(tmp_path / "whole")]) == 0
    after_whole = (random.random(), float(np.random.rand()), float(torch.rand(())))
    whole = list(drawn)
    drawn.clear()

    _scramble(222)
    out = tmp_path / "parts"
    assert main([*TINY, "--max-iters", "2", "--out", str(out)]) == 0
    state = ckpt.load(ckpt.latest(out))["rng"]
    assert set(state) >= {"torch", "numpy", "python"}
    _scramble(333)  # as a new process would start
    assert main(["--out", str(out), "--resume", "--max-iters", "5", "--no-progress"]) == 0
    after_parts = (random.random(), float(np.random.rand()), float(torch.rand(())))
    assert len(whole) == 5 and drawn == whole
    assert after_parts == after_whole
