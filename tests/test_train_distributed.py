"""Synchronised BatchNorm (fusedres.distributed) and DistributedDataParallel training.

Two real processes with the gloo backend on CPU; each holds half of a batch, and every result
(outputs, input and parameter gradients, running statistics, trained weights) must equal one
process holding the whole batch.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import fusedres
from fusedres import distributed as fdist
from fusedres.modules import PreActBasicBlock

WORLD = 2
N_LOCAL, C_IN, C_OUT, H = 2, 5, 17, 7   # awkward on purpose
# float32 sums in a different order across processes: measured max error ~1e-6.
ATOL, RTOL = 2e-5, 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_block(fused: bool) -> nn.Module:
    torch.manual_seed(0)
    block = PreActBasicBlock(C_IN, C_OUT, stride=2, fused=fused)
    with torch.no_grad():  # non-trivial BN parameters
        for m in block.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return block.double()


def _make_normact() -> nn.Module:
    """timm's norm-act layer (BatchNorm, dropout, ReLU in one module) between two convolutions."""
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(C_IN, 6, 3, padding=1), BatchNormAct2d(6),
                        nn.Conv2d(6, C_OUT, 3, stride=2, padding=1))
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net.double()


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * N_LOCAL, C_IN, H, H, generator=g, dtype=torch.float64) * 2 + 0.5
    gy = torch.randn(WORLD * N_LOCAL, C_OUT, 4, 4, generator=g, dtype=torch.float64)
    return x, gy


def _step(block, x, gy, steps=2):
    """Two forward/backward passes (running stats move twice); returns what is compared."""
    outs = []
    for _ in range(steps):
        xi = x.clone().requires_grad_()
        y = block(xi)
        (y * gy).sum().backward()
        outs.append((y.detach(), xi.grad))
    grads = {k: p.grad.clone() for k, p in block.named_parameters()}
    buffers = {k: b.clone() for k, b in block.named_buffers()}
    return outs, grads, buffers


def _worker(rank, port, fused, convert, backend, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        if convert == "torch":  # nn.SyncBatchNorm modules are routed to the same sync
            block = nn.SyncBatchNorm.convert_sync_batchnorm(_make_block(fused))
        elif convert == "normact":
            block = fdist.convert_sync_batchnorm(_make_normact())
        else:
            block = fdist.convert_sync_batchnorm(_make_block(fused))
        x, gy = _inputs()
        sl = slice(rank * N_LOCAL, (rank + 1) * N_LOCAL)
        with fusedres.use_backend(backend):
            outs, grads, buffers = _step(block, x[sl], gy[sl])
        for g in grads.values():  # sum of the processes' parameter gradients
            dist.all_reduce(g)
        torch.save((outs, grads, buffers), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _assert_each_rank_matches(results: dict, reference) -> None:
    """Each rank's outputs and input gradients equal its slice of the one-process run's; its
    parameter gradients (summed over the ranks) and buffers equal the one-process run's."""
    ref_outs, ref_grads, ref_buffers = reference
    for rank in range(WORLD):
        outs, grads, buffers = results[rank]
        sl = slice(rank * N_LOCAL, (rank + 1) * N_LOCAL)
        for (y, gx), (ry, rgx) in zip(outs, ref_outs):
            torch.testing.assert_close(y, ry[sl], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(gx, rgx[sl], atol=ATOL, rtol=RTOL)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], atol=ATOL, rtol=RTOL, msg=k)
        for k in ref_buffers:
            torch.testing.assert_close(buffers[k], ref_buffers[k], atol=ATOL, rtol=RTOL, msg=k)


# The CPU fused backends (Triton's interpreter is too slow for this; its op contract is the same).
_CPU_FUSED = [b for b in ("portable", "cpu") if b in fusedres.available_backends("cpu")]
_CASES = ([(True, "fusedres", b) for b in _CPU_FUSED]
          + [(False, "fusedres", "reference"), (True, "torch", "portable")])


@pytest.mark.parametrize("fused, convert, backend", _CASES,
                         ids=[f"{'fused' if f else 'plain'}-{c}-{b}" for f, c, b in _CASES])
def test_sync_batch_norm_equals_one_process_with_whole_batch(fused, convert, backend, tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, fused, convert, backend, str(tmp_path)))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)}

    block = _make_block(fused=False)  # the oracle: plain BatchNorm on the whole batch
    x, gy = _inputs()
    _assert_each_rank_matches(results, _step(block, x, gy))


