"""Extension points whose implementations are the modules of a package (margins/,
center_optimizers/): a config names a module, which is imported when it is used.
Nothing registers itself at import time, so adding one is adding its module."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def names(package: ModuleType) -> list[str]:
    """The implementations a config may name: the package's public modules."""
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                  if not m.name.startswith("_"))


def load(package: ModuleType, key: str, name: str) -> ModuleType:
    """The module `name` of `package`; a ValueError naming config `key` and the choices."""
    if name not in names(package):
        raise ValueError(f"{key}={name!r} must be one of {names(package)}")
    return importlib.import_module(f"{package.__name__}.{name}")
