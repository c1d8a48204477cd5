"""The GPU side of a budget, without a GPU: the CUDA caching allocator's replay (reserved
memory with and without expandable segments), cuBLAS's workspace, the device check the trainer
makes before the first step (the device's memory injected)."""

from __future__ import annotations

import types

import pytest
import torch

import fusedres
from fusedres import models
from fusedres.apps.train.loop import Run
from fusedres.memory.cuda_memory import CachingAllocatorModel, predict

MiB = 2 ** 20


def test_default_segments_round_split_and_reuse():
    a = CachingAllocatorModel(expandable_segments=False)
    small = a.malloc(100)  # rounded to 512 B, from a new 2 MiB small-pool segment
    assert (small.size, a.reserved_bytes, a.allocated_bytes) == (512, 2 * MiB, 512)
    x = a.malloc(3 * MiB)  # under 10 MiB: a 20 MiB segment, split (17 MiB > 1 MiB remain)
    assert (x.size, a.reserved_bytes) == (3 * MiB, 22 * MiB)
    y = a.malloc(12 * MiB)  # best fit: the 17 MiB remainder, split again (5 MiB remain)
    assert a.reserved_bytes == 22 * MiB
    z = a.malloc(15 * MiB + 1)  # nothing cached fits: a segment rounded up to 2 MiB
    assert a.reserved_bytes == 22 * MiB + 16 * MiB
    a.free(x)
    w = a.malloc(2 * MiB + 512 * 1024)  # best fit is the freed 3 MiB block; 0.5 MiB left is
    assert w.addr == x.addr and w.size == 3 * MiB  # not worth a split: handed out whole
    assert a.allocated_bytes == 512 + 3 * MiB + 12 * MiB + 16 * MiB
    assert a.peak_reserved_bytes == 38 * MiB
    for b in (y, z, w, small):
        a.free(b)
    assert a.allocated_bytes == 0 and a.reserved_bytes == 38 * MiB  # segments are kept


def test_freed_neighbours_merge():
    a = CachingAllocatorModel()
    blocks = [a.malloc(4 * MiB) for _ in range(4)]  # one 20 MiB segment, 4 MiB remain
    a.free(blocks[1])
    a.free(blocks[2])  # merges with blocks[1]: 8 MiB free in one block
    big = a.malloc(8 * MiB)
    assert big.addr == blocks[1].addr and a.reserved_bytes == 20 * MiB


def test_expandable_segments_grow_the_free_tail():
    """3 MiB then 30 MiB: default segments reserve 20 + 30 MiB; an expandable segment maps one
    20 MiB page, then extends the free 17 MiB at its end by one more page."""
    events = [("alloc", 1, 3 * MiB), ("alloc", 2, 30 * MiB)]
    default = CachingAllocatorModel(False).replay(events)
    grown = CachingAllocatorModel(True).replay(events)
    assert default.peak_reserved_bytes == 50 * MiB
    assert grown.peak_reserved_bytes == 40 * MiB
    assert grown.peak_allocated_bytes == default.peak_allocated_bytes == 33 * MiB


def test_expandable_best_fit_spares_the_growable_tail():
    """A free block at the end of the mapped pages counts at what it can grow to: a request
    that fits a free block in the middle goes there, even if the tail block is smaller."""
    a = CachingAllocatorModel(expandable_segments=True)
    first = a.malloc(6 * MiB)
    a.malloc(2 * MiB)
    a.malloc(8 * MiB)  # 4 MiB of the 20 MiB page remain free at the end
    a.free(first)  # 6 MiB free in the middle
    b = a.malloc(3 * MiB)  # smallest fit by size is the 4 MiB tail; the walk picks the middle
    assert b.addr == first.addr and a.reserved_bytes == 20 * MiB


def test_replay_ignores_unknown_frees_and_empty_tensors():
    a = CachingAllocatorModel().replay([("free", 7), ("alloc", 1, 0), ("alloc", 2, 1024),
                                        ("free", 2)])
    assert a.allocated_bytes == 0 and a.peak_allocated_bytes == 1024
    assert a.reserved_bytes == 2 * MiB


