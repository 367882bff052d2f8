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

Chunk bytes are read by range; a compressed chunk (another writer's) is decoded whole, by
ckptool's own bounded decoders for zlib, gzip, bz2 and lzma (never more than the chunk's size
is inflated), and through numcodecs for blosc, lz4 and zstd only after the size their headers
declare is checked. Any other codec or filter (numcodecs' ``pickle`` would run code) is
refused. Megatron-Core 0.16 no longer writes or reads this backend.
"""

from __future__ import annotations

import bz2
import itertools
import json
import lzma
import math
import re
import zlib
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
                _add_array(store, prefix + key, key, index, set(files))
                continue
            try:
                shards = _object_files(files)
            except BadCheckpoint as exc:
                raise BadCheckpoint(exc.message, path=store.display(prefix + key)) from None
            for file in shards:
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
        if chunk.fill is not None and not store.exists(piece.location.file):  # the piece, not
            return torch.full(piece.region.lengths, chunk.fill, dtype=dtype)  # the claimed chunk
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
            _check_size(reader, loc)
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


def _add_array(store: Store, rel: str, key: str, index: CheckpointIndex, present: set[str]) -> None:
    """One zarr array: a piece per chunk file; stacked layers split as in torch_dist.
    ``present``: the names in the array's directory (one listing)."""
    shape, dtype, chunk, sep = _read_zarray(store, f"{rel}/{ZARRAY}")
    index.files[f"{rel}/{ZARRAY}"] = 1
    nbytes = math.prod(chunk.shape) * dtype.itemsize
    grid = [range(-(-s // c)) for s, c in zip(shape, chunk.shape)]
    cells = math.prod(len(g) for g in grid)
    files = len(present - {ZARRAY, ".zattrs"})
    # every chunk is a file (Megatron-Core writes no fill value; a few missing are each named
    # as damage), or a fill value stands in for a bounded number: never a grid, nor a filled
    # tensor, the size of what the header claims
    if cells > files + _ABSENT_CHUNKS:
        raise BadCheckpoint(f"zarr array has a grid of {cells} chunks, but {files} chunk files "
                            "are there", path=store.display(rel))
    filled = 0
    pieces = []
    for idx in itertools.product(*grid):
        offsets = tuple(i * c for i, c in zip(idx, chunk.shape))
        lengths = tuple(min(c, s - o) for c, s, o in zip(chunk.shape, shape, offsets))
        name = sep.join(map(str, idx)) if idx else '0'
        file = f"{rel}/{name}"
        if chunk.fill is None:
            index.files[file] = 1 if chunk.codecs else nbytes
        elif name not in present:
            filled += math.prod(lengths) * dtype.itemsize
            if filled > _FILLED_BYTES:
                raise BadCheckpoint(f"zarr array's absent chunks would be filled with more than "
                                    f"{_FILLED_BYTES >> 20} MiB of its fill value",
                                    path=store.display(rel),
                                    hint="Megatron-Core writes every chunk: this array is damaged "
                                         "or not Megatron-Core's")
        pieces.append(Piece(Region(key, shape, offsets, lengths),
                            Location(file, 0, None if chunk.codecs else nbytes, chunk)))
    info = TensorInfo(key, shape, dtype)
    if is_stacked(key) and shape:
        split_layers(index, key, info, pieces)
    else:
        info.pieces = pieces
        index.tensors[key] = info


_ABSENT_CHUNKS = 1 << 16
"""Chunks of an array that may be absent beyond the files there (missing, or filled)."""
_FILLED_BYTES = 1 << 30
"""What an array's absent chunks may stand for with a fill value."""


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
        dims = [int(n) for n in shape.split(".") if n]
        if math.prod(dims) > len(names) + _ABSENT_CHUNKS:  # never a list the size of a claim
            raise BadCheckpoint(f"object shard {name} names a grid of {math.prod(dims)} shards, "
                                f"but {len(names)} files are there")
        for offsets in itertools.product(*(range(n) for n in dims)):
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
    if any(type(n) is not int or n < 0 for n in (*meta["shape"], *meta["chunks"])):
        raise BadCheckpoint(f"zarr array has shape {bounded(meta['shape'], 80)} and chunks "
                            f"{bounded(meta['chunks'], 80)}: not sizes", path=source)
    if len(chunks) != len(shape) or any(c < 1 for c in chunks) or order not in ("C", "F"):
        raise BadCheckpoint(f"zarr array has chunks {list(chunks)} for shape {list(shape)}, "
                            f"order {order!r}", path=source)
    name = _DTYPES.get(re.sub(r"^[<>]([biu]1)$", r"|\1", str(dtype_str)))
    dtype = getattr(torch, name) if name else None
    if dtype is None:
        raise UnsupportedFormat(f"zarr dtype {dtype_str!r} is not read", path=source)
    if meta.get("filters"):
        raise UnsupportedFormat(f"zarr filters are not read ({bounded(meta['filters'], 80)})",
                                path=source, hint="Megatron-Core writes none")
    codecs = []
    if meta.get("compressor"):
        codecs.append(meta["compressor"])
    fill = meta.get("fill_value")
    if fill is not None and not isinstance(fill, (int, float)):
        fill = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(fill)
        if fill is None:
            raise UnsupportedFormat(f"zarr fill_value {meta['fill_value']!r} is not read",
                                    path=source)
    if fill is not None:
        try:
            torch.full((1,), fill, dtype=dtype)
        except (RuntimeError, OverflowError, TypeError):
            raise BadCheckpoint(f"zarr fill_value {bounded(meta['fill_value'], 40)} is not a "
                                f"{dtype_str} value", path=source) from None
    for config in codecs:
        _codec(config, source)  # refused here, before any chunk is read
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


def _check_size(reader, loc: Location) -> None:
    """A raw chunk file holds exactly the chunk (zarr itself refuses one of another size)."""
    if loc.length is not None and reader.size != loc.length:
        raise BadCheckpoint(_truncated(reader.size, loc.length) if reader.size < loc.length else
                            f"chunk file is {reader.size} bytes, the array's chunk {loc.length}",
                            path=reader.source)


def _decode(store: Store, loc: Location, chunk: _Chunk, dtype: torch.dtype,
            key: str) -> torch.Tensor:
    """The whole chunk, shape ``chunk.shape`` (edge chunks are stored padded to it)."""
    reader = _open(store, loc)
    try:
        _check_size(reader, loc)
        raw = reader(0, reader.size if loc.length is None else loc.length)
    finally:
        reader.close()
    want = math.prod(chunk.shape) * dtype.itemsize
    if chunk.codecs:
        raw = _undo_codecs(raw, chunk.codecs, want, store.display(loc.file))
    if len(raw) != want:
        raise BadCheckpoint(f"decoded chunk has {len(raw)} bytes, the array needs {want}",
                            path=store.display(loc.file), key=key)
    if not want:
        return torch.empty(chunk.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=dtype)
    if chunk.order == "C":
        return flat.reshape(chunk.shape)
    return flat.reshape(chunk.shape[::-1]).permute(*reversed(range(len(chunk.shape))))


_STREAMS = {"zlib": lambda: zlib.decompressobj(), "gzip": lambda: zlib.decompressobj(31),
            "bz2": lambda: bz2.BZ2Decompressor(), "lzma": lambda: lzma.LZMADecompressor()}
"""Compressors ckptool decodes itself, never inflating more than a chunk's size."""
_DECLARED = ("blosc", "lz4", "zstd")
"""Compressors decoded by numcodecs once the size their header declares is checked."""


def _codec(config: Any, source: str) -> str:
    """The id of one codec config of ``.zarray``, refused unless ckptool decodes it safely (no
    filter: numcodecs' ``pickle`` runs code, and none changes Megatron-Core's raw bytes)."""
    codec = config.get("id") if isinstance(config, dict) else None
    if codec not in _STREAMS and codec not in _DECLARED:
        raise UnsupportedFormat(f"zarr codec {bounded(codec if codec is not None else config, 60)} "
                                "is not read", path=source,
                                hint=f"Read: raw chunks, {', '.join((*_STREAMS, *_DECLARED))}")
    if codec == "lzma" and config.get("format") not in (None, 0, 1, 2):  # auto, xz, alone; not raw
        raise UnsupportedFormat("zarr lzma chunks of a raw format are not read", path=source)
    return codec


def _undo_codecs(raw: bytes, codecs: str, want: int, source: str) -> bytes:
    """The chunk's bytes, never more than ``want`` (+1, to see an excess) decoded."""
    configs = json.loads(codecs)
    if len(configs) != 1:  # filters were refused as they were read; one compressor is left
        raise UnsupportedFormat("zarr filters are not read", path=source)
    codec = _codec(configs[0], source)
    try:
        if codec in _STREAMS:
            stream = _STREAMS[codec]()
            out = stream.decompress(raw, want + 1)
            return out
        declared = _declared_size(codec, raw)
        if declared is None or declared != want:
            raise BadCheckpoint(f"{codec} chunk declares {declared} bytes, the array needs {want}",
                                path=source)
        try:
            import numcodecs  # lazy: only these compressed chunks need it
        except ImportError:
            raise UnreadableInput(f"{codec} zarr chunks need numcodecs", path=source,
                                  hint="pip install numcodecs") from None
        out = numcodecs.get_codec(dict(configs[0])).decode(raw)
        return bytes(memoryview(out).cast("B")) if not isinstance(out, bytes) else out
    except (ValueError, KeyError, TypeError, RuntimeError, OSError, EOFError, zlib.error,
            lzma.LZMAError) as exc:
        raise BadCheckpoint(f"zarr chunk cannot be decoded ({bounded(exc, 160)})", path=source) from None


def _declared_size(codec: str, raw: bytes) -> int | None:
    """The decoded size a blosc, lz4 (numcodecs' framing) or zstd chunk's header declares."""
    if codec == "blosc":  # version, versionlz, flags, typesize, then nbytes (uint32 LE)
        return int.from_bytes(raw[4:8], "little") if len(raw) >= 16 else None
    if codec == "lz4":  # numcodecs prefixes the uncompressed size (uint32 LE)
        return int.from_bytes(raw[:4], "little") if len(raw) >= 4 else None
    # zstd frame: magic, descriptor, [window], [dictionary id], frame content size
    if len(raw) < 6 or raw[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = raw[4]
    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    n = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if n == 0 or len(raw) < at + n:
        return None  # the frame does not say: never decoded blind
    size = int.from_bytes(raw[at:at + n], "little")
    return size + 256 if n == 2 else size
