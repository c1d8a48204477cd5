"""``python -m fusedres``: the ``fusedres`` command (fusedres/apps/cli.py), for environments where
the console script is not on PATH."""

from fusedres.apps.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
