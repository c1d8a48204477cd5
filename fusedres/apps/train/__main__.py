"""``python -m fusedres.train``."""

from . import main

raise SystemExit(main())
