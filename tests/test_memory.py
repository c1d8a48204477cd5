"""Saved-activation accounting: exact byte counts, so they can be asserted."""

import pytest
import torch
import torch.nn as nn

import fusedres
from fusedres.memory import saved_bytes, saved_tensors

UNITS = [
    ("basic", lambda f: fusedres.PreActBasicBlock(16, 16, fused=f), 16),
    ("basic_projection", lambda f: fusedres.PreActBasicBlock(16, 32, stride=2, fused=f), 16),
    ("bottleneck", lambda f: fusedres.PreActBottleneck(64, 16, fused=f), 64),
    ("bottleneck_projection", lambda f: fusedres.PreActBottleneck(64, 32, stride=2, fused=f), 64),
]


@pytest.mark.parametrize("name,make,c", UNITS, ids=[u[0] for u in UNITS])
def test_fused_unit_saves_at_most_52_percent_of_plain(backend, name, make, c):
    x = torch.randn(4, c, 16, 16, requires_grad=True)
    fused, plain = saved_bytes(make(True), x), saved_bytes(make(False), x)
    assert fused <= 0.52 * plain, f"{name}: fused {fused} B vs plain {plain} B"


def test_fused_unit_saves_only_its_input_at_activation_size(backend):
    """BNReLUConv2d keeps x and per-channel vectors; never relu(bn(x)) or bn(x)."""
    x = torch.randn(4, 8, 10, 10, requires_grad=True)
    unit = fusedres.BNReLUConv2d(8, 8, 3, padding=1)
    big = [s for s in saved_tensors(unit, x) if s.storage_bytes >= x.numel() * 4]
    assert big == [fusedres.memory.SavedTensor(tuple(x.shape), torch.float32, x.numel() * 4)]
    # The plain twin keeps three tensors of that size (x, bn(x) is not kept, relu(bn(x)) is).
    plain = nn.Sequential(unit.bn, nn.ReLU(), unit.conv)
    big_plain = [s for s in saved_tensors(plain, x) if s.storage_bytes >= x.numel() * 4]
    assert len(big_plain) >= 2


def test_saved_bytes_exact_for_known_graph():
    x = torch.randn(3, 5, requires_grad=True)
    # x * x saves x twice (one storage); exp saves its result (3*5*4 bytes).
    assert saved_bytes(lambda t: (t * t).exp(), x) == 2 * 3 * 5 * 4
    # t[:, :2] * t[:, 2:4] saves two views of x's storage: counted once.
    assert saved_bytes(lambda t: t[:, :2] * t[:, 2:4], x) == 3 * 5 * 4


def test_module_parameters_are_not_counted():
    lin = nn.Linear(100, 100, bias=False)
    x = torch.randn(2, 100, requires_grad=True)
    assert saved_bytes(lin, x) == x.numel() * 4


def test_counts_on_meta_equal_real():
    block = fusedres.PreActBottleneck(16, 8, stride=2)
    real = saved_bytes(block, torch.randn(2, 16, 8, 8, requires_grad=True))
    meta = saved_bytes(block.to("meta"), torch.randn(2, 16, 8, 8, device="meta",
                                                      requires_grad=True))
    assert meta == real


def test_live_tensor_tracker_counts_storages_while_alive():
    with fusedres.memory.LiveTensorTracker() as live:
        a = torch.empty(1000)                      # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        view = a[10:20].view(2, 5)                 # same storage as a: not counted again
        del a
        assert live.current_bytes == 8000          # the view keeps a's storage alive
        del view
        c = torch.empty(100)
        assert live.peak_bytes == 8000 and live.current_bytes == 4400
        live.reset_peak()
        d = c * 2
        assert live.peak_bytes == 4800
    del b, c, d


def test_live_tensor_tracker_counts_a_whole_sgd_step():
    net = nn.Linear(100, 10)                       # 4040 bytes of parameters
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 100)                        # 3200 bytes
    with fusedres.memory.LiveTensorTracker() as live:
        live.count(net, opt, x)
        assert live.current_bytes == 4040 + 3200
        net(x).sum().backward()
        opt.step()
    # parameters, their gradients and momentum buffers (4040 each) and x are alive at the end
    assert live.current_bytes == 3 * 4040 + 3200
    assert live.peak_bytes >= live.current_bytes
    with pytest.raises(TypeError, match="count"):
        fusedres.memory.LiveTensorTracker().count("x")
