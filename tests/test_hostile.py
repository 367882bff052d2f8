"""Hostile and damaged checkpoints of every format ckptool reads, through the CLI.

Each case takes a real checkpoint (written by transformers, torch DCP, megatron-core,
DeepSpeed or ckptool itself), damages it or plants something hostile in it, and runs every
command that applies. Each must end within seconds with exit 1 or 2 and one line on
stderr naming the reason (verify: its report on stdout), with no traceback; no payload
runs; nothing in the scratch directory changes (no DST, no ``DST.tmp-*``, the decoys
outside the checkpoint untouched); and no allocation beyond a bound is made (the
address space is capped while the commands run).
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import resource
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from tests.conftest import CliResult, peer, sample_state
from tests.harness import deepspeed_engine as DH
from tests.harness import mcore as MH
from tests.harness.damage import edit_manifest, patch, truncate

REPO = Path(__file__).resolve().parents[1]
SECONDS = 30
"""What "within seconds" means for one command here (the slowest seen: ~3 s, on a busy
2-core machine)."""
HEADROOM = 2 << 30
"""Address space a command may add to what the test process already maps."""


class Call:
    """Pickles as a call of ``fn(*args)``: what a hostile checkpoint plants."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


# ------------------------------------------------------------------------ sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """One real checkpoint per format, written once; each case works on a copy."""
    base = tmp_path_factory.mktemp("sources")
    made = {"dcp": base / "dcp"}
    dcp.save(sample_state(), checkpoint_id=str(made["dcp"]))
    transformers = peer("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(base / "hf", max_shard_size="8KB")
    made["hf"] = base / "hf"
    peer("megatron.core")
    MH.save_real(MH.LLAMA, 2, base / "megatron")
    made["megatron"] = base / "megatron"
    MH.save_dist(MH.LLAMA, 1, base / "megatron-dist")
    made["megatron-dist"] = base / "megatron-dist"
    peer("deepspeed")
    DH.save(base / "ds", [1], dp=2)
    made["deepspeed"] = base / "ds" / "z1"
    from converters import dcp as ckptool_dcp

    ckptool_dcp.save(sample_state(), str(base / "sealed"), iteration=1, topology={"tp": 1, "pp": 1, "dp": 1})
    made["sealed"] = base / "sealed"
    import ckptool

    ckptool.convert(str(made["deepspeed"]), str(base / "universal"), to_format="deepspeed-universal")
    made["deepspeed-universal"] = base / "universal"
    made["megatron-zarr"] = REPO / "tests" / "data" / "mcore_zarr" / "llama_bf16"
    return made


COMMANDS = {
    "hf": [["inspect"], ["verify"], ["verify", "--deep"], ["convert", "DST", "--to", "dcp"],
           ["convert", "DST", "--to", "megatron", "--tp", "2"]],
    "dcp": [["inspect"], ["verify"], ["verify", "--deep"], ["convert", "DST", "--to", "dcp"],
            ["reshard", "DST", "--to-dp", "2"]],
    "sealed": [["inspect"], ["verify"], ["verify", "--deep"], ["reshard", "DST", "--to-dp", "2"]],
    "megatron": [["inspect"], ["verify"], ["verify", "--deep"],
                 ["convert", "DST", "--to", "megatron-dist"], ["reshard", "DST", "--to-pp", "2"]],
    "megatron-dist": [["inspect"], ["verify"], ["verify", "--deep"],
                      ["convert", "DST", "--to", "megatron"], ["reshard", "DST", "--to-pp", "2"]],
    "deepspeed": [["inspect"], ["verify"], ["verify", "--deep"], ["convert", "DST", "--to", "dcp"],
                  ["reshard", "DST", "--to-dp", "1"]],
    "deepspeed-universal": [["inspect"], ["verify"], ["convert", "DST", "--to", "deepspeed"]],
    "megatron-zarr": [["inspect"], ["verify"], ["verify", "--deep"],
                      ["convert", "DST", "--to", "megatron-dist"]],
}


# ------------------------------------------------------------------------ mutations


def _meg_rank_file(root: Path, tp: int = 0) -> Path:
    return root / "iter_0000010" / f"mp_rank_{tp:02d}" / "model_optim_rng.pt"


def _edit_torch_file(path: Path, edit: Callable[[dict], None]) -> None:
    obj = torch.load(path, weights_only=False)  # the test's own file, written by a real peer
    edit(obj)
    torch.save(obj, path)


def _edit_metadata(root: Path, edit: Callable) -> None:
    meta = pickle.loads((root / ".metadata").read_bytes())
    edit(meta)
    (root / ".metadata").write_bytes(pickle.dumps(meta))


def _storage(meta, fqn: str):
    return next(v for k, v in meta.storage_data.items() if k.fqn == fqn)


def _edit_st_header(path: Path, edit: Callable[[dict], None]) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _tensors(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _first_shard(root: Path) -> Path:
    return sorted(root.glob("model-*.safetensors"))[0]


def _decoy(case, src: Path) -> Path:
    """A copy of ``src`` outside the checkpoint: a reader that followed a path out would
    find a perfectly good file there."""
    out = case.outside / src.name
    shutil.copy(src, out)
    return out


def _weight_map_to(case, target: Callable[[Path], str]) -> None:
    index = case.ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(iter(data["weight_map"]))
    decoy = _decoy(case, case.ckpt / data["weight_map"][name])
    data["weight_map"][name] = target(decoy)
    index.write_text(json.dumps(data))


def _symlink(case, rel: str, target: Path | str) -> None:
    (case.ckpt / rel).unlink()
    os.symlink(target, case.ckpt / rel)


def _fifo(case, rel: str) -> None:
    (case.ckpt / rel).unlink()
    os.mkfifo(case.ckpt / rel)


def _zarr_chunk_symlink(case) -> None:
    array = case.ckpt / "iter_0000010" / "embedding.word_embeddings.weight"
    chunk = next(p for p in sorted(array.iterdir()) if not p.name.startswith("."))
    _symlink(case, str(chunk.relative_to(case.ckpt)), _decoy(case, chunk))


def _rename_local_record(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x03\x04", raw.index(b"/data/0") - 200)  # the local header of data/0
    name_at = raw.index(b"/data/0", at)
    raw[name_at:name_at + 7] = b"/data/X"
    path.write_bytes(bytes(raw))


@dataclass
class Case:
    name: str
    source: str
    mutate: Callable
    words: str
    """What every refusing command must say."""
    codes: dict = field(default_factory=dict)
    """Command name -> expected exit code where it is not the default (1)."""
    fifo: bool = False
    """Run in a subprocess with a timeout (a read that blocks cannot be interrupted in-process)."""
    pickle: bool = False
    """A hostile pickle: inspect warns and goes on (exit 0); verify reports it (exit 1);
    convert and reshard refuse it (exit 2)."""
    commands: list | None = None
    """The commands that apply, where not all of the source format's."""


def _hf_symlink_decoy(c):
    shard = _first_shard(c.ckpt)
    _symlink(c, shard.name, _decoy(c, shard))


CASES = [
    # ---- paths that leave the checkpoint
    Case("hf-index-dotdot", "hf", lambda c: _weight_map_to(c, lambda d: f"../outside/{d.name}"),
         "leaves the checkpoint"),
    Case("hf-index-absolute", "hf", lambda c: _weight_map_to(c, str), "is absolute"),
    Case("hf-symlink-out", "hf", _hf_symlink_decoy, "outside the checkpoint"),
    Case("hf-symlink-etc", "hf", lambda c: _symlink(c, _first_shard(c.ckpt).name, "/etc/hostname"),
         "outside the checkpoint"),
    Case("dcp-storage-dotdot", "dcp", lambda c: (_decoy(c, c.ckpt / "__0_0.distcp"), _edit_metadata(
        c.ckpt, lambda m: setattr(_storage(m, "model.embedding.weight"), "relative_path",
                                  "../outside/__0_0.distcp"))), "leaves the checkpoint"),
    Case("dcp-storage-absolute", "dcp", lambda c: _edit_metadata(c.ckpt, lambda m: setattr(
        _storage(m, "model.norm.weight"), "relative_path", str(_decoy(c, c.ckpt / "__0_0.distcp")))),
         "is absolute"),
    Case("megatron-rank-symlink", "megatron", lambda c: _symlink(
        c, "iter_0000010/mp_rank_01/model_optim_rng.pt", _decoy(c, _meg_rank_file(c.ckpt, 1))),
         "outside the checkpoint"),
    Case("deepspeed-latest-dotdot", "deepspeed", lambda c: (c.ckpt / "latest").write_text("../outside"),
         "leaves the checkpoint"),
    Case("manifest-symlink-listed", "sealed", lambda c: _plant_listed_symlink(c), "outside the checkpoint",
         commands=[["verify"], ["verify", "--deep"]]),  # nothing else reads a file the format does not name
    Case("manifest-entry-dotdot", "sealed", lambda c: _edit_manifest(
        c, lambda m: m["files"][0].update(path="../outside/x")), "leaves the checkpoint"),
    Case("manifest-entry-size", "sealed", lambda c: _edit_manifest(
        c, lambda m: m["files"][0].update(size=-1)), "has size -1"),
    Case("manifest-entry-hash", "sealed", lambda c: _edit_manifest(
        c, lambda m: m["files"][0].update(xxh3_128="abc")), "has no xxh3-128 hash"),
    Case("manifest-topology-zero", "sealed", lambda c: _edit_manifest(  # exit 2, no file named
        c, lambda m: m["topology"].update(tp=0)), "must be a positive integer"),
    # each of these verify refused, and reshard and convert wrote a new checkpoint from
    Case("manifest-files-dict", "sealed", lambda c: _edit_manifest(c, lambda m: m.update(files={})),
         "files is dict, not a list"),
    Case("manifest-entry-empty-path", "sealed", lambda c: _edit_manifest(
        c, lambda m: m["files"].append(dict(path="", size=0, xxh3_128="0" * 32))), "names no file"),
    Case("manifest-entry-huge-size", "sealed", lambda c: _edit_manifest(
        c, lambda m: m["files"][0].update(size=10 ** 40)), "has size 1000"),
    Case("manifest-lists-absent-file", "sealed", lambda c: _edit_manifest(
        c, lambda m: m["files"].append(dict(path="notes.txt", size=5, xxh3_128="0" * 32))),
         "notes.txt", codes={"inspect": 0}),  # inspect reads no listed file
    Case("manifest-true-vocab-bool", "sealed", lambda c: _edit_manifest(  # isinstance(True, int)
        c, lambda m: m.update(true_vocab_size=True)), "field true_vocab_size is True"),
    # a data file dropped from the manifest, then damaged: no hash covered it (verify said OK)
    Case("manifest-data-unlisted", "sealed", lambda c: (
        _edit_manifest(c, lambda m: m.update(files=[f for f in m["files"] if not f["path"].endswith(".distcp")])),
        patch(c.ckpt / "__0_0.distcp", (c.ckpt / "__0_0.distcp").stat().st_size // 2, b"\xff")),
         "not in the manifest, so no checksum", commands=[["verify"], ["verify", "--deep"]]),
    # the same for the metadata file every read goes through (verify warned and said OK)
    Case("manifest-metadata-unlisted", "sealed", lambda c: _edit_manifest(
        c, lambda m: m.update(files=[f for f in m["files"] if f["path"] != ".metadata"])),
         "not in the manifest, so no checksum", commands=[["verify"], ["verify", "--deep"]]),
    # ---- metadata files far larger than any real one (zeros after the document: sparse, no disk);
    # each was read whole: 3 GB of RSS and a minute, or MemoryError, exit 2
    Case("manifest-sparse", "sealed", lambda c: os.truncate(c.ckpt / "ckptool.json", 300 << 20),
         "more than any such file ckptool reads"),
    Case("hf-config-sparse", "hf", lambda c: os.truncate(c.ckpt / "config.json", 300 << 20),
         "more than any such file ckptool reads"),
    Case("hf-index-sparse", "hf", lambda c: os.truncate(c.ckpt / "model.safetensors.index.json", 300 << 20),
         "more than any such file ckptool reads"),
    Case("dcp-metadata-sparse", "dcp", lambda c: os.truncate(c.ckpt / ".metadata", 300 << 20),
         "more than all the data it describes"),
    # ---- pointers to what is not there
    Case("megatron-tracker-missing", "megatron",
         lambda c: (c.ckpt / "latest_checkpointed_iteration.txt").write_text("99"),
         "names iter_0000099, which does not exist"),
    Case("megatron-dist-tracker-missing", "megatron-dist",
         lambda c: (c.ckpt / "latest_checkpointed_iteration.txt").write_text("7"),
         "names iter_0000007, which does not exist"),
    Case("universal-latest-missing", "deepspeed-universal",
         lambda c: ((c.ckpt / "latest_universal").write_text("global_step999"),
                    (c.ckpt / "ckptool.json").unlink()),  # else verify reports the manifest's mismatch
         "latest_universal names global_step999, which does not exist"),
    Case("zarr-chunk-symlink", "megatron-zarr", lambda c: _zarr_chunk_symlink(c), "outside the checkpoint",
         codes={"inspect": 0}),  # inspect reads the arrays' metadata, not their chunks
    Case("zarr-common-mkdir", "megatron-zarr", lambda c: _edit_torch_file(
        c.ckpt / "iter_0000010" / "common.pt", lambda o: o.update(rng_state=Call(os.mkdir, str(c.marker)))),
         "posix.mkdir", pickle=True),
    Case("deepspeed-latest-missing", "deepspeed",
         lambda c: (c.ckpt / "latest").write_text("global_step999"),
         "latest names global_step999, which does not exist"),
    # ---- hostile pickles
    Case("dcp-object-mkdir", "dcp", lambda c: _plant_dcp_object(c), "posix.mkdir", pickle=True),
    Case("megatron-rng-mkdir", "megatron", lambda c: _edit_torch_file(
        _meg_rank_file(c.ckpt, 0), lambda o: o.update(rng_state=[Call(os.mkdir, str(c.marker))])),
         "posix.mkdir", pickle=True),
    Case("megatron-args-system-rank0", "megatron", lambda c: _edit_torch_file(
        _meg_rank_file(c.ckpt, 0), lambda o: o.update(args=Call(os.system, f"touch {c.marker}"))),
         "posix.system", pickle=True, codes={"inspect": 2}),  # no args: nothing to show
    Case("megatron-args-system-rank1", "megatron", lambda c: _edit_torch_file(
        _meg_rank_file(c.ckpt, 1), lambda o: o.update(args=Call(os.system, f"touch {c.marker}"))),
         "posix.system", pickle=True),
    Case("megatron-dist-says-zarr", "megatron-dist", lambda c: _edit_json(  # verify said OK, 0 tensors
        c.ckpt / "iter_0000010" / "metadata.json", lambda d: d.update(sharded_backend="zarr")),
         "no zarr array"),
    Case("megatron-dist-stacked-huge", "megatron-dist", lambda c: _edit_metadata(  # 91 s, 5.8 GB before
        c.ckpt / "iter_0000010", _huge_stack), "stacked tensor claims 1099511627776 layers"),
    Case("megatron-dist-common-system", "megatron-dist", lambda c: _edit_torch_file(
        c.ckpt / "iter_0000010" / "common.pt",
        lambda o: o.update(rng_state=Call(os.system, f"touch {c.marker}"))), "posix.system", pickle=True),
    Case("deepspeed-shape-mkdir", "deepspeed", lambda c: _edit_torch_file(  # a call where a shape is
        next((c.ckpt / "global_step2").glob("mp_rank_00_model_states.pt")),
        lambda o: o["param_shapes"][0].update({next(iter(o["param_shapes"][0])): Call(os.mkdir, str(c.marker))})),
         "posix.mkdir", pickle=True, codes={"inspect": 2}),  # no shapes: no layout to show
    Case("deepspeed-dp-huge", "deepspeed", lambda c: _edit_torch_file(  # list(range(2**40)) before
        next((c.ckpt / "global_step2").glob("mp_rank_00_model_states.pt")),
        lambda o: o.update(dp_world_size=1 << 40)), "dp_world_size is 1099511627776"),
    Case("deepspeed-scheduler-mkdir", "deepspeed", lambda c: _edit_torch_file(
        next((c.ckpt / "global_step2").glob("mp_rank_00_model_states.pt")),
        lambda o: o.update(lr_scheduler=Call(os.mkdir, str(c.marker)))), "posix.mkdir", pickle=True),
    # ---- damaged containers, caught by plain verify from metadata alone
    Case("hf-offsets-past-end", "hf", lambda c: _edit_st_header(_first_shard(c.ckpt), _grow_last),
         "truncated"),
    Case("hf-truncated", "hf", lambda c: truncate(_first_shard(c.ckpt), 100), "truncated"),
    Case("hf-overlap", "hf", lambda c: _edit_st_header(_first_shard(c.ckpt), lambda h: _overlap(h)),
         "overlaps"),
    Case("hf-huge-header", "hf", lambda c: patch(_first_shard(c.ckpt), 0, struct.pack("<Q", 1 << 60)),
         "does not fit the file"),
    Case("hf-huge-shape", "hf", lambda c: _edit_st_header(_first_shard(c.ckpt), lambda h: h[
        _tensors(h)[0]].update(shape=[1 << 40, 1 << 40])), "bytes, not"),
    Case("dcp-huge-length", "dcp", lambda c: _edit_metadata(c.ckpt, _huge_last_length), "truncated",
         codes={"inspect": 0}),  # inspect reads metadata only; the file's size is verify's
    Case("dcp-huge-shape", "dcp", lambda c: _edit_metadata(c.ckpt, lambda m: _huge_dcp_tensor(m)), "needs"),
    Case("dcp-overlap", "dcp", lambda c: _edit_metadata(c.ckpt, lambda m: setattr(
        _storage(m, "model.norm.weight"), "offset", _storage(m, "model.layers.0.bias").offset)), "overlap"),
    Case("dcp-chunk-outside", "dcp", lambda c: _edit_metadata(c.ckpt, lambda m: _chunk_outside(m)),
         "is outside"),
    Case("dcp-negative-length", "dcp", lambda c: _edit_metadata(c.ckpt, lambda m: setattr(
        _storage(m, "model.norm.weight"), "length", -1)), "malformed storage entry"),
    Case("dcp-storage-not-a-record", "dcp", lambda c: _edit_metadata(c.ckpt, lambda m: m.storage_data.update(
        {next(iter(m.storage_data)): "__0_0.distcp"})), "malformed storage entry"),
    # parsed, into something other than DCP's records (was the catch-all's exit 2)
    Case("dcp-metadata-a-dict", "dcp", lambda c: (c.ckpt / ".metadata").write_bytes(pickle.dumps({})),
         "DCP metadata is malformed"),
    Case("dcp-tensor-entry-an-int", "dcp", lambda c: _edit_metadata(c.ckpt, lambda m: m.state_dict_metadata.update(
        {next(iter(m.state_dict_metadata)): 5})), "DCP metadata is malformed"),
    Case("dcp-duplicate-storage", "dcp", lambda c: _edit_metadata(c.ckpt, _duplicate_entry),
         "two storage entries"),
    Case("dcp-metadata-memo-bomb", "dcp", lambda c: (c.ckpt / ".metadata").write_bytes(
        _memo_bomb((c.ckpt / ".metadata").read_bytes())), "memo index 67108864"),
    # the pickle's first frame claims 2**64 - 1 bytes (an OverflowError the parse did not catch)
    Case("dcp-metadata-frame", "dcp", lambda c: patch(c.ckpt / ".metadata", 3, b"\xff" * 8),
         "DCP metadata cannot be parsed"),
    Case("megatron-zip-renamed-record", "megatron", lambda c: _rename_local_record(_meg_rank_file(c.ckpt)),
         "in its local header", codes={"inspect": 1}),
    Case("megatron-truncated", "megatron", lambda c: truncate(_meg_rank_file(c.ckpt, 1), 4096),
         "not a readable torch.save archive"),
    Case("megatron-shard-dtype", "megatron", lambda c: _edit_torch_file(  # was cast silently
        _meg_rank_file(c.ckpt, 1), lambda o: o["model"].update(
            {k: v.to(torch.int64) for k, v in o["model"].items() if k.endswith("linear_qkv.weight")})),
         "disagree on the dtype"),
    # a memo index ahead of the entries made: CPython's unpickler zero-fills 16 x 2**26 bytes
    Case("megatron-memo-bomb", "megatron", lambda c: _rezip_pickle(_meg_rank_file(c.ckpt, 1), _memo_bomb),
         "memo index 67108864"),
    Case("megatron-zip-version", "megatron", lambda c: _zip_version(_meg_rank_file(c.ckpt, 1), 0x80),
         "zip file version 12.8"),
    # ---- reads that could block
    # a subprocess per command (~3 s each): the commands that open the file, not all
    Case("dcp-metadata-fifo", "dcp", lambda c: _fifo(c, ".metadata"), "FIFO", fifo=True,
         commands=[["inspect"], ["verify"], ["convert", "DST", "--to", "dcp"]]),
    Case("hf-config-fifo", "hf", lambda c: _fifo(c, "config.json"), "FIFO", fifo=True,
         commands=[["inspect"], ["verify"], ["convert", "DST", "--to", "dcp"]]),
]


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _memo_bomb(data: bytes) -> bytes:
    """The pickle with its first memo entry made at index 2**26 (``LONG_BINPUT``)."""
    ops = list(pickletools.genops(data))
    i = next(i for i, (op, _, _) in enumerate(ops) if op.name in ("BINPUT", "MEMOIZE"))
    return data[:ops[i][2]] + b"r" + struct.pack("<I", 1 << 26) + data[ops[i + 1][2]:]


def _rezip_pickle(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """A torch.save archive written again with ``edit(data.pkl)``, its other records as they are."""
    import zipfile

    with zipfile.ZipFile(path) as old:
        records = [(info.filename, old.read(info)) for info in old.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as new:
        for name, data in records:
            new.writestr(name, edit(data) if name.endswith("/data.pkl") else data)


def _zip_version(path: Path, version: int) -> None:
    """The first central directory entry's "version needed to extract" (zipfile refuses one
    above 6.3 with NotImplementedError)."""
    data = path.read_bytes()
    patch(path, data.index(b"PK\x01\x02") + 6, bytes([version]))


def _grow_last(header: dict) -> None:
    """The last tensor claims 4 more rows than the file holds (its header stays consistent)."""
    last = header[_tensors(header)[-1]]
    begin, end = last["data_offsets"]
    row = (end - begin) // last["shape"][0]
    last.update(shape=[last["shape"][0] + 4, *last["shape"][1:]], data_offsets=[begin, end + 4 * row])


def _overlap(header: dict) -> None:
    first, second = _tensors(header)[:2]
    header[second].update(dtype=header[first]["dtype"], shape=header[first]["shape"],
                          data_offsets=header[first]["data_offsets"])


def _huge_last_length(meta) -> None:
    """The file's last item claims 2**60 bytes."""
    last = max(meta.storage_data.values(), key=lambda info: info.offset)
    last.length = 1 << 60


def _duplicate_entry(meta) -> None:
    """Two storage entries for one chunk: a real dict never holds equal keys, so the second is
    changed after it went in (the pickle then holds both)."""
    first, second = list(meta.storage_data)[:2]
    object.__setattr__(second, "fqn", first.fqn)
    object.__setattr__(second, "offset", first.offset)


def _huge_dcp_tensor(meta) -> None:
    entry = meta.state_dict_metadata["model.embedding.weight"]
    entry.size = torch.Size([1 << 40, 1 << 40])
    entry.chunks[0].sizes = torch.Size([1 << 40, 1 << 40])


def _huge_stack(meta) -> None:
    """A stacked per-layer tensor claims 2**40 layers."""
    entry = next(v for k, v in meta.state_dict_metadata.items()
                 if k.startswith("decoder.layers.") and getattr(v, "chunks", None))
    entry.size = torch.Size([1 << 40, *entry.size[1:]])


def _chunk_outside(meta) -> None:
    entry = meta.state_dict_metadata["model.embedding.weight"]
    entry.chunks[0].sizes = torch.Size([entry.size[0] + 5, entry.size[1]])


def _plant_dcp_object(case) -> None:
    shutil.rmtree(case.ckpt, ignore_errors=True)
    dcp.save({**sample_state(), "evil": Call(os.mkdir, str(case.marker))}, checkpoint_id=str(case.ckpt))


def _edit_manifest(case, edit) -> None:
    edit_manifest(case.ckpt / "ckptool.json", edit)


def _plant_listed_symlink(case) -> None:
    os.symlink("/etc/hostname", case.ckpt / "notes.txt")
    content = Path("/etc/hostname").read_bytes()
    _edit_manifest(case, lambda m: m["files"].append(
        {"path": "notes.txt", "size": len(content), "xxh3_128": xxhash.xxh3_128_hexdigest(content)}))


# ------------------------------------------------------------------------ running


@dataclass
class Scratch:
    root: Path
    ckpt: Path
    outside: Path
    marker: Path
    dst: Path


def _snapshot(root: Path) -> dict:
    """Every entry below ``root``: what it is and its content's identity."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


class _AddressSpace:
    """Caps this process's address space at what it maps now plus HEADROOM: a command that
    tries to allocate what a header claims fails (MemoryError), which the test sees."""

    def __enter__(self):
        self.old = resource.getrlimit(resource.RLIMIT_AS)
        mapped = _vm_size()
        limit = mapped + HEADROOM
        if self.old[1] != resource.RLIM_INFINITY:
            limit = min(limit, self.old[1])
        resource.setrlimit(resource.RLIMIT_AS, (limit, self.old[1]))
        return self

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_AS, self.old)


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _args(cmd: list[str], scratch: Scratch) -> list[str]:
    src = str(scratch.ckpt)
    rest = [str(scratch.dst) if a == "DST" else a for a in cmd[1:]]
    return [cmd[0], src, *rest]


def _run_subprocess(args: list[str]):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        p = subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True,
                           timeout=SECONDS * 2, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptool {' '.join(args)} did not finish in {SECONDS * 2} s (a blocking read?)")
    return CliResult(p.returncode, p.stdout, p.stderr)


def _expected(case: Case, command: str) -> int:
    if command in case.codes:
        return case.codes[command]
    if case.pickle:
        return {"inspect": 0, "verify": 1}.get(command, 2)
    return 1


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input_is_refused_cleanly(case, sources, tmp_path, run_cli):
    scratch = Scratch(tmp_path, tmp_path / "ckpt", tmp_path / "outside", tmp_path / "pwned",
                      tmp_path / "dst")
    shutil.copytree(sources[case.source], scratch.ckpt, symlinks=True)
    scratch.outside.mkdir()
    case.mutate(scratch)
    before = _snapshot(tmp_path)
    for cmd in case.commands or COMMANDS[case.source]:
        started = time.monotonic()
        if case.fifo:
            res = _run_subprocess(_args(cmd, scratch))
        else:
            with _AddressSpace():
                res = run_cli(*_args(cmd, scratch))
        took = time.monotonic() - started
        label = " ".join(cmd)
        assert took < SECONDS, f"{label}: {took:.1f} s"
        assert "Traceback" not in res.out + res.err, f"{label}:\n{res.out}{res.err}"
        assert res.code == _expected(case, cmd[0]), f"{label}: exit {res.code}\n{res.out}{res.err}"
        if cmd[0] == "verify":
            assert case.words in res.out, f"{label}:\n{res.out}{res.err}"
        elif res.code:
            lines = res.err.strip().splitlines()
            assert len(lines) == 1 and case.words in lines[0], f"{label}:\n{res.err}"
            if case.pickle:
                assert "--trust-pickle" in lines[0]
        elif case.pickle:  # inspect of a hostile pickle: a warning that names it, and on it goes
            assert "warning: " in res.err and case.words in res.err, f"{label}:\n{res.err}"
        assert not scratch.marker.exists(), f"{label}: the payload ran"
        assert _snapshot(tmp_path) == before, f"{label}: the scratch directory changed"


@pytest.mark.parametrize("text,words", [("[]", "not a JSON object but an array"),
                                        ("[" * 100_000 + "]" * 100_000, "nested too deep")])
def test_a_config_json_that_is_no_json_object_is_unreadable_input(text, words, sources, tmp_path, run_cli):
    """An HF config.json that parses into another JSON value, or nests past the parser's depth,
    is one line and exit 2 for every command (it was the catch-all's line: an AttributeError,
    a RecursionError)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sources["hf"], ckpt)
    (ckpt / "config.json").write_text(text)
    for cmd in COMMANDS["hf"]:
        res = run_cli(cmd[0], ckpt, *[str(tmp_path / "dst") if a == "DST" else a for a in cmd[1:]])
        lines = res.err.strip().splitlines()
        assert res.code == 2 and len(lines) == 1 and words in lines[0], (cmd, res.err)
        assert not (tmp_path / "dst").exists()


def test_trusted_pickle_is_loaded_and_pickled_again_never_copied(sources, tmp_path, run_cli):
    """With --trust-pickle the hostile object is loaded for real (its call runs: that is
    what trusting means) and the output holds what it returned, not the call."""
    scratch = Scratch(tmp_path, tmp_path / "ckpt", tmp_path / "outside", tmp_path / "pwned",
                      tmp_path / "dst")
    scratch.outside.mkdir()
    _plant_dcp_object(scratch)
    assert b"mkdir" in b"".join(p.read_bytes() for p in scratch.ckpt.iterdir())
    res = run_cli("convert", scratch.ckpt, scratch.dst, "--to", "dcp", "--trust-pickle")
    assert res.code == 0, res.err
    assert scratch.marker.exists()  # trusted: the call ran while loading
    written = b"".join(p.read_bytes() for p in scratch.dst.iterdir() if p.is_file())
    assert b"mkdir" not in written and b"posix" not in written
    loaded = {"evil": "placeholder"}
    dcp.load(loaded, checkpoint_id=str(scratch.dst))
    assert loaded["evil"] is None  # what os.mkdir returned
    res = run_cli("verify", scratch.dst, "--deep")
    assert res.code == 0, res.out


def test_hub_cache_snapshot_reads_its_own_blobs(sources, tmp_path, run_cli):
    """A Hugging Face hub cache snapshot (``models--org--name/snapshots/<rev>/``) is made of
    symlinks into the repository's ``blobs/``: those stay inside; a link past the repository
    does not."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(sources["hf"].iterdir()):
        blob = repo / "blobs" / xxhash.xxh3_64_hexdigest(f.read_bytes())
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    assert run_cli("verify", snapshot).code == 0
    res = run_cli("convert", snapshot, tmp_path / "dcp", "--to", "dcp")
    assert res.code == 0, res.err
    outside = tmp_path / "hub" / "elsewhere.safetensors"
    shard = _first_shard(snapshot)
    shutil.copy(shard, outside)
    shard.unlink()
    os.symlink(os.path.relpath(outside, snapshot), shard)
    res = run_cli("inspect", snapshot)
    assert res.code == 1 and "outside the checkpoint" in res.err, res.err


@pytest.mark.parametrize("config,says", [
    ({"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10, "__class__": "os.system"},
     "fields ckptool does not know: __class__"),
    ({"vocab_size": 97, "hidden_size": 32}, "missing 2 required positional arguments"),
])
def test_a_manifest_model_config_that_is_no_model_is_refused_where_a_layout_is_needed(
        config, says, sources, tmp_path, run_cli):
    """The hook records the job's own model_config, any dict: it is read as it is, and what
    needs the layout rules (convert to hf or megatron, plan) refuses it in one line, exit 2."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sources["sealed"], ckpt)
    _edit_manifest(Scratch(tmp_path, ckpt, None, None, None), lambda m: m.update(model_config=config))
    assert run_cli("inspect", ckpt).code == 0
    for cmd in (["convert", ckpt, tmp_path / "hf", "--to", "hf"],
                ["convert", ckpt, tmp_path / "meg", "--to", "megatron"], ["plan", "--model", ckpt, "--gpus", 8, "--tp", 1, "--pp", 1]):
        res = run_cli(*cmd)
        lines = res.err.strip().splitlines()
        assert res.code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in res.err, res.err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "meg").exists()


_DS_RECORD = {"layers": [0, 2, 3], "entries": {}, "groups": {}, "hyper": [], "args": {},
              "bf16_files": False, "bf16_optimizer": False}


@pytest.mark.parametrize("record,target,message", [
    ("not a list", "deepspeed", "the hook's deepspeed.pipeline record is not one ckptool writes"),
    ([{"layers": "x"}], "deepspeed", "the hook's deepspeed.pipeline record is not one ckptool writes"),
    ([{**_DS_RECORD, "groups": {"0": [[["w", "not a shape"]]]}}], "deepspeed",
     "the hook's deepspeed.pipeline record is not one ckptool writes"),
    ([{**_DS_RECORD, "args": {3: "x"}}], "deepspeed",
     "the hook's deepspeed.pipeline record is not one ckptool writes"),
    ([_DS_RECORD], "deepspeed", "the hook's record holds no param groups for every rank"),
    ({"states": "x", "buffer_dtypes": []}, "megatron-dist",
     "the hook's megatron.distributed_optimizer record is not one ckptool writes"),
    ({"states": [{"optimizer": {"param_groups": []}}], "buffer_dtypes": [("x" * 10**6, 3)]},
     "megatron-dist", "the hook's megatron.distributed_optimizer record names grad buffers"),
], ids=["ds-not-a-list", "ds-missing-keys", "ds-bad-shape", "ds-args-keys", "ds-no-groups",
        "mcore-not-a-list", "mcore-huge-dtype-pair"])
def test_a_malformed_hook_record_is_one_line_and_writes_nothing(record, target, message, tmp_path,
                                                                run_cli):
    """What the save hook records beside the tensors (a pipeline engine's structure, the
    distributed optimizer's state) is read from an untrusted checkpoint: anything else is
    one bounded line, exit 2, and no output."""
    from training import AsyncCheckpointer

    where = {"deepspeed": ("deepspeed", "pipeline"), "megatron-dist": ("megatron", "distributed_optimizer")}
    outer, inner = where[target]
    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    ckpt.save(1, {"model": {"w": torch.zeros(4)}, outer: {inner: record}})
    ckpt.close()
    res = run_cli("convert", ckpt.last_committed, tmp_path / "out", "--to", target)
    assert res.code == 2 and message in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1 and len(res.err) < 400, res.err[:400]
    assert not (tmp_path / "out").exists()


def test_an_error_line_is_one_bounded_line_whatever_the_checkpoint_names():
    """A key, path or quoted value comes from the checkpoint: a megabyte of it, or newlines in
    it, still make one line of bounded length (errors and verify's problems alike)."""
    from ckptool.checkpoints.reports import Problem
    from ckptool.core.errors import BadCheckpoint

    huge = "x" * 10**6 + "\nforged line"
    for line in (BadCheckpoint(f"bad {huge}", path=huge, key=huge, hint="Fix it").one_line(),
                 Problem("metadata", f"bad {huge}", file=huge, key=huge).one_line()):
        assert "\n" not in line and len(line) < 1400 and line.startswith("bad xxx")
    assert BadCheckpoint("short", path="p", key="k").one_line() == "short (p, tensor 'k')"
    # control characters neither split the line nor reach a terminal as escape sequences
    named = "global\x0b\x1b[31mRED\x85\u2028_step2\r\n"
    line = BadCheckpoint(f"latest names {named}", path=named, hint=f"Point it at {named}").one_line()
    assert len(line.splitlines()) == 1 and "\x1b" not in line and "\\x1b[31m" in line, repr(line)


def test_a_chunk_cut_short_in_the_middle_is_refused_and_leaves_nothing(sources, tmp_path, run_cli):
    """Four bytes gone from the middle of a chunk archive: its zip offsets then point before
    the archive (a negative file offset; it was an EINVAL named after DST.tmp-*/, exit 2,
    with DST.tmp-* left behind). Refused as a damaged source, nothing written."""
    ckpt = tmp_path / "ckpt"
    assert run_cli("reshard", sources["dcp"], ckpt, "--to-dp", "2").code == 0
    f = ckpt / "__1_0.distcp"
    data = f.read_bytes()
    cut = data.index(b"PK\x01\x02") * 2 // 3  # inside the first chunk's record, before its directory
    f.write_bytes(data[:cut] + data[cut + 4:])
    for cmd in (["reshard", ckpt, tmp_path / "dst", "--to-dp", "1"],
                ["convert", ckpt, tmp_path / "dst", "--to", "dcp"]):
        r = run_cli(*cmd)
        lines = r.err.strip().splitlines()
        assert r.code == 1 and len(lines) == 1 and f.name in lines[0] and "dst" not in lines[0], r.err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _tiny_hf(root: Path, **config) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8,
        "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, **config}))
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(8, 8)}, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize("field,value", [("num_attention_heads", -(1 << 63)),
                                         ("num_key_value_heads", 1 << 64),
                                         ("num_hidden_layers", 1 << 40)])
def test_model_sizes_beyond_any_model_are_refused_before_they_size_anything(field, value, tmp_path,
                                                                           run_cli):
    """A config's sizes size lists and plans (one entry per layer, head or group): 2**64 KV
    heads built a list for 15 s and 3 GB before a MemoryError traceback; a negative head
    count was a ValueError traceback."""
    src = _tiny_hf(tmp_path / "hf", **{field: value})
    for cmd in (["inspect", src], ["convert", src, tmp_path / "out", "--to", "dcp"]):
        with _AddressSpace():
            r = run_cli(*cmd)
        lines = r.err.strip().splitlines()
        assert r.code == 2 and len(lines) == 1 and "is not a size of a model" in lines[0], r.err
    assert not (tmp_path / "out").exists()


def test_a_manifest_topology_beyond_any_job_is_refused(sources, tmp_path, run_cli):
    """The topology a manifest records sizes the plan (a target file per rank): TP 2**31 was
    2**32 planned ranks, ~3 GB and a MemoryError traceback."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sources["sealed"], ckpt)
    edit_manifest(ckpt / "ckptool.json", lambda m: m["topology"].update(tp=1 << 31))
    with _AddressSpace():
        r = run_cli("reshard", ckpt, tmp_path / "dst", "--to-dp", "2")
    assert r.code == 1 and len(r.err.strip().splitlines()) == 1 and "beyond any job" in r.err, r.err
    assert not (tmp_path / "dst").exists()


def test_an_unforeseen_error_is_one_line_not_a_traceback(tmp_path, run_cli, monkeypatch):
    """Whatever a malformed checkpoint makes ckptool's code raise that no check foresaw (here
    planted), the user gets one line and exit 2, never a traceback."""
    from converters.schemas.families import base

    def broken(self, config):
        raise AttributeError("'NoneType' object has no attribute 'shape'")
    monkeypatch.setattr(base.Family, "spec", broken)
    src = _tiny_hf(tmp_path / "hf")
    r = run_cli("convert", src, tmp_path / "out", "--to", "dcp")
    lines = r.err.strip().splitlines()
    assert r.code == 2 and len(lines) == 1 and "Traceback" not in r.err, r.err
    assert lines[0].startswith("ckptool: error: ") and "CKPTOOL_DEBUG=1" in lines[0], r.err
    assert not (tmp_path / "out").exists()


def test_a_memo_bomb_in_a_pickle_too_large_to_walk_is_not_allocated(tmp_path):
    """A ``.metadata`` above ``CHECKED_PICKLE`` is not walked opcode by opcode (at 157 MB the
    walk would cost three times the parse). One whose first memo entry is made at index 2**28
    (``LONG_BINPUT``, 5 bytes) made CPython's unpickler zero-fill a 4 GB memo: the command
    reached 4 GB of memory. The command line caps the address space while such a pickle
    parses, so it fails as damage (exit 1) within a bounded memory."""
    from ckptool.core.safe_pickle import CHECKED_PICKLE

    state = {f"optimizer.state.{i}.exp_avg": torch.zeros(2) for i in range(4000)}
    ckpt = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=str(ckpt))
    data = (ckpt / ".metadata").read_bytes()
    assert len(data) > CHECKED_PICKLE
    ops = list(pickletools.genops(data))
    i = next(i for i, (op, _, _) in enumerate(ops) if op.name in ("BINPUT", "MEMOIZE"))
    at, end = ops[i][2], ops[i + 1][2]
    bomb = b"r" + struct.pack("<I", 1 << 28)
    frame = max((pos for op, _, pos in ops[:i] if op.name == "FRAME"), default=None)
    if frame is not None:  # the frame holding it says 4 bytes more
        (length,) = struct.unpack("<Q", data[frame + 1:frame + 9])
        grown = len(bomb) - (end - at)
        data = data[:frame + 1] + struct.pack("<Q", length + grown) + data[frame + 9:]
    (ckpt / ".metadata").write_bytes(data[:at] + bomb + data[end:])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([sys.executable, "-m", "ckptool", "inspect", str(ckpt)], env=env, cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        err = proc.stderr.read()  # one line: no pipe fills
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, not the largest child's
        proc.returncode = code = os.waitstatus_to_exitcode(status)
    assert code == 1 and "DCP metadata cannot be parsed (MemoryError" in err, (code, err)
    assert usage.ru_maxrss * 1024 < 2 << 30, f"peak {usage.ru_maxrss / 2**20:.1f} GiB"


def test_the_parse_cap_is_set_only_where_no_other_thread_works():
    """The address-space cap is for the whole process: set while a large pickle parses with no
    other (non-daemon) thread running, as when a command reads a checkpoint's index; not while a
    rewrite's workers may be filling buffers, which it would make fail. Restored after."""
    import threading

    from ckptool.core import safe_pickle

    data = b"x" * (safe_pickle.CHECKED_PICKLE + 1)
    before = resource.getrlimit(resource.RLIMIT_AS)
    safe_pickle.bound_unwalked_pickles(True)
    try:
        with safe_pickle.parsing(data, "test"):
            capped = resource.getrlimit(resource.RLIMIT_AS)
        release = threading.Event()
        worker = threading.Thread(target=release.wait)
        worker.start()
        try:
            with safe_pickle.parsing(data, "test"):
                beside_a_worker = resource.getrlimit(resource.RLIMIT_AS)
        finally:
            release.set()
            worker.join()
    finally:
        safe_pickle.bound_unwalked_pickles(False)
    assert capped[0] != resource.RLIM_INFINITY and capped[0] < (before[0] if before[0] != resource.RLIM_INFINITY
                                                                else 1 << 62)
    assert beside_a_worker == before and resource.getrlimit(resource.RLIMIT_AS) == before


@pytest.mark.parametrize("text", ["global_step2/", "./global_step2", "global_step2//"])
def test_a_pointer_in_another_spelling_names_the_same_directory(text, sources, tmp_path, run_cli):
    """DeepSpeed's loader takes ``latest`` holding ``global_step2/``; verify reported each rank
    file missing (``global_step2//...``) while inspect and convert read it, so ``latest``
    skipped a checkpoint that converts."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sources["deepspeed"], ckpt)
    (ckpt / "latest").write_text(text)
    assert run_cli("verify", ckpt, "--deep").code == 0
    assert run_cli("latest", tmp_path).out.strip() == str(ckpt)
    assert run_cli("convert", ckpt, tmp_path / "out", "--to", "dcp").code == 0
    (ckpt / "latest").write_text(".")
    r = run_cli("verify", ckpt)
    assert r.code == 1 and "names no checkpoint" in r.out, r.out
