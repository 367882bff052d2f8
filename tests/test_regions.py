"""Property tests for the region engine: any tensor written through one random layout and
read back through another is reconstructed exactly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptool.core.regions import (Region, Shard, byte_runs, coverage_problems, execute,
                                  flat_to_boxes, plan_copies)

PAD = -7.0  # padding sentinel; never a value of the global tensors


shapes = st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple)


@st.composite
def box_grid(draw, key, shape):
    """Cut every dim at random points: a TP/PP-style grid of boxes, one shard each."""
    cuts = []
    for n in shape:
        points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
        edges = [0, *points, n]
        cuts.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    shards = []

    def rec(d, offs, lens):
        if d == len(shape):
            shards.append(Shard.of(Region(key, shape, tuple(offs), tuple(lens))))
            return
        for o, n in cuts[d]:
            rec(d + 1, offs + [o], lens + [n])

    rec(0, [], [])
    return shards


@st.composite
def flat_partitions(draw, tensors):
    """ZeRO-style: tensors concatenated (with alignment padding between them), padded at
    the end to a multiple of `parts`, cut into `parts` equal flat partitions."""
    parts = draw(st.integers(1, 4))
    layout = []  # (start in flat buffer, key, shape)
    pos = 0
    for key, shape in tensors:
        pos += draw(st.integers(0, 2))  # alignment padding before this tensor
        layout.append((pos, key, shape))
        pos += math.prod(shape)
    total = pos + draw(st.integers(0, 3))
    total += (-total) % parts
    size = total // parts
    shards = []
    for p in range(parts):
        lo, hi = p * size, (p + 1) * size
        pieces = []
        for start, key, shape in layout:
            a, b = max(lo, start), min(hi, start + math.prod(shape))
            if a < b:
                pieces.append((a - lo, Region.whole(key, shape, flat=(a - start, b - start))))
        shards.append(Shard((size,), tuple(pieces)))
    return shards


@st.composite
def layouts(draw, tensors):
    """A mix: some tensors in box grids, the rest in one ZeRO flat group."""
    mode = draw(st.sampled_from(["boxes", "flat", "mixed"]))
    if mode == "boxes":
        return [s for key, shape in tensors for s in draw(box_grid(key, shape))]
    if mode == "flat":
        return draw(flat_partitions(tensors))
    split = draw(st.integers(0, len(tensors)))
    boxed = [s for key, shape in tensors[:split] for s in draw(box_grid(key, shape))]
    rest = tensors[split:]
    return boxed + (draw(flat_partitions(rest)) if rest else [])


def scatter(globals_, shards):
    """Write the global tensors into the shards' local buffers through the plan."""
    sources = [Region.whole(k, t.shape) for k, t in globals_.items()]
    buffers = [torch.full(s.shape, PAD) for s in shards]
    regions, views = _flatten(shards, buffers)
    execute(plan_copies(sources, regions), sources, list(globals_.values()), regions, views)
    return buffers


def gather(shapes_, shards, buffers):
    targets = [Region.whole(k, shape) for k, shape in shapes_.items()]
    out = [torch.full(shape, float("nan")) for shape in shapes_.values()]
    regions, views = _flatten(shards, buffers)
    execute(plan_copies(regions, targets), regions, views, targets, out)
    return dict(zip(shapes_, out))


def _flatten(shards, buffers):
    regions, views = [], []
    for shard, buf in zip(shards, buffers):
        for region, view in shard.views(buf):
            regions.append(region)
            views.append(view)
    return regions, views


tensor_sets = st.lists(shapes, min_size=1, max_size=3).map(
    lambda ss: [(f"t{i}", s) for i, s in enumerate(ss)])


@settings(max_examples=300, deadline=None)
@given(st.data(), tensor_sets)
def test_any_layout_to_any_layout_is_exact(data, tensors):
    globals_ = {k: torch.randn(shape) for k, shape in tensors}
    a = data.draw(layouts(tensors), label="layout A")
    b = data.draw(layouts(tensors), label="layout B")
    for key, shape in tensors:
        assert coverage_problems(shape, [r for s in a for r in s.regions if r.key == key]).ok

    bufs_a = scatter(globals_, a)
    # A -> B directly, region by region, never through the global tensor.
    regions_a, views_a = _flatten(a, bufs_a)
    bufs_b = [torch.full(s.shape, PAD) for s in b]
    regions_b, views_b = _flatten(b, bufs_b)
    plan = plan_copies(regions_a, regions_b)
    execute(plan, regions_a, views_a, regions_b, views_b)
    # Every target element is written exactly once.
    assert sum(c.numel for c in plan) == sum(r.numel for r in regions_b)

    back = gather({k: s for k, s in tensors}, b, bufs_b)
    for key, t in globals_.items():
        assert torch.equal(back[key], t), key


