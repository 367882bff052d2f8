from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# DeepSpeed picks its accelerator from this; set before any worker process exists.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

PRELOAD = ["torch", "torch.distributed", "tests.harness.mcore", "megatron.core.models.gpt.gpt_model",
           "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "deepspeed"]
"""Imported once by the fork server that starts every test worker process (what is not
installed is skipped): a worker then starts in well under a second instead of importing
torch and megatron-core again (10 s of CPU each on the 2-core CI machine)."""


def peer(module: str):
    """Import a real peer (deepspeed, megatron.core, transformers, s3fs, moto). Outside CI a
    missing one skips its tests; in CI (``CI`` set) it fails them, so none can pass by
    being skipped."""
    if os.environ.get("CI"):
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys):
    """Run `ckptool ARGS...` in-process through the real entry point (exit-code mapping included)."""
    from ckptool.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def sample_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embedding.weight": torch.randn(96, 16, generator=g),
            "layers.0.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
            "layers.0.bias": torch.randn(16, generator=g),
            "norm.weight": torch.ones(16),
        },
        "optimizer": {"step": torch.tensor(12.0), "lr": 3e-4, "betas": [0.9, 0.95]},
        "iteration": 12,
    }


@pytest.fixture
def make_ckpt():
    """Write a committed ckptool DCP checkpoint; returns its path."""
    from converters import dcp

    def make(path: Path, seed: int = 0, iteration: int = 12, state: dict | None = None) -> Path:
        dcp.save(state if state is not None else sample_state(seed), str(path),
                 iteration=iteration, topology={"tp": 1, "pp": 1, "dp": 1})
        return path

    return make


# ckptool is imported inside the helpers below on purpose: every spawned worker imports this
# module before its caller's environment is restored (:func:`_with_env`), and ckptool imports
# fsspec, which reads its FSSPEC_* configuration once, at import.


def full_tensor(opened, key: str) -> torch.Tensor:
    """The whole global tensor ``key`` of an opened checkpoint, read through its reader."""
    from ckptool.core.engine import TargetTensor, fill_tensor
    from ckptool.core.regions import Region, Shard

    info = opened.index.tensors[key]
    t = TargetTensor(key, Shard.of(Region.whole(key, info.shape)), info.dtype)
    return fill_tensor(t, opened.index,
                       lambda p, d, b, out: opened.reader.read_box_into(opened.store, p, d, b, out))


def assembled(opened, key: str) -> torch.Tensor:
    """The whole global tensor ``key`` of an opened checkpoint, put together from every stored
    piece as the reader's ``read_piece`` returns it (:func:`full_tensor` reads boxes instead).
    A floating tensor starts as NaN, so a gap in the pieces' coverage shows."""
    from ckptool.core.regions import Region, execute, plan_copies

    info = opened.index.tensors[key]
    target = Region.whole(key, info.shape)
    out = torch.zeros(info.shape, dtype=info.dtype)
    if out.is_floating_point():
        out.fill_(float("nan"))  # a gap in coverage would show
    sources = [p.region for p in info.pieces]
    buffers = [opened.reader.read_piece(opened.store, p, info.dtype) for p in info.pieces]
    execute(plan_copies(sources, [target]), sources, buffers, [target], [out])
    return out


def convert_to_torch(run_cli, src: Path, dst: Path) -> dict:
    """``ckptool convert SRC DST --to dcp``, then torch's own ``dcp_to_torch_save`` of DST into
    ``DST.pt``: everything the converted checkpoint holds, by key, as torch reads it."""
    res = run_cli("convert", src, dst, "--to", "dcp")
    assert res.code == 0, res.err
    dcp_to_torch_save(dst, dst.parent / f"{dst.name}.pt")
    return torch.load(dst.parent / f"{dst.name}.pt", weights_only=False)


def _processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent, session, state) of every process (Linux /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
            out[int(entry)] = (int(fields[1]), int(fields[3]), fields[0])
    return out


def kill_job(pid: int, wait: float = 10.0) -> list[int]:
    """SIGKILL a job at once, as a node failure would: ``pid`` and every process below it,
    whatever session each is in (torchrun starts each rank in a session of its own, out of
    reach of ``killpg``), then whatever is left in those sessions (a rank's own child, which
    its death handed to init). Returns the processes still alive after ``wait`` seconds
    (zombies are dead): a test asserts there are none."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for p, (parent, _, _) in procs.items():
        children.setdefault(parent, []).append(p)
    job, todo = set(), [pid]
    while todo:
        p = todo.pop()
        job.add(p)
        todo.extend(children.get(p, []))
    ours = {os.getsid(0), os.getpid()}
    sessions = {procs[p][1] for p in job if p in procs} - ours
    deadline = time.monotonic() + wait
    while True:
        for p in sorted(job):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        alive = [p for p, (_, sid, state) in _processes().items()
                 if (p in job or sid in sessions) and state not in "ZX" and p != os.getpid()]
        if not alive or time.monotonic() > deadline:
            return alive
        job.update(alive)
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, nprocs: int, args: tuple = (), what: str = "test") -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each worker forked from a server
    that preloaded :data:`PRELOAD`. Retried when a worker dies by a signal (gloo workers
    sometimes abort at exit with "terminate called without an active exception", before
    ckptool is involved at all); a worker that fails by raising is never retried."""
    import multiprocessing
    import warnings

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)
    for attempt in range(3):
        try:
            mp.start_processes(_with_env, args=(dict(os.environ), pickle.dumps((fn, args))),
                               nprocs=nprocs, join=True, start_method="forkserver")
            return
        except mp.ProcessExitedException as exc:
            if exc.signal_name is None or attempt == 2:
                raise
            warnings.warn(f"{what} worker died by {exc.signal_name}; retrying")


def _with_env(rank, env, payload):
    """A forked worker has the fork server's environment: give it the caller's before
    unpickling the function and its arguments, which imports their modules (and modules
    read their configuration at import: fsspec's FSSPEC_S3_ENDPOINT_URL, for one)."""
    os.environ.clear()
    os.environ.update(env)
    fn, args = pickle.loads(payload)
    fn(rank, *args)


def spawn_gloo(fn, world_size: int, *args):
    """Run fn(rank, world_size, *args) in `world_size` processes over gloo on 127.0.0.1."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    spawn(_entry, world_size, (fn, world_size, args))


def _entry(rank, fn, world_size, args):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
