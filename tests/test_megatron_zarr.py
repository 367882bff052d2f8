"""Megatron-Core's legacy ``zarr`` checkpoints, written by real megatron-core 0.9.0 at TP2
(tests/data/mcore_zarr, made by its make_fixture.py in a side venv): read as the canonical
view, checked against zarr's own reading, and converted to every writable format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckptool.checkpoints.open import open_checkpoint
from tests.conftest import full_tensor, peer

DATA = Path(__file__).parent / "data" / "mcore_zarr"
VOCAB = 100
"""The true vocabulary; the checkpoints store 128 rows (padded for TP2)."""
STACKED = "decoder.layers."


@pytest.fixture(scope="module")
def reference():
    return torch.load(DATA / "reference_logits.pt")


def _zarr_arrays(name: str) -> dict[str, torch.Tensor]:
    """Every array of an fp32 fixture as zarr itself reads it, stacked layers split."""
    zarr = peer("zarr")
    it = DATA / name / "iter_0000010"
    out = {}
    for d in sorted(p for p in it.iterdir() if (p / ".zarray").exists()):
        array = torch.from_numpy(zarr.open_array(str(d), mode="r")[...].copy())
        if d.name.startswith(STACKED):
            rest = d.name.removeprefix(STACKED)
            out.update({f"{STACKED}{i}.{rest}": layer for i, layer in enumerate(array)})
        else:
            out[d.name] = array
    return out


def _expected(name: str) -> dict[str, torch.Tensor]:
    """What a fixture holds: zarr's arrays; the bf16 one is the fp32 weights cast to bf16."""
    if name == "llama_bf16":
        return {k: v.to(torch.bfloat16) for k, v in _zarr_arrays("llama_fp32").items()}
    return _zarr_arrays(name)


def test_inspect_shows_the_topology_and_the_model(run_cli):
    data = json.loads(run_cli("inspect", DATA / "llama_fp32", "--json").out)
    assert data["format"] == "megatron-zarr" and data["format_version"] == "1"
    assert data["topology"]["tp"] == 2 and data["topology"]["pp"] == 1
    assert data["iteration"] == 10 and data["tensor_count"] == 15
    assert data["model_config"]["num_query_groups"] == 4 and data["model_config"]["swiglu"]
    fc1 = next(t for t in data["largest"] if t["key"] == "decoder.layers.0.mlp.linear_fc1.weight")
    assert fc1["shape"] == [96, 32] and fc1["pieces"] == 4  # [gate; up] at TP2: 4 chunk files
    text = run_cli("inspect", DATA / "gpt_fp32").out
    assert "megatron-zarr (version 1)" in text and "TP2/PP1/DP1" in text
    res = run_cli("verify", DATA / "llama_fp32", "--deep")
    assert res.code == 0 and "15 tensors, 29 pieces read" in res.out, res.out + res.err


@pytest.mark.parametrize("name", ["llama_fp32", "gpt_fp32"])
def test_reads_what_zarr_reads(name):
    opened = open_checkpoint(str(DATA / name))
    want = _zarr_arrays(name)
    assert set(opened.index.tensors) == set(want)
    for key, array in want.items():
        assert torch.equal(full_tensor(opened, key), array), key
        piece = opened.index.tensors[key].pieces[0]  # and a whole piece, as verify reads it
        got = opened.reader.read_piece(opened.store, piece, array.dtype)
        r = piece.region
        assert torch.equal(got, array[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))])


def test_bf16_chunks_are_the_fp32_weights_in_bf16():
    opened = open_checkpoint(str(DATA / "llama_bf16"))
    for key, want in _expected("llama_bf16").items():
        assert opened.index.tensors[key].dtype == torch.bfloat16
        assert torch.equal(full_tensor(opened, key), want), key


