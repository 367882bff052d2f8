"""Checkpoint formats, one package per framework, and the registry by the names the CLI spells.

- :mod:`converters.dcp`: PyTorch DCP (``dcp``).
- :mod:`converters.megatron`: Megatron-LM legacy files (``megatron``), Megatron-Core
  ``torch_dist`` (``megatron-dist``) and ``zarr`` (``megatron-zarr``), their optimizers.
- :mod:`converters.deepspeed`: DeepSpeed engines, pipelines and engines made from a Hugging
  Face model (``deepspeed``: three writers, picked by the source), universal checkpoints
  (``deepspeed-universal``).
- :mod:`converters.hf`: Hugging Face safetensors (``hf``).
- :mod:`converters.schemas`: what the models' names and configs mean (Hugging Face,
  Megatron), shared by the frameworks; not formats.

Each format gives a :class:`ckptool.core.index.Reader` subclass and, where it is written, a
:class:`~ckptool.core.index.Writer`. Formats are imported lazily, so a format's optional
dependencies cost nothing until it is used. The layering (checked by ``lint-imports``,
``[tool.importlinter]`` in pyproject.toml): a framework package imports the core and the
schemas only, never another framework; the schemas import only the core.
"""

from __future__ import annotations

import importlib

from ckptool.core.errors import BadCheckpoint, UnknownFormat, UnsupportedFormat
from ckptool.core.index import CheckpointIndex, Reader, Writer
from ckptool.core.manifest import MANIFEST, read_manifest
from ckptool.core.storage import RESUME_KEY_FILE, Store

READERS = {
    "dcp": "converters.dcp:DcpReader",
    "megatron-dist": "converters.megatron.dist:MegatronDistReader",
    "megatron": "converters.megatron.legacy:MegatronReader",
    "deepspeed": "converters.deepspeed.engine:DeepSpeedReader",
    "deepspeed-universal": "converters.deepspeed.universal:UniversalReader",
    "hf": "converters.hf.format:HfReader",
    "megatron-zarr": "converters.megatron.zarr:MegatronZarrReader",
}
FORMATS = tuple(READERS)
WRITERS = {
    "megatron": "converters.megatron.legacy:MegatronWriter",
    "megatron-dist": "converters.megatron.dist:MegatronDistWriter",
    "dcp": "converters.dcp:DcpWriter",
    "hf": "converters.hf.format:HfWriter",
    "deepspeed": "converters.deepspeed.engine:DeepSpeedWriter",
    "deepspeed-universal": "converters.deepspeed.universal:UniversalWriter",
}
VARIANTS = {
    "deepspeed": ("converters.deepspeed.pipe:PipelineWriter",
                  "converters.deepspeed.from_hf:HfModelWriter"),
    "hf": ("converters.hf.stored:StoredNamesWriter",),
}
"""Writers of a format for particular sources, tried in order before its own (``WRITERS``):
each one's ``serves(index)`` says whether it writes that source. The format's own writer
class says what the format can do (``canonical_source``, ``fresh_optimizer``, ``reshards``)."""

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


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def writer_class(name: str) -> type[Writer]:
    """Format ``name``'s own writer class (what the format can do)."""
    if name not in WRITERS:
        raise UnsupportedFormat(f"writing {name} checkpoints is not implemented yet",
                                hint=f"Writable now: {', '.join(WRITERS)}")
    return _load(WRITERS[name])


def writer(name: str, source: CheckpointIndex | None = None) -> Writer:
    """A writer of format ``name`` for ``source`` (the index it will be written from, in the
    view the format reads): the first variant that serves it, else the format's own."""
    own = writer_class(name)
    if source is not None:
        for path in VARIANTS.get(name, ()):
            cls = _load(path)
            if cls.serves(source):
                return cls()
    return own()


def reshardable(name: str) -> bool:
    """Whether ``ckptool reshard`` rewrites format ``name`` at another layout."""
    return name in WRITERS and writer_class(name).reshards


def reshardable_formats() -> tuple[str, ...]:
    return tuple(name for name in WRITERS if reshardable(name))


def root_trackers() -> tuple[str, ...]:
    """Files by which a run root is itself one checkpoint (its tracker names the step to load):
    Megatron's ``latest_checkpointed_iteration.txt``, DeepSpeed's ``latest``."""
    from converters.deepspeed.engine import LATEST
    from converters.schemas.megatron import TRACKER

    return TRACKER, LATEST


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
        if store.exists(RESUME_KEY_FILE) and not store.exists(MANIFEST):  # an object store's
            raise BadCheckpoint("not committed: the output of a reshard or convert that did not "
                                "finish (written in place, no manifest yet)", path=store.url,
                                hint="Re-run the same command to resume it, or delete it")
        entries = [n + ("/" if d else "") for n, d in store.ls()][:8]
        found = ", ".join(entries) if entries else "an empty directory"
        raise UnknownFormat(
            f"not a checkpoint ckptool knows: found {found}", path=store.url,
            hint=f"Expected one of {', '.join(FORMATS)} (see `ckptool --help`)")
    return fmt
