"""``ckptool reshard`` of a Megatron-DeepSpeed pipeline checkpoint to TP2, loaded by real
DeepSpeed: a TP1/PP2 fp32 ZeRO-1 ``PipelineEngine`` run (``tests/harness/deepspeed_pipe.py``),
resharded from the CLI to TP2/PP1 and TP2/PP2, then loaded by plain
``engine.load_checkpoint`` into the same model made tensor-parallel
(``tests/harness/deepspeed_pipe_tp.py``).

Each TP-split tensor's shards, concatenated back by the harness's rule (``split_dim``), and
each replicated tensor on every TP rank, equal what the saving engine held, by parameter
name, bit for bit: the fp32 masters and Adam moments (the optimizer files) and the module's
weights (the layer files). The next ``train_batch`` gives the loss of the TP1 run that went
on without resharding. A copy whose ``query_key_value`` rows are put in ``[q; k; v]`` blocks
instead of per head shows the loss sees the per-head layout.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.conftest import peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")

from tests.harness import deepspeed_engine as H  # noqa: E402
from tests.harness import deepspeed_pipe as P  # noqa: E402
from tests.harness import deepspeed_pipe_tp as T  # noqa: E402
from tests.harness.deepspeed_pipe import DEAD, KINDS, TAG  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_pipe_tp")
    P.save(root, runs=[("pipe", 1, "fp32")])
    truths = P.truths(root, "pipe")
    source = P.by_name(truths)  # a tied module's from the first stage (the live copy)
    return root / "pipe", source, truths[0]["loss"]


def _reshard(run_cli, src, dst, tp: int, pp: int, dp: int = 1):
    res = run_cli("reshard", src, dst, "--to-tp", str(tp), "--to-pp", str(pp), "--to-dp", str(dp))
    assert res.code == 0, res.err
    assert f"-> {dst} (TP{tp}/PP{pp}/DP{dp}/ZeRO-1), deepspeed" in res.out


def _check(results: list[dict], source: dict, loss: float, stages: int, dps: int = 1) -> int:
    """Every (stage, DP rank)'s TP pair against the source; the tensors checked."""
    by_stage: dict[tuple[int, int], dict[int, dict]] = {}
    for g in results:
        assert g["global_steps"] == H.STEPS
        by_stage.setdefault((g["stage"], g["dp"]), {})[g["tp"]] = g
        assert abs(g["loss"] - loss) / abs(loss) < 1e-5, (g["stage"], g["tp"], g["loss"], loss)
    assert sorted(by_stage) == [(s, d) for s in range(stages) for d in range(dps)]
    assert all(sorted(t) == [0, 1] for t in by_stage.values())
    checked = 0
    for (stage, _), ranks in by_stage.items():
        tps = [ranks[t] for t in sorted(ranks)]
        for kind in KINDS:
            names = tps[0]["state"][kind]
            assert all(t["state"][kind].keys() == names.keys() for t in tps)
            for name in names:
                got = T.whole([t["state"][kind][name] for t in tps], name)
                assert torch.equal(got, source[kind, name]), (stage, kind, name)
                checked += 1
        for name in tps[0]["module"]:
            if stage > 0 and name == DEAD:
                continue
            got = T.whole([t["module"][name] for t in tps], name)
            assert torch.equal(got, source["params", name]), (stage, "module", name)
    return checked


def _qkv_in_blocks(tag_dir) -> None:
    """Rewrite every layer file's ``query_key_value`` rows from per head ``[q_h; k_h; v_h]``
    to ``[q; k; v]`` over the rank's heads (the shapes stay)."""
    d = H.PIPE_ARGS["hidden_size"] // H.PIPE_ARGS["num_attention_heads"]
    for path in tag_dir.glob("layer_*-model_states.pt"):
        state = torch.load(path, weights_only=False)
        for key in [k for k in state if "query_key_value" in k]:
            t = state[key]
            state[key] = t.reshape(-1, 3, d, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()
        torch.save(state, path)


def test_tp2_pp1_loads_in_deepspeed_with_the_exact_state(runs, run_cli, tmp_path):
    src, source, loss = runs
    _reshard(run_cli, src, tmp_path / "tp2", 2, 1)
    shutil.copytree(tmp_path / "tp2", tmp_path / "blocks")
    _qkv_in_blocks(tmp_path / "blocks" / TAG)
    T.load(2, [(tmp_path / "tp2", 2, 1, tmp_path / "got"), (tmp_path / "blocks", 2, 1, tmp_path / "bad")])
    assert _check(P.results(tmp_path / "got", 2), source, loss, stages=1) == 3 * 52
    for g in P.results(tmp_path / "bad", 2):  # the control: the harness reads the per-head layout
        assert abs(g["loss"] - loss) / abs(loss) > 1e-3, g["loss"]


def test_tp2_pp2_loads_in_deepspeed_with_the_exact_state(runs, run_cli, tmp_path):
    """World 4: each stage's TP pair, and the last stage's copy of the tied embeddings."""
    src, source, loss = runs
    _reshard(run_cli, src, tmp_path / "tp2pp2", 2, 2)
    T.load(4, [(tmp_path / "tp2pp2", 2, 2, tmp_path / "got")])
    assert _check(P.results(tmp_path / "got", 4), source, loss, stages=2) == 3 * 54


def test_tp2_dp2_loads_in_deepspeed_with_the_exact_state(runs, run_cli, tmp_path):
    """World 4: TP2 x DP2, each DP rank's ZeRO-1 partition of the TP shards."""
    src, source, loss = runs
    _reshard(run_cli, src, tmp_path / "tp2dp2", 2, 1, dp=2)
    T.load(4, [(tmp_path / "tp2dp2", 2, 1, tmp_path / "got")])
    assert _check(P.results(tmp_path / "got", 4), source, loss, stages=1, dps=2) == 2 * 3 * 52
