"""How long a checkpoint save stalls training inside two real training stacks: ckptool's
save hook against each stack's own save, on the same state in the same run.

    python benchmarks/async_save_stacks.py [--hidden 1024] [--layers 8] [--dir DIR]
        [--stacks deepspeed,megatron] [--repeats 3] [--ds-tp 2] [--mcore-tp 2]
        [--mcore-sharding fully_reshardable,dp_reshardable] [--no-decoupled]

Two gloo processes on the CPU (world 2), one stack after the other, each in fresh processes.
The defaults (8 layers, hidden 1024, vocab 32768: about 1 GB of state per rank) take about
6 minutes on 2 cores, most of it Megatron-Core's ``fully_reshardable`` saves
(``--mcore-sharding dp_reshardable`` or ``--writers thread`` make it shorter):

* Megatron-DeepSpeed: a real DeepSpeed ``PipelineEngine`` over the GPTModelPipe-shaped model
  of ``tests/harness/deepspeed_pipe_tp.py`` (fp32, ZeRO-1, TP2 x PP1 by default), after one
  ``train_batch``. ckptool: ``AsyncCheckpointer.save(step, training.deepspeed.sharded_state(
  engine, args=...))``; the stack: ``engine.save_checkpoint`` (synchronous), then the same
  engine reconfigured with DeepSpeed's own asynchronous save, the ``DecoupledCheckpointEngine``
  (``"checkpoint": {"writer": {"type": "python", "decoupled": true}}``: a writer process per
  rank, committed before the next optimizer step), unless ``--no-decoupled``. Where it
  fails (DeepSpeed 0.19.8 cannot hand ZeRO-1's optimizer state to its writer process), the
  error is printed under the table.
* Megatron-Core: a real ``GPTModel`` (local spec) in ``DistributedDataParallel`` with
  Megatron's ``DistributedOptimizer`` (bf16 parameters, fp32 main params and Adam moments;
  ``tests/harness/mcore_distopt.py``), after one optimizer step. ckptool:
  ``AsyncCheckpointer.save`` of ``training.megatron.sharded_state(ddp, ..., optimizer=opt)``;
  the stack: ``dist_checkpointing.save`` of the model's and optimizer's sharded state dicts
  (``torch_dist``, per optimizer sharding type), synchronous and with
  ``async_sharded_save=True``, the AsyncRequest scheduled and finalized as Megatron-LM does
  (``AsyncCallsQueue().schedule_async_request``, ``maybe_finalize_async_calls(blocking=True)``).

"Blocking" is the time from a barrier until the call returns and training could continue.
It includes describing the state, as a training loop does at every save (shown apart as
"describe": ``sharded_state``, or building Megatron's sharded state dict, whose
``dp_reshardable`` optimizer state is gathered later, inside ``save``). For Megatron-Core's
async save it runs until ``schedule_async_request`` returns. "Durable" is until the
checkpoint is on disk: ``wait()`` returned / the AsyncRequest finalized; for the synchronous
saves the call plus an fsync of the files it wrote (DeepSpeed's torch.save does not fsync;
ckptool's and Megatron-Core's writers do). "Next step" is a training step started as soon
as a save returned (the write still in flight for the asynchronous methods), against the
same step with no save around (printed above each table); "stall" is blocking plus that
step's slowdown: what a save costs the job. Each number is the median over ``--repeats``
saves of the slowest rank, after one warm-up save (ckptool allocates its staging buffers on
its first save and reuses them). Each method runs in a block, ckptool's first: Megatron-Core's
writers fork the training process (even its synchronous save forks its writer processes),
after which every page the process writes takes a copy-on-write fault; a job saving with
ckptool never forks, so its staging copies are measured before any fork.

Targets: ckptool's blocking well below the stack's own synchronous save (ratio << 1), and
<= the stack's async save's blocking (Megatron-Core; DeepSpeed's decoupled engine where it
works). On the CPU, Megatron-Core's async staging (``tensor.to("cpu")``) copies nothing: its
forked writer reads the training process's memory copy-on-write, so its blocking is
planning plus a fork, and the copying moves into the training steps that follow (pages copied
on first write: the "next step" column); ckptool copies into its staging buffers before
returning. On a GPU both stage with a device-to-host copy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

WORLD = 2


# ------------------------------------------------------------------ shared helpers

def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _fsync_tree(root: Path, rank: int, world: int) -> None:
    """fsync every file under ``root`` (each rank its share), then a barrier."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for p in files[rank::world]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _barrier()


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def _state_bytes(state: dict, rank: int) -> tuple[int, int]:
    """(bytes of every tensor the description holds on this rank, bytes this rank writes)."""
    from training.state import describe

    entries, _ = describe(state, rank)
    held = sum(e.local.numel() * e.local.element_size() for e in entries)
    writes = sum(e.local.numel() * e.local.element_size() for e in entries if e.writes)
    return held, writes


