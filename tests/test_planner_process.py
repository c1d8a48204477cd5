"""Planning for the process on CPU (``plan(..., process=True)``): the budget bounds the
resident set above a baseline, the step plus the allocator's slack; glibc is told to return
freed memory first; bad arguments fail before anything is set. Counted on the meta device;
the trainer's runs in fresh processes (tests/test_train_memory.py) measure the real figure."""

from __future__ import annotations

import pytest

import fusedres
from fusedres import models
from fusedres.memory import PlanError, allocator, allocator_slack_bytes, plan

MiB, GiB = 2 ** 20, 2 ** 30
SHAPE = (128, 3, 32, 32)


@pytest.fixture
def no_release(monkeypatch):
    """release_freed_memory replaced by a recorder (this process's glibc is left as it is)."""
    calls = []

    def fake():
        calls.append(1)
        return True, "recorded"
    monkeypatch.setattr(allocator, "release_freed_memory", fake)
    return calls


def test_process_plan_fits_step_plus_slack(no_release):
    model = models.preact_resnet20()
    tensors_only = plan(model, SHAPE, 10 * GiB, apply=False, predict_cuda=False)
    unplanned = tensors_only.peak_bytes
    # A budget the unplanned step meets but not with the allocator's slack on top.
    budget = unplanned + allocator_slack_bytes(unplanned, tensors_only.n_units) // 2
    assert plan(model, SHAPE, budget, apply=False, predict_cuda=False).segments == []
    p = plan(model, SHAPE, budget, process=True, apply=False, predict_cuda=False)
    assert no_release == [1]
    proc = p.process
    assert p.segments, "the slack does not fit beside the unplanned step: it must checkpoint"
    assert proc.tensors == p.peak_bytes < unplanned
    assert proc.slack == allocator_slack_bytes(p.peak_bytes, p.n_units) > 0
    assert p.budgeted_bytes == proc.above_baseline == proc.tensors + proc.slack <= budget
    assert proc.baseline == fusedres.memory.IMPORT_BASELINE_BYTES
    assert proc.total == proc.baseline + proc.above_baseline
    text = str(p)
    assert "process allocates above its baseline" in text
    for item in ("baseline (torch and fusedres imported)", "the step's peak",
                 "allocator slack (predicted)"):
        assert item in text


def test_process_plan_takes_a_measured_baseline(no_release):
    p = plan(models.preact_resnet20(), (8, 3, 32, 32), GiB, process=True,
             baseline_bytes=700 * MiB, predict_cuda=False)
    assert p.process.baseline == 700 * MiB and "this process, measured" in str(p)


def test_process_plan_error_names_the_smallest_process_budget(no_release):
    model = models.preact_resnet20()
    with pytest.raises(PlanError, match="allocator's slack") as info:
        plan(model, SHAPE, 10 * MiB, process=True, predict_cuda=False)
    smallest = info.value.min_budget_bytes
    p = plan(model, SHAPE, smallest, process=True, predict_cuda=False)
    assert p.process.above_baseline <= smallest
    # The same smallest step without the slack is what a tensor budget needs.
    assert plan(model, SHAPE, smallest - p.process.slack, predict_cuda=False)


def test_release_switch_is_honoured(no_release, monkeypatch):
    monkeypatch.setenv("FUSEDRES_RELEASE_FREED_MEMORY", "0")
    monkeypatch.setattr(allocator, "_applied", False)
    p = plan(models.preact_resnet20(), (8, 3, 32, 32), GiB, process=True, predict_cuda=False)
    assert no_release == []
    assert not p.process.released and "FUSEDRES_RELEASE_FREED_MEMORY=0" in str(p)
    # Freed blocks then stay resident: a larger slack is predicted.
    assert p.process.slack == allocator_slack_bytes(p.peak_bytes, p.n_units, released=False)
    assert p.process.slack > allocator_slack_bytes(p.peak_bytes, p.n_units)


def test_bad_arguments_fail_before_anything_is_set(no_release):
    model = models.preact_resnet20()
    model.set_grad_checkpointing([(0, 2)])
    cases = [
        (dict(budget_bytes=-GiB, process=True), ValueError, "budget_bytes"),
        (dict(budget_bytes=0, process=True), ValueError, "budget_bytes"),
        (dict(budget_bytes=GiB, process="yes"), TypeError, "process"),
        (dict(budget_bytes=None, activation_budget=GiB, process=True), ValueError, "process"),
        (dict(budget_bytes=GiB, process=True, baseline_bytes=-1), ValueError, "baseline_bytes"),
        (dict(budget_bytes=GiB, process=True, baseline_bytes=1.5), ValueError,
         "baseline_bytes"),
        (dict(budget_bytes=GiB, baseline_bytes=MiB), ValueError, "baseline_bytes"),
        (dict(budget_bytes=GiB, process=True, cuda_capability=9), ValueError,
         "cuda_capability"),
    ]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            plan(model, SHAPE, **kwargs)
    import torch.nn as nn
    with pytest.raises(TypeError, match="model"):
        plan(nn.Conv2d(3, 3, 1), SHAPE, GiB, process=True)
    assert no_release == []  # glibc untouched
    assert model.checkpoint_ranges == [(0, 2)]  # the model untouched


def test_slack_model():
    assert allocator_slack_bytes(0) == allocator.SLACK_BYTES
    assert allocator_slack_bytes(GiB) > allocator_slack_bytes(MiB)
    assert allocator_slack_bytes(MiB, 333) > allocator_slack_bytes(MiB, 54)
    with pytest.raises(ValueError, match="tensor_bytes"):
        allocator_slack_bytes(-1)
    with pytest.raises(ValueError, match="units"):
        allocator_slack_bytes(MiB, -3)
