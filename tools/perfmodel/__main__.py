"""``python -m tools.perfmodel``: the GPU performance model's report (MODELED figures).

--out PATH writes the markdown there (benchmarks/GPU_MODEL.md); --quick models one CIFAR and
one ImageNet unit in fp16 only; --no-calibration skips the GEMM calibration; --cuda adds the
CUDA C++ kernels' SASS (nvcc compiles csrc/cuda: ~4 minutes on 2 cores). --cuda-only rewrites
only the CUDA C++ section of the existing --out file (from its "## CUDA C++ kernels" heading to
the end): the nvcc compile and the plain sequence's model, no Triton compile; the rest of the
file, its header included, is kept as it was.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.perfmodel",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--dtype", nargs="+", default=["fp16", "bf16", "fp32"],
                    choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--quick", action="store_true", help="two units, fp16")
    ap.add_argument("--no-calibration", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="the CUDA C++ kernels' SASS too")
    ap.add_argument("--cuda-only", action="store_true",
                    help="rewrite only the CUDA C++ section of the --out file")
    args = ap.parse_args(argv)
    if args.cuda_only:
        return _cuda_only(args.out)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("tools.perfmodel: unset TRITON_INTERPRET (the kernels must be compiled)",
              file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "0"
    from fusedres.kernels import traffic

    from . import report
    from .calibrate import calibrate
    from .devices import A100, H100
    from .units import model_unit

    t0 = time.perf_counter()
    units = traffic.CIFAR_UNITS + traffic.IMAGENET_UNITS
    dtypes = args.dtype
    if args.quick:
        units, dtypes = [traffic.CIFAR_UNITS[0], traffic.IMAGENET_UNITS[0]], ["fp16"]
    calib = [] if args.no_calibration else calibrate()
    models, store = [], []
    for u in units:
        for dtype in dtypes:
            for dev in (A100, H100):
                models.append(model_unit(u, dtype, dev, backward="sums"))
                store.append(model_unit(u, dtype, dev, backward="store"))
                print(f"modeled {u.name} {dtype} {dev.name}: fused "
                      f"{models[-1].fused_s * 1e6:.1f} us (store plan "
                      f"{store[-1].fused_s * 1e6:.1f}), plain "
                      f"{models[-1].plain_s * 1e6:.1f} us", file=sys.stderr, flush=True)
    cuda = None
    if args.cuda:
        from .cuda_sass import cuda_rows

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            cuda = cuda_rows(root)
        except (FileNotFoundError, RuntimeError) as exc:
            cuda = str(exc)
    command = " ".join(["python -m tools.perfmodel", *(argv if argv is not None
                                                          else sys.argv[1:])])
    text = report.markdown(calib, models, time.perf_counter() - t0, cuda, command, store)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    else:
        print(text)
    return 0


def _cuda_only(path: str | None) -> int:
    from fusedres.kernels import traffic

    from . import report
    from .cuda_sass import cuda_rows
    from .devices import A100, H100
    from .units import plain_step

    heading = "## CUDA C++ kernels"
    if path is None or not os.path.exists(path):
        print("tools.perfmodel: --cuda-only needs --out naming an existing report",
              file=sys.stderr)
        return 2
    text = open(path).read()
    if heading not in text:
        print(f"tools.perfmodel: {path} has no '{heading}' section", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cuda = cuda_rows(root)
    runs = [(u, dtype, dev) for u in traffic.CIFAR_UNITS + traffic.IMAGENET_UNITS
            for dtype in ("fp16", "bf16") for dev in (A100, H100)]
    plain = {(u.name, dtype, dev.arch): sum(t for _, t, _ in plain_step(u, dtype, dev))
             for u, dtype, dev in runs}
    lines = report.cuda_section(cuda, runs, plain)
    with open(path, "w") as f:
        f.write(text[:text.index(heading)] + "\n".join(lines) + "\n")
    print(f"rewrote the CUDA C++ section of {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