def test_cublas_workspace_defaults_and_config():
    ws = fusedres.memory.cublas_workspace_bytes
    assert ws((9, 0), env={}) == 32 * MiB  # Hopper
    assert ws((10, 0), env={}) == 32 * MiB  # Blackwell
    assert ws((8, 0), env={}) == 8 * MiB + 128 * 1024  # ":4096:2:16:8"
    assert ws((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert ws((8, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8 * MiB + 128 * 1024


def test_expandable_segments_setting_is_read_from_the_environment():
    on = fusedres.memory.expandable_segments_enabled
    assert on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert on({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments: True"})
    assert on({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert not on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not on({})


@pytest.fixture(scope="module")
def resnet164_plan():
    model = models.preact_resnet(164)
    return fusedres.memory.plan(model, (128, 3, 32, 32), 2 ** 30, apply=False)


def test_plan_predicts_reserved_memory(resnet164_plan):
    p = resnet164_plan
    c = p.cuda
    # The replay hands out whole blocks where a split is not worth it, and holds cuBLAS's
    # workspace: at least the 512-byte-block count plus the workspace.
    assert c.allocated >= p.cuda_step.peak_bytes + c.cublas_workspace
    assert c.reserved_expandable >= c.allocated and c.reserved_default >= c.allocated
    # Expandable segments waste less: within one 20 MiB page per pool of the allocated peak
    # plus what fragmentation leaves, and below the default segments here.
    assert c.reserved_expandable < c.reserved_default
    assert c.reserved_expandable - c.allocated < 0.1 * c.allocated
    text = str(p)
    assert "max_memory_reserved" in text and "expandable_segments:True (recommended)" in text
    assert "CUDA context" in text and "an estimate" in text


def test_predict_adds_resident_data_first(resnet164_plan):
    events = resnet164_plan.cuda_step.events
    base = predict(events, env={})
    more = predict(events, resident_bytes=150 * MiB, env={})
    assert more.allocated == base.allocated + 150 * MiB
    assert more.reserved_expandable >= base.reserved_expandable + 150 * MiB - 20 * MiB
    assert not base.expandable and predict(
        events, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).expandable


def test_device_check_warns_when_budget_and_context_exceed_the_device(resnet164_plan):
    c = resnet164_plan.cuda
    budget = 2 * 2 ** 30
    need = budget + c.cudnn_workspace + c.context
    assert c.device_bytes(budget) == need
    assert fusedres.memory.device_fit_warning(c, budget, need) is None
    msg = fusedres.memory.device_fit_warning(c, budget, need - MiB)
    assert msg is not None
    assert "--memory-budget 2.000 GiB" in msg and "CUDA context" in msg and "cuDNN" in msg
    assert "exceeds the device's" in msg
    # No budget (an activation budget only): the predicted reserved memory stands in.
    msg = fusedres.memory.device_fit_warning(c, None, c.reserved)
    assert "predicted max_memory_reserved" in msg


def test_trainer_checks_the_device_before_the_first_step(resnet164_plan, monkeypatch, capsys):
    """The trainer's check with the device's memory injected: a 2 GiB GPU cannot hold a 1 GiB
    budget plus the context when the context is made 1.5 GiB; a 80 GiB one can."""
    run = types.SimpleNamespace(plan_summary=resnet164_plan, memory_budget=2 ** 30)
    assert Run._device_fit(run, 80 * 2 ** 30) is None
    monkeypatch.setattr(resnet164_plan.cuda, "context", 1536 * MiB)
    warning = Run._device_fit(run, 2 * 2 ** 30)
    assert warning is not None and "exceeds the device's 2.000 GiB" in warning
    run.plan_summary = types.SimpleNamespace(cuda=None)
    assert Run._device_fit(run, 1) is None


def test_trainer_reports_reserved_beside_the_prediction(resnet164_plan, monkeypatch, capsys):
    """On a GPU the report puts the predicted max_memory_reserved beside the measured one
    (torch.cuda's figures injected)."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1000 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 1100 * MiB)
    run = types.SimpleNamespace(plan_summary=resnet164_plan, device=torch.device("cuda", 0),
                                live=None, memory_budget=2 ** 30, cfg={"memory_budget": "1GiB"},
                                rss_baseline=None, rss_peaks=None, rss_pre_step=None,
                                rss_setup_peak=None,
                                rss_peak_since_pre_step=False, allocator=None,
                                device_warning=None)
    report = Run._memory_report(run)
    err = capsys.readouterr().err
    c = resnet164_plan.cuda
    assert report["predicted_peak_bytes"] == c.allocated
    assert report["predicted_cuda_reserved_bytes"] == c.reserved
    assert report["measured_cuda_reserved_bytes"] == 1100 * MiB
    assert "max_memory_reserved predicted" in err and "; measured 1.1 GiB" in err
