"""The results of ``verify`` and ``latest`` (plain dataclasses, no torch: the light paths of
:mod:`ckptool.checkpoints.light` build them too)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptool.core.errors import bounded


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str
    """missing, size, checksum, uncommitted, metadata, coverage, unreadable, nonfinite, extra,
    pickle (a global outside the allowlist), unsafe-path (a symlink out, a FIFO...)."""
    message: str
    file: str | None = None
    key: str | None = None

    def one_line(self) -> str:
        key = f"tensor {bounded(repr(self.key))}" if self.key else None
        where = ", ".join(x for x in (bounded(self.file) if self.file else None, key) if x)
        message = bounded(self.message, 600)
        return f"{message} ({where})" if where else message


@dataclass(frozen=True, slots=True)
class VerifyReport:
    path: str
    format: str
    ok: bool
    committed: bool | None
    """True: manifest present; False: ckptool-written without one; None: foreign, unsealed."""
    sealed: bool
    """A manifest was written by this run (``--seal``)."""
    deep: bool
    files_checked: int
    bytes_hashed: int
    tensors: int
    pieces_read: int
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


@dataclass(frozen=True, slots=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class LatestResult:
    path: str
    format: str
    iteration: int | None
    verified: bool
    skipped: list[Skipped] = field(default_factory=list)
