"""Megatron-Core ``torch_dist`` checkpoints with the distributed optimizer's state, against
real megatron-core 0.16 (``tests/harness/mcore_distopt_torch_dist.py``: DistributedDataParallel with the
distributed optimizer, one Adam step, ``dist_checkpointing.save`` in each sharding type).

Ground truth is each process's optimizer shard, taken from the optimizer. Reading is checked
bit for bit; ``ckptool reshard`` output is loaded by real megatron-core at the new topology
(``dist_checkpointing.load`` + ``load_state_dict``), whose shards must be the source's bit
for bit, and the next step must give the uninterrupted run's loss.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from ckptool.core import optimizer as canon  # noqa: E402
from tests.conftest import full_tensor, peer

peer("megatron.core")

from ckptool.checkpoints.open import open_checkpoint  # noqa: E402
from converters.megatron import dist_distopt as dd  # noqa: E402
from converters.megatron import distopt  # noqa: E402
from tests.harness import mcore_distopt_torch_dist as H  # noqa: E402
from tests.harness import mcore_distopt as D  # noqa: E402
from tests.harness.mcore import load_common  # noqa: E402


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt-dist")
    H.train_and_save(root)
    return root


def _want(real, name: str) -> dict:
    return D.canonical_state(D.truth(real, name), H.CASES[name])


def _exact(opened, want: dict) -> None:
    for key, value in want.items():
        got = full_tensor(opened, key)
        assert got.dtype == torch.float32 and torch.equal(got, value), key


@pytest.mark.parametrize("name", ["dp2", "tp2", "full", "pp2"])
def test_read_gives_the_optimizer_shards_bit_exact(real, name):
    opened = open_checkpoint(str(real / name))
    index = opened.index
    assert index.unmapped is None
    assert index.layout(distopt.Meta).sharding == H.CASES[name]["sharding"]
    want = _want(real, name)
    assert {k for k in index.tensors if k.startswith(canon.PREFIX)} == set(want)
    _exact(opened, want)
    meta = index.layout(distopt.Meta)
    assert meta.keys == {torch.float32: (torch.float32, torch.float32)}
    assert [g["step"] for g in meta.state["optimizer"]["param_groups"]] == [1.0, 1.0]
    if name == "dp2":  # the case does cut parameters at bucket and DP-rank boundaries
        (buf,) = D.truth(real, name)[0]["buffers"]
        assert len(buf["buckets"]) > 2
        assert any(len(i.pieces) > 1 for k, i in index.tensors.items() if k.startswith(canon.PREFIX))
    if name == "pp2":  # several buckets on stage 0; the word embedding alone in one on both
        dumps = D.truth(real, name)
        assert len(dumps[0]["buffers"][0]["buckets"]) > 2
        for dump in dumps:
            (buf,) = dump["buffers"]
            word = D.WORD if dump["pp"] == 0 else "output_layer.weight"
            assert [n for n, v in buf["params"].items() if v[2] == buf["params"][word][2]] == [word]


def test_a_wrong_layout_rule_is_caught(real, monkeypatch):
    """Every bucket length is checked against the rule: with another alignment the
    offsets would be wrong, and the reader refuses instead of mapping them."""
    monkeypatch.setattr(distopt, "ALIGN", 32)
    index = open_checkpoint(str(real / "dp2")).index
    assert index.unmapped.startswith("dp_group_idx_0 gbuf_idx_0 holds buckets of [9920, 7232, ")
    assert index.layout(distopt.Meta) is None


def test_a_rank_refused_late_leaves_the_stored_state_as_it_is(real, tmp_path, run_cli, monkeypatch):
    """The rule fails on TP rank 1 only, after rank 0 mapped: nothing half-mapped stays in
    the index, so verify sees the buckets as stored (sound, unsealed: exit 0) and reshard
    refuses with the reason."""
    layout, calls = distopt.layout, []

    def second_differs(*args):
        calls.append(1)
        buffers = layout(*args)
        if len(calls) == 2:
            buffers[0] = dataclasses.replace(buffers[0], buckets=buffers[0].buckets + (64,))
        return buffers
    monkeypatch.setattr(distopt, "layout", second_differs)
    index = open_checkpoint(str(real / "tp2")).index
    assert len(calls) == 2 and "dp_group_idx_1 gbuf_idx_0 holds buckets of" in index.unmapped
    assert not any(k.startswith(canon.PREFIX) for k in index.tensors)
    assert any(k.startswith("optimizer.distributed.") for k in index.tensors)
    calls.clear()
    res = run_cli("verify", real / "tp2")
    assert res.code == 0, res.out + res.err
    calls.clear()
    res = run_cli("reshard", real / "tp2", tmp_path / "out", "--to-tp", "1")
    assert res.code == 2 and "dp_group_idx_1" in res.err and not (tmp_path / "out").exists()


def test_fully_reshardable_of_several_buckets_is_refused(real, tmp_path, run_cli):
    """mcore 0.16 saves it shifted (its own warning says so): the stored word-embedding
    state is not the optimizer's, so ckptool refuses rather than carry it."""
    import torch.distributed.checkpoint as dcp

    src = real / "full-buckets"
    want = _want(real, "full-buckets")
    key = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
    stored = {key: torch.empty_like(want[key])}
    dcp.load(stored, checkpoint_id=str(next(src.glob("iter_*"))))
    assert not torch.equal(stored[key], want[key])
    index = open_checkpoint(str(src)).index
    assert index.unmapped == (
        "TP rank 0 / PP rank 0 has a grad buffer of 5 buckets: megatron-core 0.16 saves "
        "'fully_reshardable' state past a bucket boundary shifted by the bucket padding "
        "(\"param range exceeds unpadded buffer\"), so it is not the parameters' state")
    dst = tmp_path / "out"
    res = run_cli("reshard", src, dst, "--to-tp", 2, "--to-dp", 1)
    assert res.code == 2 and "shifted by the bucket padding" in res.err and "--drop-optimizer" in res.err
    assert "Traceback" not in res.err and not dst.exists()