def _rm(path: Path, rank: int) -> None:
    """Remove ``path`` on rank 0 between measurements (outside any timing)."""
    _barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    _barrier()


class _Bench:
    """Runs and records each method's saves on this rank.

    A method is ``start(n) -> (describe seconds or None, finish)``: ``start`` returns when
    training could continue; ``finish()`` returns when the checkpoint is durable. Per method:
    one warm-up save, then ``repeats`` rounds of (a) a save alone: blocking and durable, and
    (b) a save followed at once by a training step (``step``), the save's writing still in
    flight for the asynchronous methods: how long that step takes.
    """

    def __init__(self, rank: int, repeats: int, step):
        self.rank, self.repeats, self.step = rank, repeats, step
        self.rows: dict[str, dict[str, list[float]]] = {}
        self.disk: dict[str, int] = {}
        self.notes: list[str] = []
        self.saves = 0
        self.baseline: list[float] = []

    def timed_step(self) -> float:
        t = time.perf_counter()
        self.step()
        return time.perf_counter() - t

    def measure_baseline(self) -> None:
        """Training steps with no save around (after the first step, already taken)."""
        for _ in range(self.repeats):
            _barrier()
            self.baseline.append(self.timed_step())

    def run(self, name: str, start, written: Path, cleanup=None) -> bool:
        """Measure one method; False (and a note) if it failed."""
        try:
            for i in range(self.repeats + 1):
                self.saves += 1
                _barrier()
                t0 = time.perf_counter()
                describe, finish = start(self.saves)
                blocked = time.perf_counter() - t0
                finish()
                durable = time.perf_counter() - t0
                if i == 0:
                    self.disk[name] = _disk_bytes(written)
                if cleanup:
                    cleanup()
                if i == 0:
                    continue
                row = self.rows.setdefault(name, {k: [] for k in
                                                  ("blocking", "describe", "durable", "next")})
                row["blocking"].append(blocked)
                row["durable"].append(durable)
                row["describe"].append(float("nan") if describe is None else describe)
                self.saves += 1
                _barrier()
                _, finish = start(self.saves)
                row["next"].append(self.timed_step())
                finish()
                if cleanup:
                    cleanup()
            return True
        except Exception as exc:  # noqa: BLE001 - reported with the table
            self.rows.pop(name, None)
            self.notes.append(f"{name} failed on rank {self.rank}: {type(exc).__name__}: {exc}")
            if cleanup:
                cleanup()
            return False

    def dump(self, path: Path, **extra) -> None:
        path.write_text(json.dumps({"rows": self.rows, "disk": self.disk, "notes": self.notes,
                                    "baseline": self.baseline, **extra}))


def _ckptool_name(writer: str) -> str:
    return "ckptool AsyncCheckpointer.save" + ("" if writer == "thread" else f" (writer={writer})")


def _ckptool(ck, describe):
    """The method ``AsyncCheckpointer.save(n, describe())``; ``wait()`` makes it durable."""
    def start(n: int):
        t = time.perf_counter()
        state = describe()
        d = time.perf_counter() - t
        ck.save(n, state)
        return d, ck.wait
    return start


# ------------------------------------------------------------------ Megatron-DeepSpeed