def test_a_norm_act_layer_keeps_its_activation_across_two_processes(tmp_path):
    """timm's BatchNormAct2d converted keeps its ReLU (and dropout), its statistics synchronised:
    two processes with half the batch each give the one process's outputs, gradients and
    running statistics (converted to a plain synchronised BatchNorm, the ReLU was lost)."""
    pytest.importorskip("timm")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, False, "normact", "reference",
                                               str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)}
    _assert_each_rank_matches(results, _step(_make_normact(), *_inputs()))


def test_conversion_keeps_a_norm_act_layer_and_refuses_an_unknown_subclass():
    pytest.importorskip("timm")
    net = fdist.convert_sync_batchnorm(_make_normact())
    assert type(net[1]) is fdist.SyncBatchNormAct2d and isinstance(net[1].act, nn.ReLU)
    assert net.state_dict().keys() == _make_normact().state_dict().keys()
    x = _inputs()[0]
    torch.testing.assert_close(net(x), _make_normact()(x), atol=0, rtol=0)
    without_act = copy.deepcopy(net)
    without_act[1].act = nn.Identity()  # what a plain synchronised BatchNorm computed
    assert (net(x) - without_act(x)).abs().max() > 0.1

    class ScaledBN(nn.BatchNorm2d):  # a forward convert_sync_batchnorm cannot know
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.BatchNorm2d(3), nn.Sequential(ScaledBN(3)))
    with pytest.raises(TypeError, match=r"module: 1\.0 is a .*ScaledBN, a BatchNorm2d subclass"):
        fdist.convert_sync_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm2d  # refused before anything was replaced


def test_single_process_sync_batch_norm_is_plain_batch_norm():
    block = _make_block(fused=True)
    synced = fdist.convert_sync_batchnorm(copy.deepcopy(block))
    assert all(isinstance(m, fdist.SyncBatchNorm2d) for m in synced.modules()
               if isinstance(m, nn.BatchNorm2d))
    assert synced.state_dict().keys() == block.state_dict().keys()
    x, gy = _inputs()
    a = _step(block, x, gy)
    b = _step(synced, x, gy)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# --------------------------------------------------------------------------- torchrun

DDP_ARGS = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "8", "--max-iters",
            "6", "--threads", "1", "--pad", "1", "--no-progress", "--warmup-iters", "2",
            "--log-every", "3", "--batch-size", "64", "--seed", "5"]


def _train(out, *extra, nproc=1):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                 "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
                if nproc > 1 else [sys.executable])
    proc = subprocess.run([*launcher, "-m", "fusedres.apps.train", *DDP_ARGS, "--out", str(out),
                           *extra], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    from fusedres.apps.train import checkpoint as ckpt
    return ckpt.load(ckpt.latest(out))


def test_torchrun_two_processes_with_sync_bn_equal_one_process(tmp_path):
    one = _train(tmp_path / "one", "--sync-bn")
    two = _train(tmp_path / "two", "--sync-bn", nproc=2)
    assert two["world_size"] == 2 and two["iteration"] == 6
    for k, v in one["model"].items():
        if v.is_floating_point():  # float32 sums in another order: measured max 2.4e-7
            torch.testing.assert_close(two["model"][k], v, atol=1e-5, rtol=1e-4, msg=k)
        else:
            assert torch.equal(two["model"][k], v), k
    # Without --sync-bn each process normalises its half-batch: the statistics differ.
    local = _train(tmp_path / "local", nproc=2)
    diff = max((local["model"][k] - v).abs().max().item()
               for k, v in one["model"].items() if k.endswith("running_var"))
    assert diff > 1e-3


def test_torchrun_gradient_accumulation_equals_one_process(tmp_path):
    """--accum-steps under DistributedDataParallel (no_sync on all but the last micro-batch):
    two processes of 32 images in 2 micro-batches of 16 each are one process's 64 in 4
    micro-batches of 16, the same micro-batches in the same order (each process holds a
    contiguous half of the batch), so the same weights; the running statistics are not
    compared (each process updates its own from its micro-batches)."""
    one = _train(tmp_path / "one", "--accum-steps", "4")
    two = _train(tmp_path / "two", "--accum-steps", "2", nproc=2)
    assert two["world_size"] == 2 and two["iteration"] == 6
    assert two["config"]["accum_steps"] == 2
    for k, v in one["model"].items():
        if "running" in k or "num_batches" in k:
            continue
        torch.testing.assert_close(two["model"][k], v, atol=1e-5, rtol=1e-4, msg=k)
