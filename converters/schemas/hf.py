"""The Hugging Face name and config schemas: which canonical regions each HF tensor holds,
and what an HF ``config.json`` says about the model. Not a format: the ``hf`` reader and
writer (:mod:`converters.hf.format`) and the DeepSpeed reader and writer (an engine whose module
is an HF model, the HF Trainer's ``config.json`` beside ``latest``) share it.

The families are data, one table each (:mod:`converters.schemas.families`: llama, gpt2,
mistral, qwen2, qwen3): its tensors as canonical parts and its config fields as rules. This
module is their interface to the formats (by family name), and the one config-fidelity rule."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from ckptool.core.errors import UnreadableInput, UsageError
from ckptool.core.index import CheckpointIndex
from ckptool.core.layout import ModelSpec
from ckptool.core.lazy import lazy
from ckptool.core.view import Entry as HfTensor
from ckptool.core.view import remap
from converters.schemas.families import FAMILIES as TABLES
from converters.schemas.families import FEATURES, Family

torch = lazy("torch", globals())

CONFIG = "config.json"


@dataclass(frozen=True)
class HfModel:
    """The layout record of a source whose tensors are a Hugging Face model's (the hf
    reader's index, or a DeepSpeed module's canonical view): its ``config.json`` and family.
    ``family`` None: an architecture without a table (:func:`stored_view`), whose tensors
    keep their names; ``aliases`` are its tied names (``{alias: owner}``)."""

    config: dict
    family: str | None
    aliases: dict = field(default_factory=dict)
    unplaced: tuple[str, ...] = ()
    """Stored tensors the family's table has no place for (a value head, a layer beyond
    ``num_hidden_layers``): read and verified, never dropped by a conversion."""

    def unplaced_words(self) -> str:
        """:attr:`unplaced` in words, for a refusal or a warning."""
        return unplaced_words(self.unplaced, self.family)


def unplaced_words(names, family: str | None) -> str:
    return f"{len(names)} stored tensors have no place in a {family} model, e.g. {', '.join(list(names)[:3])}"


FAMILIES = tuple(TABLES)
_MODEL_TYPES = {t: f.name for f in TABLES.values() for t in f.model_types}
_ARCHITECTURES = {a: f.name for f in TABLES.values() for a in (f.architecture, *f.architectures)}


def _table(family: str) -> Family:
    try:
        return TABLES[family]
    except KeyError:
        raise UsageError(f"unknown model family {family!r}", hint=f"Use one of {', '.join(FAMILIES)}") from None


def family_of(spec: ModelSpec, named: str | None = None) -> str:
    """The HF family that can express ``spec``, or a UsageError naming what does not fit.

    ``named`` (``--model-family`` for an hf output) must be able to express it: the schema
    of the output is the model's, so a name that contradicts it is refused with the model's
    traits rather than written as a model that would not load (or would compute something
    else)."""
    if named is not None and named in TABLES and TABLES[named].expresses(spec) is None:
        return named
    fits = next((f.name for f in TABLES.values() if f.expresses(spec) is None), None)
    if fits is None:
        raise UsageError(
            f"no Hugging Face family fits this model (swiglu={spec.swiglu}, normalization="
            f"{spec.normalization}, learned positions={spec.learned_positions}, bias={spec.add_bias}, "
            f"tied={spec.tied_embeddings}, query groups={spec.groups}/{spec.num_attention_heads} heads"
            + "".join(f", {n.replace('_', ' ')}" for n, on in FEATURES.items()
                      if on(spec) and n in ("qkv_bias", "qk_layernorm", "window_size", "rope_scaling"))
            + ")",
            hint="Supported: " + "; ".join(f"{f.name} ({f.traits})" for f in TABLES.values()))
    if named is not None:
        raise UsageError(f"--model-family {named} does not fit the model: it has {TABLES[fits].traits}; "
                         f"it is {fits}, not {named}",
                         hint=f"Pass --model-family {fits}, or leave it out")
    return fits


def hf_tensors(spec: ModelSpec, family: str, vocab: int) -> list[HfTensor]:
    """Every tensor of the HF model, with the canonical regions it holds, in the model's
    ``named_parameters()`` order (the order a DeepSpeed engine flattens them in)."""
    return _table(family).tensors(spec, vocab)


def tied_aliases(spec: ModelSpec, family: str) -> dict[str, str]:
    """State-dict names the HF model ties to another parameter (safetensors stores the owner
    only): ``{alias: owner}``."""
    return _table(family).tied_aliases(spec)


# --------------------------------------------------------------------------- config.json


def spec_from_config(config: dict, family: str) -> ModelSpec:
    """The model an HF ``config.json`` describes."""
    try:
        return _table(family).spec(config)
    except (KeyError, TypeError, ValueError) as exc:
        what = f"lacks a {family} field" if isinstance(exc, KeyError) else f"is not a {family} model ckptool lays out"
        raise UnreadableInput(f"config.json {what} ({exc})") from None


def config_for(spec: ModelSpec, family: str, vocab: int, dtype: torch.dtype, base: dict | None) -> dict:
    """The ``config.json`` for ``spec``; fields of a carried source config are kept."""
    config = _table(family).config_json(spec, vocab, base)
    config["torch_dtype" if "dtype" not in config else "dtype"] = str(dtype).replace("torch.", "")
    return config


def family_of_config(config: dict, given: str | None, where: str) -> str:
    """The family a ``config.json`` describes (``given`` wins), or a UsageError naming what
    the config says."""
    family = given or known_family(config)
    if family is None:
        raise UsageError(
            f"cannot tell the model family: model_type={config.get('model_type')!r}, "
            f"architectures={config.get('architectures')}", path=where,
            hint=f"Pass --model-family ({', '.join(FAMILIES)}) if the schema is one of these")
    _table(family)
    return family


# --------------------------------------------------------------------------- config fidelity
#
# One rule for every HF config field, whatever the path (hf, deepspeed with HF names, an HF
# --model-config): the field is carried to the output, or it does not change what the weights
# compute, or the conversion is refused before anything is written. What each field is:
#
# * mapped: read into the ModelSpec, which every output carries (Megatron args, manifest...);
#   only the values the spec can express are accepted;
# * schema: the family's tensor table and config_for assume one value (no bias tensors, SiLU):
#   any other value is refused whatever the output, since even config.json would be rewritten;
# * default: changes the math unless it has its no-op value; an output that keeps config.json
#   fields as they are (KEEPS_CONFIG) carries any value;
# * neutral (_NEUTRAL): token ids, caching, dtype, dropout... never change what the model computes;
# * anything else is unknown: carried only by an output that keeps config.json as it is.

KEEPS_CONFIG = {"deepspeed": "whole", "hf": "unset"}
"""Outputs that keep the source's config.json fields. ``deepspeed`` writes the file itself
beside ``latest``; ``hf`` keeps every field :func:`config_for` does not set, when the source's
``model_type`` is the one it writes. Every other output carries the ModelSpec alone."""

_NEUTRAL = frozenset({
    "architectures", "model_type", "_name_or_path", "transformers_version", "torch_dtype",
    "dtype", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "initializer_factor", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "tokenizer_class", "task_specific_params", "prefix", "_attn_implementation",
    "attn_implementation", "chunk_size_feed_forward", "max_length", "min_length", "do_sample",
    "temperature", "top_k", "top_p", "num_beams", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "early_stopping", "num_return_sequences",
    # GPT-2: the sequence-summary head of GPT2DoubleHeadsModel (not a causal LM's); n_ctx is
    # unused by transformers; reorder_and_upcast_attn computes the same softmax in fp32
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "n_ctx", "reorder_and_upcast_attn",
    # Llama: pretraining_tp > 1 slices the same matmuls and sums them (the same math)
    "pretraining_tp",
})
"""Fields that never change what the weights compute (dropout probabilities too, by name)."""


def uncarried_field(config: dict, family: str, target: str) -> tuple[str, object, str] | None:
    """The first field of ``config`` (a ``family`` model's) that ``target`` output would lose
    although it changes what the model computes: ``(name, value, hint)``; None when nothing
    is lost. A field is mapped by a rule of the family's table (its problem, if the spec
    cannot express the value), neutral, or unknown (carried only where config.json is kept)."""
    table = _table(family)
    keeps = _keeps(config, table, target)
    given, config = config, table.complete(config)  # a field left out means what transformers takes
    problems = {p.field: p for p in (r.problem(config) for r in table.config) if p is not None}
    for name, value in config.items():
        if name in _NEUTRAL or name.endswith(("dropout", "_pdrop")):
            continue
        rule = table.rule_of(name)
        problem = problems.get(name)
        if rule is not None and problem is None:
            continue
        left_out = "" if name in given else f" (config.json leaves it out: transformers takes {_short(value)})"
        if problem is not None and problem.schema:
            return name, problem.value, (f"ckptool's {family} schema holds {name} only as "
                                         f"{problem.hint}, so no output can hold this model yet{left_out}")
        if keeps:
            continue
        keepers = [t for t in KEEPS_CONFIG if _keeps(config, table, t)]
        hint = f"ckptool maps {name} to {target} only as {problem.hint}{left_out}" if problem else \
            f"ckptool does not map it to {target}"
        if keepers:
            hint += f"; --to {' or --to '.join(sorted(keepers))} keeps it as it is"
        return name, problem.value if problem else value, hint
    return None


def _keeps(config: dict, table: Family, target: str) -> bool:
    how = KEEPS_CONFIG.get(target)
    return how == "whole" or (how == "unset" and
                              config.get("model_type", table.model_types[0]) == table.model_types[0])


def refuse_uncarried_config(index: CheckpointIndex, target: str) -> None:
    """Refuse (UsageError, exit 2) to write ``target`` output from a source whose HF config
    (the ``hf.config`` object an hf reader or a DeepSpeed HF-model view puts in the index) has
    a field the output would lose although it changes the math; see the rule above."""
    model = index.layout(HfModel)
    if model is not None and model.family is None and target != "hf":
        raise UsageError(f"ckptool has no family table for model_type "
                         f"{model.config.get('model_type')!r}, so it cannot lay the model out "
                         f"for {target} output (the converted model would compute differently)",
                         path=index.url, hint=f"--to hf writes it with its names and config.json "
                                              f"kept; tables exist for {', '.join(FAMILIES)}")
    if model is None or model.family is None or not isinstance(model.config, dict):
        return
    lost = uncarried_field(model.config, model.family, target)
    if lost is not None:
        name, value, hint = lost
        raise UsageError(f"config.json field {name}={_short(value)} is not carried to {target} "
                         "output by ckptool yet, so the converted model would compute differently",
                         path=index.url, hint=f"{hint}; nothing was written")
    if model.unplaced:  # after the fields: one the table reads otherwise (a bias flag) explains them
        raise UsageError(f"{model.unplaced_words()}: {target} output would drop them",
                         path=index.url, hint="transformers ignores them too when it loads the "
                         f"{_table(model.family).architecture}; remove them from the checkpoint to "
                         "convert it, or check --model-family; nothing was written")


def unknown_model(index: CheckpointIndex) -> UsageError:
    """The refusal of a source that does not say what model it holds, with what gives one."""
    hint = ("Pass --model-config CONFIG.json (the model's Hugging Face config) if it is an HF model"
            if index.format in MODEL_CONFIG_READERS else
            f"A {index.format} checkpoint cannot take --model-config; one the training hook saves "
            "records the model (AsyncCheckpointer(model_config=...)) and converts")
    return UsageError("the source does not say what model it holds", path=index.url, hint=hint)


MODEL_CONFIG_READERS = ("deepspeed", "deepspeed-universal")
"""Source formats whose reader takes ``--model-config`` (an HF config for its module)."""


def refuse_schema_field(config: dict, family: str, where: str) -> None:
    """Where a family's tensors are missing: refuse (exit 2) naming the config field the table
    assumes otherwise (Qwen2-MoE's ``decoder_sparse_step``, a bias flag), if one does: the
    tensors are then another model's, not a damaged checkpoint's."""
    lost = uncarried_field(config, family, "hf")
    if lost is not None:
        raise UsageError(f"config field {lost[0]}={_short(lost[1])} is not a {family} model ckptool "
                         "lays out", path=where, hint=lost[2])


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def named_view(index: CheckpointIndex, config: dict, family: str | None, where: str,
               prefixes: tuple[str, ...] = ("",), shared: Mapping[str, str] | None = None
               ) -> CheckpointIndex:
    """The canonical view of a checkpoint whose tensors carry a Hugging Face model's names
    (a DeepSpeed engine's module is often one), by the same table the hf reader uses.

    Every tensor must find its place: a model tensor the table lacks, or a table entry the
    checkpoint lacks, is a UsageError that lists what was found. A common prefix of the
    stored names (a wrapper's ``module.``) is allowed."""
    family = family_of_config(config, family, where)
    spec = spec_from_config(config, family)
    entries = hf_tensors(spec, family, spec.vocab_size)
    first = entries[0].name
    model = [k for k in index.tensors if not any(p and k.startswith(p) for p in prefixes)]
    prefix = min((k[:-len(first)] for k in model if k.endswith(first)), key=len, default="")
    if prefix:
        entries = [replace(e, name=prefix + e.name) for e in entries]
    view = remap(index, entries, prefixes)
    stray = unplaced_tensors([k for k in view.unused if k in model], spec, family)
    if view.missing:
        refuse_schema_field(config, family, where)
        found = ", ".join(sorted(index.tensors)[:3]) or "nothing"
        raise UsageError(f"the tensors are not a {family} model's ({len(view.missing)} of its "
                         f"tensors are missing, e.g. {view.missing[0]}; found e.g. {found})",
                         path=where, hint="Check --model-config / --model-family")
    if shared is not None:  # the module says which names alias another parameter
        untied = sorted(prefix + alias for alias in tied_aliases(spec, family)
                        if prefix + alias in view.unused and prefix + alias not in shared)
        if untied:
            raise UsageError(f"the model config ties {untied[0]} to its owner "
                             f"({tied_aliases(spec, family)[untied[0][len(prefix):]]}), but the "
                             "checkpoint trained it as a parameter of its own: tying would drop "
                             "its values", path=where,
                             hint="Give the config the model was trained with "
                                  "(tie_word_embeddings: false)")
    if stray:
        raise UsageError(unplaced_words(stray, family), path=where,
                         hint=f"Mapped families: {', '.join(FAMILIES)}")
    out = view.index
    out.model_config, out.true_vocab_size = asdict(spec), spec.vocab_size
    out.set_layout(HfModel(config, family))
    return out


_BUFFERS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Buffers older transformers saved beside the weights (RoPE's inverse frequencies, GPT-2's
causal mask), which every version recomputes: no weight is lost without them."""


def unplaced_tensors(unused: list[str], spec: ModelSpec, family: str) -> tuple[str, ...]:
    """Of the stored tensors a family's table did not place (``unused``), those that hold
    weights: not a recomputed buffer, nor the tied output layer a save kept beside its owner."""
    tied = tied_aliases(spec, family)
    return tuple(k for k in unused if k not in tied and not k.endswith(_BUFFERS))


def known_family(config: dict) -> str | None:
    """The family of a ``config.json`` when ckptool has its table, else None."""
    return _MODEL_TYPES.get(str(config.get("model_type"))) or \
        next((_ARCHITECTURES[a] for a in config.get("architectures") or () if a in _ARCHITECTURES), None)


def stored_view(index: CheckpointIndex, config: dict, aliases: dict[str, str]) -> CheckpointIndex:
    """A checkpoint whose tensors are a Hugging Face model of an architecture without a
    table (a DeepSpeed engine's module): its tensors under their own names, the config as it
    is. Only the hf output writes it (names and config.json kept, as zero_to_fp32 does);
    nothing that needs the canonical layout (Megatron, TP/PP) can."""
    out = index.copy()
    out.set_layout(HfModel(config, None, dict(aliases)))
    return out


__all__ = ["CONFIG", "HfModel", "FAMILIES", "KEEPS_CONFIG", "hf_tensors", "family_of",
           "tied_aliases", "spec_from_config", "config_for", "family_of_config", "named_view",
           "known_family", "stored_view",
           "uncarried_field", "refuse_uncarried_config", "unplaced_tensors", "refuse_schema_field",
           "unknown_model"]
