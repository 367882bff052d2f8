"""Background writer: a thread (what AsyncCheckpointer uses) or a persistent process?

The question is what the background write costs the training loop that keeps running while
it writes. A training proxy (small matmuls with Python between them, as a framework's
dispatch holds the GIL) runs for the duration of one background save of the same staged
state, written (a) by a thread in the training process, (b) by a persistent writer process
that shares the staging buffers (shared memory, set up once). Both hash while writing and
fsync, with the same ckptool writer. Printed: step time of the proxy during the write vs
idle, and the write's wall time, side by side.

    python benchmarks/writer_thread_vs_process.py [--size-gb 0.5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from ckptool.core.dcpwrite import DcpFileWriter  # noqa: E402
from ckptool.core.storage import Store  # noqa: E402


def write_all(root: str, name: str, buffers: list[torch.Tensor]) -> float:
    t = time.perf_counter()
    store = Store.open(root)
    store.fs.makedirs(store.root, exist_ok=True)
    with DcpFileWriter(store, name) as w:
        for i, b in enumerate(buffers):
            w.add_chunk(f"t{i}", (0, 0), tuple(b.shape), b)
    return time.perf_counter() - t


def _writer_process(conn, buffers):
    """A persistent writer: waits for (root, name), writes the shared buffers, replies."""
    torch.set_num_threads(1)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(write_all(*msg, buffers))


def proxy_steps(stop: threading.Event | None, seconds: float | None = None) -> list[float]:
    """Training proxy: matmuls with Python in between; returns per-step times."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    times, start = [], time.perf_counter()
    while True:
        t = time.perf_counter()
        x = a
        for _ in range(8):
            x = torch.tanh(x @ b) * 0.5
            _ = [i * i for i in range(200)]  # framework Python: holds the GIL
        times.append(time.perf_counter() - t)
        if stop is not None and stop.is_set():
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
    buffers = [torch.randn(rows, 4096).share_memory_() for _ in range(n)]
    try:
        idle = statistics.median(proxy_steps(None, seconds=3.0))

        results = {}
        # (a) thread
        stop, out = threading.Event(), {}

        def run_thread():
            out["wall"] = write_all(str(base / "thread"), "__0_0.distcp", buffers)
            stop.set()

        th = threading.Thread(target=run_thread)
        th.start()
        steps = proxy_steps(stop)
        th.join()
        results["thread"] = (statistics.median(steps), out["wall"], len(steps))
        shutil.rmtree(base / "thread")

        # (b) persistent process sharing the buffers (started before the save, as it would be)
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_writer_process, args=(child, buffers), daemon=True)
        proc.start()
        time.sleep(0.5)
        stop = threading.Event()

        def run_process():
            parent.send((str(base / "process"), "__0_0.distcp"))
            out["wall"] = parent.recv()
            stop.set()

        th = threading.Thread(target=run_process)
        th.start()
        steps = proxy_steps(stop)
        th.join()
        parent.send(None)
        proc.join()
        results["process"] = (statistics.median(steps), out["wall"], len(steps))

        gb = sum(b.numel() * 4 for b in buffers) / 1e9
        print(f"state {gb:.2f} GB; proxy step idle {idle * 1e3:.2f} ms (median)")
        print(f"{'writer':<10} {'step during write':>18} {'slowdown':>9} {'write wall':>11} {'GB/s':>6}")
        for name, (step, wall, count) in results.items():
            print(f"{name:<10} {step * 1e3:>15.2f} ms {step / idle:>8.2f}x {wall:>9.2f} s {gb / wall:>6.2f}")
        t, p = results["thread"], results["process"]
        print(f"ratio process/thread: step time {p[0] / t[0]:.2f}x, write wall {p[1] / t[1]:.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
