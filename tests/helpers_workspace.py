"""Run by tests/test_memory.py in a subprocess (MALLOC_MMAP_THRESHOLD_ fixed): the peak resident
memory one fused-op call adds beyond its outputs, against the predicted workspace. Prints
``op NAME LAYOUT PREDICTED MEASURED`` per call."""

import itertools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fusedres
from fusedres.memory.accounting import cpu_op_workspace_bytes


def resident():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


class Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if cpu_op_workspace_bytes(func, args):
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


torch.manual_seed(0)
# (N, C, Co, H, kernel, stride): 3x3 NHWC tiles, 1x1 GEMM tiles, a strided 1x1, tiny tiles; x
# and the unit NCHW, then channels_last.
SHAPES = [(64, 64, 64, 32, 3, 1), (32, 64, 16, 32, 1, 1), (16, 256, 128, 32, 1, 2),
          (8, 16, 16, 32, 3, 1), (128, 64, 64, 16, 3, 2)]
for fmt, (n, c, co, h, k, s) in itertools.product((torch.contiguous_format,
                                                   torch.channels_last), SHAPES):
    unit = fusedres.BNReLUConv2d(c, co, k, padding=k // 2, stride=s).to(memory_format=fmt)
    x = torch.randn(n, c, h, h).contiguous(memory_format=fmt).requires_grad_()
    unit(x).sum().backward()  # warm-up (oneDNN primitive caches)
    rec = Record()
    with rec:
        unit(x).sum().backward()
    for func, args in rec.calls:
        reset_peak()
        before, _ = resident()
        out = func(*args)
        _, peak = resident()
        outputs = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor))
        del out
        print("op", func.__name__, "nchw" if fmt == torch.contiguous_format else "cl",
              cpu_op_workspace_bytes(func, args), peak - before - outputs)
