"""ckptool: checkpoints for TP x PP x DP training.

The Python API mirrors the CLI; each operation returns a dataclass (``--json`` is its
``asdict``). Names are imported lazily so that ``ckptool --version`` does not load torch.
"""

from __future__ import annotations

import importlib

from ckptool.core import VERSION as __version__

_EXPORTS = {
    "CkptoolError": "ckptool.core.errors",
    "Topology": "ckptool.core.topology",
    "inspect": "ckptool.ops.inspect",
    "InspectResult": "ckptool.ops.inspect",
    "latest": "ckptool.checkpoints.latest",
    "LatestResult": "ckptool.checkpoints.latest",
    "verify": "ckptool.checkpoints.verify",
    "plan": "ckptool.ops.plan",
    "PlanResult": "ckptool.ops.plan",
    "reshard": "ckptool.ops.reshard",
    "convert": "ckptool.ops.reshard",
    "ReshardResult": "ckptool.ops.reshard",
    "VerifyReport": "ckptool.checkpoints.verify",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ckptool' has no attribute {name!r}")