def test_sharded_objects_and_common_state_are_read():
    opened = open_checkpoint(str(DATA / "llama_fp32"))
    objects = opened.index.objects
    assert {"rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2",
            "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"} <= set(objects)
    rng = opened.reader.read_object(opened.store, objects["rng_state/shard_0.1_1.2"])
    assert isinstance(rng[0]["torch_rng_state"], torch.Tensor)
    assert opened.reader.read_object(opened.store, objects["iteration"]) == 10
    assert opened.index.topology.tp == 2 and opened.index.model_config["normalization"] == "RMSNorm"


@pytest.mark.parametrize("name", ["llama_fp32", "llama_bf16", "gpt_fp32"])
def test_convert_to_hf_gives_megatron_cores_logits(name, reference, tmp_path, run_cli):
    transformers = peer("transformers")
    dst = tmp_path / "hf"
    res = run_cli("convert", DATA / name, dst, "--to", "hf", "--true-vocab-size", VOCAB)
    assert res.code == 0, res.err
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    # bf16: the reference is mcore's fp32 forward over the stored bf16 weights, so the
    # same tolerance holds; measured 6e-8 (fp32) and 9e-8 (bf16).
    assert (logits - reference[name]).abs().max().item() < 1e-5
    if name == "llama_bf16":
        from safetensors.torch import load_file

        weights = load_file(dst / "model.safetensors")  # written as stored: bf16
        assert all(w.dtype == torch.bfloat16 for w in weights.values())


@pytest.mark.parametrize("name", ["llama_fp32", "llama_bf16", "gpt_fp32"])
def test_convert_to_legacy_torch_dist_and_dcp_is_bit_exact(name, tmp_path, run_cli):
    want = _expected(name)
    legacy, dist, dcp = tmp_path / "legacy", tmp_path / "dist", tmp_path / "dcp"
    res = run_cli("convert", DATA / name, legacy, "--to", "megatron", "--tp", 1,
                  "--true-vocab-size", VOCAB)
    assert res.code == 0, res.err
    assert "(TP2/PP1/DP1) -> " in res.out and "(TP1/PP1/DP1), megatron" in res.out
    # TP4 reads half of each TP2 chunk file: byte ranges inside the chunks
    res = run_cli("convert", DATA / name, dist, "--to", "megatron-dist", "--tp", 4, "--pp", 2,
                  "--true-vocab-size", VOCAB)
    assert res.code == 0, res.err
    assert run_cli("convert", DATA / name, dcp, "--to", "dcp").code == 0
    for out, fmt in ((legacy, "megatron"), (dist, "megatron-dist"), (dcp, "dcp")):
        opened = open_checkpoint(str(out))
        assert opened.format == fmt and set(opened.index.tensors) == set(want)
        for key, array in want.items():
            got = full_tensor(opened, key)
            if got.shape != array.shape:  # the vocab, padded for TP1 (112 rows, not 128)
                got, array = got[:VOCAB], array[:VOCAB]
            assert got.dtype == array.dtype and torch.equal(got, array), (fmt, key)
    assert run_cli("verify", legacy, "--deep").code == 0


def _write_zstd_array(zarr, compressor, path: Path, array, chunks: tuple[int, ...]) -> None:
    """A zarr v2 array with fill value 0, whose all-fill chunks get no file, written by
    whichever zarr is installed: pyproject allows zarr 2 and 3, whose APIs differ (zarr 2
    writes empty chunks unless told not to)."""
    if int(zarr.__version__.split(".")[0]) >= 3:
        z = zarr.create_array(store=str(path), shape=array.shape, chunks=chunks, dtype="<f4",
                              zarr_format=2, compressors=compressor, fill_value=0,
                              config={"write_empty_chunks": False})
    else:
        z = zarr.open_array(str(path), mode="w", shape=array.shape, chunks=chunks, dtype="<f4",
                            compressor=compressor, fill_value=0, write_empty_chunks=False)
    z[...] = array


