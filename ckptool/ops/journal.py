"""The resume journal of an unfinished rewrite: which target files an interrupted run had
finished (path, size, xxh3, the writer's record), one append-only file per torchrun rank,
so a re-run with the same job key keeps what still hashes to its entry."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict

import xxhash

from ckptool.core.manifest import FileEntry, hash_file
from ckptool.core.storage import RESUME_KEY_FILE, Store, fsync

JOURNAL = ".ckptool-done"
"""Per-rank journals of finished target files (path, size, xxh3) in an unfinished output."""


def resume_key(opened, fmt, result, options, weights_only, names, true_vocab_size) -> str:
    """Names the job: the same source content, target and options give the same key. Content is
    the manifest's hashes, or for a source without one (Megatron, DeepSpeed) each file's size
    and modification time: a source saved again between an interrupted run and its re-run is
    another job (7 of 10 files were kept from the old source, exit 0 and verify OK)."""
    stamps = {} if opened.manifest else opened.store.stamps()  # one listing, not a request a file
    source = [(f.path, f.size, f.xxh3_128) for f in opened.manifest.files] if opened.manifest else \
        [(rel, *stamps.get(rel, ())) for rel in sorted(opened.index.files)]
    blob = json.dumps([opened.store.url, [list(map(str, f)) for f in source],
                       fmt, result.target_topology, [(f.path, f.bytes) for f in result.files],
                       sorted((options or {}).items()), weights_only, names, true_vocab_size],
                      default=str)
    return xxhash.xxh3_64_hexdigest(blob.encode())


def finished(store: Store) -> dict[str, tuple[FileEntry, dict | None]]:
    """Finished files of an interrupted run: entry and the writer's record (JSON form)."""
    done = {}
    for name, is_dir in store.ls():
        if is_dir or not name.startswith(JOURNAL):
            continue
        for line in store.read_bytes(name).decode(errors="replace").splitlines():
            try:
                d = json.loads(line)
                done[d["path"]] = (FileEntry(d["path"], int(d["size"]), d["xxh3_128"]), d.get("record"))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed run
    return done


def reusable(store: Store, target, done: dict) -> FileEntry | None:
    """The journaled entry of ``target`` if the file on storage still hashes to it."""

    entry = done.get(target.path, (None, None))[0]
    if entry is None or not store.exists(target.path):
        return None
    try:
        size, digest = hash_file(store, target.path)
    except OSError:
        return None
    return entry if (size, digest) == (entry.size, entry.xxh3_128) else None


def record(store: Store, rank: int, entry: FileEntry, record=None) -> None:
    line = json.dumps({**asdict(entry), "record": record.to_json() if record is not None else None}) + "\n"
    path = f"{JOURNAL}.{rank}"
    with LOCK:
        if store.is_local:
            with open(store.path(path), "a") as f:
                f.write(line)
                f.flush()
                if store.durable:
                    fsync(f.fileno())
        else:  # object stores cannot append: rewrite the small journal
            old = store.read_bytes(path) if store.exists(path) else b""
            store.write_bytes(path, old + line.encode())


def clear(store: Store) -> None:
    for name, is_dir in store.ls():
        if not is_dir and (name.startswith(JOURNAL) or name == RESUME_KEY_FILE):
            store.fs.rm(store.path(name))


LOCK = threading.Lock()
"""Serialises the journal's appends and the writer's ``absorb`` across worker threads."""
