"""Public re-export of the error hierarchy (defined in ckptool.core.errors)."""

from ckptool.core.errors import (  # noqa: F401
    BadCheckpoint,
    CkptoolError,
    NoCheckpoint,
    NotCommitted,
    TopologyError,
    UnknownFormat,
    UnreadableInput,
    UnsafePickle,
    UnsupportedFormat,
    UsageError,
)
