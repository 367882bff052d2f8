"""PyTorch Distributed Checkpoint (DCP): ``.metadata`` plus ``__{rank}_{n}.distcp`` files.

The container itself is read by :mod:`ckptool.core.dcpfile` (shared with Megatron-Core's
``torch_dist``); writing goes through DCP's own planner and storage writer.

ckptool marks what it writes through ``storage_meta.save_id`` (``ckptool-<uuid>``), which
DCP keeps: such a checkpoint without ``ckptool.json`` was never committed.
"""

from __future__ import annotations

import uuid

from ckptool.core.dcpfile import METADATA, SAVE_ID_MARK, DcpContainerReader, read_metadata
from ckptool.core.storage import Store

NAME = "dcp"


class DcpReader(DcpContainerReader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        return store.exists(METADATA) and not store.exists("metadata.json")


# ---------------------------------------------------------------------------- writing


def _marked(writer_cls):
    """A DCP storage writer whose ``.metadata`` carries ckptool's mark."""

    class Marked(writer_cls):
        def storage_meta(self):
            meta = super().storage_meta()
            if meta is not None:
                meta.save_id = f"{SAVE_ID_MARK}{uuid.uuid4()}"
            return meta

    Marked.__name__ = f"Ckptool{writer_cls.__name__}"
    return Marked


def storage_writer(store: Store, **kwargs):
    """A DCP storage writer for ``store`` (local or any fsspec URL) that marks its output."""
    if store.is_local:
        from torch.distributed.checkpoint import FileSystemWriter

        return _marked(FileSystemWriter)(store.root, **kwargs)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return _marked(FsspecWriter)(store.url, **kwargs)


def save(state_dict: dict, url: str, *, overwrite: bool = False, process_group=None,
         writer_options: dict | None = None, **manifest_fields) -> str:
    """Save ``state_dict`` as a committed DCP checkpoint at ``url`` (synchronous).

    Writes into a temporary directory (or in place on object stores), then the manifest,
    then renames. ``manifest_fields`` go into the manifest (topology, model_config,
    iteration, true_vocab_size); ``writer_options`` go to DCP's storage writer
    (e.g. ``thread_count``).
    """
    import torch.distributed.checkpoint as dcp

    from ckptool.core.manifest import build_manifest, write_manifest
    from ckptool.core.storage import atomic_output

    out = atomic_output(url, overwrite=overwrite)
    try:
        dcp.save(state_dict, storage_writer=storage_writer(out.store, **(writer_options or {})),
                 process_group=process_group)
        version = getattr(read_metadata(out.store), "version", None)
        manifest = build_manifest(out.store, NAME, format_version=version, **manifest_fields)
        out.commit(lambda s: write_manifest(s, manifest))
    except BaseException:
        out.abort()
        raise
    return out.final.url
