"""fusedres's version, the one place it is spelled: ``fusedres.__version__`` imports it and
setup.py reads it by path (it needs no torch). CHANGELOG.md has an entry for each version."""

__version__ = "0.1.0"
