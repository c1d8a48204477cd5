"""The traffic model's tables (kernels/traffic.py) as benchmarks/TRAFFIC.md prints them, the last
at the calibrated GPU model's efficiencies. Here, not in kernels/: the calibration (model.py) is a
developer tool, and the library's own use of the traffic model (auto_strategy) runs at the
roofline. ``python -m tools.perfmodel.traffic`` prints the tables."""

from __future__ import annotations

from fusedres.kernels import traffic

from . import model


def modeled_efficiency(per_kernel: dict[str, float] | None = None) -> traffic.Efficiency:
    """The calibrated model's H100 efficiencies: DRAM at ``DRAM_EFFICIENCY`` of the spec
    bandwidth, GEMMs at the sustained tensor fraction fitted on published cuBLAS figures, or at
    ``per_kernel`` fractions (from the SASS model)."""
    return traffic.Efficiency(model.DRAM_EFFICIENCY, model.TENSOR_SUSTAINED[90],
                              tuple(sorted((per_kernel or {}).items())))


def full_report() -> str:
    """Every table: Triton (with and without genstats, the store backward), CUDA C++ (with and
    without genstats), then the Triton step at the modeled efficiencies."""
    r = traffic.report
    return "\n\n".join((r(), r(genstats=True), r(strategy="store"), r(kernels="cuda"),
                        r(genstats=True, kernels="cuda"), r(eff=modeled_efficiency())))


if __name__ == "__main__":
    print(full_report())
