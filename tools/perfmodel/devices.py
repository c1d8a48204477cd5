"""The two GPUs the model runs on, from their public spec sheets.

Sources:

* A100 SXM4: NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), tables 1-3: 108 SMs,
  boost clock 1410 MHz, 312 TFLOP/s dense FP16/BF16 tensor, 156 TF32, 19.5 FP64 tensor,
  40 MB L2, up to 164 KB shared memory per SM (163 KB per block), 64K 32-bit registers,
  2048 threads and 32 blocks per SM; A100 80GB SXM datasheet: 2,039 GB/s HBM2e.
* H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet and Hopper architecture whitepaper (2022):
  132 SMs, 989.4 TFLOP/s dense FP16/BF16 tensor (1,979 with sparsity), 494.7 TF32, 66.9 FP64
  tensor, 3.35 TB/s HBM3, 50 MB L2, 228 KB shared memory per SM (227 KB per block), 64K
  registers, 2048 threads and 32 blocks per SM.
* Per-SM rates: the dense tensor peak divided by (SMs x clock): A100 1024 FP16 multiply-adds
  per clock per SM (4 tensor cores x 256), H100 2048 (4 x 512, "2x A100 per SM clock for clock",
  Hopper whitepaper); TF32 half of FP16. The clock is the one the spec-sheet peak implies
  (peak / (SMs x per-SM rate)): A100 1.41 GHz (its boost clock), H100 1.83 GHz.
* Issue: 4 SM sub-partitions (warp schedulers) per SM, each issuing one warp instruction per
  clock (both whitepapers, "SM architecture").
* Occupancy limits (CUDA C++ Programming Guide, "Compute capabilities" table): registers
  allocated per warp in units of 256, at most 255 per thread; shared memory allocated in units
  of 128 bytes plus 1 KB per block reserved by the system (compute capability 8.0+);
  shared-memory bandwidth 128 bytes per clock per SM (32 banks x 4 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    arch: int                 # compute capability x 10 (80, 90): the cubin's target
    sms: int
    clock_hz: float           # the clock the dense tensor peak implies
    dram_bytes_s: float
    tensor_fma_clk_sm: dict   # dense multiply-adds per clock per SM, by operand kind
    l2_bytes: int
    smem_per_sm: int          # bytes usable by blocks on one SM
    smem_per_block: int       # max dynamic shared memory per block (opt-in)
    regs_per_sm: int = 65536
    max_threads_sm: int = 2048
    max_blocks_sm: int = 32
    schedulers: int = 4
    issue_per_clk: float = 1.0  # warp instructions per scheduler per clock
    smem_bytes_clk: int = 128

    def tensor_peak_flops(self, kind: str = "fp16") -> float:
        return 2 * self.tensor_fma_clk_sm[kind] * self.sms * self.clock_hz


A100 = Device("A100 SXM4 80GB", 80, 108, 1.41e9, 2.039e12,
              {"fp16": 1024, "tf32": 512, "fp64": 64, "int8": 2048, "fp8": 1024},
              40 * 2**20, 164 * 1024, 163 * 1024)
H100 = Device("H100 SXM5", 90, 132, 1.83e9, 3.35e12,
              {"fp16": 2048, "tf32": 1024, "fp64": 128, "int8": 4096, "fp8": 4096},
              50 * 2**20, 228 * 1024, 227 * 1024)
DEVICES = {"a100": A100, "h100": H100}


def device(name: str) -> Device:
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"device: unknown {name!r}; expected one of {sorted(DEVICES)}") from None
