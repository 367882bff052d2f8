"""The ``ckptool`` command line. It only parses, calls the API and renders.

Exit codes (the contract): 0 ok, 1 the checkpoint is bad or none was found, 2 usage error
or unreadable input. Errors are one line on stderr; set CKPTOOL_DEBUG=1 for a traceback.

Each command imports its operation (and with it torch) when it runs, on purpose: ``--help``
and ``--version`` stay fast.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import sys
from typing import Any

import click

from ckptool.core import VERSION, gcpause, progress, safe_pickle
from ckptool.core.errors import CkptoolError, NoCheckpoint, UsageError, bounded

_READ_ONLY: list[bool] = []
"""Set by a command that writes nothing (inspect, verify without --seal, latest, plan): after
it, :func:`run` ends the process without the interpreter's teardown."""


def _reads_only() -> None:
    _READ_ONLY.append(True)
    # ckptool's own worker threads (one per core) call numpy's block-sized reductions; a BLAS
    # pool would put a second thread on each core (a threaded dot product costs a deep verify
    # a quarter more CPU). Set before numpy loads; a user's own setting stays.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _rank() -> int:
    """This process's rank under torchrun (0 alone)."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


class Output:
    """One sink: human text, one JSON document, or quiet. Progress only for a human on a TTY."""

    def __init__(self, as_json: bool, quiet: bool):
        self.as_json = as_json
        # Under torchrun only rank 0 speaks.
        self.quiet = quiet or _rank() > 0
        if not self.quiet:  # long metadata steps say how far they are, on stderr
            progress.enable()

    def progress(self, total, desc: str):
        """A tqdm bar on stderr for a human at a terminal, else None. ``total()`` gives bytes."""
        if self.as_json or self.quiet or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=total(), desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                    file=sys.stderr, leave=False)

    def result(self, obj: Any, human: str) -> None:
        try:
            if self.as_json:
                if _rank() == 0:  # one document, whatever the number of ranks
                    click.echo(json.dumps(_plain(obj), indent=1))
            elif not self.quiet and human:
                click.echo(human)
        except BrokenPipeError:  # click would end with exit 1, "the checkpoint is bad"
            raise CkptoolError("stdout was closed before the result was written (a broken pipe)",
                               hint="Its work ran as usual; only the printing failed") from None

    def note(self, text: str) -> None:
        """Side information for humans, on stderr (never pollutes --json stdout)."""
        if not self.quiet:
            click.echo(text, err=True)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _trust(ctx, param, value):
    if value:
        from ckptool.core.safe_pickle import trust_pickle

        trust_pickle(True)


def _output_options(f):
    f = click.option("--trust-pickle", is_flag=True, expose_value=False, callback=_trust,
                     help="Load pickles that name classes outside the allowlist (runs their code: "
                          "only for files you trust).")(f)
    f = click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")(f)
    f = click.option("--json", "as_json", is_flag=True,
                     help="Print one JSON document on stdout.")(f)
    return f


def _storage_option(ctx, param, values):
    options = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        options[key] = value
    return options


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(VERSION, prog_name="ckptool")
@click.option("--trust-pickle", "trust", is_flag=True,
              help="Allow arbitrary pickles in checkpoint files (runs their code). Off by default.")
@click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
              callback=_storage_option, help="Extra fsspec storage option for every URL.")
def cli(trust: bool, storage_options: dict):
    """Checkpoints for TP x PP x DP training: inspect, verify, latest, reshard, convert, plan.

    \b
    ckptool inspect /pfs/run/step_000200
    ckptool verify  /pfs/run/step_000200 --deep
    ckptool latest  /pfs/run --json
    ckptool reshard /pfs/run /pfs/run-tp4pp4 --tp 8 --pp 2 --to-tp 4 --pp 4
    ckptool convert /pfs/run/iter_0001000 /models/hf --to hf
    ckptool plan    --gpus 32 --tp 8 --pp 2 --params 175B
    """
    from ckptool.core.safe_pickle import trust_pickle
    from ckptool.core.storage import set_storage_options

    trust_pickle(trust)
    set_storage_options(storage_options)


@cli.command()
@click.argument("ckpt", metavar="CKPT")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, help="How many of the largest tensors to list.")
@_output_options
def inspect(ckpt: str, top: int, as_json: bool, quiet: bool):
    """Show what the checkpoint CKPT holds: format, topology, iteration, tensors by size.

    CKPT is a checkpoint directory or a run root (its newest checkpoint is shown).
    """
    from ckptool.ops.inspect import inspect as run

    _reads_only()
    out = Output(as_json, quiet)
    res = run(ckpt, top=top)
    lines = [
        f"{res.path}",
        f"  format      {res.format}" + (f" (version {res.format_version})" if res.format_version else ""),
        f"  committed   {_committed(res.committed)}",
        f"  topology    {_topology(res.topology)}",
        f"  iteration   {res.iteration if res.iteration is not None else 'unknown'}",
        f"  tensors     {res.tensor_count} ({_size(res.total_bytes)})",
        f"  objects     {res.object_count}",
    ]
    if res.model_config:
        cfg = ", ".join(f"{k}={v}" for k, v in list(res.model_config.items())[:8])
        lines.append(f"  model       {cfg}")
        experts = res.model_config.get("num_experts")
        if experts:
            ep = (res.topology or {}).get("ep", 1)
            lines.append(f"  experts     {experts} per MoE layer, top-{res.model_config.get('moe_router_topk')}, "
                         f"{experts // ep} per EP rank at EP{ep} (ETP {(res.topology or {}).get('etp') or 'TP'})")
    if res.bytes_by_dtype:
        lines.append("  by dtype    " + ", ".join(f"{k} {_size(v)}" for k, v in res.bytes_by_dtype.items()))
    lines.append(f"  optimizer   {res.optimizer or 'none'}")
    if res.largest:
        lines.append("  largest tensors:")
        width = max(len(t.key) for t in res.largest)
        for t in res.largest:
            lines.append(f"    {t.key:<{width}}  {t.dtype:<8} {str(t.shape):<18} {_size(t.bytes):>10}"
                         f"  {t.pieces} piece(s)")
    for w in res.warnings:
        out.note(f"warning: {w}")
    out.result(res, "\n".join(lines))


@cli.command()
@click.argument("ckpt", metavar="CKPT")
@click.option("--deep", is_flag=True, help="Also read every piece: shape, dtype, NaN/Inf.")
@click.option("--seal", is_flag=True, help="Write a manifest for a foreign checkpoint after a deep check.")
@click.option("--strict", is_flag=True, help="Treat files missing from the manifest as errors.")
@click.option("--workers", type=click.IntRange(min=1),
              help="Files hashed in parallel.  [default: the cores, at most 8]")
@_output_options
def verify(ckpt: str, deep: bool, seal: bool, strict: bool, workers: int, as_json: bool, quiet: bool):
    """Check that the checkpoint CKPT is whole, committed and uncorrupted.

    Exit 0 when it is sound, 1 when it is not (each problem names the file and the tensor),
    2 when CKPT cannot be read at all. CKPT is a checkpoint directory or a run root.
    """
    from ckptool.checkpoints.verify import verify as run

    if not seal:
        _reads_only()
    out = Output(as_json, quiet)
    bar = out.progress(lambda: _total_bytes(ckpt), "verify")
    try:
        report = run(ckpt, deep=deep, seal=seal, strict=strict, workers=workers,
                     progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    for w in report.warnings:
        out.note(f"warning: {w.one_line()}")
    status = "OK" if report.ok else "FAILED"
    state = {True: "committed", False: "NOT committed", None: "foreign, unsealed"}[report.committed]
    if report.sealed:
        state = "sealed now (manifest written)"
    human = [f"{status}: {report.path} ({report.format}, {state}; {report.files_checked} files, "
             f"{_size(report.bytes_hashed)} hashed, {report.tensors} tensors"
             + (f", {report.pieces_read} pieces read" if report.deep else "") + ")"]
    human += [f"  error: {p.one_line()}" for p in report.problems]
    if report.ok:
        out.result(report, "\n".join(human))
        sys.exit(0)
    first = report.problems[0].one_line() if report.problems else "failed"
    failed = f"{len(report.problems)} problem(s); the first: {first}"
    # what --json promises every failure: "error" and "exit_code" beside the report
    out.result({**_plain(report), "error": failed, "exit_code": report.exit_code},
               "" if as_json else "\n".join(human))
    if quiet:
        for p in report.problems:
            click.echo(f"ckptool: error: {p.one_line()}", err=True)
    elif not out.quiet:  # the one line on stderr every failed command gives
        click.echo(f"ckptool: error: {report.path} fails verification: {failed}", err=True)
    sys.exit(report.exit_code)


@cli.command()
@click.argument("root", metavar="ROOT")
@click.option("--no-verify", is_flag=True, help="Skip hashing: take the newest committed one.")
@_output_options
def latest(root: str, no_verify: bool, as_json: bool, quiet: bool):
    """Print the path of the newest valid checkpoint under the run root ROOT.

    Newer checkpoints that were skipped are listed on stderr with the reason. Exit 1
    when there is none.
    """
    from ckptool.checkpoints.latest import latest as run

    _reads_only()
    out = Output(as_json, quiet)
    try:
        res = run(root, verify_checkpoints=not no_verify)
    except NoCheckpoint as exc:
        _report_skipped(out, getattr(exc, "skipped", []))
        raise
    _report_skipped(out, res.skipped)
    out.result(res, res.path)


_SIZE = click.IntRange(min=1)


def _rewrite_options(f):
    """The options reshard and convert share."""
    for option in reversed([
        click.option("--true-vocab-size", type=_SIZE,
                     help="The tokenizer's vocabulary size, if SRC lacks it."),
        click.option("--workers", default=4, show_default=True, type=_SIZE,
                     help="Target files written in parallel."),
        click.option("--decoder-first-pipeline-num-layers", "first_stage_layers", type=_SIZE,
                     help="megatron targets: layers on the first pipeline stage (uneven split)."),
        click.option("--decoder-last-pipeline-num-layers", "last_stage_layers", type=_SIZE,
                     help="megatron targets: layers on the last pipeline stage (uneven split)."),
        click.option("--dry-run", is_flag=True, help="Print the plan: target files, bytes read and written."),
        click.option("--overwrite", is_flag=True, help="Replace DST if it exists."),
        click.option("--drop-optimizer", is_flag=True,
                     help="Write model weights only when SRC's optimizer state cannot be carried."),
        click.option("--no-fsync", is_flag=True,
                     help="Leave DST's write-back to the kernel, as cp does (faster; the commit is "
                          "still atomic, but after a power loss run `ckptool verify` before use)."),
        click.option("--no-verify-source", is_flag=True,
                     help="Do not hash SRC's files against its manifest while writing (by default a "
                          "source that does not match is refused and nothing is committed)."),
    ]):
        f = option(f)
    return _output_options(f)


@cli.command()
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--to-tp", type=_SIZE, help="Target tensor-parallel size.")
@click.option("--to-pp", type=_SIZE, help="Target pipeline-parallel size.")
@click.option("--to-dp", type=_SIZE, help="Target data-parallel size.")
@click.option("--to-vpp", type=_SIZE, help="Target virtual pipeline chunks per stage.")
@click.option("--to-zero", type=click.IntRange(0, 3), help="Target ZeRO stage (DeepSpeed).")
@click.option("--to-ep", type=_SIZE, help="Target expert-parallel size (MoE).")
@click.option("--to-etp", type=_SIZE, help="Target expert tensor-parallel size (MoE; default: the TP).")
@click.option("--tp", type=_SIZE, help="Assert the source's TP (read from SRC).")
@click.option("--pp", type=_SIZE, help="Assert the source's PP.")
@click.option("--dp", type=_SIZE, help="Assert the source's DP.")
@click.option("--ep", type=_SIZE, help="Assert the source's EP.")
@click.option("--etp", type=_SIZE, help="Assert the source's ETP.")
@_rewrite_options
def reshard(src, dst, to_tp, to_pp, to_dp, to_vpp, to_zero, to_ep, to_etp, tp, pp, dp, ep, etp,
            true_vocab_size, workers,
            first_stage_layers, last_stage_layers, dry_run, overwrite, drop_optimizer, no_fsync,
            no_verify_source, as_json, quiet):
    """Rewrite the checkpoint SRC at DST for another TP/PP layout, same format.

    SRC's topology is read from it; --tp/--pp/--dp before the --to-* flags are assertions.
    The form users type also works: a topology flag after a --to-* flag is a target.

    \b
    ckptool reshard /ckpt/run /ckpt/run-tp4pp4 --tp 8 --pp 2 --to-tp 4 --pp 4
    ckptool reshard /ckpt/run /ckpt/run-tp2 --to-tp 2 --dry-run
    """
    from ckptool.ops.reshard import RewriteOptions
    from ckptool.ops.reshard import reshard as run

    out = Output(as_json, quiet)
    options = RewriteOptions(
        to={"tp": to_tp, "pp": to_pp, "dp": to_dp, "vpp": to_vpp, "zero": to_zero, "ep": to_ep,
            "etp": to_etp},
        expect={"tp": tp, "pp": pp, "dp": dp, "ep": ep, "etp": etp}, workers=workers, dry_run=dry_run,
        overwrite=overwrite, true_vocab_size=true_vocab_size, drop_optimizer=drop_optimizer,
        fsync=not no_fsync, verify_source=not no_verify_source,
        format_options={"first_stage_layers": first_stage_layers,
                        "last_stage_layers": last_stage_layers})
    res = _with_bar(out, "reshard", dry_run, lambda progress: run(src, dst, options, progress=progress))
    _render_rewrite(out, res, "resharded")


def _with_bar(out: Output, desc: str, dry_run: bool, work):
    """``work(progress)`` with a bar of the bytes written for a human at a terminal."""
    bar = out.progress(lambda: None, desc) if not dry_run else None
    try:
        return work(bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


def _render_rewrite(out: Output, res, verb: str) -> None:
    src_t, dst_t = _topology(res.source_topology), _topology(res.target_topology)
    lines = [f"{'plan' if res.dry_run else verb}: {res.source} ({src_t}) -> {res.destination} "
             f"({dst_t}), {res.format}",
             f"  {len(res.files)} files, read {_size(res.bytes_read)}, write {_size(res.bytes_written)}"
             + ("" if res.dry_run else f", {res.seconds:.1f}s")]
    if res.reused_files:
        lines.append(f"  kept {res.reused_files} finished files of an interrupted run (hashes checked)")
    if res.dropped:
        lines.append(f"  left out: {res.dropped}")
    lines += [f"  note: {n}" for n in res.notes]
    if res.dry_run:
        lines += [f"  {f.path}  {_size(f.bytes)}" for f in res.files]
    out.result(res, "\n".join(lines))


class ByteSize(click.ParamType):
    """``5GB``, ``500MB``, ``64KiB`` or plain bytes (decimal units as in Hugging Face)."""

    name = "size"
    _UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}

    def convert(self, value, param, ctx):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(value).upper())
        if not m or m.group(2) not in self._UNITS or float(m.group(1)) <= 0:
            self.fail(f"{value!r} is not a size such as 5GB or 500MB", param, ctx)
        return int(float(m.group(1)) * self._UNITS[m.group(2)])


class FormatType(click.ParamType):
    name = "format"

    def convert(self, value, param, ctx):
        import converters

        if value not in converters.FORMATS:
            self.fail(f"{value!r} is not a format; use one of {', '.join(converters.FORMATS)}",
                      param, ctx)
        return value


@cli.command()
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--to", "to_format", required=True, type=FormatType(), help="Target format.")
@click.option("--tp", "--to-tp", "tp", type=_SIZE, help="Target tensor-parallel size (default: SRC's).")
@click.option("--pp", "--to-pp", "pp", type=_SIZE, help="Target pipeline-parallel size.")
@click.option("--dp", "--to-dp", "dp", type=_SIZE, help="Target data-parallel size.")
@click.option("--zero", "--to-zero", "zero", type=click.IntRange(0, 3), help="Target ZeRO stage (deepspeed).")
@click.option("--ep", "--to-ep", "ep", type=_SIZE, help="Target expert-parallel size (MoE).")
@click.option("--etp", "--to-etp", "etp", type=_SIZE, help="Target expert tensor-parallel size (MoE).")
@click.option("--megatron-names", type=click.Choice(["mcore-local", "mcore-te", "legacy"]),
              help="Tensor names of a megatron target: Megatron-Core local or Transformer Engine "
                   "spec, or pre-mcore (Megatron-DeepSpeed). Default: the source's, else mcore-local.")
@click.option("--model-family", type=click.Choice(["llama", "gpt", "gpt2"]),
              help="Hugging Face model family, when config.json or the model does not say.")
@click.option("--model-config", type=click.Path(dir_okay=False), metavar="CONFIG.json",
              help="The model's Hugging Face config.json, when SRC does not carry one "
                   "(DeepSpeed checkpoints of HF models look for it beside `latest`).")
@click.option("--max-shard-size", type=ByteSize(), help="hf: largest safetensors file, e.g. 5GB, 500MB.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]),
              help="hf: dtype of the written weights (default: the source's).")
@click.option("--init-optimizer", is_flag=True,
              help="deepspeed from hf: write a fresh optimizer state (fp32 masters, zero "
                   "moments, step 0) for --zero S at --dp N.")
@click.option("--param-groups", type=click.Choice(["decay", "single"]),
              help="deepspeed from hf: the engine's param groups: decay (default; no weight decay "
                   "for biases and 1-D parameters, as the HF Trainer groups them) or single.")
@click.option("--megatron-lr-schedule", metavar="KEY=VALUE,...",
              help="megatron from deepspeed with the optimizer: the resuming job's "
                   "OptimizerParamScheduler (max_lr, min_lr, lr_warmup_steps, lr_decay_steps, "
                   "lr_decay_style, start_wd, end_wd, wd_incr_steps, wd_incr_style; steps in "
                   "samples), which a DeepSpeed checkpoint does not hold.")
@_rewrite_options
def convert(src, dst, to_format, tp, pp, dp, zero, ep, etp, megatron_names, model_family, model_config,
            max_shard_size, dtype, init_optimizer, param_groups, megatron_lr_schedule,
            true_vocab_size, workers, first_stage_layers, last_stage_layers, dry_run, overwrite,
            drop_optimizer, no_fsync, no_verify_source, as_json, quiet):
    """Write the checkpoint SRC at DST in another format, optionally at another TP/PP.

    --tp/--pp/--dp describe the target (SRC's own layout is read from it).

    \b
    ckptool convert /ckpt/run/iter_0001000 /ckpt/legacy --to megatron --tp 4 --pp 2
    """
    from ckptool.ops.reshard import RewriteOptions
    from ckptool.ops.reshard import convert as run

    out = Output(as_json, quiet)
    options = RewriteOptions(
        to={"tp": tp, "pp": pp, "dp": dp, "zero": zero, "ep": ep, "etp": etp}, workers=workers,
        dry_run=dry_run,
        overwrite=overwrite, true_vocab_size=true_vocab_size, drop_optimizer=drop_optimizer,
        names=megatron_names, model_family="gpt2" if model_family == "gpt" else model_family,
        model_config=model_config, init_optimizer=init_optimizer, fsync=not no_fsync,
        verify_source=not no_verify_source,
        format_options={"max_shard_size": max_shard_size, "dtype": dtype, "param_groups": param_groups,
                        "megatron_lr_schedule": megatron_lr_schedule,
                        "first_stage_layers": first_stage_layers, "last_stage_layers": last_stage_layers})
    res = _with_bar(out, "convert", dry_run, lambda progress: run(src, dst, options, to_format=to_format,
                                                                 progress=progress))
    _render_rewrite(out, res, "converted")


class _Rate(click.ParamType):
    """A positive, finite GB/s (nan passed a FloatRange and printed "~nan s")."""

    name = "GB/s"

    def convert(self, value, param, ctx):
        try:
            rate = float(value)
        except (TypeError, ValueError):
            rate = float("nan")
        if not 0 < rate < 1e6:
            self.fail(f"{value!r} is not a rate in GB/s above 0", param, ctx)
        return rate


_RATE = _Rate()


@cli.command()
@click.option("--gpus", type=_SIZE, required=True, help="GPUs of the job.")
@click.option("--tp", type=_SIZE, required=True, help="Tensor-parallel size.")
@click.option("--pp", type=_SIZE, required=True, help="Pipeline-parallel size.")
@click.option("--ep", type=_SIZE, default=1, show_default=True, help="Expert-parallel size (MoE models).")
@click.option("--etp", type=_SIZE, help="Expert tensor-parallel size (MoE; default: the TP).")
@click.option("--model", "model_path", metavar="CONFIG",
              help="HF config.json, Megatron args (JSON) or a checkpoint.")
@click.option("--params", help="Parameter count instead of a model, e.g. 70B, 175B.")
@click.option("--zero", type=click.IntRange(0, 3), default=1, show_default=True,
              help="ZeRO stage for the checkpoint cost.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Training dtype (bf16/fp16: mixed precision with fp32 masters).")
@click.option("--gpu-mem", type=ByteSize(), help="GPU memory, e.g. 80GB: marks what fits.")
@click.option("--gpus-per-node", type=_SIZE, default=8, show_default=True)
@click.option("--h2d-gbps", type=_RATE, default=20.0, show_default=True,
              help="Device-to-host copy GB/s (pinned memory) for the save stall.")
@click.option("--storage-gbps", type=_RATE, default=10.0, show_default=True,
              help="Aggregate storage write GB/s.")
@click.option("--from", "from_ckpt", metavar="CKPT",
              help="A checkpoint: list the topologies it reshards to for --gpus.")
@_output_options
def plan(gpus, tp, pp, ep, etp, model_path, params, zero, dtype, gpu_mem, gpus_per_node, h2d_gbps,
         storage_gbps, from_ckpt, as_json, quiet):
    """Topology math, per-GPU memory per ZeRO stage, checkpoint cost, restart options.

    \b
    ckptool plan --gpus 32 --tp 8 --pp 2 --params 175B --zero 2 --gpu-mem 80GB
    ckptool plan --gpus 64 --tp 8 --pp 4 --model llama-70b/config.json
    ckptool plan --gpus 24 --tp 8 --pp 2 --from /pfs/run     # restart on fewer nodes
    """
    from ckptool.ops.plan import model_from, parse_count
    from ckptool.ops.plan import plan as run

    _reads_only()
    out = Output(as_json, quiet)
    spec = source = source_topo = None
    if model_path:
        spec, _ = model_from(model_path)
    if from_ckpt:
        source, source_topo = model_from(from_ckpt)
        spec = spec or source
    if spec is None and not params:
        raise UsageError("give the model: --model CONFIG, --params N or --from CKPT")
    res = run(gpus, tp, pp, params=parse_count(params) if params and spec is None else None,
              spec=spec, zero=zero, dtype=dtype, gpu_mem_gb=gpu_mem / 1e9 if gpu_mem else None,
              gpus_per_node=gpus_per_node, h2d_gbps=h2d_gbps, storage_gbps=storage_gbps,
              source=source, source_topology=source_topo, ep=ep, etp=etp)
    for w in res.warnings:
        out.note(f"warning: {w}")
    lines = [f"{gpus} GPUs = TP{tp} x PP{pp} x DP{res.dp}" + (f" (EP{ep})" if ep > 1 else "")
             + (f" (ETP{etp})" if etp is not None and etp != tp else "")
             + f"; {res.params / 1e9:.2f}B parameters, "
             f"{res.params_per_gpu / 1e9:.3f}B on the busiest GPU ({dtype})",
             "", f"  {'per GPU (GB)':<17} {'weights':>8} {'grads':>8} {'optimizer':>10} {'total':>8}"
             + ("  fits" if gpu_mem else "")]
    for r in res.memory:
        fits = "" if r.fits is None else ("  yes" if r.fits else "  NO")
        lines.append(f"  {r.strategy:<17} {r.weights_gb:>8.2f} {r.grads_gb:>8.2f} {r.optimizer_gb:>10.2f} "
                     f"{r.total_gb:>8.2f}{fits}")
    lines.append("  (training state only: add activations and buffers)")
    c = res.checkpoint
    lines += ["", f"checkpoint: {_size(c.bytes)} (weights + fp32 master + Adam); the busiest rank "
                  f"stages {_size(c.per_gpu_bytes)} (ZeRO-{zero})",
              f"  async save stalls ~{c.stall_s:.2f} s at {h2d_gbps:g} GB/s device-to-host; "
              f"writing takes ~{c.write_s:.0f} s at {storage_gbps:g} GB/s"]
    if res.restarts:
        lines += ["", f"restart topologies for {gpus} GPUs:"]
        for r in res.restarts[:12]:
            tags = [t for t, on in (("same TP/PP", r["same_model_parallel"]),
                                    ("TP across nodes", not r["within_node"])) if on]
            eps = "" if r["ep"] == [1] else f", EP {'/'.join(map(str, r['ep']))}"
            lines.append(f"  TP{r['tp']} x PP{r['pp']} x DP{r['dp']}{eps}" + (f"  ({', '.join(tags)})" if tags else ""))
    out.result(res, "\n".join(lines))


_TARGET_FLAGS = {"--tp": "--to-tp", "--pp": "--to-pp", "--dp": "--to-dp", "--ep": "--to-ep",
                 "--etp": "--to-etp"}


def _literal_targets(argv: list[str]) -> list[str]:
    """`reshard ... --tp 8 --pp 2 --to-tp 4 --pp 4`: a topology flag after a --to-* flag is a target."""
    if "reshard" not in argv:
        return argv
    start = argv.index("reshard")
    out, seen_to = argv[:start + 1], False
    for tok in argv[start + 1:]:
        flag, eq, value = tok.partition("=")
        if flag.startswith("--to-"):
            seen_to = True
        elif seen_to and flag in _TARGET_FLAGS:
            tok = _TARGET_FLAGS[flag] + eq + value
        out.append(tok)
    targets: dict[str, str] = {}  # one value per target axis: `--to-tp 1 --tp 2` was a silent TP2 copy
    for i, tok in enumerate(out):
        flag, eq, value = tok.partition("=")
        if flag.startswith("--to-"):
            value = value if eq else (out[i + 1] if i + 1 < len(out) else "")
            if targets.setdefault(flag, value) != value:
                raise click.UsageError(f"{flag} is given twice, as {targets[flag]} and {value} (a topology "
                                       "flag after a --to-* flag is a target too)")
    return out


def _report_skipped(out: Output, skipped) -> None:
    for s in skipped:
        out.note(f"skipped {s.path}: {s.reason}")


def _committed(value) -> str:
    return {True: "yes (manifest present)", False: "NO (ckptool.json missing: writer never finished)",
            None: "foreign checkpoint, no manifest (seal it with `ckptool verify --seal`)"}[value]


def _topology(topo: dict | None) -> str:
    if not topo:
        return "unknown"
    from ckptool.core.topology import Topology

    return str(Topology.from_dict(topo))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _total_bytes(url: str) -> int | None:
    try:
        from ckptool.checkpoints.open import resolve

        return sum(resolve(url).files().values())
    except Exception:
        return None


def _fail(line: str | None, code: int, argv: list[str], message: str | None = None,
          skipped: list | None = None) -> None:
    """End a failed command: its one line on stderr (``ckptool: LINE``; None: already shown)
    and the exit code; with ``--json``, also one JSON document on stdout, so a script that
    parses stdout gets ``{"ok": false, "error": ..., "exit_code": ...}`` rather than nothing."""
    if line is not None:
        _echo(f"ckptool: {line}", err=True)
    if "--json" in argv and _rank() == 0:  # one document, whatever the number of ranks
        text = message if message is not None else line.removeprefix("error: ")
        doc = {"ok": False, "error": text, "exit_code": code}
        if skipped is not None:  # latest: the candidates it went past, and why
            doc["skipped"] = [_plain(s) for s in skipped]
        _echo(json.dumps(doc))
    sys.exit(code)


def _echo(text: str, err: bool = False) -> None:
    """A line the failure path prints, never an error of its own (a closed or broken stdout)."""
    try:
        click.echo(text, err=err)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    gcpause.freeze_builds(True)  # a command's index lives until it ends: never walked again
    safe_pickle.bound_unwalked_pickles(True)  # what a large pickle claims fails, not allocated
    try:
        argv = _literal_targets(argv)
        cli.main(args=argv, prog_name="ckptool", standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", 130, argv)
    except click.ClickException as exc:  # one line, not click's usage block of four
        code = 2 if isinstance(exc, click.UsageError) else exc.exit_code
        if type(exc).__name__ == "NoArgsIsHelpError":  # `ckptool` alone: the help it asks for
            exc.show()
            _fail(None, code, argv, exc.format_message())
        ctx = getattr(exc, "ctx", None)
        where = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
        _fail(f"error: {exc.format_message().rstrip('.')}{where}", code, argv, exc.format_message())
    except CkptoolError as exc:
        if os.environ.get("CKPTOOL_DEBUG"):
            raise
        _fail(f"error: {exc.one_line()}", exc.exit_code, argv, skipped=getattr(exc, "skipped", None))
    except OSError as exc:
        if os.environ.get("CKPTOOL_DEBUG"):
            raise
        where = f" ({bounded(exc.filename)})" if getattr(exc, "filename", None) else ""
        _fail(f"error: {bounded(exc.strerror or exc, 600)}{where}", 2, argv)
    except Exception as exc:  # noqa: BLE001 - never a traceback (MemoryError, RecursionError too)
        if os.environ.get("CKPTOOL_DEBUG"):
            raise
        # a checkpoint no check foresaw (what ckptool reads is untrusted): one line, exit 2
        _fail(f"error: cannot read the input: {type(exc).__name__}: {bounded(exc, 300)}. Check the "
              f"checkpoint (ckptool verify); if it is sound, report this with the output of "
              f"CKPTOOL_DEBUG=1 ckptool ...", 2, argv)
    finally:
        progress.disable()  # a command's setting, not the process's (main runs in tests too)
        gcpause.freeze_builds(False)
        safe_pickle.bound_unwalked_pickles(False)
        gc.unfreeze()


def run() -> None:
    """The console entry (``ckptool``, ``python -m ckptool``): :func:`main`, then, after a
    command that wrote nothing, the end of the process without the interpreter's teardown
    (freeing every object of a large index one by one, joining idle pools): what a restart
    script that calls ``latest`` and ``verify`` on every job start waits for. A command that
    wrote ends the ordinary way."""
    _READ_ONLY.clear()
    code: Any = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    if not _READ_ONLY:
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # sys.exit("text"): Python's own rule
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: started with the descriptor closed
                stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: as Python ends, exit 120
            code = code or 120
    os._exit(code or 0)


if __name__ == "__main__":
    run()
