"""Metadata at scale: torch's own `read_metadata` against `ckptool inspect`, `verify` and
`reshard --dry-run` on a DCP checkpoint of many FSDP ranks, in the same run.

    python benchmarks/metadata_scale.py [--ranks 64 256] [--layers 126] [--dir /tmp]

Builds, for each rank count, a real DCP checkpoint of a Llama-3-405B-shaped model (hidden
16384, ffn 53248, 128 heads / 8 kv groups, vocab 128256, --layers of them) as FSDP writes
it: every tensor cut on dim 0 into one chunk per rank, bf16 weights and fp32 Adam moments
and masters, the `.metadata` made by torch's own classes, one sparse `__{rank}_0.distcp` file
per rank (no data is written: the commands here read metadata only). Then times, as child
processes with their peak RSS:

* `torch FileSystemReader.read_metadata()`    the baseline
* `ckptool inspect`, `ckptool verify` (structure, sizes; no hashing of data never written)
* `ckptool reshard SRC DST --to-dp RANKS/2 --dry-run`   planning the reshard

and prints each as a ratio to torch and per chunk. Targets (issue #20): inspect and verify
<= 1.0x torch, reshard --dry-run <= 2.0x, time per chunk flat across rank counts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run  # noqa: E402

H, FFN, HEADS, GROUPS, VOCAB = 16384, 53248, 128, 8, 128256


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    d = H // HEADS
    out = {"tok_embeddings.weight": (VOCAB, H), "norm.weight": (H,), "output.weight": (VOCAB, H)}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({p + "attention.wq.weight": (H, H), p + "attention.wk.weight": (GROUPS * d, H),
                    p + "attention.wv.weight": (GROUPS * d, H), p + "attention.wo.weight": (H, H),
                    p + "feed_forward.w1.weight": (FFN, H), p + "feed_forward.w2.weight": (H, FFN),
                    p + "feed_forward.w3.weight": (FFN, H), p + "attention_norm.weight": (H,),
                    p + "ffn_norm.weight": (H,)})
    return out


def build(root: Path, ranks: int, layers: int) -> int:
    """The checkpoint at ``root``; its chunk count."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    root.mkdir(parents=True)
    state, storage, ends = {}, {}, [0] * ranks
    tensors = {}
    for name, shape in shapes(layers).items():
        tensors[f"model.{name}"] = (shape, torch.bfloat16)
        for kind in ("exp_avg", "exp_avg_sq", "fp32_param"):
            tensors[f"optimizer.state.{kind}.{name}"] = (shape, torch.float32)
    chunks = 0
    for fqn, (shape, dtype) in tensors.items():
        rows = -(-shape[0] // ranks)
        parts = []
        for r in range(ranks):
            lo, hi = min(r * rows, shape[0]), min((r + 1) * rows, shape[0])
            if hi <= lo:
                continue
            offsets, sizes = (lo, *(0,) * (len(shape) - 1)), (hi - lo, *shape[1:])
            parts.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            nbytes = (hi - lo) * (shape[1] if len(shape) > 1 else 1) * dtype.itemsize
            storage[MetadataIndex(fqn, torch.Size(offsets))] = _StorageInfo(f"__{r}_0.distcp", ends[r], nbytes)
            ends[r] += nbytes
        chunks += len(parts)
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), parts)
    meta = Metadata(state_dict_metadata=state, planner_data=None, storage_data=storage)
    with open(root / ".metadata", "wb") as f:
        import pickle
        pickle.dump(meta, f)
    for r, end in enumerate(ends):
        with open(root / f"__{r}_0.distcp", "wb") as f:
            f.truncate(end)  # sparse: nothing here reads the data
    return chunks


TORCH = ("import sys; from torch.distributed.checkpoint import FileSystemReader; "
         "FileSystemReader(sys.argv[1]).read_metadata()")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--layers", type=int, default=126)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckptool-metadata-"))
    cli = [sys.executable, "-m", "ckptool.cli"]
    rows = []
    try:
        for ranks in args.ranks:
            src = base / f"r{ranks}"
            chunks = build(src, ranks, args.layers)
            size = (src / ".metadata").stat().st_size
            t_torch, m_torch = run([sys.executable, "-c", TORCH, str(src)])
            t_inspect, m_inspect = run([*cli, "inspect", str(src), "--json"], quiet=True)
            t_verify, m_verify = run([*cli, "verify", str(src)], quiet=True)
            t_dry, m_dry = run([*cli, "reshard", str(src), str(base / "out"), "--to-dp",
                                str(max(1, ranks // 2)), "--dry-run"], quiet=True)
            rows.append((ranks, chunks, size, t_torch, m_torch, t_inspect, m_inspect, t_verify,
                         m_verify, t_dry, m_dry))
            shutil.rmtree(src)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{'ranks':>6} {'chunks':>8} {'.metadata':>10} {'torch s':>8} "
          f"{'inspect':>14} {'verify':>14} {'reshard dry':>16} {'RSS GB t/i/v/r':>22} {'us/chunk (dry)':>15}")
    for ranks, chunks, size, tt, mt, ti, mi, tv, mv, td, md in rows:
        print(f"{ranks:>6} {chunks:>8} {size / 1e6:>8.1f}MB {tt:>8.2f} "
              f"{ti:>6.2f}s {ti / tt:>5.2f}x {tv:>6.2f}s {tv / tt:>5.2f}x {td:>7.2f}s {td / tt:>6.2f}x "
              f"{mt:>5.2f}/{mi:.2f}/{mv:.2f}/{md:.2f} {1e6 * td / chunks:>15.1f}")
    os.environ.get("CKPTOOL_BENCH_QUIET") or print(
        "\nratios are against torch's read_metadata in the same run (inspect/verify target <= 1.0x, "
        "reshard --dry-run <= 2.0x; us/chunk should stay flat as ranks grow)")


if __name__ == "__main__":
    main()
