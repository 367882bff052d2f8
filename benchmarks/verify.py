"""Verify throughput: `ckptool verify` against `cat` of the same files, in the same run.

    python benchmarks/verify.py [--size-gb 1.0] [--dir /path/on/the/disk/to/test]

Makes a DCP checkpoint of --size-gb with ckptool (several shard files, as a multi-rank
save has), then times, best of --repeat, with the page cache warmed by a first `cat`:

* `cat FILES > /dev/null`                    the baseline: just reading the bytes
* ckptool.verify() in-process                hash every file (xxh3-128) + structure checks
* `ckptool verify` as a command              the same plus interpreter and torch start-up
* `python -c "import torch"`                 that start-up alone (a fixed cost, ~2 s here)
* ckptool.verify(deep=True) in-process       also read back every piece, NaN/Inf scan

and prints each as a ratio to `cat`. Target: verify <= 1.3x cat.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckptool  # noqa: E402
from converters import dcp as ckpt_dcp  # noqa: E402


def make_checkpoint(path: Path, size_gb: float) -> None:
    n_tensors = 16
    numel = int(size_gb * (1 << 30) / 4 / n_tensors)
    rows = numel // 4096
    state = {f"layers.{i}.weight": torch.randn(rows, 4096) for i in range(n_tensors)}
    state["iteration"] = 1000
    ckpt_dcp.save(state, str(path), iteration=1000, writer_options={"thread_count": 4})


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="ckptool-bench-", dir=args.dir))
    try:
        ckpt = base / "step_001000"
        t = time.perf_counter()
        make_checkpoint(ckpt, args.size_gb)
        files = sorted(str(p) for p in ckpt.iterdir())
        total = sum(os.path.getsize(f) for f in files)
        print(f"checkpoint: {ckpt}  {len(files)} files, {total / 1e9:.2f} GB "
              f"(written in {time.perf_counter() - t:.1f}s)")

        def cat():
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)

        def verify_api():
            assert ckptool.verify(str(ckpt)).ok

        ckptool_bin = shutil.which("ckptool") or str(Path(sys.executable).parent / "ckptool")

        def verify_cli():
            subprocess.run([ckptool_bin, "verify", "-q", str(ckpt)], check=True)

        def startup():  # the fixed cost every torch-based tool pays
            subprocess.run([sys.executable, "-c", "import torch"], check=True)

        def verify_deep():
            assert ckptool.verify(str(ckpt), deep=True).ok

        cat()  # warm the page cache for everyone
        t_cat = best(cat, args.repeat)
        t_api = best(verify_api, args.repeat)
        t_cli = best(verify_cli, args.repeat)
        t_start = best(startup, args.repeat)
        t_deep = best(verify_deep, max(1, args.repeat - 1))
        gb = total / 1e9
        print(f"{'what':<34}{'seconds':>9}{'GB/s':>8}{'x cat':>8}")
        for name, sec in [("cat > /dev/null", t_cat), ("ckptool.verify() (hash)", t_api),
                          ("ckptool verify (command)", t_cli),
                          ("  of which `import torch`", t_start),
                          ("ckptool.verify(deep=True)", t_deep)]:
            print(f"{name:<34}{sec:>9.3f}{gb / sec:>8.2f}{sec / t_cat:>8.2f}")
        verdict = "meets" if t_api <= 1.3 * t_cat else "MISSES"
        print(f"verify/cat ratio {t_api / t_cat:.2f} ({verdict} the 1.3x target); "
              f"command minus `import torch` {(t_cli - t_start) / t_cat:.2f}x cat")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
