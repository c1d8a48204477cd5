"""Model zoo: pre-activation ResNets, fused (default) or plain PyTorch (``fused=False``).

``MODELS`` maps a name to its constructor; every constructor takes ``num_classes``,
``fused``, ``in_chans``, ``pretrained`` (no weights are published: True raises ValueError)
and the keyword arguments of :func:`preact_resnet`.
"""

from __future__ import annotations

from typing import Callable

from . import unit_shapes  # the zoo's unit shapes, which the benchmarks and self-test measure
from .preact_resnet import PreActResNet, preact_resnet, valid_depths

__all__ = ["MODELS", "PreActResNet", "preact_resnet", "unit_shapes", "valid_depths"]


def _named(depth: int, variant: str) -> Callable[..., PreActResNet]:
    def build(num_classes: int = 10 if variant == "cifar" else 1000, fused: bool = True,
              in_chans: int = 3, pretrained: bool = False, **kwargs) -> PreActResNet:
        # timm's and torch.hub's convention: the flag exists, and a zoo without weights
        # refuses it by name (hubconf.py and fusedres.models.timm_registry do the same).
        if pretrained:
            raise ValueError(f"pretrained: fusedres publishes no weights for "
                             f"preact_resnet{depth}; expected False (load a state_dict into "
                             f"the model instead)")
        return preact_resnet(depth, num_classes=num_classes, variant=variant, fused=fused,
                             in_chans=in_chans, **kwargs)

    build.__name__ = build.__qualname__ = f"preact_resnet{depth}"
    build.__doc__ = (f"Pre-activation ResNet-{depth}, {variant} variant "
                     f"(see :func:`preact_resnet`).")
    return build


MODELS: dict[str, Callable[..., PreActResNet]] = {}
for _depth in (20, 56, 110, 164, 1001):
    MODELS[f"preact_resnet{_depth}"] = _named(_depth, "cifar")
for _depth in (18, 34, 50, 101, 152, 200):
    MODELS[f"preact_resnet{_depth}"] = _named(_depth, "imagenet")

preact_resnet20 = MODELS["preact_resnet20"]
preact_resnet56 = MODELS["preact_resnet56"]
preact_resnet110 = MODELS["preact_resnet110"]
preact_resnet164 = MODELS["preact_resnet164"]
preact_resnet1001 = MODELS["preact_resnet1001"]
preact_resnet18 = MODELS["preact_resnet18"]
preact_resnet34 = MODELS["preact_resnet34"]
preact_resnet50 = MODELS["preact_resnet50"]
preact_resnet101 = MODELS["preact_resnet101"]
preact_resnet152 = MODELS["preact_resnet152"]
preact_resnet200 = MODELS["preact_resnet200"]

__all__ += list(MODELS)
del _depth
