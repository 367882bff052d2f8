"""Makes the Megatron-Core legacy ``zarr`` checkpoints in this directory, with real mcore.

Made with Python 3.11.7, torch 2.13.0+cpu, megatron-core 0.9.0, zarr 2.18.7, numcodecs 0.15.2,
numpy 2.4.6 and tensorstore 0.1.86 (mcore 0.9's zarr strategy only knows a numpy ``bfloat16``
dtype when tensorstore is importable: ``strategies/zarr.py``, ``HAS_BFLOAT16``), in a side venv
that the tests never need::

    python -m venv /tmp/mcore09venv
    /tmp/mcore09venv/bin/pip install torch==2.13.0 megatron-core==0.9.0 "zarr<3" numcodecs \
        tensorstore packaging
    /tmp/mcore09venv/bin/python tests/data/mcore_zarr/make_fixture.py   # from the repo root

Each checkpoint is a Megatron-LM run root (``latest_checkpointed_iteration.txt`` +
``iter_0000010/``) written at TP=2 by two gloo processes on CPU with
``dist_checkpointing.save(state, dir, sharded_strategy=("zarr", 1))``; the state is what
Megatron-LM saves: ``model`` (the GPTModel's sharded state dict), ``args``, ``iteration``,
``checkpoint_version`` and, for ``llama_fp32``, the ``rng_state`` ShardedObject of shape
(PP, TP) (Megatron-LM ``training/checkpointing.py`` ``get_rng_state(use_dist_ckpt=True)``).

- ``llama_fp32``: GQA (8 heads, 4 groups), SwiGLU, RMSNorm, RoPE, untied, no biases.
- ``llama_bf16``: the same weights cast to bf16 before saving.
- ``gpt_fp32``: LayerNorm, GeLU, learned positions, tied embeddings, biases.

All have 2 layers, hidden 32 and vocab 100 (padded to 128 at TP2: make_vocab_size_divisible_by
16). mcore 0.9's local spec falls back to torch LayerNorm without apex, which refuses RMSNorm,
so the Llama models get ``TorchRMSNorm`` below (``torch.nn.RMSNorm``, eps 1e-5) as their norm
module; its state is a plain ``weight``, stored under the same Transformer-Engine-style names.

``reference_logits.pt`` holds mcore's own logits for ``tokens()`` (explicit causal mask, fp32
forward, first 100 vocab columns): ``llama_fp32``, ``gpt_fp32`` and ``llama_bf16`` (the bf16
weights upcast to fp32 for the forward, so transformers can be compared at fp32 precision).

CPU shims (as in tests/mcore_harness.py): ``torch.cuda.current_device`` returns "cpu", the
CUDA RNG tracker's ``fork`` is a null context, ``torch.cuda.synchronize`` is a no-op.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
TP, SEQ, BATCH, ITERATION = 2, 8, 2, 10
VOCAB, DIVISIBLE_BY = 100, 16
LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=48, swiglu=True, tied=False, bias=False, norm="RMSNorm", pos="rope")
GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=None,
           ffn_hidden_size=64, swiglu=False, tied=True, bias=True, norm="LayerNorm",
           pos="learned_absolute")
MODELS = {"llama_fp32": (LLAMA, False), "llama_bf16": (LLAMA, True), "gpt_fp32": (GPT, False)}


def padded_vocab() -> int:
    m = DIVISIBLE_BY * TP
    return -(-VOCAB // m) * m


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


class TorchRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with mcore's norm-module signature (what apex/TE would give on a GPU)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)


def megatron_args(m: dict, bf16: bool) -> argparse.Namespace:
    """The args Megatron-LM keeps in common.pt (the fields a converter reads)."""
    return argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        group_query_attention=m["num_query_groups"] is not None,
        num_query_groups=m["num_query_groups"], ffn_hidden_size=m["ffn_hidden_size"],
        kv_channels=m["hidden_size"] // m["num_attention_heads"], padded_vocab_size=padded_vocab(),
        make_vocab_size_divisible_by=DIVISIBLE_BY, swiglu=m["swiglu"],
        untie_embeddings_and_output_weights=not m["tied"], add_bias_linear=m["bias"],
        normalization=m["norm"], norm_epsilon=1e-5, position_embedding_type=m["pos"],
        max_position_embeddings=SEQ, tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
        world_size=TP, data_parallel_size=1, seq_length=SEQ, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, ckpt_format="zarr")


def build_model(m: dict):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    act = torch.nn.functional.silu if m["swiglu"] else torch.nn.functional.gelu
    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        ffn_hidden_size=m["ffn_hidden_size"], use_cpu_initialization=True,
        gated_linear_unit=m["swiglu"], activation_func=act, add_bias_linear=m["bias"],
        normalization=m["norm"], params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=TP, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, apply_rope_fusion=False)
    layer = get_gpt_layer_local_spec()
    spec = layer
    if m["norm"] == "RMSNorm":
        layer.submodules.input_layernorm = TorchRMSNorm
        layer.submodules.pre_mlp_layernorm = TorchRMSNorm
        spec = TransformerBlockSubmodules(layer_specs=[layer] * m["num_layers"],
                                          layer_norm=TorchRMSNorm)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab(),
                    max_sequence_length=SEQ, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=m["tied"], position_embedding_type=m["pos"])


def seeded_model(m: dict):
    torch.manual_seed(1234)
    model = build_model(m)
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up cannot hide
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                g = torch.Generator().manual_seed(len(name))
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def forward(ps, model, m) -> torch.Tensor | None:
    """Full-vocab fp32 logits (first VOCAB columns) on TP rank 0."""
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    model.eval()
    with torch.no_grad():
        out = model(tokens(), pos, mask).contiguous()
    parts = [torch.empty_like(out) for _ in range(TP)]
    dist.all_gather(parts, out, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)[..., :VOCAB] if ps.get_tensor_model_parallel_rank() == 0 else None


def rng_state(ps):
    """Megatron-LM's rng_state ShardedObject (one list per (pp, tp) rank)."""
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
              "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
              "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]
    return ShardedObject("rng_state", state, (1, TP), (0, ps.get_tensor_model_parallel_rank()),
                         replica_id=0)


def worker(rank: int, name: str, port: int, out: str):
    m, bf16 = MODELS[name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    random.seed(5)
    np.random.seed(5)
    model = seeded_model(m)
    if bf16:
        model = model.to(torch.bfloat16)
    root = Path(out) / name
    it = root / f"iter_{ITERATION:07d}"
    if rank == 0:
        it.mkdir(parents=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": megatron_args(m, bf16),
             "iteration": ITERATION, "checkpoint_version": 3.0}
    if name == "llama_fp32":
        state["rng_state"] = rng_state(parallel_state)
    dist_checkpointing.save(state, str(it), sharded_strategy=("zarr", 1))
    if rank == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    logits = forward(parallel_state, model.float(), m)
    if logits is not None:
        torch.save(logits, Path(out) / f"{name}.logits.pt")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    import torch.multiprocessing as mp

    names = sys.argv[1:] or list(MODELS)
    logits = {}
    for name in names:
        shutil.rmtree(HERE / name, ignore_errors=True)
        mp.spawn(worker, args=(name, free_port(), str(HERE)), nprocs=TP, join=True)
        logits[name] = torch.load(HERE / f"{name}.logits.pt")
        (HERE / f"{name}.logits.pt").unlink()
    torch.save({"tokens": tokens(), "vocab_size": VOCAB, **logits}, HERE / "reference_logits.pt")


if __name__ == "__main__":
    main()
