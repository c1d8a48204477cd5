"""Read a cubin's SASS: disassemble (cuobjdump from Triton's wheel), parse each instruction,
split the code into basic blocks, find the loops (backward branches), pick the steady-state
main loop, and count what one of its iterations issues.

Counts are per warp (SASS is the per-thread program; every warp of a CTA issues it), so a CTA
of ``num_warps`` warps issues ``num_warps`` times as many warp instructions. Tensor-core work is
counted per CTA from the instruction shapes:

* ``HMMA.16816`` (sm_80/sm_90 mma.sync m16n8k16, fp16/bf16), ``HMMA.1688``/``HMMA.1684`` (TF32
  m16n8k8 / m16n8k4), ``DMMA.884`` (float64): one warp-level MMA per warp that issues it;
  multiply-adds = m*n*k per warp instruction (PTX ISA, "Matrix shape" of mma.sync).
* ``HGMMA.64xNxK`` (sm_90a wgmma.mma_async): one warpgroup-level MMA, m64nNkK, issued by each
  of the warpgroup's four warps; multiply-adds = 64*N*K per warpgroup (PTX ISA, "Asynchronous
  Warpgroup Level Matrix Multiply-Accumulate", shape m64nNk16 for f16/bf16, m64nNk8 for tf32).

Loops: a branch whose target is at or before it closes a loop spanning the address range
[target, branch] (the layout ptxas emits for the natural loops of Triton and nvcc code); loops
sharing a head are merged. Every instruction in a loop's range counts once per iteration (an
``if`` inside the body is taken as executed: an upper bound on the issue count).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CLASSES = ("tensor", "fp_alu", "int_addr", "conversion", "global_mem", "shared_mem", "control",
           "barrier_wait", "other")

_TENSOR = {"HMMA", "HGMMA", "IMMA", "IGMMA", "DMMA", "BMMA", "BGMMA", "QGMMA", "UTCHMMA",
           "UTCQMMA", "UTCIMMA"}
_FP = {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSET", "FSETP", "FCHK", "FSWZADD", "MUFU",
       "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSET2", "HSETP2", "DADD", "DMUL", "DFMA", "DSETP",
       "DMNMX", "FMUL2", "FADD2", "FFMA2", "FMNMX3", "FADD32I", "FMUL32I", "FFMA32I",
       "HADD2_32I", "HMUL2_32I", "HFMA2_32I"}
_CONV = {"F2F", "F2I", "I2F", "F2FP", "I2FP", "F2IP", "FRND", "I2I", "I2IP", "DFRND"}
_GLOBAL = {"LDG", "STG", "LDGSTS", "LD", "ST", "RED", "REDG", "ATOM", "ATOMG", "UTMALDG",
           "UTMASTG", "UTMAREDG", "UTMAPF", "UBLKCP", "UBLKRED", "UBLKPF", "LDL", "STL", "CCTL",
           "UTMACCTL"}
_SHARED = {"LDS", "STS", "LDSM", "STSM", "ATOMS", "LDTM", "STTM"}
_CONTROL = {"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK", "BMOV",
            "BPT", "KILL", "NOP", "YIELD", "ACQBULK", "ELECT", "PREEXIT", "ACQSHMINIT"}
_BARRIER = {"BAR", "WARPSYNC", "DEPBAR", "LDGDEPBAR", "WARPGROUP", "SYNCS", "MEMBAR", "FENCE",
            "ERRBAR", "ARRIVES", "CGAERRBAR", "UCGABAR_ARV", "UCGABAR_WAIT", "CCTLL", "B2R", "R2B"}
_OTHER = {"SHFL", "VOTE", "VOTEU", "MATCH", "REDUX", "CREDUX", "S2R", "CS2R", "S2UR", "LDC",
          "ULDC", "R2UR", "REDAS"}

# Bytes per thread of a global/shared access by its width modifier (default: 32-bit).
_WIDTH = {"128": 16, "64": 8, "32": 4, "U16": 2, "S16": 2, "U8": 1, "S8": 1}

_LINE = re.compile(
    r"/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?:\{\s*)?(?P<pred>@!?U?P[T0-9]+\s+)?"
    r"(?P<op>[A-Z][A-Z0-9_]*)(?P<mods>(?:\.[A-Za-z0-9_]+)*)\s*(?P<args>[^;]*);")
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")


@dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str
    modifiers: tuple[str, ...]
    operands: str
    predicate: str = ""

    @property
    def text(self) -> str:
        mods = "".join("." + m for m in self.modifiers)
        pred = self.predicate + " " if self.predicate else ""
        return f"{pred}{self.opcode}{mods} {self.operands}".strip()

    @property
    def klass(self) -> str:
        return classify(self)

    def branch_target(self) -> int | None:
        if self.opcode not in ("BRA", "JMP"):
            return None
        m = re.search(r"(?:^|[\s,`(])(0x[0-9a-f]+)\s*\)?\s*$", self.operands)
        return int(m.group(1), 16) if m else None


def classify(ins: Instr) -> str:
    op = ins.opcode
    if op in _TENSOR:
        return "tensor"
    if op in _BARRIER:
        return "barrier_wait"
    if op in _GLOBAL:
        return "global_mem"
    if op in _SHARED:
        return "shared_mem"
    if op in _CONV:
        return "conversion"
    if op in _FP:
        return "fp_alu"
    if op in _CONTROL:
        return "control"
    if op in _OTHER:
        return "other"
    return "int_addr"  # IADD3, IMAD, LEA, SHF, LOP3, ISETP, SEL, MOV, PRMT, U* uniform ops ...


def parse(text: str) -> dict[str, list[Instr]]:
    """SASS text (cuobjdump -sass / nvdisasm) -> instructions per function, in address order."""
    funcs: dict[str, list[Instr]] = {}
    cur: list[Instr] | None = None
    for line in text.splitlines():
        fm = _FUNC.match(line)
        if fm:
            cur = funcs.setdefault(fm.group(1), [])
            continue
        m = _LINE.search(line)
        if m is None:
            continue
        if cur is None:
            cur = funcs.setdefault("", [])
        mods = tuple(x for x in m.group("mods").split(".") if x)
        cur.append(Instr(int(m.group("addr"), 16), m.group("op"), mods,
                         m.group("args").strip(), (m.group("pred") or "").strip()))
    return funcs


# ----------------------------------------------------------------------------- work per instr

def mma_fma(ins: Instr) -> int:
    """Multiply-adds of one tensor instruction, per warp (HMMA/DMMA/IMMA) or per warpgroup
    (HGMMA); 0 for anything else."""
    if ins.opcode == "HGMMA" or ins.opcode.endswith("GMMA"):
        m = re.match(r"(\d+)x(\d+)x(\d+)", ins.modifiers[0] if ins.modifiers else "")
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else 0
    if ins.opcode in ("HMMA", "DMMA", "IMMA", "BMMA") and ins.modifiers:
        m = re.fullmatch(r"(16|8)(8)(\d+)", ins.modifiers[0])
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else 0
    return 0


def mma_kind(ins: Instr) -> str:
    """The tensor-pipe rate class of a tensor instruction: fp16 (fp16/bf16 inputs), tf32, fp64,
    int8."""
    mods = set(ins.modifiers)
    if ins.opcode == "DMMA":
        return "fp64"
    if ins.opcode in ("IMMA", "IGMMA"):
        return "int8"
    if "TF32" in mods:
        return "tf32"
    if ins.opcode == "QGMMA" or mods & {"E4M3", "E5M2"}:
        return "fp8"
    return "fp16"


def mma_is_warpgroup(ins: Instr) -> bool:
    return ins.opcode.endswith("GMMA")


def access_bytes(ins: Instr) -> int:
    """Bytes one thread moves (global or shared) for a load/store; LDSM/STSM: per thread share of
    the warp's 8x8 b16 matrices (x1/x2/x4 -> 4/8/16 bytes)."""
    if ins.opcode in ("LDSM", "STSM"):
        n = next((int(m) for m in ins.modifiers if m in ("2", "4")), 1)
        if any(m.startswith("x") and m[1:].isdigit() for m in ins.modifiers):
            n = next(int(m[1:]) for m in ins.modifiers if m.startswith("x") and m[1:].isdigit())
        return 4 * n
    for m in reversed(ins.modifiers):
        if m in _WIDTH:
            return _WIDTH[m]
    return 4


