"""Megatron layout rules: hand-checked cases and properties over random topologies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptool.core.errors import TopologyError
from ckptool.core.layout import (ModelSpec, global_params, layout, padded_vocab, split,
                                 stage_layers, Param, GATED)
from ckptool.core.regions import Region, coverage_problems, execute, plan_copies
from ckptool.core.topology import Topology

LLAMA = dict(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=48, vocab_size=1000, swiglu=True, tied_embeddings=False,
             add_bias=False, normalization="RMSNorm", learned_positions=False)
GPT = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
           vocab_size=1003, max_position_embeddings=64)


def test_swiglu_rank_holds_gate_and_up_halves():
    """fc1 [gate; up] of 2x6 rows at TP2: rank 1 holds gate rows 3..6 and up rows 9..12."""
    shard = split(Param("fc1", (12, 4), GATED), 1, 2)
    (o0, gate), (o1, up) = shard.parts
    assert shard.shape == (6, 4)
    assert (gate.offsets, gate.lengths) == ((3, 0), (3, 4)) and o0 == 0
    assert (up.offsets, up.lengths) == ((9, 0), (3, 4)) and o1 == 12
    full = torch.arange(48.0).reshape(12, 4)
    local = torch.empty(6, 4)
    regions = list(shard.regions)
    views = [v for _, v in shard.views(local)]
    src = Region.whole("fc1", (12, 4))
    execute(plan_copies([src], regions), [src], [full], regions, views)
    # exactly what Megatron's ColumnParallelLinear over torch.chunk(fc1, 2) gives rank 1
    gate_w, up_w = torch.chunk(full, 2)
    assert torch.equal(local, torch.cat([gate_w[3:6], up_w[3:6]]))


def test_vocab_padding_depends_on_tp_and_never_drops_a_real_row():
    assert padded_vocab(1003, 128, 1) == 1024
    assert padded_vocab(1003, 128, 4) == 1024
    assert padded_vocab(1003, 128, 8) == 1024
    assert padded_vocab(50257, 128, 8) == 51200
    spec = ModelSpec(**GPT)
    shards = [split(global_params(spec)[0], t, 4, spec.padded_vocab(4)) for t in range(4)]
    assert [s.shape for s in shards] == [(256, 32)] * 4
    # rank 3 holds real rows 768..1003 and 21 padding rows
    assert shards[3].parts[0][1].offsets == (768, 0) and shards[3].parts[0][1].lengths == (235, 32)
    assert coverage_problems((1003, 32), [r for s in shards for r in s.regions]).ok


def test_pipeline_stages_even_uneven_and_virtual():
    spec = ModelSpec(**{**GPT, "num_layers": 8})
    assert stage_layers(spec, 2) == [[range(0, 4)], [range(4, 8)]]
    assert stage_layers(spec, 2, vpp=2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    uneven = ModelSpec(**{**GPT, "num_layers": 10, "first_stage_layers": 1, "last_stage_layers": 3})
    assert stage_layers(uneven, 4) == [[range(0, 1)], [range(1, 4)], [range(4, 7)], [range(7, 10)]]
    with pytest.raises(TopologyError, match=r"num_layers \(8\) must be divisible by PP x VPP \(3 x 1\)"):
        stage_layers(spec, 3)


def test_refuses_heads_and_groups_not_divisible_by_tp():
    with pytest.raises(TopologyError, match=r"query groups / kv heads \(4\) must be divisible by TP \(8\)"):
        layout(ModelSpec(**LLAMA), Topology(tp=8))
    with pytest.raises(TopologyError, match=r"attention heads \(4\) must be divisible by TP \(8\)"):
        layout(ModelSpec(**GPT), Topology(tp=8))


def test_tied_embeddings_last_stage_holds_a_replica():
    spec = ModelSpec(**GPT)
    ranks = layout(spec, Topology(tp=2, pp=2))
    last = [r for r in ranks if r.pp_rank == 1]
    emb = [t for r in last for t in r.tensors if t.name == "embedding.word_embeddings.weight"]
    assert len(emb) == 2 and all(t.replica for t in emb)
    first = [t for r in ranks if r.pp_rank == 0 for t in r.tensors
             if t.name == "embedding.word_embeddings.weight"]
    assert len(first) == 2 and not any(t.replica for t in first)


specs = st.sampled_from([LLAMA, GPT])


@settings(max_examples=40, deadline=None)
@given(specs, st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_any_topology_to_any_topology_is_exact(kw, tp_a, pp_a, vpp_a, tp_b, pp_b):
    """Scatter random global weights into layout A, reshard A -> B by regions, gather: exact.
    Primary (non-replica) pieces cover every global element exactly once."""
    if vpp_a > 1 and pp_a == 1:
        vpp_a = 1
    assert_reshard_exact(ModelSpec(**kw), Topology(tp=tp_a, pp=pp_a, vpp=vpp_a), Topology(tp=tp_b, pp=pp_b))


MOE = dict(LLAMA, num_experts=4, moe_ffn_hidden_size=24)


@pytest.mark.parametrize("a,b", [((1, 1, 2), (1, 1, 1)), ((1, 1, 1), (2, 2, 4)), ((2, 1, 2), (1, 2, 4)),
                                 ((1, 2, 4), (2, 1, 2))])
def test_experts_reshard_exactly_across_ep_tp_and_pp(a, b):
    """(TP, PP, EP), DP = EP: each EP rank's experts are its slice of the stacked [E, ...]
    tensors, ETP = TP splits inside each expert; the router and dense tensors are replicas
    on EP ranks > 0."""
    spec = ModelSpec(**MOE)
    ta, tb = (Topology(tp=t, pp=p, ep=e, dp=e) for t, p, e in (a, b))
    assert_reshard_exact(spec, ta, tb)
    ranks = layout(spec, ta)
    assert len(ranks) == ta.tp * ta.pp * ta.ep
    names = {t.name for r in ranks if r.ep_rank == ta.ep - 1 for t in r.tensors}
    assert f"decoder.layers.0.mlp.experts.local_experts.{4 // ta.ep - 1}.linear_fc1.weight" in names


def test_impossible_expert_layouts_are_refused_naming_the_rule():
    spec = ModelSpec(**MOE)
    with pytest.raises(TopologyError, match="4 experts must be divisible by EP \\(3\\)"):
        layout(spec, Topology(ep=3, dp=3))
    with pytest.raises(TopologyError, match="needs a model with experts"):
        layout(ModelSpec(**LLAMA), Topology(ep=2, dp=2))
    with pytest.raises(TopologyError, match="must divide tp x dp"):
        Topology(tp=2, dp=1, ep=4, etp=1)
    with pytest.raises(TopologyError, match="ep=4 must divide dp=2"):  # etp=tp is the default
        Topology(tp=1, dp=2, ep=4, etp=1)


def assert_reshard_exact(spec: ModelSpec, topo_a: Topology, topo_b: Topology) -> None:
    try:
        a = layout(spec, topo_a)
        b = layout(spec, topo_b)
    except TopologyError:
        return
    g = torch.Generator().manual_seed(0)
    params = global_params(spec)
    globals_ = {p.key: torch.randn(p.shape, generator=g) for p in params}
    for p in params:
        prim = [r for rank in a for t in rank.tensors if not t.replica for r in t.shard.regions
                if r.key == p.key]
        assert coverage_problems(p.shape, prim).ok, p.key

    def buffers(ranks, primary_only=False):
        regions, views = [], []
        for rank in ranks:
            for t in rank.tensors:
                buf = torch.full(t.shard.shape, float("nan"))
                for region, view in t.shard.views(buf):
                    if not (primary_only and t.replica):
                        regions.append(region)
                        views.append(view)
        return regions, views

    src_global = [Region.whole(k, v.shape) for k, v in globals_.items()]
    reg_a, views_a = buffers(a, primary_only=True)
    execute(plan_copies(src_global, reg_a), src_global, list(globals_.values()), reg_a, views_a)
    reg_b, views_b = buffers(b)
    execute(plan_copies(reg_a, reg_b), reg_a, views_a, reg_b, views_b)
    out = {k: torch.full(v.shape, float("nan")) for k, v in globals_.items()}
    dst = [Region.whole(k, v.shape) for k, v in out.items()]
    execute(plan_copies(reg_b, dst), reg_b, views_b, dst, list(out.values()))
    for k, v in globals_.items():
        assert torch.equal(out[k], v), k


def test_megatron_deepspeed_args_spellings_read_as_megatron_lms():
    """Megatron-DeepSpeed spells some args its own way (lower-case normalization, rotary as a
    flag, num_key_value_heads); the legacy readers see the same model as from Megatron-LM's."""
    import argparse

    from converters.schemas.megatron_args import spec_from_args

    common = dict(num_layers=2, hidden_size=64, num_attention_heads=8, padded_vocab_size=128,
                  ffn_hidden_size=128, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    ds = argparse.Namespace(**common, normalization="rmsnorm", use_rotary_position_embeddings=True,
                            num_key_value_heads=2, swiglu=True)
    lm = argparse.Namespace(**common, normalization="RMSNorm", position_embedding_type="rope",
                            group_query_attention=True, num_query_groups=2, swiglu=True)
    assert spec_from_args(ds)[0] == spec_from_args(lm)[0]
    spec = spec_from_args(ds)[0]
    assert (spec.normalization, spec.learned_positions, spec.groups) == ("RMSNorm", False, 2)


def test_the_hook_refuses_ranks_outside_the_topology_in_one_line():
    """training.megatron.sharded_state of a TP rank the topology does not have: a UsageError
    naming it, not a StopIteration from the layout lookup."""
    from ckptool.core.errors import UsageError
    from training.megatron import sharded_state

    with pytest.raises(UsageError, match="TP rank 5 / PP rank 0 is not a rank of TP2"):
        sharded_state({}, ModelSpec(**GPT), Topology(tp=2), tp_rank=5, pp_rank=0)
