"""The NaN/Inf scan of raw bytes (``ckptool.core.scan``) against torch's own isnan/isinf:
every bit pattern of the 8- and 16-bit floats, boundaries and random patterns of the wider
ones, and elements split between the blocks of a file pass."""

from __future__ import annotations

import random

import pytest
import torch

from ckptool.core.scan import FileScan, Span, float_kind, nonfinite

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2,
          torch.float8_e4m3fn]
_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _patterns(dtype: torch.dtype, n: int = 20000) -> torch.Tensor:
    """Every bit pattern (8/16-bit) or boundary and random patterns (32/64-bit), as ``dtype``."""
    size = dtype.itemsize
    bits = 8 * size
    if bits <= 16:
        values = list(range(-(1 << (bits - 1)), 1 << (bits - 1)))
    else:
        rng = random.Random(bits)
        exp = {4: (8, 23), 8: (11, 52)}[size]
        top = ((1 << exp[0]) - 1) << exp[1]  # exponent all ones
        edges = [0, 1, top - 1, top, top + 1, top | ((1 << exp[1]) - 1), (1 << (bits - 1)) - 1]
        values = [v for e in edges for v in (e, e | (1 << (bits - 1)))]
        values += [rng.getrandbits(bits) for _ in range(n)]
        values = [v - (1 << bits) if v >= 1 << (bits - 1) else v for v in values]
    return torch.tensor(values, dtype=_INT[size]).view(dtype)


def _expected(t: torch.Tensor) -> tuple[int, int]:
    wide = t.float() if t.dtype.itemsize == 1 else t
    return int(torch.isnan(wide).sum()), int(torch.isinf(wide).sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_counts_equal_torch_for_every_pattern(dtype):
    t = _patterns(dtype)
    kind = float_kind(dtype)
    assert kind is not None
    nan, inf = _expected(t)
    assert nan > 0 and (inf > 0 or dtype == torch.float8_e4m3fn)  # the test can fail
    assert nonfinite(t.view(torch.uint8).numpy().tobytes(), kind) == (nan, inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_finite_extremes_are_finite(dtype):
    info = torch.finfo(dtype)
    t = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0], dtype=dtype)
    assert nonfinite(t.view(torch.uint8).numpy().tobytes(), float_kind(dtype)) == (0, 0)


def test_dtypes_it_cannot_scan_are_named_none():
    assert float_kind(torch.int64) is None and float_kind(torch.complex64) is None
    assert float_kind(torch.float8_e4m3fnuz) is None  # NaN is -0's pattern: read by torch
    assert float_kind("torch.half") == "float16"  # a name read without torch


