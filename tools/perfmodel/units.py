"""The fused unit's forward + backward on a device, kernel by kernel, beside the plain
sequence (BatchNorm, ReLU, cuDNN conv, add and their backward passes).

Fused: the Triton launches of launches.unit_launches, each compiled for the device's arch and
modeled from its SASS (model.predict), with DRAM bytes from kernels/traffic.py's per-kernel
model (fused_step; split between the launches of one role by their CTAs), and every PyTorch op
the host launchers run between them (reductions of partials, per-channel vectors) as one
DRAM-bound launch each.

Plain: kernels/traffic.py's unfused_step, each kernel max(bytes / (bandwidth x
DRAM_EFFICIENCY), FLOPs / (tensor peak x TENSOR_SUSTAINED)) + LAUNCH_S: cuDNN's convolution at
the sustained tensor rate the calibration's cuBLAS figures reach (an upper bound on cuDNN, so
the ratio favours the plain sequence), the BatchNorm, ReLU and add passes at DRAM speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusedres.kernels import traffic
from fusedres.kernels._common import cdiv
from fusedres.models.unit_shapes import ConvUnit

from . import model, sass
from .devices import Device
from .launches import HostOp, params, unit_step

ELEM = {"fp16": 2, "bf16": 2, "fp32": 4}
KIND = {"fp16": "fp16", "bf16": "fp16", "fp32": "tf32"}


def conv_unit(u: traffic.Unit) -> ConvUnit:
    return ConvUnit(u.name, u.n, u.c, u.co, u.h, u.k, u.stride, u.residual)


def traffic_unit(u: traffic.Unit, dtype: str) -> traffic.Unit:
    return traffic.Unit(u.name, u.n, u.c, u.h, u.co, u.k, u.stride, u.residual, ELEM[dtype])


def trips(launch) -> model.Trips:
    """Main-loop trips per CTA, from the launch's arguments and each kernel's loop structure:

    * batch_stats_kernel: one loop over its split's row tiles (``tiles_per_split``);
    * bn_relu_conv2d_fwd_kernel: one loop over taps x channel blocks (KH*KW*cdiv(C, BLOCK_K));
    * wgrad_kernel: one loop over its split's pixel blocks (``iters_per_split``);
    * dgrad_kernel: one loop over the taps that feed the launch's stride phase (TIN*TJN, from
      the host's ``phase_taps``) x output-channel blocks (cdiv(Co, BLOCK_K));
    * dx_kernel: no loop;
    * kernels/reductions.py's small kernels, as batch_stats: stats_combine_kernel two passes
      over the row blocks (2*cdiv(rows, BLOCK_R)), bn_prepare_kernel the same (none when it
      merges no partial rows); scale_shift_kernel no loop;
      partials_reduce_kernel one loop over the splits, SPLIT_R a step (weight and bias
      gradient programs) or the sums' partial rows, BLOCK_R a step (the others): the longer,
      max(cdiv(split, SPLIT_R), cdiv(rows, BLOCK_R)).
    """
    a, name = params(launch), launch.fn.__name__
    if name == "batch_stats_kernel":
        return model.Trips(a["tiles_per_split"])
    if name == "bn_relu_conv2d_fwd_kernel":
        return model.Trips(a["KH"] * a["KW"] * cdiv(a["C"], a["BLOCK_K"]))
    if name == "wgrad_kernel":
        return model.Trips(a["iters_per_split"])
    if name == "dgrad_kernel":
        return model.Trips(a["TIN"] * a["TJN"] * cdiv(a["Co"], a["BLOCK_K"]))
    if name in ("dx_kernel", "scale_shift_kernel"):
        return model.Trips(0)
    if name in ("stats_combine_kernel", "bn_prepare_kernel"):
        return model.Trips(2 * cdiv(a["rows"], a["BLOCK_R"]))
    if name == "partials_reduce_kernel":
        return model.Trips(max(cdiv(a["split"], a.get("SPLIT_R", 1)),
                               cdiv(a["rows"], a["BLOCK_R"])))
    raise ValueError(f"trips: no loop structure documented for kernel {name!r}")


# jit_spec's role names -> kernels/traffic.py's kernel names (the DRAM bytes).
TRAFFIC_NAME = {"batch_stats": "batch_stats", "bn_relu_conv2d_fwd": "fwd",
                "wgrad_sums": "wgrad+sums", "wgrad": "wgrad", "dgrad_dx": "dgrad+dx",
                "dgrad_store": "dgrad+sums (dz)", "dx": "dx"}
# Roles traffic.py has no entry for (kernels/reductions.py's, a few vectors or a (split, K)
# matrix each): their DRAM bytes are those of their tensor arguments, each read or written once.
ARGUMENT_BYTES = ("stats_combine", "bn_prepare", "scale_shift", "partials_reduce")


@dataclass
class KernelRow:
    role: str
    cap: object        # kernels.jit_spec.Launch
    comp: object       # kernels.jit_spec.Compiled
    sass: sass.KernelSass
    trips: model.Trips
    pred: model.Prediction


@dataclass
class UnitModel:
    unit: traffic.Unit
    dtype: str
    device: Device
    kernels: list[KernelRow] = field(default_factory=list)
    host: list[HostOp] = field(default_factory=list)
    host_s: float = 0.0
    plain: list[tuple[str, float, str]] = field(default_factory=list)  # (kernel, s, bound)
    backward: str = "sums"

    @property
    def slowest(self) -> KernelRow:
        """The launch with the largest modeled time: what bounds the unit."""
        return max(self.kernels, key=lambda k: k.pred.time_s)

    @property
    def fused_s(self) -> float:
        return sum(k.pred.time_s for k in self.kernels) + self.host_s

    @property
    def plain_s(self) -> float:
        return sum(t for _, t, _ in self.plain)


def _dram_s(nbytes: float, dev: Device) -> float:
    return nbytes / (dev.dram_bytes_s * model.DRAM_EFFICIENCY)


def plain_step(u: traffic.Unit, dtype: str, dev: Device) -> list[tuple[str, float, str]]:
    tu = traffic_unit(u, dtype)
    peak = dev.tensor_peak_flops(KIND[dtype]) * model.TENSOR_SUSTAINED[dev.arch]
    out = []
    for k in traffic.unfused_step(tu).kernels:
        mem, flop = _dram_s(k.bytes, dev), k.flops / peak
        out.append((k.name, max(mem, flop) + model.LAUNCH_S, "tensor" if flop > mem else "dram"))
    return out


def model_unit(u: traffic.Unit, dtype: str, dev: Device, backward: str = "auto") -> UnitModel:
    """The unit's training step with the Triton backward plan ``backward``: "sums", "store", or
    "auto" (the default, as the backend's: the plan kernels/traffic.auto_strategy picks; see
    fusedres.backends.triton.backward_strategy). ``UnitModel.backward`` names the plan."""
    from ..jit_spec import compile_launch

    tu = traffic_unit(u, dtype)
    if backward == "auto":
        backward = traffic.auto_strategy(tu)
    launches, host = unit_step(conv_unit(u), dtype, arch=dev.arch, sms=dev.sms,
                               backward=backward)
    dram = {k.name: k.bytes for k in traffic.fused_step(tu, strategy=backward).kernels}
    role_ctas: dict[str, int] = {}
    for launch in launches:
        role_ctas[launch.kernel] = role_ctas.get(launch.kernel, 0) + launch.programs
    um = UnitModel(u, dtype, dev, host=host, backward=backward)
    for launch in launches:
        comp = compile_launch(launch)
        k = sass.analyse(comp.name, sass.parse(sass.disassemble(comp.cubin))[comp.name])
        t = trips(launch)
        if launch.kernel in ARGUMENT_BYTES:
            nbytes = sum(launch.tensor_bytes.values())
        else:
            nbytes = dram.get(TRAFFIC_NAME.get(launch.kernel, launch.kernel), 0) \
                * launch.programs / role_ctas[launch.kernel]
        ml = model.Launch(f"{u.name} {launch.kernel}", k,
                          model.Resources(comp.registers, comp.shared, comp.num_warps),
                          launch.programs, t, nbytes)
        um.kernels.append(KernelRow(launch.kernel, launch, comp, k, t, model.predict(ml, dev)))
    um.host_s = sum(_dram_s(h.bytes, dev) + model.LAUNCH_S for h in host)
    um.plain = plain_step(u, dtype, dev)
    return um


def device_for(capability: tuple[int, int], sms: int) -> Device:
    """The modeled device for a GPU of compute ``capability`` with ``sms`` SMs: sm_80 -> A100
    specs, sm_90 -> H100 specs, with the GPU's own SM count. Raises ValueError otherwise."""
    import dataclasses

    from .devices import A100, H100

    base = {(8, 0): A100, (9, 0): H100}.get(tuple(capability))
    if base is None:
        raise ValueError(f"capability: the model has specs for sm_80 and sm_90 only, not "
                         f"sm_{capability[0]}{capability[1]}")
    return dataclasses.replace(base, sms=sms)


def model_conv_unit(shape: ConvUnit, dtype: str, dev: Device) -> UnitModel:
    """:func:`model_unit` for a ``unit_shapes.ConvUnit`` (the benchmarks' shapes)."""
    return model_unit(traffic.Unit(shape.name, shape.n, shape.cin, shape.hw, shape.cout,
                                   shape.k, shape.stride, shape.residual, ELEM[dtype]),
                      dtype, dev)
