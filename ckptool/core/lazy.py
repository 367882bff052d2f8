"""Modules imported on first use, so that the light commands (``ckptool latest``, ``verify``
of a committed checkpoint) never import torch: reading a manifest, hashing files and checking
a DCP ``.metadata`` need none of it.

``torch = lazy("torch", globals())`` binds a stand-in; its first attribute access imports
the module and rebinds the global name to the module itself, so later uses cost nothing.
"""

from __future__ import annotations

import importlib
from typing import Any


class _Lazy:
    __slots__ = ("_name", "_namespace", "_alias")

    def __init__(self, name: str, namespace: dict, alias: str):
        self._name, self._namespace, self._alias = name, namespace, alias

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        self._namespace[self._alias] = module
        return getattr(module, attr)


def lazy(name: str, namespace: dict, alias: str | None = None) -> Any:
    """A stand-in for module ``name`` bound as ``alias`` (default: its last component) in
    ``namespace`` (the caller's ``globals()``)."""
    return _Lazy(name, namespace, alias or name.rsplit(".", 1)[-1])