# ----------------------------------------------------------------------------- control flow

@dataclass
class Loop:
    head: int   # address of the first instruction (the back edge's target)
    tail: int   # address of the backward branch
    children: list[Loop] = field(default_factory=list)
    parent: Loop | None = None

    def contains(self, addr: int) -> bool:
        return self.head <= addr <= self.tail

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else 1 + self.parent.depth


def basic_blocks(code: list[Instr]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each basic block: leaders are the entry, branch
    targets and the instruction after a branch or exit."""
    addr_index = {ins.addr: i for i, ins in enumerate(code)}
    leaders = {0}
    for i, ins in enumerate(code):
        t = ins.branch_target()
        if t is not None and t in addr_index:
            leaders.add(addr_index[t])
        if ins.opcode in ("BRA", "JMP", "BRX", "JMX", "EXIT", "RET", "CALL") and i + 1 < len(code):
            leaders.add(i + 1)
    starts = sorted(leaders)
    return [(s, (starts[k + 1] - 1 if k + 1 < len(starts) else len(code) - 1))
            for k, s in enumerate(starts)]


def find_loops(code: list[Instr]) -> list[Loop]:
    """Loops from backward branches, nested by containment; returns every loop, outermost
    first."""
    spans: dict[int, int] = {}
    for ins in code:
        t = ins.branch_target()
        # t == addr: the `BRA` to itself that pads the code after EXIT, not a loop.
        if t is not None and t < ins.addr:
            spans[t] = max(spans.get(t, t), ins.addr)
    loops = [Loop(h, t) for h, t in sorted(spans.items(), key=lambda s: (s[0], -s[1]))]
    for lp in loops:
        enclosing = [o for o in loops if o is not lp and o.head <= lp.head and lp.tail <= o.tail
                     and (o.tail - o.head) > (lp.tail - lp.head)]
        if enclosing:
            lp.parent = min(enclosing, key=lambda o: o.tail - o.head)
            lp.parent.children.append(lp)
    return loops


# ----------------------------------------------------------------------------- counts

@dataclass
class Counts:
    """What a stretch of code issues, per warp: instructions by class, tensor multiply-adds
    (per warp for warp-level MMAs, per warpgroup for HGMMA, kept apart), bytes per thread."""

    instrs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    mma_warp: dict[str, int] = field(default_factory=dict)       # kind -> m*n*k per warp
    mma_warpgroup: dict[str, int] = field(default_factory=dict)  # kind -> m*n*k per warpgroup
    global_load: int = 0   # bytes per thread (LDG, LDGSTS source)
    global_store: int = 0  # bytes per thread (STG, RED/ATOM)
    shared_load: int = 0   # bytes per thread (LDS, LDSM)
    shared_store: int = 0  # bytes per thread (STS, STSM, LDGSTS destination)
    tma: int = 0           # UTMALDG/UTMASTG instructions (bytes set by the tensor map)
    barriers: int = 0      # BAR.SYNC / BAR.* (CTA barriers)
    waits: int = 0         # DEPBAR, LDGDEPBAR, WARPGROUP.DEPBAR/ARRIVE, SYNCS.*, WARPSYNC
    mma_shapes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.instrs.values())

    def add(self, ins: Instr) -> None:
        k = classify(ins)
        self.instrs[k] += 1
        op = ins.opcode
        if k == "tensor":
            fma = mma_fma(ins)
            kind = mma_kind(ins)
            bucket = self.mma_warpgroup if mma_is_warpgroup(ins) else self.mma_warp
            bucket[kind] = bucket.get(kind, 0) + fma
            shape = f"{op}.{ins.modifiers[0]}" if ins.modifiers else op
            self.mma_shapes[shape] = self.mma_shapes.get(shape, 0) + 1
        elif op in ("UTMALDG", "UTMASTG", "UBLKCP"):
            self.tma += 1
        elif op in ("LDG", "LD"):
            self.global_load += access_bytes(ins)
        elif op == "LDGSTS":
            self.global_load += access_bytes(ins)
            self.shared_store += access_bytes(ins)
        elif op in ("STG", "ST", "RED", "REDG", "ATOM", "ATOMG"):
            self.global_store += access_bytes(ins)
        elif op in ("LDS", "LDSM"):
            self.shared_load += access_bytes(ins)
        elif op in ("STS", "STSM"):
            self.shared_store += access_bytes(ins)
        elif op == "BAR":
            self.barriers += 1
        elif k == "barrier_wait":
            self.waits += 1

    def scaled(self, n: int) -> Counts:
        out = Counts({k: v * n for k, v in self.instrs.items()},
                     {k: v * n for k, v in self.mma_warp.items()},
                     {k: v * n for k, v in self.mma_warpgroup.items()},
                     self.global_load * n, self.global_store * n, self.shared_load * n,
                     self.shared_store * n, self.tma * n, self.barriers * n, self.waits * n,
                     {k: v * n for k, v in self.mma_shapes.items()})
        return out

    def plus(self, other: Counts) -> Counts:
        def merge(a, b):
            return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}
        return Counts(merge(self.instrs, other.instrs), merge(self.mma_warp, other.mma_warp),
                      merge(self.mma_warpgroup, other.mma_warpgroup),
                      self.global_load + other.global_load,
                      self.global_store + other.global_store,
                      self.shared_load + other.shared_load,
                      self.shared_store + other.shared_store, self.tma + other.tma,
                      self.barriers + other.barriers, self.waits + other.waits,
                      merge(self.mma_shapes, other.mma_shapes))


def count(code: list[Instr], lo: int | None = None, hi: int | None = None,
          exclude: list[Loop] = ()) -> Counts:
    """Counts of the instructions with lo <= addr <= hi, outside the ``exclude`` loops."""
    c = Counts()
    for ins in code:
        if lo is not None and ins.addr < lo or hi is not None and ins.addr > hi:
            continue
        if any(lp.contains(ins.addr) for lp in exclude):
            continue
        c.add(ins)
    return c


@dataclass
class KernelSass:
    """One kernel's SASS read: the main loop, its per-iteration counts, the counts of the loop
    enclosing it (outside the main loop: once per outer iteration) and of everything else (once
    per CTA)."""

    name: str
    code: list[Instr]
    loops: list[Loop]
    main: Loop | None
    per_iter: Counts
    outer_own: Counts          # the enclosing loop's body outside the main loop (zero if none)
    rest: Counts               # the rest of the kernel, once per CTA

    @property
    def outer(self) -> Loop | None:
        return self.main.parent if self.main else None


def pick_main_loop(code: list[Instr], loops: list[Loop]) -> Loop | None:
    """The innermost loop carrying tensor-core instructions (no loop inside it carries any;
    the most MMA work among those); without any, the innermost loop moving the most global
    bytes (then the largest). A main loop with loops inside it (nvcc's operand-staging loops
    left rolled) counts their bodies once per iteration: a lower bound on its issue count."""
    if not loops:
        return None
    counts = {id(lp): count(code, lp.head, lp.tail) for lp in loops}

    def mma(lp: Loop) -> int:
        c = counts[id(lp)]
        return sum(c.mma_warp.values()) + 4 * sum(c.mma_warpgroup.values())

    def carriers_inside(lp: Loop) -> bool:
        return any(mma(ch) or carriers_inside(ch) for ch in lp.children)

    tensor = [lp for lp in loops if mma(lp) and not carriers_inside(lp)]
    if tensor:
        return max(tensor, key=lambda lp: (mma(lp), -lp.head))
    inner = [lp for lp in loops if not lp.children]

    def work(lp: Loop) -> tuple:
        c = counts[id(lp)]
        return (c.global_load + c.global_store + 16 * c.tma, c.total, -lp.head)

    return max(inner, key=work)


def analyse(name: str, code: list[Instr]) -> KernelSass:
    loops = find_loops(code)
    main = pick_main_loop(code, loops)
    if main is None:
        return KernelSass(name, code, loops, None, Counts(), Counts(), count(code))
    per_iter = count(code, main.head, main.tail)
    outer = main.parent
    outer_own = count(code, outer.head, outer.tail, [main]) if outer else Counts()
    rest = count(code, exclude=[outer or main])
    return KernelSass(name, code, loops, main, per_iter, outer_own, rest)


# ----------------------------------------------------------------------------- tools

def tool(name: str) -> str:
    """Path of ``cuobjdump``/``nvdisasm``: Triton's wheel (triton/backends/nvidia/bin), then
    $PATH. Raises FileNotFoundError saying where it looked."""
    try:
        import triton
        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    except ImportError:
        cand = None
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(
        f"{name} not found: looked in Triton's wheel ({cand or 'triton not importable'}) and on "
        f"PATH; install triton (its wheel ships {name}) or nvidia-cuda-cuobjdump")


def disassemble(cubin: bytes) -> str:
    """SASS text of a cubin (cuobjdump -sass)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([tool("cuobjdump"), "-sass", str(path)], capture_output=True,
                             text=True, check=False)
    if out.returncode != 0 or "Function" not in out.stdout:
        raise RuntimeError(f"cuobjdump -sass failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def resource_usage(cubin: bytes) -> dict[str, dict[str, int]]:
    """Per function: REG, SHARED (static bytes), LOCAL, STACK from cuobjdump -res-usage."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([tool("cuobjdump"), "-res-usage", str(path)], capture_output=True,
                             text=True, check=False)
    res: dict[str, dict[str, int]] = {}
    name = None
    for line in out.stdout.splitlines():
        m = re.match(r"\s*Function\s+(\S+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            res[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
    return res