@settings(max_examples=200, deadline=None)
@given(shapes, st.data())
def test_flat_to_boxes_partitions_the_range(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    marks = torch.zeros(n, dtype=torch.int64)
    grid = torch.arange(n).reshape(shape)
    for offs, lens in flat_to_boxes(shape, start, stop):
        sl = tuple(slice(o, o + l) for o, l in zip(offs, lens))
        marks[grid[sl].reshape(-1)] += 1
    expect = torch.zeros(n, dtype=torch.int64)
    expect[start:stop] = 1
    assert torch.equal(marks, expect)


@settings(max_examples=200, deadline=None)
@given(st.data(), shapes)
def test_byte_runs_address_the_same_elements_as_views(data, shape):
    shards = data.draw(layouts([("x", shape)]))
    for shard in shards:
        for _, region in shard.parts:
            buf = torch.arange(region.numel, dtype=torch.float64)
            for box in region.boxes():
                via_runs = torch.cat([buf[s:s + n] for s, n in byte_runs(region, box)])
                assert torch.equal(via_runs, region.view(buf, box).reshape(-1))


def test_coverage_reports_gaps_and_overlaps():
    shape = (4, 6)
    left = Region("w", shape, (0, 0), (4, 3))
    right = Region("w", shape, (0, 3), (4, 3))
    assert coverage_problems(shape, [left, right]).ok
    gap = coverage_problems(shape, [left])
    assert gap.missing == 12 and not gap.ok
    doubled = coverage_problems(shape, [left, right, Region("w", shape, (1, 2), (1, 2))])
    assert doubled.overlapping == 2
    flat = coverage_problems(shape, [Region.whole("w", shape, flat=(0, 10)),
                                     Region.whole("w", shape, flat=(10, 24))])
    assert flat.ok


def test_coverage_compares_a_bounded_number_of_pairs(monkeypatch):
    """Metadata is untrusted: pieces that share rows are compared pairwise up to a budget
    (200,000 copies of one chunk did not finish verify in a minute), then refused."""
    from ckptool.core import regions

    monkeypatch.setattr(regions, "_PAIRS", 1000)
    shape = (4, 5000)
    copies = coverage_problems(shape, [Region("w", shape, (0, 0), (4, 1))] * 5000)
    assert copies.problems == ["at least 4000 elements are stored more than once"]
    columns = coverage_problems(shape, [Region("w", shape, (0, i), (4, 1)) for i in range(5000)])
    assert not columns.ok and "share rows more than ckptool compares" in columns.problems[0]
    few = coverage_problems(shape, [Region("w", shape, (0, i * 200), (4, 200)) for i in range(25)])
    assert few.ok  # 300 pairs: checked exactly


def test_region_rejects_out_of_bounds_box():
    with pytest.raises(ValueError, match="outside"):
        Region("w", (4,), (2,), (3,))


def test_the_box_index_finds_exactly_what_a_scan_finds_in_the_same_order():
    """BoxIndex against the all-pairs scan it replaces: random grid and flat-range sources
    (rows, columns, ZeRO-style flat slices), random target boxes."""
    import random

    from ckptool.core.regions import BoxIndex, Region, intersect_boxes

    rng = random.Random(7)
    shape = (12, 10)
    for trial in range(30):
        sources = []
        if trial % 3 == 0:  # row blocks
            cuts = sorted(rng.sample(range(1, 12), 3))
            sources = [Region("w", shape, (a, 0), (b - a, 10)) for a, b in zip([0, *cuts], [*cuts, 12])]
        elif trial % 3 == 1:  # a grid of row and column blocks
            sources = [Region("w", shape, (r, c), (4, 5)) for r in (0, 4, 8) for c in (0, 5)]
        else:  # flat slices of the whole tensor
            cuts = sorted(rng.sample(range(1, 120), 5))
            sources = [Region.whole("w", shape, (a, b)) for a, b in zip([0, *cuts], [*cuts, 120])]
        index = BoxIndex(sources)
        boxes = [(i, b) for i, r in enumerate(sources) for b in r.boxes()]
        for _ in range(20):
            r0, c0 = rng.randrange(12), rng.randrange(10)
            box = ((r0, c0), (rng.randint(1, 12 - r0), rng.randint(1, 10 - c0)))
            want = [(i, c) for i, b in boxes if (c := intersect_boxes(b, box)) is not None]
            assert index.overlaps(box) == want


def test_bytes_read_counts_each_overlap_once_per_target_region():
    """``engine.bytes_read`` (the dry run's "read" figure): a tensor whose pieces tile it reads
    each target region's size; one with a piece no file holds (fresh zeros) or with a gap
    counts only the overlaps with stored bytes. The same region in two target files is read
    twice."""
    from ckptool.core.engine import TargetFile, TargetTensor, bytes_read
    from ckptool.core.index import CheckpointIndex, Location, Piece, TensorInfo

    def rows(key, lo, hi, shape=(8, 4)):
        return Region(key, shape, (lo, 0), (hi - lo, shape[1]))

    index = CheckpointIndex(format="dcp", url="mem://")
    tiled = TensorInfo("a", (8, 4), torch.float32)
    tiled.pieces += [Piece(rows("a", 0, 4), Location("f", 0, 64)), Piece(rows("a", 4, 8), Location("f", 64, 64))]
    fresh = TensorInfo("b", (8, 4), torch.float32)
    fresh.pieces += [Piece(rows("b", 0, 4), Location("f", 128, 64)), Piece(rows("b", 4, 8), Location(""))]
    gap = TensorInfo("c", (8, 4), torch.float32)
    gap.pieces += [Piece(rows("c", 0, 2), Location("f", 192, 32)), Piece(rows("c", 6, 8), Location("f", 224, 32))]
    index.tensors.update(a=tiled, b=fresh, c=gap)

    def target(path, *regions):
        return TargetFile(path, [TargetTensor(r.key, Shard.of(r), torch.float32) for r in regions])

    plan = [target("x", rows("a", 2, 6), rows("b", 2, 6), rows("c", 0, 8)),
            target("y", rows("a", 2, 6))]
    assert bytes_read(plan, index) == 4 * (4 * 4 + 2 * 4 + 4 * 4 + 4 * 4)
