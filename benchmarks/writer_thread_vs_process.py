"""Background writer: a thread or a persistent process? `AsyncCheckpointer(writer=...)`.

What a background write costs the training loop that keeps running while it writes. A
training proxy (small matmuls with Python between them, as a framework's dispatch holds
the GIL) runs while one `AsyncCheckpointer.save` of the same state is written in the
background, by (a) `writer="thread"`, a thread in the training process, (b)
`writer="process"`, a persistent writer process reading the shared-memory staging
buffers. Both hash while writing, fsync and commit. A warm-up save comes first (buffers
allocated, process started). Printed side by side: how long `save()` blocked, the proxy's
step time during the write vs idle, and the time until the checkpoint was committed.

    python benchmarks/writer_thread_vs_process.py [--size-gb 0.5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from training import AsyncCheckpointer  # noqa: E402


def proxy_steps(until, seconds: float | None = None) -> list[float]:
    """Training proxy: matmuls with Python in between; per-step times until ``until()``."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    times, start = [], time.perf_counter()
    while True:
        t = time.perf_counter()
        x = a
        for _ in range(8):
            x = torch.tanh(x @ b) * 0.5
            _ = [i * i for i in range(200)]  # framework Python: holds the GIL
        times.append(time.perf_counter() - t)
        if until is not None and until():
            break
        if seconds is not None and time.perf_counter() - start > seconds:
            break
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="ckptool-writer-bench-", dir=args.dir))
    n = 8
    rows = int(args.size_gb * (1 << 30) / 4 / n / 4096)
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(n)}
    gb = sum(t.numel() * 4 for t in state.values()) / 1e9
    try:
        idle = statistics.median(proxy_steps(None, seconds=3.0))
        results = {}
        for mode in ("thread", "process"):
            ckpt = AsyncCheckpointer(base / mode, keep_last=1, writer=mode)
            ckpt.save(0, state)  # warm-up: buffers, writer process
            ckpt.wait()
            t0 = time.perf_counter()
            ckpt.save(1, state)
            blocked = time.perf_counter() - t0
            steps = proxy_steps(lambda: not ckpt._thread.is_alive())
            ckpt.wait()
            results[mode] = (blocked, statistics.median(steps), time.perf_counter() - t0)
            ckpt.close()
            shutil.rmtree(base / mode)
        print(f"state {gb:.2f} GB; proxy step idle {idle * 1e3:.2f} ms (median)")
        print(f"{'writer':<9}{'save() blocked':>16}{'step during write':>19}{'slowdown':>10}"
              f"{'committed after':>17}{'GB/s':>7}")
        for mode, (blocked, step, wall) in results.items():
            print(f"{mode:<9}{blocked:>14.3f} s{step * 1e3:>16.2f} ms{step / idle:>9.2f}x"
                  f"{wall:>15.2f} s{gb / wall:>7.2f}")
        t, p = results["thread"], results["process"]
        print(f"ratio process/thread: step time during write {p[1] / t[1]:.2f}x, "
              f"time to commit {p[2] / t[2]:.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
