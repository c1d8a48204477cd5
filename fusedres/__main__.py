"""``python -m fusedres``: the ``fusedres`` command (fusedres/cli.py), for environments where the
console script is not on PATH."""

from fusedres.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
