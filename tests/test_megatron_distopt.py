"""Megatron's distributed optimizer state (``distrib_optim.pt``) against real megatron-core.

The checkpoints are written by real megatron-core on CPU (``tests/harness/mcore_distopt.py``:
DistributedDataParallel with the distributed optimizer, one Adam step, Megatron-LM's
legacy save). Ground truth is each process's optimizer shard, taken from the optimizer,
not from the file. Results are checked bit for bit: read through ``ckptool convert --to
dcp`` and torch DCP, and written by ``ckptool reshard`` then loaded by real megatron-core.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import peer
import torch

peer("megatron.core")

from converters.megatron import distopt  # noqa: E402
from tests.harness import mcore_distopt as H  # noqa: E402


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt")
    H.generate(root)
    return root


def _same(got: dict, want: dict, rows: int | None = None):
    assert got.keys() == want.keys()
    for key in want:
        a, b = got[key], want[key]
        if rows is not None and ("word_embeddings" in key or "output_layer" in key):
            a, b = a[:rows], b[:rows]  # vocab padding rows differ between TP sizes
        assert a.shape == b.shape and torch.equal(a, b), key


@pytest.mark.parametrize("name", list(H.CASES))
def test_layout_rule_gives_mcore_buffer_offsets(real, name):
    """The rule, from names, shapes and args only, against mcore's own param_index_map."""
    case = H.CASES[name]
    args = H.megatron_args(case)
    for dump in H.truth(real, name):
        (buf,) = dump["buffers"]  # one dtype, no virtual pipeline
        base = [sum(buf["unpadded"][:b]) for b in range(len(buf["buckets"]))]
        want = {n: base[b] + start - buf["buckets"][b][0] for n, (start, _, b) in buf["params"].items()}
        params = [distopt.Param(n, torch.Size(shape).numel(), buf["key"][0], distopt.shared_embedding(
            H.WORD if (case["tied"] and n == "output_layer.weight") else n, case["tied"], case["pp"]))
            for n, shape in dump["names"]]
        (got,) = distopt.layout([params], args, args.data_parallel_size, dump["pp"])
        assert got.offsets == want and got.numel_unpadded == sum(buf["unpadded"])
    if name in ("bucketed", "tp2"):
        assert len(buf["buckets"]) > 1  # the case does exercise bucket boundaries


@pytest.mark.parametrize("name", list(H.CASES))
def test_convert_to_dcp_carries_the_optimizer_state_bit_exact(real, name, tmp_path, run_cli):
    import torch.distributed.checkpoint as dcp

    dst = tmp_path / "dcp"
    res = run_cli("convert", real / name, dst, "--to", "dcp")
    assert res.code == 0, res.err
    want = H.canonical_state(H.truth(real, name), H.CASES[name])
    stored = dcp.FileSystemReader(str(dst)).read_metadata().state_dict_metadata
    assert {k for k in stored if k.startswith("optimizer.")} == set(want)
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=str(dst))
    _same(got, want)
    assert run_cli("verify", dst, "--deep").code == 0


def test_dcp_copy_is_not_written_back_without_the_param_groups(real, tmp_path, run_cli):
    """DCP keeps the vectors but not Megatron's param groups and step: the Megatron writer
    refuses rather than drop the optimizer state."""
    mid, back = tmp_path / "dcp", tmp_path / "back"
    assert run_cli("convert", real / "odd", mid, "--to", "dcp").code == 0
    res = run_cli("convert", mid, back, "--to", "megatron")
    assert res.code == 2 and "optimizer state" in res.err and "--drop-optimizer" in res.err, res.err
    assert not back.exists()


def test_inspect_and_deep_verify_see_the_optimizer_state(real, run_cli):
    report = json.loads(run_cli("inspect", real / "tp2", "--json").out)
    model = 2 + 2 * 12 + 2 + 1  # embeddings, 2 layers, final norm, untied output layer
    assert report["tensor_count"] == 4 * model and report["optimizer"].startswith("exp_avg")
    # PP2 with tied embeddings: the last stage's Adam state of its copy must equal the first's
    assert run_cli("verify", real / "pp2", "--deep").code == 0