def _edit_common(real, tmp_path, name, edit):
    src = tmp_path / name
    shutil.copytree(real / name, src)
    path = next(src.glob("iter_*/common.pt"))
    common = torch.load(path, weights_only=False)
    edit(common)
    torch.save(common, path)
    return src


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["optimizer"].update(param_state_sharding_type="fully_sharded_model_space"),
     "Megatron-Core's deprecated 'fully_sharded_model_space' distributed-optimizer state "
     "(flattened ShardedTensors, which megatron-core 0.16 itself neither saves nor loads) is "
     "not read"),
    (lambda c: c["optimizer"].update(param_state_sharding_type="dp_zero_gather_scatter"),
     "Megatron-Core's deprecated 'dp_zero_gather_scatter' distributed-optimizer state"),
    (lambda c: delattr(c["args"], "transformer_impl"),
     "Megatron args say transformer_impl=None; the order of the parameters in the distributed "
     "optimizer's buffers is known only for 'local' and 'transformer_engine'"),
    (lambda c: setattr(c["args"], "ddp_bucket_size", 20000),
     "dp_group_idx_0 gbuf_idx_0 holds buckets of [9920, 7232, 7360, 12160, 15552] elements, "
     "Megatron's layout rule gives"),
], ids=["fully-sharded-model-space", "dp-zero-gather-scatter", "unknown-spec", "other-buckets"])
def test_unmappable_state_is_refused_with_the_reason(real, tmp_path, run_cli, edit, message):
    src = _edit_common(real, tmp_path, "dp2", edit)
    dst = tmp_path / "out"
    res = run_cli("reshard", src, dst, "--to-tp", 2, "--to-dp", 1)
    assert res.code == 2 and message in res.err and "--drop-optimizer" in res.err, res.err
    assert "Traceback" not in res.err and not dst.exists()
    shown = run_cli("inspect", src)  # inspect says the same, before anyone tries
    assert shown.code == 0 and "optimizer   not mapped to parameters:" in shown.out and message in shown.out
    res = run_cli("reshard", src, dst, "--to-tp", 2, "--to-dp", 1, "--drop-optimizer")
    assert res.code == 0, res.err
    assert "optimizer" not in load_common(dst)


