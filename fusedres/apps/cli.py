"""The ``fusedres`` command: ``fusedres train|bench|demo|selftest|evaluate|lesion|landscape|
compare [args]``, and the command-line conventions its apps share (:class:`UsageError`,
:func:`parse_bytes`): the apps import them from here, not from each other. Imports nothing
from fusedres at module level."""

from __future__ import annotations

import importlib
import re
import sys

__all__ = ["COMMANDS", "UsageError", "main", "parse_bytes"]


class UsageError(Exception):
    """A problem with what the user asked for: reported on one line, exit code 2."""


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text, flag: str | None = "--memory-budget") -> int:
    """'4GiB' -> 4294967296; '500MB' -> 500000000; a bare number is bytes. Errors name
    ``flag`` (none when ``flag`` is None)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise UsageError(f"{flag}: expected a positive size, got {text!r}")
        return int(text)
    where = f"{flag}: " if flag else ""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"{where}expected a size such as 4GiB or 500MB"
                         + (" or auto" if flag == "--memory-budget" else "") + f", got {text!r}")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise UsageError(f"{where}expected a positive size, got {text!r}")
    return value


COMMANDS = {
    "train": ("fusedres.apps.train", "train a pre-activation ResNet (He et al.'s recipe)"),
    "bench": ("fusedres.apps.bench", "time and memory of the fused units on this machine "
                                "(units, step, fit, gpu-report)"),
    "demo": ("fusedres.apps.demo", "fused unit vs plain PyTorch: agreement and saved memory"),
    "selftest": ("fusedres.apps.selftest", "run the kernels against the reference on this machine"),
    "evaluate": ("fusedres.apps.experiments.evaluate",
                 "a trained run's checkpoint on its test set: loss, top-1/top-5 error "
                 "(model and EMA)"),
    "lesion": ("fusedres.apps.experiments.lesion",
               "test error of a trained run with residual units deleted (Veit et al. 2016)"),
    "landscape": ("fusedres.apps.experiments.landscape",
                  "loss and accuracy around a run's trained weights (Li et al. 2018)"),
    "compare": ("fusedres.apps.experiments.compare",
                "runs side by side: curves per variant (median over seeds) and a table of "
                "test errors"),
    "settings": ("fusedres.settings", "the FUSEDRES_* environment variables, and those set here"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
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