def _resize_pipe(sizes: dict) -> None:
    """Size the harness's GPTModelPipe: ``PIPE_ARGS`` is read when the engine is built."""
    from tests.harness import deepspeed_engine as H

    h, heads = sizes["hidden"], sizes["heads"]
    H.PIPE_ARGS.update(num_layers=sizes["layers"], hidden_size=h, num_attention_heads=heads,
                       num_key_value_heads=heads, kv_channels=h // heads,
                       ffn_hidden_size=sizes["ffn"], padded_vocab_size=sizes["vocab"],
                       max_position_embeddings=max(H.PIPE_ARGS["max_position_embeddings"], H.SEQ),
                       seq_length=H.SEQ)


def _ds_worker(rank: int, tp: int, pp: int, sizes: dict, writers: list[str], repeats: int,
               decoupled: bool, root: str, port: int) -> None:
    import argparse as ap

    from tests.harness import deepspeed_engine as H
    from tests.harness import deepspeed_pipe as P
    from tests.harness import deepspeed_pipe_tp as T
    from training import AsyncCheckpointer
    from training.deepspeed import sharded_state

    _resize_pipe(sizes)
    H._init(rank, WORLD, port)  # also torch.set_num_threads(1): two ranks on two cores
    dp = WORLD // (tp * pp)
    eng = T.engine(tp, pp, dp, stage=1, precision="fp32")
    P.train_batch(eng, 0)
    args = dict(H.PIPE_ARGS, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                world_size=WORLD, data_parallel_size=dp, iteration=1)
    client = {"args": ap.Namespace(**args), "checkpoint_version": 3.0, "iteration": 1}
    base, ds_root = Path(root), Path(root) / "deepspeed"
    held, writes = _state_bytes(sharded_state(eng, args=args), rank)
    bench = _Bench(rank, repeats, lambda: P.train_batch(eng, 1))
    bench.measure_baseline()

    for writer in writers:
        ck = AsyncCheckpointer(str(base / f"ckptool-{writer}"), keep_last=1, writer=writer,
                               topology={"tp": tp, "pp": pp, "dp": dp, "zero": 1})
        bench.run(_ckptool_name(writer), _ckptool(ck, lambda: sharded_state(eng, args=args)),
                  base / f"ckptool-{writer}")
        ck.close()

    def ds_save(n: int):
        tag = f"global_step{n}"
        eng.save_checkpoint(str(ds_root), tag=tag, client_state=client)

        def finish():  # DeepSpeed's torch.save does not fsync
            _barrier()
            _fsync_tree(ds_root / tag, rank, WORLD)
        return None, finish

    clean = lambda: _rm(ds_root, rank)  # noqa: E731
    bench.run("DeepSpeed save_checkpoint (sync)", ds_save, ds_root, clean)

    if decoupled:
        # DeepSpeed's own asynchronous save on the same engine: its checkpoint engine set up
        # as if the JSON config held "checkpoint": {"writer": {"type": "python", "decoupled":
        # true}} ("fast" needs the async_io op, built against libaio). A writer process per
        # rank gets the state dicts; the engine commits before its next optimizer step.
        from deepspeed.runtime.model_checkpointing.config import get_checkpoint_config

        os.environ.setdefault("CROSS_RANK", "0")  # the deepspeed launcher's (one node)
        os.environ.setdefault("CROSS_SIZE", "1")

        def decoupled_save(n: int):
            tag = f"global_step{n}"
            eng.save_checkpoint(str(ds_root), tag=tag, client_state=client)

            def finish():
                eng._commit_decoupled_checkpoint()  # what the next optimizer step waits for
                _barrier()
                _fsync_tree(ds_root / tag, rank, WORLD)  # its Python writer does not fsync
            return None, finish

        name = "DeepSpeed save_checkpoint (decoupled, async)"
        try:
            eng._config.checkpoint_config = get_checkpoint_config(
                {"checkpoint": {"writer": {"type": "python", "decoupled": True}}})
            eng._configure_checkpointing()

            def settle():  # let its writer process finish what it was handed, then clean
                if eng.checkpoint_engine.get_commit_info() is not None:
                    eng._commit_decoupled_checkpoint()
                clean()
            bench.run(name, decoupled_save, ds_root, settle)
        except Exception as exc:  # noqa: BLE001 - reported with the table
            bench.notes.append(f"{name} failed on rank {rank}: {type(exc).__name__}: {exc}")
        finally:
            if any("non-leaf tensor" in n for n in bench.notes):
                bench.notes.append(
                    f"{name}: ZeRO-1's optimizer state_dict() holds slices of its fp32 partitions "
                    "(which require grad: non-leaf views, _get_groups_without_padding), which "
                    "torch.multiprocessing refuses to send to the writer process")
            if eng.checkpoint_engine.is_decoupled():
                eng.checkpoint_engine.cleanup()
    bench.dump(base / f"deepspeed.rank{rank}.json", held=held, writes=writes,
               step="train_batch (forward, backward, optimizer step)",
               layout=f"TP{tp} x PP{pp} x DP{dp}, fp32 ZeRO-1")
    _barrier()