def test_round_trip_is_bit_exact(real, tmp_path, run_cli):
    """dp_reshardable TP1/DP2 -> TP2/DP1 -> TP1/DP2; and through legacy distrib_optim.pt."""
    src = real / "dp2"
    there, back = tmp_path / "tp2", tmp_path / "back"
    assert run_cli("reshard", src, there, "--to-tp", 2, "--to-dp", 1).code == 0
    assert run_cli("reshard", there, back, "--to-tp", 1, "--to-dp", 2).code == 0
    legacy, again = tmp_path / "legacy", tmp_path / "again"
    assert run_cli("convert", src, legacy, "--to", "megatron", "--tp", 2, "--dp", 1).code == 0
    assert list(legacy.rglob("distrib_optim.pt"))
    assert run_cli("convert", legacy, again, "--to", "megatron-dist", "--tp", 1, "--dp", 2).code == 0
    source = open_checkpoint(str(src))
    for out in (back, again):
        opened = open_checkpoint(str(out))
        assert opened.index.tensors.keys() == source.index.tensors.keys()
        for key in source.index.tensors:
            assert torch.equal(full_tensor(opened, key), full_tensor(source, key)), (out.name, key)
        assert opened.index.layout(distopt.Meta).state == source.index.layout(distopt.Meta).state
    assert load_common(back)["content_metadata"] == {"distrib_optim_sharding_type": dd.WRITTEN,
                                                     "chained_optim_avoid_prefix": True}
    assert run_cli("verify", back, "--deep").code == 0


def test_reshard_loads_in_mcore_and_resumes_like_the_uninterrupted_run(real, tmp_path, run_cli):
    """Each output at a new TP/DP (one through legacy distrib_optim.pt files) is loaded by
    real megatron-core; the next step gives the uninterrupted run's loss."""
    targets = {"dp2": ("--to-tp", 2, "--to-dp", 1), "tp2": ("--to-tp", 1, "--to-dp", 2),
               "full": ("--to-tp", 1, "--to-dp", 2)}
    outs = {}
    for name, flags in targets.items():
        dst = tmp_path / name
        res = run_cli("reshard", real / name, dst, *flags)
        assert res.code == 0, res.err
        assert f"written in Megatron-Core's '{dd.WRITTEN}' form" in res.out
        assert load_common(dst)["optimizer"]["param_state_sharding_type"] == dd.WRITTEN
        outs[dst] = name
    legacy, dst = tmp_path / "legacy", tmp_path / "via-legacy"
    assert run_cli("convert", real / "tp2", legacy, "--to", "megatron").code == 0
    assert run_cli("convert", legacy, dst, "--to", "megatron-dist", "--tp", 1, "--dp", 2).code == 0
    outs[dst] = "tp2"
    _resumes_like_the_uninterrupted_run(real, tmp_path, outs)


def test_pipeline_reshard_loads_in_mcore_and_resumes_like_the_uninterrupted_run(real, tmp_path, run_cli):
    """PP changes both ways, tied embeddings included (at PP2 the last stage's output layer
    is the word embedding, with a bucket of its own on each stage): real megatron-core
    loads each output; the next step gives the uninterrupted run's loss."""
    targets = {"pp2-tp2": ("pp2", "--to-tp", 2, "--to-pp", 1),
               "pp2-dp2": ("pp2", "--to-pp", 1, "--to-dp", 2),
               "tp2-pp2": ("tp2", "--to-tp", 1, "--to-pp", 2),
               "full-pp2": ("full", "--to-tp", 1, "--to-pp", 2)}
    outs = {}
    for out, (name, *flags) in targets.items():
        dst = tmp_path / out
        res = run_cli("reshard", real / name, dst, *flags)
        assert res.code == 0, res.err
        outs[dst] = name
    _resumes_like_the_uninterrupted_run(real, tmp_path, outs)
    for dst in (tmp_path / "tp2-pp2", tmp_path / "full-pp2"):  # the tied copies agree
        loaded, _ = H.dumps(tmp_path / f"{dst.name}.resumed")
        stages = D.local_state(loaded)
        first, last = stages[(0, 0)][D.WORD], stages[(0, 1)]["output_layer.weight"]
        assert all(torch.equal(first[k], last[k]) for k in ("param", "exp_avg", "exp_avg_sq"))


def _resumes_like_the_uninterrupted_run(real, tmp_path, outs: dict) -> None:
    """Resume each output (``dst -> source case``) in real mcore: the loaded shards must be
    the source's bit for bit, the losses before and after the next step the source run's."""
    H.resume(list(outs))
    for dst, name in outs.items():
        loaded, (before, after) = H.dumps(tmp_path / f"{dst.name}.resumed")
        _, (want_before, want_after) = H.dumps(real / f"{name}.truth")
        args = load_common(dst)["args"]
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) != \
            (H.CASES[name]["tp"], H.CASES[name]["pp"])
        got = D.canonical_state(loaded, D.case_from_args(args))
        want = _want(real, name)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), dst.name
        assert abs(before - want_before) / abs(want_before) < 1e-5
        assert abs(after - want_after) / abs(want_after) < 1e-5, (dst.name, after, want_after)
