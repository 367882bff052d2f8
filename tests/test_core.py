"""Topology rules, the manifest format, and atomic output on POSIX and on a store without rename."""

from __future__ import annotations

import io
import json

import pytest
import torch

from ckptool.core.errors import TopologyError, UsageError
from ckptool.core.manifest import MANIFEST, Manifest, build_manifest
from ckptool.core.storage import MarkerOutput, RenameOutput, Store, atomic_output
from ckptool.core.topology import Topology


def test_topology_world_and_rules():
    t = Topology(tp=8, pp=2, dp=2, zero=1)
    assert t.world == 32 and t.mp == 16 and str(t) == "TP8/PP2/DP2/ZeRO-1"
    assert Topology.from_dict(t.to_dict()) == t
    with pytest.raises(TopologyError, match="Topology.tp must be a positive integer, got 0"):
        Topology(tp=0)
    with pytest.raises(TopologyError, match="ep=3 must divide dp=4"):
        Topology(dp=4, ep=3)
    with pytest.raises(TopologyError, match="zero must be 0, 1, 2 or 3"):
        Topology(zero=4)


def test_manifest_round_trip_and_golden_fields(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"hello")
    m = build_manifest(Store.open(str(tmp_path)), "dcp", iteration=7, topology={"tp": 2})
    data = json.loads(m.to_json())
    assert data["ckptool_manifest"] == 1 and data["hash"] == "xxh3-128"
    # xxh3-128 of b"hello", pinned so the on-disk format cannot drift silently
    assert data["files"] == [{"path": "a.bin", "size": 5,
                              "xxh3_128": "b5e9c1ad071b3e7fc779cfaa5e523818"}]
    assert Manifest.from_json(m.to_json(), "x").files == m.files


