"""Every ``FUSEDRES_*`` environment variable: its type, default, when it is read, what it does.

The one place they are declared. Python code reads them through :func:`get` (which parses and
checks the value, naming the variable in the error); the C++ kernels read theirs with
``std::getenv`` at the moment this table says; ``setup.py`` loads this file by path (it needs no
torch). ``fusedres settings`` prints the table that docs/settings.md carries
(tests/test_layout.py checks that every variable the sources read is declared here and that the
docs' table is this one).

This module imports nothing from fusedres or torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SETTINGS", "Setting", "get", "main", "markdown_table"]


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # "choice", "bool", "int" or "str"
    default: str  # as written in the environment; "" means unset
    read: str  # when the value is read
    what: str
    choices: tuple[str, ...] = ()

    def parse(self, raw: str):
        value = raw.strip()
        if self.kind == "choice":
            if value.lower() not in self.choices:
                raise ValueError(f"{self.name}: expected one of {', '.join(self.choices)}, "
                                 f"got {raw!r}")
            return value.lower()
        if self.kind == "bool":
            if value not in ("0", "1"):
                raise ValueError(f"{self.name}: expected 0 or 1, got {raw!r}")
            return value == "1"
        if self.kind == "int":
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{self.name}: expected an integer, got {raw!r}") from None
        return value


_BACKENDS = ("auto", "reference", "portable", "cpu", "triton", "cuda")

SETTINGS: dict[str, Setting] = {s.name: s for s in (
    # ---- selection and behaviour (Python)
    Setting("FUSEDRES_BACKEND", "choice", "auto", "when fusedres is imported",
            "The backend in force when neither `use_backend` nor `set_backend` says otherwise.",
            _BACKENDS),
    Setting("FUSEDRES_CUDA_ON_CPU", "bool", "0",
            "when fusedres.backends.cuda is imported (with fusedres)",
            "Run the cuda backend on CPU tensors: the CUDA kernels compiled by the host "
            "compiler through the CPU execution layer (csrc/cuda/on_cpu) into the test extension "
            "`fusedres._C_cuda_on_cpu` (a test vehicle, never picked by auto; `make test` builds "
            "it)."),
    Setting("FUSEDRES_TRITON_BACKWARD", "choice", "auto", "at every triton backward call",
            "The Triton backward's plan: `sums` (the weight-gradient pass also reduces the "
            "BatchNorm sums, then one pass writes dx), `store` (dz stored in the x gradient's "
            "buffer, then an elementwise pass turns it into dx; no more memory), `auto` (the "
            "lower modeled H100 time per shape: `store` on wide units).",
            ("sums", "store", "auto")),
    Setting("FUSEDRES_TRITON_AUTOTUNE", "bool", "0", "at every Triton kernel launch",
            "Time every config of a kernel once per shape key and keep the fastest (else the "
            "config is chosen by rule)."),
    Setting("FUSEDRES_RELEASE_FREED_MEMORY", "bool", "1",
            "when `fusedres train` sets up a CPU run with --memory-budget, and by "
            "`fusedres.memory.plan(..., process=True)`",
            "Tell glibc's malloc to return freed blocks to the system "
            "(`fusedres.memory.release_freed_memory`), so that the budget bounds the process's "
            "resident set; 0: leave the allocator as it is."),
    # ---- kernel tuning, read by the C++ kernels (csrc/)
    Setting("FUSEDRES_CPU_CAPABILITY", "choice", "auto",
            "once, when `fusedres._C` is loaded (importing fusedres)",
            "The instruction set of the cpu backend's kernels (compiled once per capability "
            "into `fusedres._C`): `auto`, the best this CPU supports; `baseline` (x86-64-v2), "
            "`avx2` (AVX2 + FMA) or `avx512` (AVX-512 F/BW/DQ/VL) pins one. A pinned "
            "capability this CPU or build lacks makes the cpu backend unavailable, with the "
            "reason (no silent fallback: a pin says which code a run means to test). "
            "`fusedres settings` and `fusedres.cpu_capability()` say which is in use.",
            ("auto", "baseline", "avx2", "avx512")),
    Setting("FUSEDRES_CPU_TILE_BYTES", "int", "",
            "at every cpu-backend call (csrc/cpu), and by the memory accounting through "
            "`fusedres._C`'s `cpu_tile_samples`",
            "Bytes of activation + output per tile of the cpu backend; unset: 4 MiB per thread "
            "(16 MiB per thread and 32 MiB at least for channels_last inputs); 0 or less: the "
            "whole batch in one tile."),
    Setting("FUSEDRES_CPU_TILE_WEIGHT_X", "int", "4", "at every cpu-backend call (csrc/cpu)",
            "A tile's budget is at least this many times the weight's bytes."),
    Setting("FUSEDRES_CPU_CONV_NHWC", "choice", "", "at every cpu-backend call (csrc/cpu)",
            "`0`: convolve tiles in x's layout; `1`: always NHWC; unset: NHWC for spatial "
            "kernels on maps of at least 8x8 at stride 2 or under 48 input channels.", ("0", "1")),
    Setting("FUSEDRES_CPU_GEMM_1X1", "bool", "1", "at every cpu-backend call (csrc/cpu)",
            "Run stride-1 unpadded 1x1 convolutions as GEMMs (NCHW tiles: batched, one per "
            "sample; channels_last tiles: one per tile)."),
    Setting("FUSEDRES_CPU_GEMM_STRIDED", "bool", "1", "at every cpu-backend call (csrc/cpu)",
            "Run a strided unpadded 1x1 convolution that shares its BatchNorm-ReLU with another "
            "convolution (a projection shortcut beside conv1) as GEMMs on the pixels it reads, "
            "on channels_last tiles (pixel rows) and NCHW ones (channel-major, one GEMM a "
            "tile); 0: oneDNN's convolution (FUSEDRES_CPU_GEMM_1X1=0 turns both GEMM routes "
            "off)."),
    Setting("FUSEDRES_CPU_CHUNK_BYTES", "int", "262144", "at every cpu-backend call (csrc/cpu)",
            "Bytes of activation + output rows per pixel chunk of a channels_last 1x1 unit "
            "(the GEMM route: one convolution, or a pair's two) whose weights are no larger: "
            "each thread computes its chunks' activation and runs their GEMMs in its own "
            "cache; 0 or less: batch tiles (FUSEDRES_CPU_TILE_BYTES) instead."),
    Setting("FUSEDRES_CPU_GW_T", "choice", "", "at every cpu-backend call (csrc/cpu)",
            "The channels_last GEMM route's weight gradient accumulated as `0`: gw += go^T @ a; "
            "`1`: gw^T += a^T @ go; unset: gw^T for widening 1x1 convolutions (fewer input "
            "than output channels), gw otherwise.", ("0", "1")),
    Setting("FUSEDRES_CUDA_BACKWARD", "choice", "sums", "at every cuda backward call (csrc/cuda)",
            "The CUDA backward's plan: `sums` or `store` (as FUSEDRES_TRITON_BACKWARD).",
            ("sums", "store")),
    Setting("FUSEDRES_CUDA_FORWARD", "choice", "mma", "at every cuda forward call (csrc/cuda)",
            "The CUDA forward's kernel for 16-bit channels-last inputs: `mma` (mma.sync + "
            "ldmatrix + cp.async) or `wmma` (the older WMMA kernel, which every other input "
            "uses).", ("mma", "wmma")),
    Setting("FUSEDRES_CUDA_FORWARD_TILE", "choice", "", "at every cuda forward call (csrc/cuda)",
            "The mma.sync forward's tile: `64` (64 x 64, 2 x 2 warps of 32 x 32) or `128` "
            "(128 x 64, 4 x 1 warps of 32 x 64); unset: 128 where its tiles fill every SM at "
            "least once, else 64.", ("64", "128")),
    Setting("FUSEDRES_CUDA_DGRAD", "choice", "mma", "at every cuda backward call (csrc/cuda)",
            "The CUDA data gradient's kernel for 16-bit channels-last x and grad_out with C and "
            "Co multiples of 8 and at most 64 taps: `mma` (mma.sync + ldmatrix + cp.async) or "
            "`wmma` (the older WMMA kernel, which every other input uses).", ("mma", "wmma")),
    Setting("FUSEDRES_CUDA_DGRAD_TILE", "choice", "", "at every cuda backward call (csrc/cuda)",
            "The mma.sync data gradient's tile: `64` (64 x 64, 2 x 2 warps of 32 x 32) or `128` "
            "(128 x 64, 4 x 1 warps of 32 x 64); unset: 128 where its tiles over every stride "
            "phase fill every SM at least once, else 64.", ("64", "128")),
    Setting("FUSEDRES_CUDA_WGRAD", "choice", "mma", "at every cuda backward call (csrc/cuda)",
            "The CUDA weight gradient's kernel for 16-bit channels-last x and grad_out with C "
            "and Co multiples of 8: `mma` (mma.sync + ldmatrix + cp.async) or `wmma` (the older "
            "WMMA kernel, which every other input uses).", ("mma", "wmma")),
    Setting("FUSEDRES_CUDA_WGRAD_SPLIT", "int", "", "at every cuda backward call (csrc/cuda)",
            "Force the weight gradient's split-K count; unset: sized to the SMs."),
    Setting("FUSEDRES_HOST_STACK_KB", "int", "256",
            "once, at the first launch of the CUDA-on-CPU layer (csrc/cuda/on_cpu)",
            "Stack size of each emulated CUDA thread (a fibre), in KiB."),
    # ---- build (setup.py)
    Setting("FUSEDRES_BUILD_EXT", "choice", "auto", "by setup.py",
            "`auto`: build `fusedres._C` when a C++ compiler is found (a failed build warns and "
            "installs Python-only); `1`: a failure is an error; `0`: Python-only. The Makefile "
            "sets 1.",
            ("auto", "0", "1")),
    Setting("FUSEDRES_BUILD_CUDA", "choice", "auto", "by setup.py",
            "Build the nvcc copy of csrc/cuda into `fusedres._C`: `auto` when nvcc is found and "
            "torch has CUDA. The Makefile sets `auto` where `nvidia-smi -L` sees a GPU, else `0`.",
            ("auto", "0", "1")),
    Setting("FUSEDRES_BUILD_TEST_EXT", "choice", "0", "by setup.py",
            "Build the test extension `fusedres._C_cuda_on_cpu` (csrc/cuda compiled by the host "
            "compiler through the execution layer, and the layer's own test ops): `auto` for "
            "in-place builds; `make test` and CI build it, `pip install .` does not.",
            ("auto", "0", "1")),
    # ---- benchmarks (benchmarks/)
    Setting("FUSEDRES_BENCH_QUICK", "bool", "0", "when benchmarks/ is collected",
            "Tiny shapes and few rounds, so CI can smoke-run every benchmark file."),
    Setting("FUSEDRES_BENCH_THREADS", "int", "", "when benchmarks/ is collected",
            "torch's thread count for the benchmark run; unset: torch's default."),
    Setting("FUSEDRES_BENCH_COMPILE", "bool", "1", "when benchmarks/ is collected",
            "Include the torch.compile rows."),
    # ---- the op fuzzer's child processes (tools.opfuzz), set by its parent
    Setting("FUSEDRES_OPFUZZ_PLANT", "bool", "0", "when an opfuzz child process starts",
            "Register the planted-fault namespace the fuzzer's own test calls."),
    Setting("FUSEDRES_ASAN_EXTENSION", "str", "", "when an opfuzz child process starts",
            "The AddressSanitizer build of `fusedres._C` the child loads in place of the "
            "regular one (`make asan`); unset: the regular build."),
)}


# os.environ's own store (CPython: a dict of encoded names to encoded values, which setting or
# deleting through os.environ keeps current), read by get() without os.environ's Python-level
# mapping methods: the eager routes read settings at every step, ~4 Python calls each that way.
_STORE = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
if not (isinstance(_STORE, dict) and callable(_ENCODE)):
    _STORE = None
_ENCODED: dict[str, object] = {}
_PARSED: dict[tuple, object] = {}  # (name, raw value) -> the value parsed from it
_UNSET = object()


def get(name: str, environ=None):
    """The value of setting ``name`` from the environment, parsed; its default when unset
    (``None`` for a setting whose default is unset). Raises ``ValueError`` naming the
    variable for a value of the wrong form, ``KeyError`` for an undeclared name."""
    if environ is None and _STORE is not None:
        key = _ENCODED.get(name)
        if key is None:
            SETTINGS[name]  # noqa: B018 (KeyError for an undeclared name)
            key = _ENCODED[name] = _ENCODE(name)
        memo = (name, _STORE.get(key))
        value = _PARSED.get(memo, _UNSET)
        if value is _UNSET:
            value = _PARSED[memo] = _parse(name, os.environ.get(name))
        return value
    return _parse(name, (os.environ if environ is None else environ).get(name))


def raw_lookup(*names: str) -> tuple:
    """``(get, keys)`` with ``tuple(map(get, keys))`` the raw values of the settings ``names``
    in the environment now: a cache key for what those settings decide (a launch plan), read
    with no Python frame on CPython (os.environ's own store), os.environ's mapping elsewhere."""
    for name in names:
        SETTINGS[name]  # noqa: B018 (KeyError for an undeclared name)
    if _STORE is None:
        return os.environ.get, names
    return _STORE.get, tuple(_ENCODE(n) for n in names)


def _parse(name: str, raw):
    setting = SETTINGS[name]
    if raw is None or raw == "":
        return None if setting.default == "" else setting.parse(setting.default)
    return setting.parse(raw)


def markdown_table() -> str:
    """The table of settings in docs/settings.md."""
    rows = ["| variable | values | default | read | what it does |",
            "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        values = ("/".join(s.choices) if s.kind == "choice"
                  else {"bool": "0/1", "int": "integer", "str": "text"}[s.kind])
        rows.append(f"| `{s.name}` | {values} | {s.default or 'unset'} | {s.read} | {s.what} |")
    return "\n".join(rows)


def _cpu_capability_line() -> str:
    # Imports fusedres (and torch) here only: the module itself imports neither.
    try:
        from fusedres.ops import _extension
    except Exception as exc:  # noqa: BLE001 - the table is printed whatever the library's state
        return f"cpu capability: unknown (importing fusedres failed: {exc})"
    return f"cpu capability: {_extension.describe_cpu_capability()}"


def main(argv: list[str] | None = None) -> int:
    """``fusedres settings``: the table, then the variables set in this environment and the
    value each is read as (exit 2 when one is malformed), then the CPU capability the cpu
    backend's kernels run with here (FUSEDRES_CPU_CAPABILITY's effect)."""
    print(markdown_table())
    status = 0
    for name in SETTINGS:
        if name in os.environ:
            try:
                print(f"{name}={os.environ[name]!r}: read as {get(name)!r}")
            except ValueError as exc:
                print(f"error: {exc}")
                status = 2
    print(_cpu_capability_line())
    return status


if __name__ == "__main__":
    raise SystemExit(main())
