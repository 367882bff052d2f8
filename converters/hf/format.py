"""Hugging Face checkpoints: ``config.json`` + ``model.safetensors``, or sharded
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``.

The names and the config are :mod:`converters.schemas.hf`'s: one table per model family
says which regions of the canonical (Megatron-Core) global tensors each HF tensor holds;
the reader and the writer both use it, so a quirk is written once.

Vocabulary rule: the HF model gets the true vocabulary size (``--true-vocab-size``, or
what the source records). When the true size is unknown, it gets every stored row (the
source's padded size), so a real row is never dropped; ``config.json`` then says so.
Reading never loads a whole file: each piece is a byte range of one safetensors tensor.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, replace

from ckptool.core.engine import TargetFile, TargetTensor, cast
from ckptool.core.errors import BadCheckpoint, UnreadableInput, UsageError
from ckptool.core.index import (
    CheckpointIndex,
    Location,
    Piece,
    Reader,
    TensorInfo,
    Writer,
)
from ckptool.core.jsonfile import json_object
from ckptool.core.layout import ModelSpec, model_spec
from ckptool.core.lazy import lazy
from ckptool.core.manifest import HashingWriter
from ckptool.core.optimizer import state_shard
from ckptool.core.regions import Region, Shard
from ckptool.core.stfile import code_of
from ckptool.core.stfile import parse_header
from ckptool.core.storage import Store
from ckptool.core.topology import Topology
from ckptool.core.view import Entry as HfTensor
from ckptool.core.view import remap, stored_box
from converters.schemas.hf import (
    CONFIG,
    HfModel,
    config_for,
    family_of,
    family_of_config,
    hf_tensors,
    refuse_schema_field,
    spec_from_config,
    unknown_model,
    unplaced_tensors,
)

torch = lazy("torch", globals())

NAME = "hf"
WRITER_KEY, WRITER = "writer", "ckptool"
"""ckptool's mark in the safetensors ``__metadata__`` of the weight files it writes (transformers
reads only ``format`` there)."""
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
WEIGHT_FILES = (SINGLE, INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
"""``--dtype`` spellings by torch dtype name."""


# --------------------------------------------------------------------------- reading


class HfReader(Reader):
    name = NAME
    model_family: str | None = None
    """Set by ``--model-family`` when config.json does not say."""

    def __init__(self):
        self._files: dict[tuple[str, str], tuple] = {}
        self._lock = threading.Lock()

    @classmethod
    def detect(cls, store: Store) -> bool:
        return store.exists(CONFIG) and any(store.exists(f) for f in WEIGHT_FILES)

    def configure(self, *, model_family: str | None = None, **unknown) -> None:
        super().configure(**unknown)
        self.model_family = model_family

    def read_index(self, store: Store) -> CheckpointIndex:
        return self._stored(store)[1]

    def native(self, store: Store, index: CheckpointIndex) -> CheckpointIndex:
        """The model's tensors under their HF names, in ``named_parameters()`` order."""
        stored, _, table = self._stored(store)
        stored.tensors = {e.name: stored.tensors[e.name] for e in table}
        return stored

    def _stored(self, store: Store) -> tuple[CheckpointIndex, CheckpointIndex, list[HfTensor]]:
        """(the index under stored names, the canonical index, the family's table)."""
        config = json_object(store.read_small(CONFIG), store.display(CONFIG), "config.json")
        family = family_of_config(config, self.model_family, store.display(CONFIG))
        spec = spec_from_config(config, family)
        weight_map = self._weight_map(store)
        stored = CheckpointIndex(format=NAME, url=store.url, topology=Topology(),
                                 model_config=asdict(spec), true_vocab_size=spec.vocab_size,
                                 iteration=None)
        stored.files = {f: 1 for f in sorted(set(weight_map.values()))}
        stored.files[CONFIG] = 1
        for name, file in weight_map.items():
            entry = self._entries(store, file).get(name)
            if entry is None:
                raise BadCheckpoint(f"{name} is not in {file}", path=store.display(file))
            stored.tensors[name] = TensorInfo(name, tuple(entry.shape), entry.dtype, [
                Piece(Region.whole(name, tuple(entry.shape)), Location(file, detail=name))])
        table = hf_tensors(spec, family, spec.vocab_size)
        view = remap(stored, table)
        if view.missing:
            refuse_schema_field(config, family, store.display(CONFIG))
            raise BadCheckpoint(f"{len(view.missing)} tensors of a {family} model are missing, e.g. "
                                f"{', '.join(view.missing[:3])}", path=store.url)
        model = HfModel(config, family, unplaced=unplaced_tensors(view.unused, spec, family))
        # ckptool's mark in the weight files: without its manifest, such an output is uncommitted
        # (an object store's, killed before the manifest that commits it), not a foreign model
        stored.written_by_ckptool = view.index.written_by_ckptool = \
            any(self._marked(store, f) for f in sorted(set(weight_map.values())))
        stored.set_layout(model)
        view.index.set_layout(model)
        return stored, view.index, table

    def _weight_map(self, store: Store) -> dict[str, str]:
        if store.exists(INDEX):
            try:
                weight_map = dict(json.loads(store.read_small(INDEX))["weight_map"])
            except (ValueError, KeyError, TypeError, RecursionError):
                raise BadCheckpoint("model.safetensors.index.json has no weight_map",
                                    path=store.display(INDEX)) from None
            for name, file in weight_map.items():  # every file it names stays inside
                store.contained(file, named_by=INDEX, key=name)
            return weight_map
        if store.exists(SINGLE):
            return {name: SINGLE for name in self._entries(store, SINGLE)}
        raise UnreadableInput("only safetensors weights are read (pytorch_model.bin is a pickle)",
                              path=store.url, hint="Save the model with safe_serialization=True")

    def _file(self, store: Store, file: str):
        key = (store.url, file)
        with self._lock:
            if key not in self._files:
                reader = store.range_reader(file)
                entries, metadata = parse_header(reader, store.display(file))
                self._files[key] = (reader, entries, metadata)
            return self._files[key]

    def _entries(self, store: Store, file: str):
        return self._file(store, file)[1]

    def _marked(self, store: Store, file: str) -> bool:
        """Whether ckptool wrote ``file`` (its safetensors ``__metadata__`` says so)."""
        return self._file(store, file)[2].get(WRITER_KEY) == WRITER

    def read_box_into(self, store: Store, piece: Piece, dtype: torch.dtype, box, out) -> None:
        """Read canonical ``box`` of the piece: the stored rows it spans, as one byte range."""
        piece, (offsets, lengths), out = stored_box(piece, box, out)
        name = piece.location.detail
        reader, entries, _ = self._file(store, piece.location.file)
        entry = entries[name]
        row = math.prod(entry.shape[1:])
        data = _read(reader, entry, offsets[0], lengths[0], row).view(lengths[0], *entry.shape[1:])
        out.copy_(data[(slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:])))])

    def read_piece(self, store: Store, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(piece.region.local_shape, dtype=dtype)
        self.read_box_into(store, piece, dtype, piece.region.box, out)
        return out

    def read_box(self, store: Store, piece: Piece, dtype: torch.dtype, box) -> torch.Tensor:
        out = torch.empty(box[1], dtype=dtype)
        self.read_box_into(store, piece, dtype, box, out)
        return out


def _read(reader, entry, first: int, count: int, row: int) -> torch.Tensor:
    item = entry.dtype.itemsize
    begin = entry.begin + first * row * item
    end = begin + count * row * item
    if end > entry.end:
        raise BadCheckpoint("tensor data is shorter than its header says", path=reader.source)
    raw = reader(begin, end)
    if len(raw) != end - begin:
        raise BadCheckpoint("safetensors file is truncated", path=reader.source)
    return torch.frombuffer(bytearray(raw), dtype=entry.dtype)


# --------------------------------------------------------------------------- writing


class HfWriter(Writer):
    """Writes ``config.json`` and safetensors shards (``--max-shard-size``, ``--dtype``)."""

    name = NAME
    holds_optimizer = False
    reshards = False

    def __init__(self):
        self.max_shard_size = 5 << 30
        self.dtype: torch.dtype | None = None
        self.model_family: str | None = None
        self._config: dict | None = None
        self._source_family: str | None = None

    def configure(self, *, max_shard_size: int | None = None, dtype: str | None = None,
                  model_family: str | None = None, **unknown) -> None:
        super().configure(**unknown)
        if max_shard_size:
            self.max_shard_size = int(max_shard_size)
        if dtype:
            self.dtype = getattr(torch, DTYPES[dtype])
        self.model_family = model_family

    def target_spec(self, index: CheckpointIndex, source: Topology, target: Topology,
                    true_vocab_size: int | None) -> ModelSpec:
        if index.model_config is None:
            raise unknown_model(index)
        # one stage: a pipeline split the source recorded for its own PP says nothing here
        spec = replace(model_spec(index.model_config, index.url), first_stage_layers=None,
                       last_stage_layers=None)
        vocab = true_vocab_size or index.true_vocab_size or spec.global_vocab_rows
        if vocab > spec.global_vocab_rows:
            raise UsageError(f"the vocabulary ({vocab}) exceeds the {spec.global_vocab_rows} stored rows")
        self._vocab = vocab
        return spec

    def target_topology(self, source: Topology, changes: dict) -> Topology:
        """One unsharded model, whatever the source's layout."""
        if any(changes.get(k, 1) != 1 for k in ("tp", "pp")):
            raise UsageError("Hugging Face checkpoints are not model-parallel",
                             hint="Drop --tp/--pp for --to hf")
        return Topology()

    def bind(self, opened) -> None:
        model = opened.index.layout(HfModel)
        self._config = model.config if model is not None else None
        self._source_family = model.family if model is not None else None

    def source_schema(self, opened) -> str:
        return NAME

    def plan(self, index: CheckpointIndex, topo: Topology, spec: ModelSpec, schema: str,
             with_optimizer: bool = True) -> list[TargetFile]:
        tensors = self._tensors = self.model_tensors(index, spec)
        self._dtype = self.dtype or index.model_dtype or _common_dtype(index, tensors)
        shards = {t.name: _weights(index, t.shard) for t in tensors}
        groups: list[list[HfTensor]] = [[]]
        size = 0
        for t in tensors:
            n = math.prod(t.shape) * self._dtype.itemsize
            if groups[-1] and size + n > self.max_shard_size:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += n
        names = [SINGLE] if len(groups) == 1 else \
            [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        self._weight_map = {t.name: f for f, g in zip(names, groups) for t in g}
        files = []
        for name, group in zip(names, groups):
            files.append(TargetFile(name, [
                TargetTensor(t, shards[t.name], index.tensors[shards[t.name].regions[0].key].dtype
                             if shards[t.name].regions[0].key in index.tensors else self._dtype)
                for t in group]))
        return files

    def write_file(self, store: Store, target: TargetFile, produce, index: CheckpointIndex,
                   true_vocab_size: int | None) -> tuple[int, str]:
        header, at = {"__metadata__": {"format": "pt", WRITER_KEY: WRITER}}, 0
        for t in target.tensors:
            n = math.prod(t.name.stored_shape) * self._dtype.itemsize
            header[t.name.name] = {"dtype": code_of(self._dtype), "shape": list(t.name.stored_shape),
                                   "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with store.open_file(target.path, "wb") as f:
            out = HashingWriter(f, store.durable)
            out.write(len(raw).to_bytes(8, "little") + raw)
            for t in target.tensors:
                data = cast(produce(t), self._dtype, t.name.name, index.url,
                            "Convert with --dtype bf16 or fp32")
                if t.name.transposed:
                    data = data.t()
                out.write(memoryview(data.contiguous().view(torch.uint8).numpy()))
            out.fsync()
        return out.size, out.hexdigest()

    def model_tensors(self, index: CheckpointIndex, spec: ModelSpec) -> list[HfTensor]:
        """The tensors written, with the canonical regions each holds: the family's table."""
        # the source's family when it has one (a Phi-3 stays a Phi-3), else the first that fits
        self._family, self._spec = family_of(spec, self.model_family or self._source_family), spec
        return hf_tensors(spec, self._family, self._vocab)

    def config_json(self) -> dict:
        return config_for(self._spec, self._family, self._vocab, self._dtype, self._config)

    def finalize(self, store: Store, index: CheckpointIndex) -> list[str]:
        config = self.config_json()
        store.write_bytes(CONFIG, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        written = [CONFIG]
        if len(set(self._weight_map.values())) > 1:
            total = sum(math.prod(t.stored_shape) * self._dtype.itemsize for t in self._tensors)
            body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self._weight_map.items()))}
            store.write_bytes(INDEX, (json.dumps(body, indent=2) + "\n").encode())
            written.append(INDEX)
        return written


def _weights(index: CheckpointIndex, shard: Shard) -> Shard:
    """Where the weights come from: the fp32 master copies when the source has them (a
    mixed-precision optimizer's, as DeepSpeed's zero_to_fp32 takes them), else the model's.
    The model's low-precision weights are the masters rounded, so any --dtype is as exact."""
    masters = state_shard("fp32_param", shard)
    return masters if all(r.key in index.tensors for r in masters.regions) else shard


def _common_dtype(index: CheckpointIndex, tensors: list[HfTensor]) -> torch.dtype:
    dtypes = {index.tensors[r.key].dtype for t in tensors for _, r in t.parts if r.key in index.tensors}
    if len(dtypes) == 1:
        return dtypes.pop()
    if not dtypes:
        return torch.float32
    raise UsageError(f"the source mixes dtypes ({', '.join(sorted(map(str, dtypes)))})",
                     hint="Pick one with --dtype bf16|fp16|fp32")


__all__ = ["HfReader", "HfWriter"]
