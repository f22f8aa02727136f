"""Classes named by a string alone: a bare class path on a command line or in YAML means the class with its defaults.

jsonargparse (LightningCLI, ``fedshard plan``) reads a value such as ``lightning_fedshard.Gossip`` as a string when
the argument also accepts strings (``outer_topology``, ``reduce_dtype``); it builds the class only when init arguments
follow. The resolvers of those arguments use :func:`named_class` to read such a string as the class itself.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence


def named_class(name: str, base: type | tuple[type, ...], known: Sequence[type]) -> type | None:
    """The subclass of ``base`` that ``name`` names, or ``None`` when it names none.

    Args:
        name: A class name of ``known`` (``"Gossip"``) or an import path of a ``base`` subclass
            (``"lightning_fedshard.Gossip"``, ``"my_package.MyMixing"``).
        base: The class (or classes) every accepted class derives from.
        known: The classes a bare class name may refer to.
    """
    module, _, attr = name.rpartition(".")
    if not module:
        return next((cls for cls in known if cls.__name__ == name), None)
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, base) else None


def required_arguments(cls: type) -> list[str]:
    """The names of the arguments ``cls(...)`` cannot do without."""
    parameters = inspect.signature(cls).parameters.values()
    return [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
