"""Megatron-Core's legacy ``zarr`` distributed checkpoints, read as the canonical view.

What megatron-core 0.9.0 writes (``megatron/core/dist_checkpointing/``; checked against real
checkpoints it wrote on CPU, ``tests/data/mcore_zarr/make_fixture.py``):

- ``metadata.json``: ``{"sharded_backend": "zarr", "sharded_backend_version": 1,
  "common_backend": "torch", "common_backend_version": 1}`` (``core.py`` ``save_config``).
- ``common.pt``: rank 0's ``torch.save`` of the non-sharded state (``args``, ``iteration``...)
  (``strategies/common.py`` ``TorchCommonSaveStrategy.save_common``), as in ``torch_dist``.
- A ShardedObject is ``<key>/shard_<offsets>_<shape>.pt`` (``.``-joined), a ``torch.save`` of
  its data (``strategies/common.py`` ``save_sharded_objects``, ``mapping.py`` ``unique_key``).
- A ShardedTensor is one zarr v2 array directory ``<key>/`` (``strategies/zarr.py``
  ``_create_zarr_array``): ``.zarray`` says compressor null, filters null, order C,
  fill_value null, ``chunks`` = global shape / axis fragmentations (``mapping.py``
  ``max_allowed_chunks``), so each shard is one chunk file, named by its chunk index joined
  with ``.`` (zarr's default separator): the raw little-endian C-order bytes.
- bf16: numpy has none. When ``tensorstore`` is importable mcore uses its numpy ``bfloat16``,
  creates the array (zarr writes ``<V2``) and rewrites ``.zarray``'s dtype to ``"bfloat16"``;
  the chunk bytes are the bf16 bits. Without tensorstore mcore cannot save bf16 to zarr.
- Layers are stacked as in ``torch_dist``: ``decoder.layers.<name>`` is ``[L, ...]`` and
  chunked ``(1, ...)``; the reader splits them into ``decoder.layers.{i}.<name>``.

Chunk bytes are read by range; a compressed chunk (another writer's) is decoded whole with
numcodecs. Megatron-Core 0.16 no longer writes or reads this backend.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ckptool.core.errors import BadCheckpoint, UnreadableInput, UnsupportedFormat, bounded
from ckptool.core.index import (
    CheckpointIndex,
    Location,
    ObjectInfo,
    Piece,
    Reader,
    TensorInfo,
)
from ckptool.core.lazy import lazy
from ckptool.core.regions import Region, byte_runs
from ckptool.core.storage import Store
from ckptool.core.torchfile import TorchFile
from converters.megatron import optimizer as optim
from converters.megatron.common import (
    COMMON,
    METADATA_JSON,
    OPTIMIZER,
    STACK_TAG,
    checkpoint_dir,
    is_stacked,
    metadata,
    read_common,
    split_layers,
)

torch = lazy("torch", globals())

NAME = "megatron-zarr"
BACKEND = "zarr"
ZARRAY = ".zarray"
_SHARD = re.compile(r"^shard_([\d.]*)_([\d.]*)\.pt$")
_DTYPES = {
    "bfloat16": "bfloat16", "<f2": "float16", "<f4": "float32", "<f8": "float64",
    "|b1": "bool", "|u1": "uint8", "|i1": "int8", "<i2": "int16",
    "<i4": "int32", "<i8": "int64", "<c8": "complex64", "<c16": "complex128",
}
"""zarr dtype strings by torch dtype name."""


@dataclass(frozen=True, slots=True)
class _Chunk:
    """How one chunk file is stored: its full shape (edge chunks too), order and codecs."""

    shape: tuple[int, ...]
    order: str = "C"
    codecs: str | None = None
    """JSON list of numcodecs configs (filters, then the compressor), or None for raw."""
    fill: float | None = None
    """zarr's fill_value: what a chunk file that is absent holds. Megatron-Core writes none
    (null) and every chunk, so there a missing chunk file is damage."""


class MegatronZarrReader(Reader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        try:
            base = checkpoint_dir(store)
        except BadCheckpoint:
            return False
        return metadata(store, base).get("sharded_backend") == BACKEND

    def read_index(self, store: Store) -> CheckpointIndex:
        base = checkpoint_dir(store)
        meta = metadata(store, base)
        if meta.get("sharded_backend") != BACKEND:
            raise UnsupportedFormat(f"not a zarr checkpoint ({meta.get('sharded_backend')!r})",
                                    path=store.url, hint="Read it as megatron-dist")
        prefix = f"{base}/" if base else ""
        index = CheckpointIndex(format=NAME, url=store.url,
                                format_version=str(meta.get("sharded_backend_version")))
        index.files[prefix + METADATA_JSON] = 1
        by_key: dict[str, list[str]] = {}  # one listing: <key>/<file>, one level down
        for path in (store.child(base) if base else store).files():
            key, _, file = path.partition("/")
            if file and "/" not in file:
                by_key.setdefault(key, []).append(file)
        for key, files in sorted(by_key.items()):
            if ZARRAY in files:
                _add_array(store, prefix + key, key, index)
                continue
            for file in _object_files(files):
                name = f"{key}/{file.removesuffix('.pt')}"
                index.objects[name] = ObjectInfo(name, Location(f"{prefix}{key}/{file}"))
                index.files[f"{prefix}{key}/{file}"] = 1
        if not index.tensors:  # a torch_dist checkpoint whose metadata.json says zarr, say
            raise BadCheckpoint("metadata.json says zarr, but no zarr array (.zarray) is there",
                                path=store.url, hint="Check metadata.json's sharded_backend")
        read_common(self, store, prefix + COMMON, index)  # as torch_dist's, the optimizer's too
        _refuse_optimizer(index)
        return index

    def read_piece(self, store: Store, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        layer, chunk_region, chunk = _unpack(piece)
        data = _decode(store, piece.location, chunk, dtype, piece.region.key)
        data = data[tuple(slice(0, n) for n in chunk_region.lengths)]  # an edge chunk is padded
        return (data[layer] if layer is not None else data).contiguous()

    def read_box_into(self, store: Store, piece: Piece, dtype: torch.dtype, box, out) -> None:
        layer, _, chunk = _unpack(piece)
        block = chunk.shape[1:] if layer is not None else chunk.shape
        if chunk.codecs or chunk.order != "C" or not out.is_contiguous() \
                or tuple(piece.region.lengths) != block \
                or (chunk.fill is not None and not store.exists(piece.location.file)):
            return super().read_box_into(store, piece, dtype, box, out)
        base = layer * math.prod(block) if layer is not None else 0
        item = dtype.itemsize
        loc = piece.location
        reader = _open(store, loc)
        try:
            flat, pos = out.view(-1), 0
            for start, n in byte_runs(piece.region, box):  # only the overlap, straight into place
                view = memoryview(flat[pos:pos + n].view(torch.uint8).numpy()).cast("B")
                if reader.readinto((base + start) * item, view) != view.nbytes:
                    raise BadCheckpoint(_truncated(reader.size, loc.length), path=reader.source)
                pos += n
        finally:
            reader.close()

    def read_object(self, store: Store, obj: ObjectInfo) -> Any:
        if obj.location is None:
            return obj.value
        reader = _open(store, obj.location)
        try:
            archive = TorchFile(reader, reader.size, reader.source)
            self.note_unsafe(reader.source, archive.unsafe, obj.key)
            return archive.materialize(archive.obj)
        finally:
            reader.close()


def _refuse_optimizer(index: CheckpointIndex) -> None:
    """Optimizer state is refused, with :func:`read_common`'s reason when it has one. Even
    state that maps as torch_dist's does is refused: no real zarr checkpoint with optimizer
    state was at hand to check Megatron-Core's layout against. Every writer then refuses it,
    unless the user drops it (--drop-optimizer)."""
    found = next((k for k in index.tensors if k.startswith(f"{OPTIMIZER}.")), None)
    if found is None and index.unmapped is None:  # read_common: no layout without tensors
        return
    index.drop_layout(optim.Layout)
    why = f": {index.unmapped}" if index.unmapped else f" (e.g. {found})"
    index.unmapped = f"optimizer state in Megatron-Core zarr checkpoints is not read yet{why}"


def _add_array(store: Store, rel: str, key: str, index: CheckpointIndex) -> None:
    """One zarr array: a piece per chunk file; stacked layers split as in torch_dist."""
    shape, dtype, chunk, sep = _read_zarray(store, f"{rel}/{ZARRAY}")
    index.files[f"{rel}/{ZARRAY}"] = 1
    nbytes = math.prod(chunk.shape) * dtype.itemsize
    grid = [range(-(-s // c)) for s, c in zip(shape, chunk.shape)]
    pieces = []
    for idx in itertools.product(*grid):
        offsets = tuple(i * c for i, c in zip(idx, chunk.shape))
        lengths = tuple(min(c, s - o) for c, s, o in zip(chunk.shape, shape, offsets))
        file = f"{rel}/{sep.join(map(str, idx)) if idx else '0'}"
        if chunk.fill is None:
            index.files[file] = 1 if chunk.codecs else nbytes
        pieces.append(Piece(Region(key, shape, offsets, lengths),
                            Location(file, 0, None if chunk.codecs else nbytes, chunk)))
    info = TensorInfo(key, shape, dtype)
    if is_stacked(key) and shape:
        split_layers(index, key, info, pieces)
    else:
        info.pieces = pieces
        index.tensors[key] = info


def _object_files(names: list[str]) -> list[str]:
    """The shard files of one ShardedObject: those present, and those its global shape (in
    every file's name, ``shard_<offsets>_<shape>.pt``) says must be there too."""
    found = set()
    for name in names:
        m = _SHARD.match(name)
        if m is None:
            continue
        found.add(name)
        shape = m.group(2)
        for offsets in itertools.product(*(range(int(n)) for n in shape.split(".") if n)):
            found.add(f"shard_{'.'.join(map(str, offsets))}_{shape}.pt")
    return sorted(found)


def _read_zarray(store: Store, rel: str) -> tuple[tuple[int, ...], torch.dtype, _Chunk, str]:
    """(shape, dtype, chunk layout, dimension separator) from a zarr v2 ``.zarray``."""
    source = store.display(rel)
    try:
        meta = json.loads(store.read_small(rel))
        shape, chunks = tuple(int(n) for n in meta["shape"]), tuple(int(n) for n in meta["chunks"])
        fmt, order, dtype_str = meta["zarr_format"], meta.get("order", "C"), meta["dtype"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise BadCheckpoint(f"zarr array metadata cannot be parsed ({bounded(exc, 120)})", path=source) from None
    if fmt != 2:
        raise UnsupportedFormat(f"zarr format {fmt} arrays are not read (Megatron-Core wrote v2)",
                                path=source)
    if len(chunks) != len(shape) or any(c < 1 for c in chunks) or order not in ("C", "F"):
        raise BadCheckpoint(f"zarr array has chunks {list(chunks)} for shape {list(shape)}, "
                            f"order {order!r}", path=source)
    name = _DTYPES.get(re.sub(r"^[<>]([biu]1)$", r"|\1", str(dtype_str)))
    dtype = getattr(torch, name) if name else None
    if dtype is None:
        raise UnsupportedFormat(f"zarr dtype {dtype_str!r} is not read", path=source)
    codecs = list(meta.get("filters") or [])
    if meta.get("compressor"):
        codecs.append(meta["compressor"])
    fill = meta.get("fill_value")
    if fill is not None and not isinstance(fill, (int, float)):
        fill = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(fill)
        if fill is None:
            raise UnsupportedFormat(f"zarr fill_value {meta['fill_value']!r} is not read",
                                    path=source)
    chunk = _Chunk(chunks, order, json.dumps(codecs) if codecs else None, fill)
    return shape, dtype, chunk, meta.get("dimension_separator") or "."


def _unpack(piece: Piece) -> tuple[int | None, Region, _Chunk]:
    """(layer within the chunk or None, the chunk's region, its storage) of a piece."""
    detail = piece.location.detail
    if isinstance(detail, tuple) and detail and detail[0] == STACK_TAG:
        _, layer, chunk_region, chunk = detail
        return layer, chunk_region, chunk
    return None, piece.region, detail


def _open(store: Store, loc: Location):
    try:
        return store.range_reader(loc.file)
    except UnreadableInput:  # the file is not there: the checkpoint is damaged
        what = "object file" if loc.file.endswith(".pt") else "chunk file"
        raise BadCheckpoint(f"{what} is missing", path=store.display(loc.file)) from None


def _truncated(size: int, want: int | None) -> str:
    return f"chunk file is truncated: {size} bytes, the array needs {want}"


def _decode(store: Store, loc: Location, chunk: _Chunk, dtype: torch.dtype,
            key: str) -> torch.Tensor:
    """The whole chunk, shape ``chunk.shape`` (edge chunks are stored padded to it)."""
    if chunk.fill is not None and not store.exists(loc.file):
        return torch.full(chunk.shape, chunk.fill, dtype=dtype)
    reader = _open(store, loc)
    try:
        if loc.length is not None and reader.size < loc.length:
            raise BadCheckpoint(_truncated(reader.size, loc.length), path=reader.source)
        raw = reader(0, reader.size if loc.length is None else loc.length)
    finally:
        reader.close()
    if chunk.codecs:
        raw = _undo_codecs(raw, chunk.codecs, store.display(loc.file))
    want = math.prod(chunk.shape) * dtype.itemsize
    if len(raw) != want:
        raise BadCheckpoint(f"decoded chunk has {len(raw)} bytes, the array needs {want}",
                            path=store.display(loc.file), key=key)
    if not want:
        return torch.empty(chunk.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=dtype)
    if chunk.order == "C":
        return flat.reshape(chunk.shape)
    return flat.reshape(chunk.shape[::-1]).permute(*reversed(range(len(chunk.shape))))


def _undo_codecs(raw: bytes, codecs: str, source: str) -> bytes:
    try:
        import numcodecs  # lazy: only compressed chunks need it
    except ImportError:
        raise UnreadableInput("compressed zarr chunks need numcodecs", path=source,
                              hint="pip install numcodecs") from None
    for config in reversed(json.loads(codecs)):
        try:
            raw = numcodecs.get_codec(dict(config)).decode(raw)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise BadCheckpoint(f"zarr chunk cannot be decoded ({exc})", path=source) from None
        raw = bytes(memoryview(raw).cast("B")) if not isinstance(raw, bytes) else raw
    return raw
