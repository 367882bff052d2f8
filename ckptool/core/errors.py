"""One error hierarchy for all of ckptool.

Each class carries the CLI exit code of the contract (0 ok, 1 bad checkpoint or none
found, 2 usage error or unreadable input). Errors carry fields (path, key) and a hint;
the CLI edge renders them as one line: what, where, what to do.
"""

from __future__ import annotations


class CkptoolError(Exception):
    """Base of every error a user can cause. Never shown with a traceback."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = path
        self.key = key
        self.hint = hint

    def one_line(self) -> str:
        where = []
        if self.path:
            where.append(bounded(str(self.path)))
        if self.key:
            where.append(f"tensor {bounded(repr(self.key))}")
        text = bounded(self.message, 600)
        if where:
            text = f"{text} ({', '.join(where)})"
        if self.hint:
            text = f"{text}. {bounded(self.hint, 900)}"
        return text


def bounded(text: str, limit: int = 300) -> str:
    """``text`` as one line of at most ``limit`` characters: what a checkpoint names (a key, a
    path, a value quoted in a refusal) is untrusted, and may be a megabyte or hold newlines."""
    text = str(text).translate(_CONTROL)
    return text if len(text) <= limit else f"{text[:limit - 1]}…"


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))} | \
    {c: f"\\u{c:04x}" for c in (0x2028, 0x2029)} | {ord("\n"): "\\n", ord("\r"): "\\r",
                                                              ord("\t"): " "}
"""Control characters shown escaped: a name a checkpoint holds must neither split the one
line nor send escape sequences to a terminal."""


class UsageError(CkptoolError):
    """Bad flags or arguments (exit 2)."""


class UnreadableInput(CkptoolError, OSError):
    """A path that cannot be opened or parsed at all (exit 2)."""


class UnknownFormat(UnreadableInput):
    """Nothing at the path looks like a checkpoint format ckptool knows (exit 2)."""


class UnsupportedFormat(UnreadableInput):
    """The format was detected but this operation is not available for it yet (exit 2)."""


class UnsafePickle(UnreadableInput):
    """A pickle refers to a class outside the allowlist (exit 2)."""


class OutputFailed(CkptoolError):
    """The destination's storage refused a write: full, over quota, a file too large for it,
    or read-only (exit 2). What a rewrite had finished is kept for a re-run to resume."""


class BadCheckpoint(CkptoolError):
    """The checkpoint is corrupt, partial or uncommitted (exit 1)."""

    exit_code = 1


class PathEscape(BadCheckpoint):
    """A path a checkpoint names (an index entry, a storage path, a tracker, a symlink) leads
    outside the checkpoint directory (exit 1). Nothing outside it is ever read."""


class NotRegularFile(BadCheckpoint):
    """A FIFO, device or socket where a checkpoint file should be (exit 1): refused before it
    is opened, since reading one can block for ever."""


class DanglingPointer(BadCheckpoint):
    """A tracker or ``latest`` file names a checkpoint that is not there (exit 1). The
    frameworks' own loaders fail there too; ckptool never takes another one instead."""


class NotCommitted(BadCheckpoint):
    """A ckptool-written checkpoint without its manifest: the writer never finished."""


class NoCheckpoint(CkptoolError):
    """`latest` found nothing valid (exit 1)."""

    exit_code = 1


class TopologyError(UsageError):
    """A topology that breaks a layout rule (exit 2)."""