# ------------------------------------------------------------------ Megatron-Core

def _mcore_worker(rank: int, c: dict, shardings: list[str], writers: list[str], repeats: int,
                  root: str, port: int) -> None:
    from dataclasses import asdict

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from ckptool.core.topology import Topology
    from converters.schemas.megatron_args import spec_from_args
    from tests.harness import mcore_distopt as D
    from tests.harness import mcore_distopt_torch_dist as TD
    from training import AsyncCheckpointer
    from training.megatron import sharded_state

    D._init(rank, port)  # gloo at D.WORLD == 2, and the CPU shims
    torch.set_num_threads(1)
    ps, ddp, opt = D._setup(c)
    TD._step(ps, ddp, opt, c, 1)
    iteration = 1

    # tests.harness.mcore_hook_distopt._described, at world 2 (that harness runs 4 processes)
    spec, _, _ = spec_from_args(D.megatron_args(c), true_vocab_size=c["vocab"])
    topo = Topology(tp=c["tp"], pp=c["pp"], dp=WORLD // (c["tp"] * c["pp"]))
    ranks = dict(tp_rank=ps.get_tensor_model_parallel_rank(),
                 pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())

    def describe():
        return sharded_state(ddp, spec, topo, **ranks, optimizer=opt)

    def native(sharding: str) -> dict:
        """What Megatron-LM's save_checkpoint hands dist_checkpointing.save (torch_dist)."""
        return {**TD._sharded(ddp, opt, sharding), "args": TD.args_of(c), "iteration": iteration,
                "checkpoint_version": 3.0, "opt_param_scheduler": {"num_steps": iteration}}

    base, mc_root = Path(root), Path(root) / "mcore"
    held, writes = _state_bytes(describe(), rank)
    # the step after a save: the optimizer step (seeded gradients), as in the harness
    bench = _Bench(rank, repeats, lambda: TD._step(ps, ddp, opt, c, 2))
    bench.measure_baseline()

    # ckptool first: Megatron-Core's writers fork this process (its async save forks a writer,
    # which forks more; the synchronous save forks those too), and after a fork each page
    # this process writes takes a copy-on-write fault, which would then be charged to
    # ckptool's staging copies (a job saving with ckptool never forks)
    for writer in writers:
        ck = AsyncCheckpointer(str(base / f"ckptool-{writer}"), keep_last=1, writer=writer,
                               topology=topo.to_dict(), model_config=asdict(spec),
                               true_vocab_size=c["vocab"])
        bench.run(_ckptool_name(writer), _ckptool(ck, describe), base / f"ckptool-{writer}")
        ck.close()

    queue = AsyncCallsQueue()  # Megatron-LM's (non-persistent: a forked writer per save)

    it = mc_root / f"iter_{iteration:07d}"

    def fresh() -> None:
        """An empty iteration directory for the next save, as dist_checkpointing.save expects."""
        _barrier()
        if rank == 0:
            shutil.rmtree(mc_root, ignore_errors=True)
            it.mkdir(parents=True)
        _barrier()

    def mcore(sharding: str, asynchronous: bool):
        meta = {"distrib_optim_sharding_type": sharding}

        def start(n: int):
            t = time.perf_counter()
            sd = native(sharding)
            d = time.perf_counter() - t
            if not asynchronous:
                dist_checkpointing.save(sd, str(it), content_metadata=meta)

                def finish():  # its writers fsync the data; common.pt and metadata too
                    _barrier()
                    _fsync_tree(it, rank, WORLD)
                return d, finish
            req = dist_checkpointing.save(sd, str(it), content_metadata=meta, async_sharded_save=True)
            queue.schedule_async_request(req)  # Megatron-LM's schedule_async_save
            # finalized: the writer joined on every rank, metadata.json written
            return d, lambda: queue.maybe_finalize_async_calls(blocking=True)
        return start

    fresh()
    for sharding in shardings:
        bench.run(f"mcore dist_checkpointing.save sync [{sharding}]", mcore(sharding, False),
                  mc_root, fresh)
        bench.run(f"mcore dist_checkpointing.save async [{sharding}]", mcore(sharding, True),
                  mc_root, fresh)
    _rm(mc_root, rank)
    queue.close()
    layout = (f"TP{c['tp']} x PP{c['pp']} x DP{topo.dp}, bf16 params + fp32 main params and "
              "Adam moments (DistributedOptimizer)")
    bench.dump(base / f"megatron.rank{rank}.json", held=held, writes=writes, layout=layout,
               step="optimizer step (DistributedOptimizer, seeded gradients)")
    _barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


# ------------------------------------------------------------------ the parent

def _spawn(fn, args: tuple, results: list[Path]) -> None:
    """Two fresh processes (torch's spawn); a worker that dies by a signal at exit after
    writing its results (gloo sometimes aborts at teardown) is not a failure."""
    import torch.multiprocessing as mp

    try:
        mp.spawn(fn, args=args, nprocs=WORLD, join=True)
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None or not all(p.exists() for p in results):
            raise
        print(f"(a worker died by {exc.signal_name} at exit, after writing its results)")


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: a rank that connects before rank 0
    listens can otherwise be given that very port as its own source port (a TCP
    self-connect), and rank 0 then fails with EADDRINUSE."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _report(title: str, files: list[Path]) -> None:
    """Each method's median (over the repeats) of the slowest rank, and ckptool's ratios."""
    ranks = [json.loads(p.read_text()) for p in files]
    print(f"\n== {title}: {ranks[0]['layout']}")
    for r, data in enumerate(ranks):
        print(f"   rank {r}: state described by ckptool {data['held'] / 1e6:.1f} MB, "
              f"of which this rank writes {data['writes'] / 1e6:.1f} MB")
    total = sum(d["writes"] for d in ranks)
    print(f"   state written per save (all ranks): {total / 1e6:.1f} MB")
    step = statistics.median(max(x) for x in zip(*(d["baseline"] for d in ranks)))
    print(f"   training step ({ranks[0]['step']}) with no save in flight: {step:.3f} s")

    def med(method: str, field: str) -> float:
        per_repeat = zip(*(d["rows"][method][field] for d in ranks))
        return statistics.median(max(x) for x in per_repeat)

    methods = [m for m in ranks[0]["rows"] if all(m in d["rows"] for d in ranks)]
    if not methods:
        print("   no method completed on every rank")
    ckptool = [m for m in methods if m.startswith("ckptool")]
    width = max(len(m) for m in methods) + 2 if methods else 8
    print(f"{'method':<{width}}{'blocking s':>11}{'describe s':>11}{'durable s':>11}"
          f"{'next step s':>12}{'stall s':>9}{'ckptool/this':>13}{'on disk MB':>12}")
    stall = {m: med(m, "blocking") + max(0.0, med(m, "next") - step) for m in methods}
    ours = med(ckptool[0], "blocking") if ckptool else float("nan")
    for m in methods:
        b, d, dur, nxt = med(m, "blocking"), med(m, "describe"), med(m, "durable"), med(m, "next")
        ratio = "" if m in ckptool else f"{ours / b:.3f}"
        desc = "" if d != d else f"{d:.3f}"  # NaN: not a separate step
        disk = ranks[0]["disk"].get(m)
        print(f"{m:<{width}}{b:>11.3f}{desc:>11}{dur:>11.3f}{nxt:>12.3f}{stall[m]:>9.3f}{ratio:>13}"
              f"{(f'{disk / 1e6:.1f}' if disk is not None else ''):>12}")
    for ck in ckptool:
        for m in (m for m in methods if m not in ckptool):
            target = "<= 1" if " async" in m else "well below 1"
            print(f"{ck} / {m}: blocking {med(ck, 'blocking') / med(m, 'blocking'):.3f} "
                  f"(target {target}), stall {stall[ck] / stall[m]:.3f}")
    seen = set()
    for data in ranks:
        for note in data["notes"]:
            key = re.sub(r" on rank \d+", "", note)
            if key not in seen:
                seen.add(key)
                print(f"NOTE: {key}" + (" (every rank)" if key != note else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=None, help="default: 4 x hidden")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stacks", default="deepspeed,megatron")
    ap.add_argument("--ds-tp", type=int, default=2, choices=[1, 2],
                    help="DeepSpeed TP size; PP is 2 / TP (TP2 x PP1 or TP1 x PP2)")
    ap.add_argument("--writers", default="thread,process",
                    help="AsyncCheckpointer writers to measure (comma list; the first is the "
                         "one the ratios use)")
    ap.add_argument("--no-decoupled", action="store_true",
                    help="skip DeepSpeed's DecoupledCheckpointEngine (its asynchronous save)")
    ap.add_argument("--mcore-tp", type=int, default=2, choices=[1, 2],
                    help="Megatron-Core TP size; PP is 2 / TP")
    ap.add_argument("--mcore-sharding", default="fully_reshardable,dp_reshardable",
                    help="the DistributedOptimizer sharding types to save with (comma list)")
    args = ap.parse_args()
    ffn = args.ffn or 4 * args.hidden
    if args.hidden % args.heads or args.heads % 2 or args.vocab % 16:
        ap.error("--hidden must divide by --heads, --heads by 2 (TP) and --vocab by 16")
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    writers = [w.strip() for w in args.writers.split(",") if w.strip()]
    if not writers or any(w not in ("thread", "process") for w in writers):
        ap.error("--writers is a comma list of thread and process")
    base = Path(tempfile.mkdtemp(prefix="ckptool-stacks-bench-", dir=args.dir))
    print(f"world {WORLD} (gloo, CPU), {args.layers} layers, hidden {args.hidden}, heads "
          f"{args.heads}, ffn {ffn}, vocab {args.vocab}; {args.repeats} measured saves per "
          f"method after a warm-up; under {base}")
    try:
        if "deepspeed" in stacks:
            root = base / "ds"
            root.mkdir()
            sizes = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=ffn,
                         vocab=args.vocab)
            files = [root / f"deepspeed.rank{r}.json" for r in range(WORLD)]
            t = time.perf_counter()
            _spawn(_ds_worker, (args.ds_tp, WORLD // args.ds_tp, sizes, writers, args.repeats,
                                not args.no_decoupled, str(root), _free_port()), files)
            _report(f"Megatron-DeepSpeed PipelineEngine ({time.perf_counter() - t:.0f} s)", files)
            shutil.rmtree(root, ignore_errors=True)
        if "megatron" in stacks:
            from tests.harness import mcore_distopt_torch_dist as TD

            root = base / "mcore"
            root.mkdir()
            c = dict(TD.BASE, layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=ffn,
                     vocab=args.vocab, tp=args.mcore_tp, pp=WORLD // args.mcore_tp, bf16=True,
                     overlap=False, bucket=None)
            files = [root / f"megatron.rank{r}.json" for r in range(WORLD)]
            t = time.perf_counter()
            shardings = [x.strip() for x in args.mcore_sharding.split(",") if x.strip()]
            _spawn(_mcore_worker, (c, shardings, writers, args.repeats, str(root), _free_port()),
                   files)
            _report(f"Megatron-Core GPTModel + DistributedOptimizer ({time.perf_counter() - t:.0f} s)",
                    files)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
