"""Public re-export of the error hierarchy (defined in ckptool.core.errors)."""

from ckptool.core.errors import (
    BadCheckpoint,
    CkptoolError,
    DanglingPointer,
    NoCheckpoint,
    NotCommitted,
    NotRegularFile,
    PathEscape,
    TopologyError,
    UnknownFormat,
    UnreadableInput,
    UnsafePickle,
    UnsupportedFormat,
    UsageError,
)

__all__ = ["BadCheckpoint", "CkptoolError", "DanglingPointer", "NoCheckpoint", "NotCommitted", "NotRegularFile", "PathEscape", "TopologyError",
           "UnknownFormat", "UnreadableInput", "UnsafePickle", "UnsupportedFormat", "UsageError"]
