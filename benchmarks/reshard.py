"""Reshard speed and memory: `ckptool reshard` against `cp -r` and a naive baseline.

    python benchmarks/reshard.py [--size-gb 3.2] [--workers 2] [--procs 2] [--dir DIR]

Makes a legacy Megatron checkpoint (GPT-style, fp32) of about --size-gb at TP4/PP2, then
reshards it to TP2/PP4 three ways, each in its own process, in the same run:

* `cp -r SRC DST`                        moving the bytes once (left dirty in the page cache)
* `cp -r SRC DST && sync`                the same, durable: the floor for a crash-safe writer
* `ckptool reshard SRC DST --to-tp 2 --pp 4` (the engine: overlapping byte ranges, streamed;
  every file fsynced before the commit, the default)
* the same with `--no-fsync` (write-back left to the kernel, as cp and torch.save leave it)
* naive: torch.load every rank file, torch.cat into full tensors, split, torch.save
  (what Megatron's tools/checkpoint does, in one process; no fsync)

The ratios pair like with like: durable ckptool against `cp -r && sync`, ckptool
`--no-fsync` against `cp -r` and against the naive baseline (neither of which fsyncs).

With ``--procs N`` (N > 1) it also runs ``torchrun --nproc_per_node N -m ckptool reshard``,
checks its output equals the single-process one byte for byte, and prints the speedup.

It checks that the naive and ckptool outputs hold bit-identical tensors, and prints wall
time, the ratios, and each process's peak RSS next to the target
`1 GB + 2 x the largest single tensor`.
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

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ckptool.core.layout import ModelSpec, global_params, layout, stage_layers  # noqa: E402
from ckptool.core.topology import Topology  # noqa: E402
from converters.schemas.megatron import SCHEMAS  # noqa: E402
from converters.schemas.megatron_args import update_args  # noqa: E402
from benchmarks.common import run  # noqa: E402


def model_for(size_gb: float) -> ModelSpec:
    hidden = 2560
    per_layer = 12 * hidden * hidden * 4 + 13 * hidden * 4
    emb = 2 * 32000 * hidden * 4
    layers = max(8, round((size_gb * 1e9 - emb) / per_layer / 8) * 8)
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=20,
                     vocab_size=32000, ffn_hidden_size=4 * hidden, tied_embeddings=False,
                     max_position_embeddings=2048)


def make_source(root: Path, spec: ModelSpec, topo: Topology) -> None:
    """Write each rank file from its local shapes, never holding the whole model."""
    schema = SCHEMAS["mcore-local"]
    stages = stage_layers(spec, topo.pp)
    g = torch.Generator().manual_seed(0)
    for rank in layout(spec, topo):
        model = {}
        for t in rank.tensors:
            name = schema.from_canonical(t.name, stages[rank.pp_rank][0], rank.pp_rank, topo.pp,
                                         t.replica)
            model[name] = torch.randn(t.shard.shape, generator=g)
        d = root / "iter_0000100" / f"mp_rank_{rank.tp_rank:02d}_{rank.pp_rank:03d}"
        d.mkdir(parents=True)
        torch.save({"args": update_args(None, spec, topo, spec.vocab_size), "iteration": 100,
                    "checkpoint_version": 3.0, "model": model,
                    "rng_state": [{"torch_rng_state": torch.get_rng_state()}]}, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("100")


NAIVE = r'''
import sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from ckptool.core.layout import layout, stage_layers, split, global_params
from ckptool.core.topology import Topology
from converters.schemas.megatron import SCHEMAS
from converters.schemas.megatron_args import spec_from_args, update_args
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
files = sorted(src.rglob("model_optim_rng.pt"))
states = {f.parent.name: torch.load(f, weights_only=False) for f in files}   # everything in RAM
args = next(iter(states.values()))["args"]
spec, topo, _ = spec_from_args(args)
schema = SCHEMAS["mcore-local"]
full = {}
for p in global_params(spec):                                               # merge TP and PP
    parts = []
    for pp, layers in enumerate(stage_layers(spec, topo.pp)):
        for tp in range(topo.tp):
            m = states[f"mp_rank_{tp:02d}_{pp:03d}"]["model"]
            i = None
            if p.key.startswith("decoder.layers."):
                g = int(p.key.split(".")[2])
                if g not in layers[0]:
                    continue
                i = layers[0].index(g)
            local = p.key if i is None else p.key.replace(f"layers.{g}.", f"layers.{i}.", 1)
            name = schema.from_canonical(local, layers[0], pp, topo.pp)
            if name in m:
                parts.append(m[name])
    if p.rule == "row":
        full[p.key] = torch.cat(parts, 1)
    elif p.rule == "replicated":
        full[p.key] = parts[0]
    else:
        full[p.key] = torch.cat(parts, 0)[: p.shape[0]]
new = Topology(tp=2, pp=4)
for rank in layout(spec, new):                                              # split and save
    layers = stage_layers(spec, new.pp)[rank.pp_rank][0]
    model = {}
    for t in rank.tensors:
        buf = torch.zeros(t.shard.shape)
        flat = buf.view(-1)
        for off, r in t.shard.parts:
            sl = tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))
            flat[off:off + r.numel] = full[r.key][sl].reshape(-1)
        model[schema.from_canonical(t.name, layers, rank.pp_rank, new.pp, t.replica)] = buf
    d = dst / "iter_0000100" / f"mp_rank_{rank.tp_rank:02d}_{rank.pp_rank:03d}"
    d.mkdir(parents=True)
    torch.save({"args": update_args(args, spec, new, spec.vocab_size), "iteration": 100,
                "checkpoint_version": 3.0, "model": model}, d / "model_optim_rng.pt")
'''


def kernel_copies(base: Path) -> str:
    """Whether this filesystem takes copy_file_range (ckptool's path for runs of source
    files; without it they go through a small buffer)."""
    src, dst = base / "probe-src", base / "probe-dst"
    src.write_bytes(b"x" * 4096)
    try:
        with open(src, "rb") as f, open(dst, "wb") as g:
            return "yes" if os.copy_file_range(f.fileno(), g.fileno(), 4096, 0) == 4096 else "short"
    except (AttributeError, OSError) as exc:
        return f"no ({exc})"
    finally:
        src.unlink()
        dst.unlink(missing_ok=True)


def same_tensors(a: Path, b: Path) -> bool:
    for f in sorted(a.rglob("model_optim_rng.pt")):
        x = torch.load(f, weights_only=False, mmap=True)["model"]
        y = torch.load(b / f.relative_to(a), weights_only=False, mmap=True)["model"]
        for k, v in x.items():
            if isinstance(v, torch.Tensor) and not torch.equal(v, y[k]):
                print(f"  differs: {f.relative_to(a)} {k}")
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=3.2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--procs", type=int, default=1, help="also run under torchrun with N processes")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--skip-naive", action="store_true",
                    help="leave out the naive baseline (it holds the model twice in RAM: at >= 8 GB "
                         "on a 24 GB machine it does not fit)")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="ckptool-reshard-bench-", dir=args.dir))
    try:
        spec = model_for(args.size_gb)
        src = base / "src"
        t = time.perf_counter()
        make_source(src, spec, Topology(tp=4, pp=2))
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        largest = max(p.shape[0] * p.shape[1] * 4 if len(p.shape) == 2 else 0
                      for p in global_params(spec))
        print(f"source: TP4/PP2, {spec.num_layers} layers, hidden {spec.hidden_size}: {size / 1e9:.2f} GB "
              f"(made in {time.perf_counter() - t:.0f}s); largest tensor {largest / 1e9:.2f} GB; "
              f"in-kernel copies here: {kernel_copies(base)}")
        subprocess.run(["cat", *map(str, src.rglob("*.pt"))], stdout=subprocess.DEVNULL, check=True)

        # `python -m ckptool` from this checkout: no install needed (a bare GPU node, say)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        os.sync()
        t_cp, rss_cp = run(["cp", "-r", str(src), str(base / "cp")])
        shutil.rmtree(base / "cp")  # each copy goes as soon as it is timed: big runs fit the disk
        os.sync()
        t_cps, _ = run(["sh", "-c", f"cp -r '{src}' '{base / 'cp2'}' && sync"])
        shutil.rmtree(base / "cp2")
        os.sync()
        cmd = [sys.executable, "-m", "ckptool", "reshard", str(src), "DST", "--tp", "4", "--pp", "2",
               "--to-tp", "2", "--pp", "4", "--workers", str(args.workers), "-q"]
        t_ck, rss_ck = run([str(base / "ckptool") if a == "DST" else a for a in cmd], env=env)
        os.sync()
        t_nf, rss_nf = run([str(base / "nofsync") if a == "DST" else a for a in cmd] + ["--no-fsync"],
                           env=env)
        same_nf = subprocess.run(["diff", "-r", "-x", "ckptool.json", str(base / "ckptool"),
                                  str(base / "nofsync")], stdout=subprocess.DEVNULL).returncode == 0
        shutil.rmtree(base / "nofsync")
        # the fixed start-up cost every torch tool pays (several seconds with a CUDA torch)
        t_start, _ = run([sys.executable, "-c", "import torch, ckptool.ops.reshard, converters.megatron"],
                         env=env)
        os.sync()
        t_nv = rss_nv = float("nan")
        identical = "not run (--skip-naive)"
        if not args.skip_naive:
            t_nv, rss_nv = run([sys.executable, "-c", NAIVE, str(src), str(base / "naive"), str(REPO)])
            identical = same_tensors(base / "naive", base / "ckptool")
            shutil.rmtree(base / "naive")
        t_multi = None
        if args.procs > 1:
            os.sync()
            t_multi, _ = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                              str(args.procs), "--master_addr", "127.0.0.1", "--master_port", "29561",
                              "-m", "ckptool", "reshard", str(src), str(base / "multi"), "--to-tp", "2",
                              "--to-pp", "4", "--workers", str(max(1, args.workers // args.procs)), "-q"],
                             env=env)
            same = subprocess.run(["diff", "-r", "-x", "ckptool.json", str(base / "ckptool"),
                                   str(base / "multi")], stdout=subprocess.DEVNULL).returncode == 0

        target = 1.0 + 2 * largest / 1e9
        print(f"{'what':<44}{'seconds':>9}{'GB/s':>8}{'peak RSS GB':>13}")
        for name, sec, rss in [
                ("cp -r (data left in page cache)", t_cp, rss_cp),
                ("cp -r && sync (durable)", t_cps, float("nan")),
                (f"ckptool reshard (--workers {args.workers}; durable)", t_ck, rss_ck),
                ("ckptool reshard --no-fsync", t_nf, rss_nf),
                ("naive load-cat-save (no fsync)", t_nv, rss_nv)]:
            print(f"{name:<44}{sec:>9.2f}{size / 1e9 / sec:>8.2f}{rss:>13.2f}")
        print("like with like:")
        print(f"  ckptool --no-fsync / cp -r             = {t_nf / t_cp:.2f}  (target <= 1.5)")
        print(f"  naive / ckptool --no-fsync             = {t_nv / t_nf:.2f}  (target >= 3)")
        print(f"  ckptool (durable) / (cp -r && sync)    = {t_ck / t_cps:.2f}")
        print(f"  naive (no fsync) / ckptool (durable)   = {t_nv / t_ck:.2f}")
        print(f"  ckptool (durable) / cp -r              = {t_ck / t_cp:.2f}  (mixed: cp does not fsync)")
        print(f"start-up (python + import torch, ckptool) {t_start:.2f} s; without it "
              f"ckptool --no-fsync / cp -r = {(t_nf - t_start) / t_cp:.2f}, "
              f"ckptool / (cp -r && sync) = {(t_ck - t_start) / t_cps:.2f}, "
              f"naive / ckptool --no-fsync = {(t_nv - t_start) / (t_nf - t_start):.2f}")
        target_ok = max(rss_ck, rss_nf) <= target
        print(f"ckptool peak RSS {rss_ck:.2f} GB (--no-fsync {rss_nf:.2f}) vs target {target:.2f} GB "
              f"(1 GB + 2 x largest tensor): {'met' if target_ok else 'NOT met'}")
        print(f"ckptool peak RSS / checkpoint size = {max(rss_ck, rss_nf) / (size / 1e9):.2f} "
              f"(target <= 0.5)")
        print(f"outputs bit-identical to the naive baseline: {identical}; --no-fsync output "
              f"byte-identical to the durable one: {same_nf}")
        if t_multi is not None:
            print(f"torchrun --nproc_per_node {args.procs}: {t_multi:.2f} s, speedup over 1 process "
                  f"{t_ck / t_multi:.2f}x; output byte-identical to 1 process: {same}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
