"""Package attributes imported on first use.

A package whose public name needs a heavy or optional dependency (torch, pytest) lists
it in ``__all__`` and answers it from a module-level ``__getattr__`` that calls
:func:`lazy_attribute`, so importing the package never loads that dependency.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

__all__ = ["lazy_attribute"]


def lazy_attribute(package: str, name: str, homes: Mapping[str, str]) -> Any:
    """Attribute ``name`` of ``package``, imported from its module ``homes[name]``;
    AttributeError (as for any missing attribute) for a name ``homes`` does not list."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