def test_compressed_and_edge_chunks_as_zarr_writes_them(tmp_path, run_cli):
    """Not what Megatron-Core writes (raw chunks, one per shard), but valid zarr v2: an
    array rewritten by zarr with zstd, chunks that do not divide the shape, a fill value
    and an absent all-fill chunk."""
    zarr, numcodecs = peer("zarr"), peer("numcodecs")
    root = tmp_path / "zarr"
    shutil.copytree(DATA / "gpt_fp32", root)
    want = _zarr_arrays("gpt_fp32")
    for key, chunks in (("embedding.word_embeddings.weight", (48, 20)),
                        ("decoder.layers.mlp.linear_fc1.weight", (2, 40, 32))):
        path = root / "iter_0000010" / key
        array = zarr.open_array(str(path), mode="r")[...]
        if key.startswith(STACKED):
            array[:, 40:] = 0  # the edge chunk is all fill values: zarr writes no file for it
        shutil.rmtree(path)
        _write_zstd_array(zarr, numcodecs.Zstd(level=1), path, array, chunks)
        assert json.loads((path / ".zarray").read_text())["compressor"]["id"] == "zstd"
        if key.startswith(STACKED):
            want.update({f"{STACKED}{i}.{key.removeprefix(STACKED)}": torch.from_numpy(a.copy())
                         for i, a in enumerate(array)})
    assert not (root / "iter_0000010" / "decoder.layers.mlp.linear_fc1.weight" / "0.1.0").exists()
    opened = open_checkpoint(str(root))
    for key, array in want.items():
        assert torch.equal(full_tensor(opened, key), array), key
    res = run_cli("verify", root, "--deep")
    assert res.code == 0, res.out + res.err


def test_optimizer_state_is_refused_not_dropped_silently(tmp_path, run_cli):
    root = tmp_path / "zarr"
    shutil.copytree(DATA / "llama_fp32", root)
    it = root / "iter_0000010"
    shutil.copytree(it / "output_layer.weight", it / "optimizer.state.exp_avg.output_layer.weight")
    res = run_cli("convert", root, tmp_path / "hf", "--to", "hf", "--true-vocab-size", VOCAB)
    assert res.code == 2 and "optimizer state in Megatron-Core zarr checkpoints" in res.err
    assert "optimizer.state.exp_avg.output_layer.weight" in res.err
    res = run_cli("convert", root, tmp_path / "mg", "--to", "megatron", "--true-vocab-size", VOCAB,
                  "--drop-optimizer")
    assert res.code == 0, res.err


RNG_SHARD = "rng_state/shard_0.0_1.2.pt"


def _damaged(tmp_path: Path, how: str) -> Path:
    root = tmp_path / "zarr"
    shutil.copytree(DATA / "llama_fp32", root)
    chunk = root / "iter_0000010" / "decoder.layers.mlp.linear_fc1.weight" / "1.2.0"
    if how == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:1000])
    else:
        chunk.unlink()
        (root / "iter_0000010" / RNG_SHARD).unlink()  # its twin says (1, 2): both must be there
    return root


@pytest.mark.parametrize("how", ["truncated", "missing"])
def test_damaged_chunk_is_a_bad_checkpoint(how, tmp_path, run_cli):
    root = _damaged(tmp_path, how)
    res = run_cli("verify", root)
    assert res.code == 1 and "linear_fc1.weight/1.2.0" in res.out
    if how == "truncated":
        assert "data file is truncated: 1000 bytes, metadata needs 3072" in res.out
    else:
        assert res.out.count("data file named by the checkpoint metadata is missing") == 2
        assert RNG_SHARD in res.out
        # convert reads every object (for its pickles) before any tensor: the missing rng
        # shard may be what it meets first; either missing file is the checkpoint's damage
        res = run_cli("convert", root, tmp_path / "hf", "--to", "hf", "--true-vocab-size", VOCAB)
        lines = res.err.strip().splitlines()
        assert res.code == 1 and len(lines) == 1 and "file is missing" in lines[0], res.err
        assert "linear_fc1.weight/1.2.0" in lines[0] or RNG_SHARD in lines[0], lines[0]
        shutil.copy(DATA / "llama_fp32" / "iter_0000010" / RNG_SHARD,
                    root / "iter_0000010" / RNG_SHARD)  # now only the chunk is missing
    res = run_cli("convert", root, tmp_path / "hf", "--to", "hf", "--true-vocab-size", VOCAB)
    assert res.code == 1 and "Traceback" not in res.err
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and f"chunk file is {how}" in lines[0], res.err
    assert "linear_fc1.weight/1.2.0" in lines[0]
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob("hf.tmp-*"))


