"""The reshard engine's own two checks, each tested where it is the only thing in the way:

- **the padding fill**: elements of a target tensor that no region holds (Megatron's vocab
  padding, the gaps of a flat buffer) get ``pad_value``. The rewrite fills tensors in
  reused scratch buffers, so without the fill they would hold a previous tensor's bytes.
- **the coverage check**: a target element that no source piece holds is refused (exit 1),
  never written with whatever the buffer held.

Each is tested directly on the engine and end to end through the CLI. Deleting either from
``ckptool/core/engine.py`` makes tests here fail (issue #15).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from ckptool.core.engine import Scratch, ScratchPool, TargetTensor, fill_tensor
from ckptool.core.errors import BadCheckpoint
from ckptool.core.index import CheckpointIndex, Location, Piece, TensorInfo
from ckptool.core.regions import Region, Shard

ZARR = Path(__file__).parent / "data" / "mcore_zarr" / "llama_fp32"
"""Real Megatron-Core TP2 weights (tests/data/mcore_zarr): true vocab 100, stored 128 rows."""
VOCAB = 100
EMBEDDINGS = ("embedding.word_embeddings.weight", "output_layer.weight")
STALE = 0x7F
"""A byte no zero-filled buffer holds: 0x7F7F7F7F is a large finite fp32 (3.4e38)."""


# ------------------------------------------------------------------------------- the engine


def _index(source: dict[str, torch.Tensor], rows: dict[str, list[tuple[int, int]]]):
    """An index over in-memory global tensors, each stored as the given row ranges
    (``[start, stop)`` of dim 0), and the ``read_box`` the rewrite would pass."""
    index = CheckpointIndex(format="memory", url="memory://source")
    for key, tensor in source.items():
        shape = tuple(tensor.shape)
        pieces = [Piece(Region(key, shape, (a, *(0,) * (len(shape) - 1)), (b - a, *shape[1:])),
                        Location(f"{key}.{a}")) for a, b in rows[key]]
        index.tensors[key] = TensorInfo(key, shape, tensor.dtype, pieces)

    def read_box(piece, dtype, box, out):
        offsets, lengths = box
        box = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
        out.copy_(source[piece.region.key][box])

    return index, read_box


def _dirty(scratch: Scratch, index, read_box, key: str) -> torch.Tensor:
    """Fill a whole tensor in ``scratch``, as the tensor before the one under test: its
    bytes are what the next tensor's buffer holds before it is filled."""
    info = index.tensors[key]
    out = fill_tensor(TargetTensor(key, Shard.of(Region.whole(key, info.shape)), info.dtype),
                      index, read_box, scratch=scratch)
    assert out.ne(0).all()  # the premise: nothing in the reused buffer is zero already
    return out


@pytest.mark.parametrize("pad_value", [0.0, -2.5])
def test_padding_in_a_reused_scratch_buffer_gets_the_pad_value(pad_value):
    """A shard of two 12-element regions at offsets 0 and 16 of 32 (the shape of
    ``[gate_r; up_r]`` with padding after each), filled in the buffer that just held a
    full tensor: the padding holds ``pad_value``, never that tensor's bytes."""
    g = torch.Generator().manual_seed(0)
    source = {"full": torch.rand(8, 4, generator=g) + 1, "w": torch.randn(6, 4, generator=g)}
    index, read_box = _index(source, {"full": [(0, 8)], "w": [(0, 3), (3, 6)]})
    scratch = Scratch(ScratchPool(budget=1 << 20))
    before = _dirty(scratch, index, read_box, "full")
    ptr = before.data_ptr()
    shard = Shard((8, 4), ((0, Region("w", (6, 4), (0, 0), (3, 4))),
                           (16, Region("w", (6, 4), (3, 0), (3, 4)))))
    out = fill_tensor(TargetTensor("w", shard, torch.float32), index, read_box,
                      pad_value=pad_value, scratch=scratch)
    assert out.data_ptr() == ptr  # the same buffer: its stale bytes were there to be seen
    flat = out.reshape(-1)
    assert torch.equal(flat[:12], source["w"][:3].reshape(-1))
    assert torch.equal(flat[16:28], source["w"][3:].reshape(-1))
    pad = torch.cat([flat[12:16], flat[28:]])
    want = torch.full((8,), pad_value).view(torch.int32)
    assert torch.equal(pad.view(torch.int32), want)  # bit-exact: +0.0 is not -0.0
    scratch.done()


def test_a_target_element_no_source_piece_holds_is_refused():
    """The source stores rows 0-3 of a 6-row tensor: a target holding rows 0-3 is filled, one
    that reaches row 4 is refused, also in a buffer whose stale bytes would pass as data."""
    g = torch.Generator().manual_seed(1)
    source = {"full": torch.rand(8, 4, generator=g) + 1, "w": torch.randn(6, 4, generator=g)}
    index, read_box = _index(source, {"full": [(0, 8)], "w": [(0, 2), (2, 4)]})
    scratch = Scratch(ScratchPool(budget=1 << 20))
    held = Region("w", (6, 4), (0, 0), (4, 4))
    out = fill_tensor(TargetTensor("w", Shard.of(held), torch.float32), index, read_box,
                      scratch=scratch)
    assert torch.equal(out, source["w"][:4])
    rows_3_4 = Region("w", (6, 4), (3, 0), (2, 4))
    last_of_3_first_of_4 = Region.whole("w", (6, 4), flat=(15, 17))
    for target in (Region.whole("w", (6, 4)), rows_3_4, last_of_3_first_of_4):
        _dirty(scratch, index, read_box, "full")
        with pytest.raises(BadCheckpoint, match="do not cover") as err:
            fill_tensor(TargetTensor("w", Shard.of(target), torch.float32), index, read_box,
                        scratch=scratch)
        assert err.value.key == "w" and err.value.exit_code == 1
    scratch.done()


