"""The ``fusedres`` command: ``fusedres train|bench|demo|selftest [args]``."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("fusedres.train", "train a pre-activation ResNet (He et al.'s recipe)"),
    "bench": ("fusedres.bench", "time and memory of the fused units on this machine "
                                "(units, step, fit, gpu-report)"),
    "demo": ("fusedres.demo", "fused unit vs plain PyTorch: agreement and saved memory"),
    "selftest": ("fusedres.selftest", "run the kernels against the reference on this machine"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:9} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: fusedres {" + ",".join(COMMANDS) + "} [args]\n\ncommands:\n"
              + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nfusedres: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
