"""``training.megatron.from_sharded_state_dict`` (Megatron-Core's own ``sharded_state_dict``)
describes a real rank exactly as ``training.megatron.sharded_state`` (ckptool's layout rules)
does: the same regions of the same global tensors, written by the same ranks, for the model
and its Adam state. Covered: SwiGLU's fc1 factory (``[gate_r; up_r]``, two regions), GQA,
RMSNorm, untied output at TP2 x PP2; tied embeddings with biases and learned positions at
TP2 x PP2 (the last stage's copy is a replica); MoE experts (layer and expert axes) at
TP1 x EP2 and TP2 x EP2.

The resume test of the description (bit-equal state through the hook, at another topology)
is in ``tests/test_hook_mcore_distopt.py``.
"""

from __future__ import annotations

import pytest

from tests.conftest import peer

peer("megatron.core")

import tests.harness.mcore as M  # noqa: E402
import tests.harness.mcore_moe as MOE  # noqa: E402
from tests.harness import mcore_describe as H  # noqa: E402

RUNS = {
    "llama.tp2pp2": lambda out: H.dense(M.LLAMA, 2, 2, out),
    "gpt.tp2pp2": lambda out: H.dense(M.GPT, 2, 2, out),
    "moe.tp1ep2": lambda out: H.moe(MOE.MOE, 1, 2, out),
    "moe.tp2ep2": lambda out: H.moe(MOE.MOE, 2, 2, out),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_state_dict_describes_like_the_layout_rules(tmp_path, name):
    ranks = RUNS[name](tmp_path / name)
    for rank, got in enumerate(ranks):
        for part in ("model", "optimizer"):
            spec, mcore = got["spec"][part], got["mcore"][part]
            assert len(spec) > 10, (rank, part)
            assert mcore == spec, (rank, part, [r for r in mcore if r not in spec][:2],
                                   [r for r in spec if r not in mcore][:2])
    writes = [sum(w for _, _, w, _ in got["mcore"]["model"]) for got in ranks]
    assert all(writes), writes  # every rank is the main replica of something
