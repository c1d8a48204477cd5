"""``fusedres.kernels`` in a source checkout used in place.

An install maps the repository's ``kernels/`` to ``fusedres.kernels`` (setup.py's
``package_dir``; an editable install through its own finder). A checkout whose extension was
built in place (``python setup.py build_ext --inplace``, as on a GPU machine without pip's
index) and run from the repository root has no such mapping: the Triton backend then reported
"No module named 'fusedres.kernels'" (the H100 run of benchmarks/report-gpu-h100/). There,
and only there (no ``fusedres/kernels`` package, a ``kernels/_tl.py`` beside the package), a
finder maps that one name to ``kernels/``. Nothing is imported until the name is.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

NAME = "fusedres.kernels"
# fusedres/ (this file is fusedres/ops/_source_checkout.py)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIR = os.path.join(os.path.dirname(PACKAGE_DIR), "kernels")


class KernelsFinder(importlib.abc.MetaPathFinder):
    """Finds ``fusedres.kernels`` in ``SOURCE_DIR``; its submodules follow its ``__path__``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        return importlib.util.spec_from_file_location(
            NAME, os.path.join(SOURCE_DIR, "__init__.py"),
            submodule_search_locations=[SOURCE_DIR])


def needed() -> bool:
    """A checkout used in place: no installed ``fusedres/kernels``, the sources beside us."""
    return (not os.path.isdir(os.path.join(PACKAGE_DIR, "kernels"))
            and os.path.isfile(os.path.join(SOURCE_DIR, "_tl.py")))


# Last, so an installed mapping (an editable install's finder) answers first.
if needed() and not any(isinstance(f, KernelsFinder) for f in sys.meta_path):
    sys.meta_path.append(KernelsFinder())
