"""PyTorch Distributed Checkpoint (DCP): ``.metadata`` plus ``__{rank}_{n}.distcp`` files.

The container itself is read by :mod:`ckptool.core.dcpfile` (shared with Megatron-Core's
``torch_dist``); writing goes through DCP's own planner and storage writer.

ckptool marks what it writes through ``storage_meta.save_id`` (``ckptool-<uuid>``), which
DCP keeps: such a checkpoint without ``ckptool.json`` was never committed.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from ckptool.core.dcpfile import (
    METADATA,
    SAVE_ID_MARK,
    DcpContainerReader,
    read_metadata,
)
from ckptool.core.dcpwrite import DcpFileWriter, RecordedFiles, write_metadata
from ckptool.core.engine import TargetFile, TargetTensor
from ckptool.core.index import CheckpointIndex, Writer
from ckptool.core.manifest import build_manifest, write_manifest
from ckptool.core.regions import Region, Shard
from ckptool.core.storage import Store, atomic_output
from ckptool.core.topology import Topology

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")

NAME = "dcp"


class DcpReader(DcpContainerReader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        return store.exists(METADATA) and not store.exists("metadata.json")

    def read_index(self, store: Store) -> CheckpointIndex:
        index = super().read_index(store)
        # Plain DCP records no topology: the writer ranks are the data-parallel world.
        ranks = {m.group(1) for f in index.files if (m := _RANK_FILE.match(f))}
        index.topology = Topology(dp=max(1, len(ranks)))
        return index


@dataclass(frozen=True, slots=True)
class RankFile:
    """``__{rank}_0.distcp``: one writer rank's row blocks (rank 0 also the non-tensor entries)."""

    rank: int


class DcpWriter(RecordedFiles, Writer):
    """Regroups a DCP checkpoint for a new world size W = TP x PP x DP: every tensor is cut
    along dim 0 into W row blocks (as ``torch.chunk``), block r goes to ``__r_0.distcp``,
    so each target rank reads one file. Non-tensor entries are read through the one
    unpickler and pickled again (never copied raw: a hostile pickle cannot pass)."""

    name = NAME

    def __init__(self):
        self._shapes: dict[str, tuple] = {}
        self._source = None

    def bind(self, opened) -> None:
        self._source = opened

    def target_spec(self, index, source, target, true_vocab_size):
        return None

    def source_schema(self, opened) -> str:
        return NAME

    def plan(self, index: CheckpointIndex, topo: Topology, spec, schema: str,
             with_optimizer: bool = True) -> list[TargetFile]:
        world = topo.world
        files = [TargetFile(f"__{r}_0.distcp", context=RankFile(r)) for r in range(world)]
        self._shapes = {k: (t.shape, t.dtype) for k, t in index.tensors.items()}
        for key, info in index.tensors.items():
            for r, (start, rows) in enumerate(_row_blocks(info.shape, world)):
                rest = info.shape[1:]
                region = Region(key, info.shape, (start, *(0,) * len(rest)), (rows, *rest)) \
                    if info.shape else Region.whole(key, ())
                files[r].tensors.append(TargetTensor((key, region.offsets, region.lengths),
                                                     Shard.of(region), info.dtype))
        return files

    def write_file(self, store: Store, target: TargetFile, produce, index, true_vocab_size):
        with DcpFileWriter(store, target.path) as w:
            for t in target.tensors:
                key, offsets, lengths = t.name
                w.add_chunk(key, offsets, lengths, produce(t).reshape(lengths))
            if target.context.rank == 0:
                for key, obj in index.objects.items():
                    if obj.location is not None:  # re-pickled from what was read, never copied raw
                        w.add_object(key, self._source.reader.read_object(self._source.store, obj))
        self._remember(target.path, w)
        return w.digest

    def finalize(self, store: Store, index) -> list[str]:
        write_metadata(store, self._shapes, self.recorded())
        return [METADATA]


def _row_blocks(shape: tuple, world: int) -> list[tuple[int, int]]:
    """(start, rows) of each rank's block, as torch.chunk cuts dim 0; scalars go to rank 0."""
    if not shape or shape[0] == 0:
        return [(0, shape[0] if shape else 1)]
    step = -(-shape[0] // world)
    return [(s, min(step, shape[0] - s)) for s in range(0, shape[0], step)]


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
        from torch.distributed.checkpoint import (
            FileSystemWriter,  # lazy: DCP costs a second to import
        )

        return _marked(FileSystemWriter)(store.root, **kwargs)
    from torch.distributed.checkpoint._fsspec_filesystem import (
        FsspecWriter,  # lazy: as above
    )

    return _marked(FsspecWriter)(store.url, **kwargs)


def save(state_dict: dict, url: str, *, overwrite: bool = False, process_group=None,
         writer_options: dict | None = None, **manifest_fields) -> str:
    """Save ``state_dict`` as a committed DCP checkpoint at ``url`` (synchronous).

    Writes into a temporary directory (or in place on object stores), then the manifest,
    then renames. ``manifest_fields`` go into the manifest (topology, model_config,
    iteration, true_vocab_size); ``writer_options`` go to DCP's storage writer
    (e.g. ``thread_count``).
    """
    import torch.distributed.checkpoint as dcp  # lazy: as above

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