def test_rename_output_is_all_or_nothing(tmp_path):
    out = atomic_output(str(tmp_path / "ckpt"))
    assert isinstance(out, RenameOutput)
    out.store.write_bytes("data", b"123")
    assert not (tmp_path / "ckpt").exists()
    assert [p.name for p in tmp_path.iterdir()][0].startswith("ckpt.tmp-")
    out.commit(lambda s: s.write_bytes(MANIFEST, b"{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(UsageError, match="already exists"):
        atomic_output(str(tmp_path / "ckpt"))


def test_two_runs_of_one_job_never_write_one_temporary_directory(tmp_path):
    """The same command run twice at once (a prelaunch script on every node) shares the resume
    key, so both wrote ``DST.tmp-KEY``: the second rewrote the first's files under it, even after
    the first committed them, and then failed with "file not found". Now the second is refused
    while the first writes; and one that began before the other committed fails at its rename,
    leaving the committed destination as it was."""
    from ckptool.core.errors import OutputFailed

    dst = tmp_path / "dst"
    first = atomic_output(str(dst), resume_key="k")
    with pytest.raises(OutputFailed, match="another ckptool run is writing"):
        atomic_output(str(dst), resume_key="k")
    first.store.write_bytes("a.bin", b"first")
    first.commit(lambda s: s.write_bytes(MANIFEST, b"{}"))
    late = RenameOutput(Store.open(str(dst)), "k")  # it found no destination, just before the commit
    late.store.write_bytes("a.bin", b"late")
    with pytest.raises(OutputFailed, match="appeared while this run wrote it"):
        late.commit(lambda s: s.write_bytes(MANIFEST, b"{}"))
    assert (dst / "a.bin").read_bytes() == b"first" and sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    again = atomic_output(str(tmp_path / "other"), resume_key="k")  # the lock went with the commit
    again.abort()
    atomic_output(str(tmp_path / "other"), resume_key="k").abort()


def test_store_without_rename_uses_the_manifest_as_commit_marker(run_cli):
    """fsspec's memory filesystem has no atomic rename: the manifest is the marker."""
    from converters import dcp

    root = Store.open("memory://runs/r1")
    if root.exists():
        root.fs.rm(root.root, recursive=True)
    url = "memory://runs/r1/step_000005"
    dcp.save({"w": torch.arange(6.0)}, url, iteration=5)
    out = atomic_output("memory://runs/r1/other")
    assert isinstance(out, MarkerOutput)
    assert run_cli("verify", url, "--deep").code == 0
    assert run_cli("latest", "memory://runs/r1").out.strip().endswith("runs/r1/step_000005")
    # a writer that died before its manifest: present, never returned
    dcp.save({"w": torch.arange(6.0)}, "memory://runs/r1/step_000009", iteration=9)
    Store.open("memory://runs/r1/step_000009").fs.rm("/runs/r1/step_000009/" + MANIFEST)
    res = run_cli("latest", "memory://runs/r1")
    assert res.code == 0 and res.out.strip().endswith("step_000005")
    assert "step_000009: not committed" in res.err


def test_a_box_read_into_another_dtype_is_converted(tmp_path):
    """Loading fp32 masters into a bf16 parameter (a ZeRO-3 bf16 engine through the hook):
    the bytes are converted, not copied raw into the smaller dtype."""
    from ckptool.core.torchfile import TorchFile

    value = torch.linspace(-3, 3, 40).reshape(5, 8)
    torch.save({"w": value}, tmp_path / "f.pt")
    store = Store.open(str(tmp_path))
    reader = store.range_reader("f.pt")
    archive = TorchFile(reader, reader.size, "f.pt")
    out = torch.empty(12, dtype=torch.bfloat16)
    archive.read_into(archive.obj["w"], 9, out)
    assert torch.equal(out, value.reshape(-1)[9:21].bfloat16())


def _with_byteorder(raw: bytes, order: bytes) -> bytes:
    """A torch.save archive whose ``byteorder`` record says ``order`` (the rest unchanged)."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, order if info.filename.endswith("/byteorder") else data)
    return out.getvalue()


def test_a_big_endian_torch_save_archive_is_refused_never_read_as_little_endian(tmp_path, run_cli):
    """torch.save records the writer's byte order; torch.load byteswaps a big-endian file. ckptool
    reads raw bytes as little-endian, so it refuses such a file (exit 2, one line) rather than
    read every value wrong. A Megatron rank file saved on a big-endian machine stands here."""
    from ckptool.core.errors import BadCheckpoint, UnsupportedFormat
    from ckptool.core.torchfile import TorchFile

    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0)}, buf)
    for order, error, words in [(b"big", UnsupportedFormat, "big-endian"),
                                (b"middle", BadCheckpoint, "byteorder")]:
        raw = _with_byteorder(buf.getvalue(), order)
        with pytest.raises(error, match=words):
            TorchFile(lambda a, b, raw=raw: raw[a:b], len(raw), "f.pt")
    little = _with_byteorder(buf.getvalue(), b"little")
    archive = TorchFile(lambda a, b: little[a:b], len(little), "f.pt")
    assert torch.equal(archive.load(archive.obj["w"]), torch.arange(6.0))

    ckpt = tmp_path / "iter_0000001" / "mp_rank_00"
    ckpt.mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    state = io.BytesIO()
    torch.save({"iteration": 1, "model": {"language_model": {"embedding": {"word_embeddings": {
        "weight": torch.randn(8, 4)}}}}, "checkpoint_version": 3.0}, state)
    (ckpt / "model_optim_rng.pt").write_bytes(_with_byteorder(state.getvalue(), b"big"))
    res = run_cli("inspect", tmp_path / "iter_0000001")
    assert res.code == 2 and "big-endian" in res.err and len(res.err.strip().splitlines()) == 1, res.err


def test_scratch_pool_reuses_buffers_and_keeps_to_its_budget():
    """The rewrite's fill buffers: reused from tensor to tensor, never more than the budget
    in use at once across threads (one tensor always fits), and no worker waits forever."""
    import threading

    from ckptool.core.engine import Scratch, ScratchPool

    pool = ScratchPool(budget=1000)
    one = Scratch(pool)
    a = one.take((100,), torch.float32)  # 400 bytes
    ptr = a.data_ptr()
    assert one.take((50,), torch.float32).data_ptr() == ptr  # the same buffer again
    one.done()
    big = one.take((600,), torch.float32)  # 2400 bytes: over budget, alone it still fits
    assert big.numel() == 600
    one.done()

    peak, lock, errors = [0], threading.Lock(), []

    def worker(seed):
        scratch, g = Scratch(pool), torch.Generator().manual_seed(seed)
        try:
            for _ in range(200):
                n = int(torch.randint(1, 120, (1,), generator=g))
                t = scratch.take((n,), torch.float32)
                t.fill_(seed)
                with lock:
                    peak[0] = max(peak[0], pool._in_use)
                assert bool((t == seed).all())  # nobody else writes into this buffer
            scratch.done()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert peak[0] <= 2400 and pool._in_use == 0


def test_a_pickled_field_never_shadows_what_a_stand_in_is():
    """A record keeps its pickled fields as attributes, but a hostile state naming the
    stand-in's own attributes (``unsafe``, ``fields``, ``qualified_name``) reads the class's:
    a refused global stays refused; absent fields still read as None."""
    import io
    import os
    import pickle

    from ckptool.core.safe_pickle import Unpickler, Unsafe, unsafe_in

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",), {"unsafe": False, "fields": 1, "qualified_name": "torch.Size",
                                            "relative_path": "x"})

    obj = Unpickler(io.BytesIO(pickle.dumps(Evil()))).load()
    assert isinstance(obj, Unsafe) and obj.unsafe is True
    assert obj.qualified_name in ("posix.system", "os.system")
    assert obj.fields()["unsafe"] is False and callable(obj.fields)
    assert obj.relative_path == "x" and obj.offset is None
    assert list(unsafe_in({"a": obj})) == [("a", obj.qualified_name)]


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_archives_of_one_layout_are_opened_once_and_each_reads_its_own_bytes():
    """DCP stores each chunk as a torch.save archive; chunks of one shape differ only in
    their tensor bytes and the CRC fields over them. The second opens from the first's parse,
    and reads its own values; a different shape of the same size is parsed in full."""
    from ckptool.core.torchfile import ArchiveLayouts, TorchFile

    layouts = ArchiveLayouts()
    tensors = [torch.randn(4, 8) for _ in range(3)]
    tensors[2][1, 3] = float("nan")
    raws = [_saved(t) for t in tensors]
    assert len({len(r) for r in raws}) == 1 and len(set(raws)) == 3
    opened = [layouts.open(lambda a, b, r=r: r[a:b], len(r), f"c{i}") for i, r in enumerate(raws)]
    assert opened[1].obj is opened[0].obj and opened[2].obj is opened[0].obj  # parsed once
    for archive, t in zip(opened, tensors):
        got = archive.read_elements(archive.obj, 0, t.numel()).reshape(t.shape)
        assert torch.equal(got, t) or (torch.isnan(got).sum() == 1 and torch.equal(got.nan_to_num(), t.nan_to_num()))
    assert opened[2].source == "c2"
    other = _saved(torch.randn(8, 4))  # the same bytes, another pickle
    assert len(other) == len(raws[0])
    archive = layouts.open(lambda a, b: other[a:b], len(other), "d")
    assert archive.obj.shape == (8, 4) and archive.obj is not opened[0].obj
    assert TorchFile(lambda a, b: other[a:b], len(other), "d").obj.shape == (8, 4)


@pytest.mark.parametrize("damage", ["local name", "central offset", "pickle byte"])
def test_an_archive_that_differs_from_a_layout_outside_its_data_is_parsed_in_full(damage):
    """Any byte the parse reads, other than a CRC field, keeps an archive from being taken for
    a known layout: a record renamed in its local header, a central directory entry pointing
    elsewhere, a changed pickle each meet the full checks, exactly as without layouts."""
    import struct

    from ckptool.core.errors import BadCheckpoint
    from ckptool.core.torchfile import ArchiveLayouts, TorchFile

    raw = _saved(torch.randn(4, 8))
    layouts = ArchiveLayouts()
    first = layouts.open(lambda a, b: raw[a:b], len(raw), "a")
    bad = bytearray(raw)
    if damage == "local name":
        data_header = raw.rindex(b"PK\x03\x04", 0, raw.index(b"/data/0"))
        at = raw.index(b"/data/0", data_header) + 6  # the record's name in its local header
        assert bad[at] == ord("0")
        bad[at] = ord("9")
    elif damage == "central offset":
        entry = raw.rindex(b"PK\x01\x02", 0, raw.rindex(b"/data/0") + 1)
        (offset,) = struct.unpack_from("<I", raw, entry + 42)
        struct.pack_into("<I", bad, entry + 42, offset + 1)
    else:
        name_len, extra_len = struct.unpack_from("<HH", raw, 26)  # data.pkl is the first record
        at = 30 + name_len + extra_len + 2  # inside the pickle, past its protocol opcode
        bad[at] ^= 0x01
    bad = bytes(bad)

    def parse(open_):
        try:
            archive = open_(lambda a, b: bad[a:b], len(bad), "b")
        except BadCheckpoint as exc:
            return "refused", str(exc)
        return "opened", archive.obj is first.obj

    full = parse(TorchFile)
    assert parse(layouts.open) == (full if full[0] == "refused" else ("opened", False))
    if damage != "pickle byte":
        assert full[0] == "refused"


def test_a_crc_field_alone_does_not_keep_an_archive_from_its_layout():
    """The CRC-32 fields are read with the headers but never used (as torch reads): an archive
    that differs in them only is the same layout. Its data is still its own to read."""
    from ckptool.core.torchfile import ArchiveLayouts

    t = torch.randn(4, 8)
    raw = _saved(t)
    layouts = ArchiveLayouts()
    first = layouts.open(lambda a, b: raw[a:b], len(raw), "a")
    crcs = list(first._crc_fields)
    assert len(crcs) >= 4
    other = bytearray(raw)
    for at in crcs:
        other[at] ^= 0xFF
    other = bytes(other)
    second = layouts.open(lambda a, b: other[a:b], len(other), "b")
    assert second.obj is first.obj
    assert torch.equal(second.read_elements(second.obj, 0, 32).reshape(4, 8), t)


def test_archive_layouts_keep_a_bounded_number(monkeypatch):
    """Archives of all-different sizes (uneven shards) keep at most SIZES x PER_SIZE layouts,
    and each still opens right."""
    from ckptool.core.torchfile import ArchiveLayouts

    monkeypatch.setattr(ArchiveLayouts, "SIZES", 3)
    layouts = ArchiveLayouts()
    for n in range(1, 9):
        t = torch.arange(n * 64, dtype=torch.float32)
        raw = _saved(t)
        archive = layouts.open(lambda a, b, r=raw: r[a:b], len(raw), f"c{n}")
        assert torch.equal(archive.read_elements(archive.obj, 0, n * 64), t)
    assert len(layouts._by_size) == 3 and sum(len(v) for v in layouts._by_size.values()) <= 3 * 8


def test_an_archive_whose_parse_reads_much_is_opened_but_not_kept():
    """A layout keeps what its parse read; an archive with a large pickle is opened in full
    each time instead of being kept (memory stays bounded by MOST per layout)."""
    from ckptool.core.torchfile import ArchiveLayouts

    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0), "notes": [f"{i:04d}" + "x" * 1000 for i in range(100)]}, buf)
    raw = buf.getvalue()
    layouts = ArchiveLayouts()
    assert len(raw) > ArchiveLayouts.MOST // 2  # a 100 KB pickle
    archive = layouts.open(lambda a, b: raw[a:b], len(raw), "big")
    assert torch.equal(archive.read_elements(archive.obj["w"], 0, 4), torch.arange(4.0))
    assert not any(layouts._by_size.values())


def test_a_dangling_symlink_as_destination_is_refused_before_writing_or_replaced(tmp_path, make_ckpt, run_cli):
    """DST a symlink to nothing: exists() said no, so everything was written, and the rename onto
    the link failed, leaving the whole output in DST.tmp-* (exit 2, "Not a directory")."""
    import os

    src = make_ckpt(tmp_path / "src")
    dst = tmp_path / "dst"
    os.symlink(tmp_path / "nowhere", dst)
    r = run_cli("convert", src, dst, "--to", "dcp")
    assert r.code == 2 and "is a symlink to" in r.err and "does not exist" in r.err, r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"] and dst.is_symlink()
    assert run_cli("convert", src, dst, "--to", "dcp", "--overwrite").code == 0
    assert not dst.is_symlink() and run_cli("verify", dst, "--deep").code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]
