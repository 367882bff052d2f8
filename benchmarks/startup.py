"""The fixed start-up of the commands a restart script runs on every job start, against
``python -c pass`` in the same run.

    python benchmarks/startup.py [--dir DIR] [--tensors 200]

Builds a run root of 3 committed checkpoints with the save hook (one process, ``--tensors``
small tensors each), then times each command as a fresh process (best of 5): ``ckptool
latest ROOT``, ``ckptool verify CKPT`` (hashes and structure, no ``--deep``), ``ckptool
inspect ROOT``, ``ckptool --help``, and whether each imported torch (``python -X importtime``
lists it). Targets: ``latest`` and ``verify`` <= 0.5 s each.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(root: Path, tensors: int) -> None:
    import torch

    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer(str(root), keep_last=3)
    state = {"model": {f"layers.{i}.weight": torch.randn(64, 64) for i in range(tensors)}, "step": 0}
    for step in (10, 20, 30):
        state["step"] = step
        ckpt.save(step, state)
    ckpt.wait()
    ckpt.close()


def timed(argv: list[str], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        best = min(best, time.perf_counter() - t)
    return best


def imports_torch(argv: list[str]) -> bool:
    """Whether the command imports torch (``-X importtime`` prints every module imported)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv[1:]], capture_output=True, text=True)
    return any(re.search(r"\|\s+torch$", line.rstrip()) for line in proc.stderr.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--tensors", type=int, default=200)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptool-startup-", dir=args.dir))
    try:
        root = base / "run"
        build(root, args.tensors)
        newest = sorted(root.glob("step_*"))[-1]
        cli = [sys.executable, "-m", "ckptool"]
        rows = [("python -c pass", [sys.executable, "-c", "pass"]),
                ("ckptool --help", [*cli, "--help"]),
                ("ckptool latest ROOT", [*cli, "latest", str(root)]),
                ("ckptool verify CKPT", [*cli, "verify", str(newest)]),
                ("ckptool inspect ROOT", [*cli, "inspect", str(root)])]
        print(f"run root: 3 committed checkpoints of {args.tensors} tensors each")
        print(f"{'command':<24}{'best of 5 s':>12}{'imports torch':>15}")
        results = {}
        for name, argv in rows:
            results[name] = timed(argv)
            torch = "" if name.startswith("python") else ("yes" if imports_torch(argv) else "no")
            print(f"{name:<24}{results[name]:>12.3f}{torch:>15}")
        floor = results["python -c pass"]
        for name in ("ckptool latest ROOT", "ckptool verify CKPT"):
            print(f"{name}: {results[name]:.3f} s ({results[name] / floor:.1f}x python -c pass; "
                  "target <= 0.5 s)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
