"""``python -m fusedres.apps.demo``: the fused pre-activation unit against plain PyTorch.

Prints forward/backward agreement and saved-activation bytes for every backend that runs here,
on the units of a CIFAR ResNet-164 (small batch so it runs in seconds on a laptop CPU).
"""

from __future__ import annotations

import argparse
import time

import torch

import fusedres
from fusedres.memory import saved_bytes

UNITS = [
    ("bottleneck 64->16->64 @32x32", lambda f: fusedres.PreActBottleneck(64, 16, fused=f), 64, 32),
    ("bottleneck 64->32->128 /2", lambda f: fusedres.PreActBottleneck(64, 32, 2, fused=f), 64, 32),
    ("basic 16->16 @32x32", lambda f: fusedres.PreActBasicBlock(16, 16, fused=f), 16, 32),
]


def _grads(block, x):
    x = x.clone().requires_grad_()
    y = block(x)
    y.backward(torch.ones_like(y))
    return y.detach(), [x.grad] + [p.grad for p in block.parameters()]


def _max_rel_err(a, b):
    return max(((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item() for p, q in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusedres demo", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error("--batch: expected at least 2 (BatchNorm needs more than one value)")
    backends = [b for b in fusedres.available_backends("cpu") if b != "reference"]
    print(f"fusedres {fusedres.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; backends here: {', '.join(backends)}")
    header = f"{'unit':32} {'backend':9} {'max rel err fwd':>15} {'bwd':>9} " \
             f"{'saved MiB':>10} {'plain MiB':>10} {'ratio':>6} {'fwd+bwd ms':>10}"
    print(header)
    print("-" * len(header))
    for name, make, c, hw in UNITS:
        torch.manual_seed(0)
        plain = make(False)
        x = torch.randn(args.batch, c, hw, hw)
        y_ref, g_ref = _grads(plain, x)
        plain.zero_grad()
        plain_bytes = saved_bytes(plain, x.requires_grad_())
        for backend in backends:
            fused = make(True)
            fused.load_state_dict(plain.state_dict())
            with fusedres.use_backend(backend):
                _grads(fused, x)  # warm-up
                fused.zero_grad()
                t0 = time.perf_counter()
                y, g = _grads(fused, x.detach())
                ms = (time.perf_counter() - t0) * 1e3
                fused_bytes = saved_bytes(fused, x)
            print(f"{name:32} {backend:9} {_max_rel_err([y], [y_ref]):15.1e} "
                  f"{_max_rel_err(g, g_ref):9.1e} {fused_bytes / 2**20:10.2f} "
                  f"{plain_bytes / 2**20:10.2f} {fused_bytes / plain_bytes:6.2f} {ms:10.1f}")
    print("\nsaved = bytes autograd keeps between forward and backward "
          "(fusedres.memory.saved_bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
