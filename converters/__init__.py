"""Checkpoint formats: one module per format, a registry by the names the CLI spells.

Each module gives a :class:`ckptool.core.index.Reader` subclass. Modules are imported
lazily, so a format's optional dependencies cost nothing until it is used.

A format never imports another format. Rules that several formats share live in modules
that are not formats: :mod:`converters.hf_schema` (Hugging Face names and ``config.json``),
:mod:`converters.zero` (DeepSpeed's ZeRO layout and files), :mod:`converters.megatron_common`,
:mod:`converters.megatron_ranks`, :mod:`converters.megatron_optimizer`,
:mod:`converters.megatron_distopt`. The one exception is a format's own variant:
:mod:`converters.deepspeed` dispatches pipeline checkpoints to :mod:`converters.deepspeed_pipe`.
"""

from __future__ import annotations

import importlib

from ckptool.core.errors import UnknownFormat, UnsupportedFormat
from ckptool.core.index import Reader
from ckptool.core.manifest import MANIFEST, read_manifest
from ckptool.core.storage import Store

READERS = {
    "dcp": "converters.dcp:DcpReader",
    "megatron-dist": "converters.megatron_dist:MegatronDistReader",
    "megatron": "converters.megatron:MegatronReader",
    "deepspeed": "converters.deepspeed:DeepSpeedReader",
    "deepspeed-universal": "converters.deepspeed_universal:UniversalReader",
    "hf": "converters.hf:HfReader",
    "megatron-zarr": "converters.megatron_zarr:MegatronZarrReader",
}
FORMATS = tuple(READERS)
WRITERS = {
    "megatron": "converters.megatron:MegatronWriter",
    "megatron-dist": "converters.megatron_dist:MegatronDistWriter",
    "dcp": "converters.dcp:DcpWriter",
    "hf": "converters.hf:HfWriter",
    "deepspeed": "converters.deepspeed:DeepSpeedWriter",
    "deepspeed-universal": "converters.deepspeed_universal:UniversalWriter",
}

# More specific layouts first: a DeepSpeed universal checkpoint also has model-state files,
# a Megatron torch_dist directory also has a DCP `.metadata`, and an HF Trainer DeepSpeed
# checkpoint also has `config.json`. Megatron-Core's zarr backend also has `metadata.json`.
DETECT_ORDER = ("deepspeed-universal", "deepspeed", "megatron-zarr", "megatron-dist", "dcp",
                "megatron", "hf")


def reader_class(name: str) -> type[Reader]:
    try:
        module, cls = READERS[name].split(":")
    except KeyError:
        raise UnknownFormat(f"unknown format {name!r}",
                            hint=f"Use one of: {', '.join(FORMATS)}") from None
    return getattr(importlib.import_module(module), cls)


def reader(name: str) -> Reader:
    return reader_class(name)()


def writer(name: str):
    if name not in WRITERS:
        raise UnsupportedFormat(f"writing {name} checkpoints is not implemented yet",
                                hint=f"Writable now: {', '.join(WRITERS)}")
    module, cls = WRITERS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def detect(store: Store) -> str | None:
    """The format of the checkpoint at ``store``, or None.

    A manifest names its format; otherwise each format's own layout decides.
    """
    manifest = read_manifest(store) if store.exists(MANIFEST) else None
    if manifest is not None:
        return manifest.format
    for name in DETECT_ORDER:
        if reader_class(name).detect(store):
            return name
    return None


def require_format(store: Store) -> str:
    """Like :func:`detect`, but explain what was found when nothing matches."""
    if not store.exists():
        raise UnknownFormat("no such file or directory", path=store.url)
    fmt = detect(store)
    if fmt is None:
        entries = [n + ("/" if d else "") for n, d in store.ls()][:8]
        found = ", ".join(entries) if entries else "an empty directory"
        raise UnknownFormat(
            f"not a checkpoint ckptool knows: found {found}", path=store.url,
            hint=f"Expected one of {', '.join(FORMATS)} (see `ckptool --help`)")
    return fmt