def test_reshard_writes_distrib_optim_that_mcore_loads(real, tmp_path, run_cli):
    """Each target is loaded by real megatron-core (load_state_dict + load_parameter_state) at
    the new topology; its optimizer shards must be the source's, bit for bit."""
    targets = {"odd": ("--to-tp", 2, "--to-dp", 1), "tp2": ("--to-tp", 1, "--to-dp", 2),
               "pp2": ("--to-pp", 1, "--to-dp", 2), "bucketed": ("--to-pp", 2, "--to-dp", 1)}
    outs = []
    for name, flags in targets.items():
        dst = tmp_path / name
        res = run_cli("reshard", real / name, dst, *flags)
        assert res.code == 0, res.err
        assert "distrib_optim.pt is laid out for DDP buckets" in res.out
        outs.append(dst)
    for dst, loaded in zip(outs, H.load(outs)):
        name = dst.name
        args = torch.load(next(dst.glob("iter_*/mp_rank_*/model_optim_rng.pt")), weights_only=False)["args"]
        want = H.canonical_state(H.truth(real, name), H.CASES[name])
        _same(H.canonical_state(loaded, H.case_from_args(args)), want, rows=H.CASES[name]["vocab"])


def _copy_with(real, tmp_path, edit_args=None, edit_file=None, edit_state=None):
    src = tmp_path / "src"
    shutil.copytree(real / "odd", src)
    for f in src.rglob("model_optim_rng.pt"):
        if edit_args or edit_state:
            state = torch.load(f, weights_only=False)
            if edit_args:
                edit_args(state["args"])
            if edit_state:
                edit_state(state)
            torch.save(state, f)
        if edit_file:
            g = f.parent / "distrib_optim.pt"
            torch.save(edit_file(torch.load(g)), g)
    return src


def _forget_bucketing(args):
    del args.overlap_grad_reduce, args.ddp_bucket_size


def _word_embedding_last(state):
    state["model"][H.WORD] = state["model"].pop(H.WORD)


def _expert_parallel(state):
    return [state, None]  # ChainedOptimizer with a dense and an expert-parallel optimizer


def _pre_2024(state):
    del state["buckets_coalesced"]
    (key, entry), = state[0].items()
    return {0: {torch.float32: {k: [entry[k]] for k in ("param", "exp_avg", "exp_avg_sq")}}}


def _wrong_size(state):
    (entry,) = state[0].values()
    entry["numel_unpadded"] += 64
    for k in ("param", "exp_avg", "exp_avg_sq"):
        entry[k] = torch.cat([entry[k], torch.zeros(64)])
    return state


@pytest.mark.parametrize("edit,message", [
    (dict(edit_args=_forget_bucketing), "Megatron args lack overlap_grad_reduce, which decides the "
     "bucket boundaries of distrib_optim.pt, and with parameter sizes that are not multiples of 64"),
    (dict(edit_file=_expert_parallel), "holds the states of several optimizers, but the args say EP1"),
    (dict(edit_file=_pre_2024), "distrib_optim.pt is in the pre-2024 per-bucket format"),
    (dict(edit_file=_wrong_size), "grad buffer 0 of distrib_optim.pt holds 52000 elements, "
     "Megatron's layout rule gives 51936"),
    (dict(edit_state=_word_embedding_last), "the parameters of model are not in the order of "
     "Megatron's named_parameters() that ckptool knows"),
], ids=["unknown-buckets", "expert-parallel", "pre-2024", "wrong-size", "other-order"])
def test_unmappable_state_is_refused_before_writing(real, tmp_path, run_cli, edit, message):
    src = _copy_with(real, tmp_path, **edit)
    dst = tmp_path / "out"
    res = run_cli("reshard", src, dst, "--to-tp", 2, "--to-dp", 1)
    assert res.code == 2 and message in res.err and "--drop-optimizer" in res.err, res.err
    assert "Traceback" not in res.err and not dst.exists() and not list(tmp_path.glob("out*"))
    report = json.loads(run_cli("inspect", src, "--json").out)  # the weights stay readable
    assert report["tensor_count"] == 28 and report["optimizer"].startswith("not mapped to parameters")
    res = run_cli("reshard", src, dst, "--to-tp", 2, "--to-dp", 1, "--drop-optimizer")
    assert res.code == 0, res.err
    assert not list(dst.rglob("distrib_optim.pt"))
