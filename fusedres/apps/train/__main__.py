"""``python -m fusedres.apps.train``."""

from . import main

raise SystemExit(main())
