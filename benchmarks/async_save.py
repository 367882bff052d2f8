"""How long a save stalls training: AsyncCheckpointer against torch.save, dcp.save and
dcp.async_save, on the same >= 1 GB state in the same run; and the background write
throughput against `dd conv=fdatasync` on the same disk.

    python benchmarks/async_save.py [--size-gb 1.0] [--dir DIR] [--device cuda] [--writer process]
    python benchmarks/async_save.py --many-tensors 20000   # an optimizer-shaped state
    python benchmarks/async_save.py --stacks [ARGS...]      # inside the stacks (below)

``--stacks``: the hook inside Megatron-DeepSpeed (a PipelineEngine with TP) and Megatron-Core
(GPTModel + DistributedOptimizer) against those stacks' own saves (``save_checkpoint``;
``dist_checkpointing.save`` sync and async), in the same run: the rest of the command line
goes to ``benchmarks/async_save_stacks.py``, which does it (``--help`` there).

"Blocking" is the time until the call returns (training could continue). For the async
ones the time until the checkpoint is durable is measured too (wait()/future.result()).
Targets: AsyncCheckpointer blocking <= dcp.async_save's and <= 1/10 of dcp.save's;
background throughput >= 80% of dd's. With ``--device cuda`` the state lives on the GPU and
the floor for blocking is one device-to-host copy into page-locked memory, measured too.

``--many-tensors N``: N small tensors (4 KiB each, what the norms, biases and their Adam
moments of a real model look like) plus four large ones holding ``--size-gb``. Targets:
AsyncCheckpointer blocking <= 0.5x dcp.async_save's and <= 2x one bare copy of the same bytes.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from training import AsyncCheckpointer  # noqa: E402


def make_state(size_gb: float, device: str = "cpu", many: int = 0) -> dict:
    n = 4 if many else 16
    rows = int(size_gb * (1 << 30) / 4 / n / 4096)
    g = torch.Generator(device=device).manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g, device=device)
             for i in range(n)}
    for i in range(many):  # 4 KiB each: norms, biases, their moments
        model[f"small.{i}.weight"] = torch.randn(1024, generator=g, device=device)
    return {"model": model, "step": 100}


def copy_floor(state: dict) -> float:
    """Seconds for one copy of the tensors into preallocated (page-locked on GPU) host memory."""
    tensors = list(state["model"].values())
    cuda = tensors[0].is_cuda
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    import torch.distributed.checkpoint as dcp

    if "--stacks" in sys.argv[1:2]:  # the two training stacks: their own script, same run
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import async_save_stacks

        sys.argv = [sys.argv[0], *sys.argv[2:]]
        return async_save_stacks.main()

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    ap.add_argument("--writer", default="thread", choices=["thread", "process"])
    ap.add_argument("--many-tensors", type=int, default=0, metavar="N",
                    help="add N small tensors (4 KiB each) to four large ones")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptool-async-bench-", dir=args.dir))
    try:
        state = make_state(args.size_gb, args.device, args.many_tensors)
        nbytes = sum(t.numel() * 4 for t in state["model"].values())
        gb = nbytes / 1e9
        rows = []

        t = time.perf_counter()
        torch.save(state, base / "torch.pt")
        rows.append(("torch.save (sync)", time.perf_counter() - t, None))

        t = time.perf_counter()
        dcp.save(state, checkpoint_id=str(base / "dcp_sync"))
        rows.append(("dcp.save (sync)", time.perf_counter() - t, None))

        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(base / "dcp_async"))
        blocked = time.perf_counter() - t
        fut.result()
        rows.append(("dcp.async_save", blocked, time.perf_counter() - t))

        ckpt = AsyncCheckpointer(str(base / "run"), keep_last=2, writer=args.writer)
        t = time.perf_counter()
        ckpt.save(1, state)  # the first save allocates the host buffers
        first = time.perf_counter() - t
        ckpt.wait()
        floor = copy_floor(state)
        blocked = total = float("inf")
        for step in (2, 3, 4):  # best of 3, as the copy floor
            t = time.perf_counter()
            ckpt.save(step, state)
            blocked = min(blocked, time.perf_counter() - t)
            ckpt.wait()
            total = min(total, time.perf_counter() - t)
        rows.append(("AsyncCheckpointer.save", blocked, total))
        ckpt.close()

        dd_file = base / "dd.bin"
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={dd_file}", "bs=8M", f"count={max(1, nbytes >> 23)}",
                        "conv=fdatasync"], check=True, capture_output=True)
        dd = time.perf_counter() - t

        print(f"state: {gb:.2f} GB in {len(state['model'])} tensors ({args.device}); "
              f"writer: {args.writer}")
        print(f"{'what':<26}{'blocking s':>11}{'durable s':>11}")
        for name, b, d in rows:
            print(f"{name:<26}{b:>11.3f}{(d if d is not None else b):>11.3f}")
        ours = rows[-1]
        target = 0.5 if args.many_tensors else 1
        print(f"AsyncCheckpointer blocking / dcp.async_save blocking = {ours[1] / rows[2][1]:.2f} "
              f"(target <= {target})")
        print(f"AsyncCheckpointer blocking / dcp.save = {ours[1] / rows[1][1]:.3f} (target <= 0.1)")
        print(f"AsyncCheckpointer first save (allocates its buffers) blocked {first:.3f} s; "
              f"later saves {ours[1]:.3f} s = {ours[1] / floor:.2f}x one bare copy into "
              f"{'page-locked ' if args.device != 'cpu' else ''}host memory ({floor:.3f} s, "
              f"{gb / floor:.1f} GB/s)" + (" (target <= 2x)" if args.many_tensors else ""))
        print(f"background write {gb / ours[2]:.2f} GB/s vs dd conv=fdatasync {gb / dd:.2f} GB/s: "
              f"{dd / ours[2]:.0%} (target >= 80%; includes hashing, fsync and the commit)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