class _Evil:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['CKPTOOL_TEST_PWNED'], 'w').write('ran')",))


def _zarray(it: Path, **fields) -> None:
    path = it / "output_layer.weight" / ".zarray"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _pickle_codec(it: Path) -> None:
    import pickle

    _zarray(it, compressor={"id": "pickle", "protocol": 5})
    for c in ("0.0", "1.0"):
        (it / "output_layer.weight" / c).write_bytes(pickle.dumps(_Evil()))


def _zlib_bomb(it: Path) -> None:  # each 8 KiB chunk inflates to 1 GiB
    import zlib

    _zarray(it, compressor={"id": "zlib", "level": 1})
    co = zlib.compressobj(1)
    bomb = b"".join(co.compress(bytes(1 << 24)) for _ in range(64)) + co.flush()
    for c in ("0.0", "1.0"):
        (it / "output_layer.weight" / c).write_bytes(bomb)


def _longer_chunk(it: Path) -> None:
    chunk = it / "output_layer.weight" / "0.0"
    chunk.write_bytes(chunk.read_bytes() + bytes(4096))


HOSTILE = {  # what a header claims is never listed, allocated, inflated or run
    "pickle codec": (_pickle_codec, 2, "zarr codec pickle is not read"),
    "zlib bomb": (_zlib_bomb, 1, "decoded chunk has 8193 bytes, the array needs 8192"),
    "filter": (lambda it: _zarray(it, filters=[{"id": "astype", "encode_dtype": "<f8",
                                                "decode_dtype": "<f4"}]), 2, "zarr filters are not read"),
    "huge grid": (lambda it: _zarray(it, shape=[10**6, 10**6], chunks=[1, 1]), 1,
                  "zarr array has a grid of 1000000000000 chunks, but 2 chunk files are there"),
    "huge object grid": (lambda it: (it / "rng_state" / "shard_0.0_100000.100000.pt").write_bytes(b"x"),
                         1, "names a grid of 10000000000 shards, but 3 files are there"),
    "negative shape": (lambda it: _zarray(it, shape=[-128, 32]), 1, "not sizes"),
    "float shape": (lambda it: _zarray(it, shape=[128.9, 32]), 1, "not sizes"),
    "fill out of range": (lambda it: _zarray(it, dtype="|i1", fill_value=1000), 1,
                          "zarr fill_value 1000 is not a |i1 value"),
    "chunk file too long": (_longer_chunk, 1, "chunk file is 12288 bytes, the array's chunk 8192"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_array_metadata_is_refused_in_one_line(case, tmp_path, run_cli, monkeypatch):
    """Each a copy of a real Megatron-Core zarr checkpoint with one hostile edit: refused with
    its exit code and one line, by verify --deep and convert alike, in seconds, nothing run
    (numcodecs' own pickle guard opened, as an environment may have it) and nothing written."""
    edit, code, words = HOSTILE[case]
    pwned = tmp_path / "PWNED"
    monkeypatch.setenv("CKPTOOL_TEST_PWNED", str(pwned))
    monkeypatch.setenv("NUMCODECS_ALLOW_UNSAFE_PICKLE_DECODE", "1")
    root = tmp_path / "zarr"
    shutil.copytree(DATA / "llama_fp32", root)
    edit(root / "iter_0000010")
    for argv in (["verify", "--deep", root], ["convert", root, tmp_path / "out", "--to", "dcp"]):
        res = run_cli(*argv)
        err = res.err.strip()
        assert res.code == code and words in err, (argv, res.out, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not pwned.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zarr"]
