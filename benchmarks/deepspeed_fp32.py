"""Extracting fp32 weights from a DeepSpeed ZeRO checkpoint: ckptool vs DeepSpeed's zero_to_fp32.

    python benchmarks/deepspeed_fp32.py [--size-gb 2.2] [--stage 2] [--dir DIR]

Makes a real ZeRO checkpoint with DeepSpeed on CPU: a Hugging Face LlamaForCausalLM sized
so the checkpoint is about --size-gb, one AdamW step at DP=2 over gloo, saved as the HF
Trainer lays it out (``config.json`` beside ``latest``). Then in the same run, each in its
own process:

* DeepSpeed: ``python -m deepspeed.utils.zero_to_fp32 CKPT OUT --safe_serialization``;
* ckptool:   ``ckptool convert CKPT OUT --to hf --dtype fp32`` (the fp32 masters, streamed
  region by region into a model transformers loads).

It checks both hold the same tensors bit for bit and prints wall time and peak RSS with the
ratios. Target: ckptool faster, with at most half the peak memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import run  # noqa: E402

MAKE = r'''
import os, sys, logging, warnings
os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")
import torch
import torch.multiprocessing as mp

def worker(rank, world, out, layers, stage, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed, deepspeed.ops
    from transformers import LlamaConfig, LlamaForCausalLM
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                         max_position_embeddings=64)
    model = LlamaForCausalLM(config).float()
    cfg = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    tok = torch.randint(0, 32000, (1, 16))
    engine.backward(engine(input_ids=tok, labels=tok).loss)
    engine.step()
    engine.save_checkpoint(out)
    if rank == 0:
        config.save_pretrained(out)
    deepspeed.comm.barrier()

if __name__ == "__main__":
    out, layers, stage, port = sys.argv[1], *map(int, sys.argv[2:5])
    mp.spawn(worker, args=(2, out, layers, stage, port), nprocs=2, join=True)
'''
PER_LAYER = 4 * 1024 * 1024 - 2 * 512 * 1024 + 3 * 1024 * 2816 + 2 * 1024
EMBEDDINGS = 2 * 32000 * 1024 + 1024


def tensors_equal(a_dir: Path, b_dir: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    def load(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    a, b = load(a_dir), load(b_dir)
    if a.keys() != b.keys():
        print(f"  different names: {sorted(a.keys() ^ b.keys())[:4]}")
        return False
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    if bad:
        print(f"  differ: {bad[:4]}")
    return not bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.2)
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    # checkpoint ~ 16 bytes/param (fp32 weights + fp32 master + 2 moments)
    layers = max(1, round((args.size_gb * 1e9 / 16 - EMBEDDINGS) / PER_LAYER))
    base = Path(tempfile.mkdtemp(prefix="ckptool-dsfp32-bench-", dir=args.dir))
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        t = time.perf_counter()
        maker = base / "make_ds.py"  # a file: spawned workers must import it
        maker.write_text(MAKE)
        subprocess.run([sys.executable, str(maker), str(base / "ckpt"), str(layers),
                        str(args.stage), "29573"], check=True, env=env, cwd=REPO)
        size = sum(f.stat().st_size for f in (base / "ckpt").rglob("*") if f.is_file())
        print(f"DeepSpeed ZeRO-{args.stage} checkpoint, DP=2, Llama with {layers} layers: "
              f"{size / 1e9:.2f} GB (made in {time.perf_counter() - t:.0f}s)")
        subprocess.run(["cat", *map(str, (base / "ckpt").rglob("*.pt"))], stdout=subprocess.DEVNULL)
        os.sync()
        t_ds, rss_ds = run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(base / "ckpt"),
                            str(base / "ds_out"), "--safe_serialization"], env=env, quiet=True)
        os.sync()
        t_dss, _ = run(["sh", "-c", f"{sys.executable} -m deepspeed.utils.zero_to_fp32 '{base / 'ckpt'}' "
                        f"'{base / 'ds_out2'}' --safe_serialization >/dev/null 2>&1 && sync"], env=env)
        os.sync()
        ckptool = str(Path(sys.executable).parent / "ckptool")
        t_ck, rss_ck = run([ckptool, "convert", str(base / "ckpt"), str(base / "ck_out"), "--to", "hf",
                            "--dtype", "fp32", "-q"], env=env, quiet=True)
        same = tensors_equal(base / "ds_out", base / "ck_out")
        print(f"{'what':<44}{'seconds':>9}{'peak RSS GB':>13}")
        print(f"{'zero_to_fp32 --safe_serialization':<44}{t_ds:>9.2f}{rss_ds:>13.2f}")
        print(f"{'zero_to_fp32 ... && sync (durable)':<44}{t_dss:>9.2f}{'':>13}")
        print(f"{'ckptool convert --to hf --dtype fp32':<44}{t_ck:>9.2f}{rss_ck:>13.2f}")
        print("(ckptool hashes and fsyncs what it writes, then commits; zero_to_fp32 does neither)")
        print(f"time ckptool / (zero_to_fp32 && sync) = {t_ck / t_dss:.2f}")
        print(f"time ckptool / zero_to_fp32 = {t_ck / t_ds:.2f} (target < 1); "
              f"peak RSS ckptool / zero_to_fp32 = {rss_ck / rss_ds:.2f} (target <= 0.5)")
        print(f"same fp32 tensors bit for bit: {same}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