def test_a_file_pass_splits_elements_between_blocks_and_finds_each_value():
    rng = random.Random(0)
    parts, spans, expect, pos = [], [], {}, 3  # odd start: elements cross block boundaries
    parts.append(b"\x00" * pos)
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float64, torch.float16] * 3):
        t = torch.randn(rng.randrange(1, 5000)).to(dtype)
        for _ in range(rng.randrange(0, 4)):
            t[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
        raw = t.view(torch.uint8).numpy().tobytes()
        spans.append(Span(pos, len(raw), float_kind(dtype), f"t{i}"))
        expect[f"t{i}"] = _expected(t)
        gap = rng.randrange(0, 9)
        parts.append(raw + b"\xff" * gap)  # NaN-looking bytes between spans are not counted
        pos += len(raw) + gap
    data = b"".join(parts)
    assert sum(n for n, _ in expect.values()) > 0
    for block in (1, 7, 4096, len(data)):
        scan = FileScan([Span(s.offset, s.nbytes, s.kind, s.tag) for s in spans])
        for start in range(0, len(data), block):
            scan.feed(start, memoryview(data)[start:start + block])
        assert {s.tag: (s.nan, s.inf) for s in scan.spans} == expect, block
        assert scan.unfinished() == []


def test_a_file_shorter_than_its_spans_leaves_them_unfinished():
    scan = FileScan([Span(0, 8, "float32", "a"), Span(8, 8, "float32", "b")])
    scan.feed(0, b"\x00" * 10)
    assert [s.tag for s in scan.unfinished()] == ["b"]


def test_ckptool_dcp_chunks_start_aligned_so_deep_verify_scans_them_in_place(tmp_path):
    """Every chunk ckptool's DCP writer appends (here through the training hook) has its bytes
    at a 64-byte file offset, whatever the odd sizes and objects before it; torch's DCP still
    reads the result, and the deep scan still finds a NaN put there."""
    import torch.distributed.checkpoint as dcp

    import converters
    from ckptool.checkpoints.open import read_index
    from ckptool.checkpoints.verify import verify
    from ckptool.core.storage import Store
    from training import AsyncCheckpointer

    state = {"a": torch.randn(3), "note": {"text": "x" * 7}, "b": torch.randn(5).bfloat16(),
             "c": torch.randn(7, 3, dtype=torch.float64), "d": torch.randn(1).half(), "step": 3}
    state["c"][2, 1] = float("nan")
    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    ckpt.save(1, state)
    ckpt.close()
    store = Store.open(ckpt.last_committed)
    reader = converters.reader(converters.require_format(store))
    index = read_index(reader, store)
    offsets = [reader.raw_span(store, p, t.dtype)[1] for t in index.tensors.values() for p in t.pieces]
    assert len(offsets) == 4 and all(o % 64 == 0 for o in offsets), offsets
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    dcp.load(back, checkpoint_id=ckpt.last_committed)
    assert all(torch.equal(back[k], state[k]) for k in "abd")
    report = verify(ckpt.last_committed, deep=True)
    assert [(p.kind, p.key) for p in report.problems] == [("nonfinite", "c")]


def test_hash_file_scans_spans_across_its_blocks_aligned_or_not(tmp_path):
    """The local pass of ``hash_file``: spans longer than a block, at aligned and odd offsets,
    give torch's counts, and the hash is the plain pass's."""
    from ckptool.core.manifest import hash_file
    from ckptool.core.scan import SCAN_BLOCK
    from ckptool.core.storage import Store

    gen = torch.Generator().manual_seed(1)
    parts, spans, expect, pos = [], [], {}, 0
    for i, (dtype, gap) in enumerate([(torch.float32, 0), (torch.bfloat16, 3), (torch.float32, 1),
                                      (torch.float16, 64)]):
        t = torch.randn(SCAN_BLOCK // 2 + 12345, generator=gen).to(dtype)
        t[torch.randint(t.numel(), (5,), generator=gen)] = float("nan")
        t[-1] = float("-inf")
        parts.append(b"\x7f" * gap)
        pos += gap
        raw = t.view(torch.uint8).numpy().tobytes()
        spans.append(Span(pos, len(raw), float_kind(dtype), i))
        expect[i] = _expected(t)
        parts.append(raw)
        pos += len(raw)
    (tmp_path / "f").write_bytes(b"".join(parts))
    assert pos > 2 * SCAN_BLOCK
    store = Store.open(str(tmp_path))
    scan = FileScan(spans)
    assert hash_file(store, "f", scan=scan) == hash_file(store, "f")
    assert {s.tag: (s.nan, s.inf) for s in scan.spans} == expect
    assert scan.unfinished() == []


def test_an_error_during_the_pass_is_the_one_raised(tmp_path):
    """Whatever stops ``hash_file`` mid-file (an interrupt, a failing progress callback) is the
    error its caller sees, and the scan lets go of the read buffer and of the numpy error state
    it set for the pass: the caller's thread warns on overflow again, and the next pass works."""
    import numpy as np

    from ckptool.core.manifest import hash_file
    from ckptool.core.scan import SCAN_BLOCK
    from ckptool.core.storage import Store

    (tmp_path / "f").write_bytes(torch.randn(SCAN_BLOCK).numpy().tobytes())  # 4 blocks
    seen = []

    def progress(n):
        seen.append(n)
        if len(seen) == 2:
            raise RuntimeError("stop here")

    scan = FileScan([Span(0, 4 * SCAN_BLOCK, "float32", "w")])
    before = np.geterr()
    with pytest.raises(RuntimeError, match="stop here"):
        hash_file(Store.open(str(tmp_path)), "f", progress, scan)
    assert np.geterr() == before
    again = FileScan([Span(0, 4 * SCAN_BLOCK, "float32", "w")])
    assert hash_file(Store.open(str(tmp_path)), "f", scan=again)[0] == 4 * SCAN_BLOCK
    assert again.unfinished() == [] and np.geterr() == before


def test_a_file_cut_short_during_the_pass_gives_its_new_size_not_a_crash(tmp_path):
    """Another job truncating a file while ``verify`` hashes it (a checkpoint being deleted or
    rewritten) shows as a short file, which verify then reports, and never kills the process:
    the pass reads, so there is no mapping whose vanished pages raise SIGBUS. Run in a child,
    so that a regression fails this test rather than the whole suite."""
    import subprocess
    import sys

    from ckptool.core.scan import SCAN_BLOCK

    f = tmp_path / "f"
    f.write_bytes(torch.randn(2 * SCAN_BLOCK).numpy().tobytes())  # 8 blocks
    code = f"""
import os
from ckptool.core.manifest import hash_file
from ckptool.core.scan import FileScan, Span
from ckptool.core.storage import Store
path = {str(f)!r}
def progress(n):
    if os.path.getsize(path) > {SCAN_BLOCK}:
        os.truncate(path, {SCAN_BLOCK} + 100)
scan = FileScan([Span(0, {8 * SCAN_BLOCK}, "float32", "w")])
size, _ = hash_file(Store.open(os.path.dirname(path)), "f", progress, scan)
print(size, [s.tag for s in scan.unfinished()])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == [str(SCAN_BLOCK + 100), "['w']"]


def test_blocks_keep_the_phase_of_most_elements_and_still_hash_the_file_whole(tmp_path):
    """A torch-written file's chunks start anywhere: the pass reads its blocks so that they
    end at the offset class (mod 8) holding most element bytes, scanning that class in place.
    The first block is then short: the hash is still the whole file's, the counts torch's,
    for the class in phase and for one out of it."""
    import numpy as np
    import xxhash

    from ckptool.core.manifest import hash_file
    from ckptool.core.scan import SCAN_BLOCK
    from ckptool.core.storage import Store

    gen = torch.Generator().manual_seed(2)
    big = torch.randn(SCAN_BLOCK, generator=gen)  # 4 blocks of fp32, starting at 5 mod 8
    big[torch.randint(big.numel(), (7,), generator=gen)] = float("nan")
    big[SCAN_BLOCK // 4 - 1] = float("inf")  # the element that ends the short first block
    small = torch.randn(SCAN_BLOCK // 2 + 333, generator=gen).bfloat16()  # out of phase, cut
    small[3] = float("-inf")
    small[-2] = float("nan")
    at = 14 + big.numel() * 4
    spans = [Span(13, big.numel() * 4, "float32", "big"), Span(at, small.numel() * 2, "bfloat16", "small")]
    probe = FileScan(spans)
    phase = probe.bind(bytearray(SCAN_BLOCK))
    probe.release()
    assert phase % 4 == 1  # the fp32 bytes' class
    # the element of `small` that the first block end inside it cuts in two is a NaN
    first = SCAN_BLOCK - (8 - phase) % 8
    cut = next(first + j * SCAN_BLOCK for j in range(9) if first + j * SCAN_BLOCK > at)
    assert (cut - at) % 2 == 1
    small[(cut - at) // 2] = float("nan")
    raw_big, raw_small = big.numpy().tobytes(), small.view(torch.int16).numpy().tobytes()
    data = b"\x01" * 13 + raw_big + b"\x02" + raw_small + b"\x03" * 5
    (tmp_path / "f").write_bytes(data)
    scan = FileScan(spans)
    size, digest = hash_file(Store.open(str(tmp_path)), "f", scan=scan)
    assert (size, digest) == (len(data), xxhash.xxh3_128_hexdigest(data))
    assert {s.tag: (s.nan, s.inf) for s in scan.spans} == {"big": _expected(big), "small": _expected(small)}
    assert scan.unfinished() == [] and np.geterr()["over"] == "warn"
    # in place but for the first block (it starts at 0) and the span out of phase
    assert 0 < scan.copied <= SCAN_BLOCK + len(raw_small)


def test_an_element_the_short_first_block_cuts_is_carried_not_lost(tmp_path):
    """A span aligned at the file's start is read in place in the first block, which the
    phase of the file's larger class makes short by an odd count: the element that block end
    cuts is completed from the next block, not dropped, and the rest of the span is still
    read element by element (a NaN put in that element and one after it are both found)."""
    from ckptool.core.manifest import hash_file
    from ckptool.core.scan import SCAN_BLOCK
    from ckptool.core.storage import Store

    gen = torch.Generator().manual_seed(4)
    first = torch.randn(SCAN_BLOCK // 2 + 100, generator=gen).bfloat16()  # offset 0, > a block
    big = torch.randn(SCAN_BLOCK, generator=gen)  # fp32 at an odd offset: it sets the phase
    at_big = first.numel() * 2 + 1
    spans = [Span(0, first.numel() * 2, "bfloat16", "first"), Span(at_big, big.numel() * 4, "float32", "big")]
    probe = FileScan(spans)
    phase = probe.bind(bytearray(SCAN_BLOCK))
    probe.release()
    cut = SCAN_BLOCK - (8 - phase) % 8
    assert cut % 2 == 1 and cut < first.numel() * 2
    first[cut // 2] = float("nan")  # the element the first block's end cuts in two
    first[cut // 2 + 7] = float("inf")
    data = first.view(torch.int16).numpy().tobytes() + b"\x00" + big.numpy().tobytes()
    (tmp_path / "f").write_bytes(data)
    scan = FileScan(spans)
    assert hash_file(Store.open(str(tmp_path)), "f", scan=scan)[0] == len(data)
    assert {s.tag: (s.nan, s.inf) for s in scan.spans} == {"first": (1, 1), "big": _expected(big)}
    assert scan.unfinished() == []
