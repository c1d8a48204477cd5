"""The zoo in timm's model registry: ``timm.create_model("fusedres_preact_resnet164")``.

Every model of :data:`fusedres.models.MODELS` is registered as ``"fusedres_" + name``, built by
timm's ``build_model_with_cfg`` (so ``pretrained_cfg``, ``num_classes``/``in_chans`` defaults
from it, and timm's keyword arguments pass through to :func:`fusedres.models.preact_resnet`,
e.g. ``fused=False``, ``drop_path_rate=0.1``), with a config that timm's data pipeline reads
(input size, mean, std: CIFAR-10's at 32x32 for the CIFAR variants, ImageNet's at 224x224).
fusedres publishes no weights: ``pretrained=True`` is refused.

When: ``import fusedres`` registers the zoo if timm is already imported; otherwise, if timm is
installed, right after timm's own import (a one-shot import hook, :func:`install`), so that
importing fusedres never imports timm (1.7 s here) and either import order works.
:func:`register` does it at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

from . import MODELS

__all__ = ["PREFIX", "install", "register"]

PREFIX = "fusedres_"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_CIFAR_DEPTHS = (20, 56, 110, 164, 1001)


def _cfg(name: str) -> dict:
    cifar = int(name.removeprefix("preact_resnet")) in _CIFAR_DEPTHS
    if cifar:
        data = dict(num_classes=10, input_size=(3, 32, 32), pool_size=(8, 8),
                    mean=CIFAR10_MEAN, std=CIFAR10_STD, crop_pct=1.0)
    else:
        from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

        data = dict(num_classes=1000, input_size=(3, 224, 224), pool_size=(7, 7),
                    mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, crop_pct=0.875)
    return dict(url="", interpolation="bilinear", first_conv="conv1", classifier="fc",
                license="", **data)


def _entrypoint(name: str):
    build = MODELS[name]

    def create(pretrained: bool = False, **kwargs):
        if pretrained:
            raise ValueError(f"pretrained: fusedres publishes no weights for {PREFIX}{name}; "
                             f"expected False (load a checkpoint with checkpoint_path=)")
        from timm.models import build_model_with_cfg

        return build_model_with_cfg(build, PREFIX + name, False, **kwargs)

    create.__name__ = create.__qualname__ = PREFIX + name
    create.__module__ = __name__
    create.__doc__ = build.__doc__
    return create


def register() -> list[str]:
    """Register the zoo in timm's registry (imports timm); returns the names. Registering
    again does nothing."""
    import timm.models as tm

    names = [PREFIX + n for n in MODELS]
    if all(tm.is_model(n) for n in names):
        return names
    # timm's register_model reads the entrypoint module's ``default_cfgs``.
    globals()["default_cfgs"] = tm.generate_default_cfgs({PREFIX + n: _cfg(n) for n in MODELS})
    for n in MODELS:
        if not tm.is_model(PREFIX + n):
            tm.register_model(_entrypoint(n))
    return names


class _RegisterAfter(importlib.abc.Loader):
    """timm's own loader, then :func:`register`."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            register()
        except Exception as e:  # noqa: BLE001 - never break the user's import of timm
            warnings.warn(f"fusedres: the zoo could not be registered in timm's registry "
                          f"({type(e).__name__}: {e})", stacklevel=2)

    def __getattr__(self, name):  # resource readers and the rest: timm's loader's
        return getattr(self._loader, name)


class _AfterTimmImport(importlib.abc.MetaPathFinder):
    """One shot: finds timm through the other finders and wraps its loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "timm":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


def install() -> None:
    """Register now if timm is imported; else after timm's import, if timm is installed."""
    if "timm.models" in sys.modules:
        register()
    elif "timm" not in sys.modules and importlib.util.find_spec("timm") is not None:
        if not any(isinstance(f, _AfterTimmImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterTimmImport())
