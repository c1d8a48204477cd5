"""torch.hub entry points: the fusedres zoo.

    torch.hub.load("OWNER/fusedres", "preact_resnet164", num_classes=10)     # from GitHub
    torch.hub.load("/path/to/fusedres", "preact_resnet164", source="local")  # a checkout

Each entry point takes the keyword arguments of its constructor in :mod:`fusedres.models`
(``num_classes``, ``fused``, ``in_chans``, those of ``preact_resnet``). fusedres publishes no
weights: ``pretrained=True`` is refused. Loaded from a checkout that was not built, fusedres
runs on its Python backends (the compiled ones are picked up when built).
"""

dependencies = ["torch"]

from fusedres.models import MODELS as _MODELS  # noqa: E402


def _entrypoint(name):
    build = _MODELS[name]

    def load(pretrained=False, **kwargs):
        if pretrained:
            raise ValueError(f"pretrained: fusedres publishes no weights for {name}; expected "
                             f"False (load a state_dict into the model instead)")
        return build(**kwargs)

    load.__name__ = load.__qualname__ = name
    load.__doc__ = build.__doc__
    return load


for _name in _MODELS:
    globals()[_name] = _entrypoint(_name)
del _name
