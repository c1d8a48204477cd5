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
    Setting("FUSEDRES_CUDA_KERNELS", "choice", "native", "at every cuda-backend op call",
            "The cuda backend's convolution kernels: `native` (csrc/cuda's own) or `cutlass` "
            "(csrc/cuda/cutlass_conv: CUTLASS implicit-GEMM forward with the BatchNorm-ReLU in "
            "the main loop, and weight gradient of the activation the native data gradient "
            "writes, for float16/bfloat16 channels-last operands "
            "with C and Co multiples of 8, the weight gradient for filters larger than 1x1 in "
            "a backward that computes the data gradient too; "
            "every other input keeps the native kernels). "
            "Opt-in until a GPU self-test has passed them. `cutlass` where the build has no "
            "CUTLASS kernels, or on the CPU execution layer, is an error naming this variable.",
            ("native", "cutlass")),
    Setting("FUSEDRES_CPU_TILE_BYTES", "int", "",
            "at every cpu-backend call (csrc/cpu), and by the memory accounting through "
            "`fusedres._C`'s `cpu_tile_samples`",
            "Bytes of activation + output per tile of the cpu backend; unset: 4 MiB per thread "
            "(16 MiB per thread and 32 MiB at least for channels_last inputs); 0 or less: the "
            "whole batch in one tile."),
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


# nvcc flags of the CUTLASS kernels and of the files that call them (every .cu of a build that
# has them): the switch that compiles the calls, and the constexpr use CUTLASS's host-device code
# needs. setup.py builds with them and tools/cuda_aot compiles its table with them.
CUTLASS_NVCC_FLAGS = ("-DFUSEDRES_WITH_CUTLASS", "--expt-relaxed-constexpr")


def cutlass_include_dir(environ=None) -> str | None:
    """The CUTLASS headers the cuda backend's CUTLASS kernels compile against (the folder
    holding ``cutlass/cutlass.h``): ``$CUTLASS_PATH/include`` (a CUTLASS checkout, the variable
    CUTLASS's own tools read), else the installed ``nvidia-cutlass`` package's
    ``cutlass_library/source/include``, found without importing it (its import needs
    cuda-python); ``None`` when neither has them."""
    import importlib.util

    environ = os.environ if environ is None else environ
    candidates = []
    if environ.get("CUTLASS_PATH"):
        candidates.append(os.path.join(environ["CUTLASS_PATH"], "include"))
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(os.path.join(folder, "source", "include"))
    for inc in candidates:
        if os.path.isfile(os.path.join(inc, "cutlass", "cutlass.h")):
            return os.path.abspath(inc)
    return None


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
    sets = _extension.cuda_kernel_sets()
    return (f"cpu capability: {_extension.describe_cpu_capability()}\n"
            f"cuda kernel sets built (FUSEDRES_CUDA_KERNELS): {', '.join(sets) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    """``fusedres settings``: the table, then the variables set in this environment and the
    value each is read as (exit 2 when one is malformed), then the CPU capability the cpu
    backend's kernels run with here (FUSEDRES_CPU_CAPABILITY's effect) and the cuda backend's
    kernel sets this build has (FUSEDRES_CUDA_KERNELS's choices)."""
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