# --------------------------------------------------------------------------- through the CLI


@pytest.fixture
def stale_scratch(monkeypatch):
    """Every buffer the rewrite's scratch pool hands out holds :data:`STALE` bytes, as a
    reused one holds a previous tensor's: which tensor came before, and whether fresh memory
    happens to be zero, then no longer decide whether the padding fill is needed to pass."""
    acquire = ScratchPool.acquire

    def stale(self, nbytes):
        buf = acquire(self, nbytes)
        buf.fill_(STALE)
        return buf

    monkeypatch.setattr(ScratchPool, "acquire", stale)


def _rows(root: Path, fmt: str) -> dict[str, torch.Tensor]:
    """The full embedding and output layer of a TP1 or TP2 checkpoint, read by the real
    peer's loader: torch DCP for megatron-dist, ``torch.load`` of the rank files (TP-split on
    dim 0) for legacy megatron."""
    if fmt == "megatron-dist":
        import torch.distributed.checkpoint as dcp

        path = str(next(root.glob("iter_*")))
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        state = {k: torch.empty(tuple(meta[k].size)) for k in EMBEDDINGS}
        dcp.load(state, checkpoint_id=path)
        return state
    ranks = sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    models = [torch.load(f, weights_only=False)["model"] for f in ranks]
    return {k: torch.cat([m[k] for m in models]) for k in EMBEDDINGS}


@pytest.mark.parametrize("fmt", ["megatron-dist", "megatron"])
def test_reshard_tp1_to_tp2_zero_fills_the_vocab_padding_it_adds(fmt, stale_scratch, tmp_path,
                                                                  run_cli):
    """Megatron pads the vocab to a multiple of 16 x TP here: 112 rows at TP1, 128 at TP2.
    The 16 new rows exist in no source (TP2 rank 1 holds rows 64-127, rows 112-127 from
    nothing): they must be written as zeros, and the 112 stored rows (the true 100 and the
    12 padding rows Megatron trained) bit for bit."""
    tp1, tp2 = tmp_path / "tp1", tmp_path / "tp2"
    res = run_cli("convert", ZARR, tp1, "--to", fmt, "--tp", 1, "--true-vocab-size", VOCAB)
    assert res.code == 0, res.err
    res = run_cli("reshard", tp1, tp2, "--to-tp", 2, "--workers", 1)
    assert res.code == 0, res.err
    assert "(TP1/PP1/DP1) -> " in res.out and "(TP2/PP1/DP1)" in res.out
    before, after = _rows(tp1, fmt), _rows(tp2, fmt)
    for key in EMBEDDINGS:
        assert before[key].shape == (112, 32) and after[key].shape == (128, 32), key
        assert torch.equal(after[key][:112].view(torch.int32), before[key].view(torch.int32)), key
        nonzero = after[key][112:].view(torch.int32).count_nonzero().item()  # +0.0 bits
        assert nonzero == 0, f"{key}: {nonzero} of 512 padding elements are not zero"
    res = run_cli("verify", tp2, "--deep")
    assert res.code == 0, res.out + res.err


GAP = "decoder.layers.1.mlp.linear_fc2.weight"
"""The tensor whose second chunk the damaged checkpoint's metadata forgets."""


def _dcp_missing_a_chunk(tmp_path: Path, run_cli) -> Path:
    """A TP2 DCP checkpoint (rank files chunked on dim 0) whose ``.metadata`` lists only the
    first chunk of :data:`GAP`: a writer's bug, not a damaged file, so the manifest is made
    to agree and only the engine can see that half of the tensor is stored nowhere."""
    from ckptool.core.manifest import FileEntry, hash_file, read_manifest, write_manifest
    from ckptool.core.storage import Store

    root = tmp_path / "dcp"
    res = run_cli("convert", ZARR, root, "--to", "dcp")
    assert res.code == 0, res.err
    meta = pickle.loads((root / ".metadata").read_bytes())  # our own file: trusted
    chunks = meta.state_dict_metadata[GAP].chunks
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (16, 0)]
    del chunks[1]
    (root / ".metadata").write_bytes(pickle.dumps(meta))
    store = Store.open(str(root))
    manifest = read_manifest(store)
    manifest.files = [FileEntry(f.path, *hash_file(store, f.path)) if f.path == ".metadata"
                      else f for f in manifest.files]
    write_manifest(store, manifest)
    return root


@pytest.mark.parametrize("how", [("reshard", "--to-tp", 1),
                                 ("convert", "--to", "megatron", "--tp", 1,
                                  "--true-vocab-size", VOCAB)],
                         ids=["reshard-dcp", "convert-megatron"])
def test_a_source_that_stores_a_target_element_nowhere_is_refused(how, tmp_path, run_cli):
    src, dst = _dcp_missing_a_chunk(tmp_path, run_cli), tmp_path / "out"
    res = run_cli(how[0], src, dst, *how[1:])
    assert res.code == 1, res.out + res.err
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.err, res.err
    assert GAP in lines[0] and str(src) in lines[0], lines[0]
    assert not dst.exists() and not list(tmp_path.glob("out.tmp-*"))
