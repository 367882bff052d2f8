"""ckptool: checkpoints for TP x PP x DP training.

The Python API mirrors the CLI; each operation returns a dataclass (``--json`` is its
``asdict``).
"""

from ckptool.core import VERSION as __version__
from ckptool.core.errors import CkptoolError
from ckptool.core.topology import Topology
from ckptool.inspect import InspectResult, inspect
from ckptool.latest import LatestResult, latest
from ckptool.verify import VerifyReport, verify

__all__ = [
    "__version__",
    "CkptoolError",
    "Topology",
    "inspect",
    "InspectResult",
    "latest",
    "LatestResult",
    "verify",
    "VerifyReport",
]
