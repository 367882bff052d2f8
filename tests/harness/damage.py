"""Byte-level damage to a checkpoint's files, for the tests that must see it caught: a
flipped bit, a cut-off end, bytes overwritten in place."""

from __future__ import annotations

from pathlib import Path


def flip_bit(data: bytes) -> bytes:
    """``data`` with the lowest bit of its middle byte flipped."""
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x01
    return bytes(damaged)


def truncate(path: Path, n: int) -> None:
    """Cut the last ``n`` bytes off the file ``path``."""
    raw = path.read_bytes()
    path.write_bytes(raw[:-n])


def patch(path: Path, at: int, data: bytes) -> None:
    """Overwrite the file ``path`` with ``data`` from byte ``at`` on."""
    raw = bytearray(path.read_bytes())
    raw[at:at + len(data)] = data
    path.write_bytes(bytes(raw))


def edit_manifest(path: Path, edit) -> None:
    """Apply ``edit`` to the parsed manifest ``path`` (a ``ckptool.json``) and write it back with
    its own checksum made again, as someone who knows the format would: what is tested is
    then the check of the edited field, not the checksum."""
    import json

    from ckptool.core.manifest import SELF, self_digest

    data = json.loads(path.read_text())
    edit(data)
    data[SELF] = self_digest(data)
    path.write_text(json.dumps(data))
