"""Config rules that several families share: the Llama-style sizes, RoPE (theta and
scaling), the sliding window, tied embeddings. Each is written once here and listed in
the families' tables."""

from __future__ import annotations

from converters.schemas.families.base import Feature, Fixed, Mapped, Problem, Rule

# --------------------------------------------------------------------------- sizes

VOCAB = Feature(("vocab_size",), lambda c: {"vocab_size": int(c["vocab_size"])},
                lambda s, v, b: {"vocab_size": v})
"""The true vocabulary (the embedding's rows as written)."""


def llama_sizes(head_dim: bool | int = True, norm_eps: str = "rms_norm_eps") -> tuple[Rule, ...]:
    """The sizes every Llama-style config names the same way. ``head_dim``: the family reads
    the field (an int: its default when absent, as Gemma's 256; True:
    hidden / heads), or not at all (False: OLMo 2 derives hidden / heads)."""
    default = head_dim if head_dim is not True and head_dim is not False else None
    dim = Feature(("head_dim",), lambda c: _read_head_dim(c, default),
                  lambda s, v, b: {"head_dim": s.head_dim}) if head_dim is not False \
        else Feature((), lambda c: {}, lambda s, v, b: {})
    return (
        Mapped("num_hidden_layers", "num_layers"),
        Mapped("hidden_size", "hidden_size"),
        Mapped("num_attention_heads", "num_attention_heads"),
        Feature(("num_key_value_heads",), _read_groups, _write_groups),
        VOCAB,
        Mapped("intermediate_size", "ffn_hidden_size"),
        dim,
        Feature(("max_position_embeddings",),
                lambda c: {"max_position_embeddings": int(c.get("max_position_embeddings") or 0)},
                lambda s, v, b: {"max_position_embeddings": s.max_position_embeddings or
                                 b.get("max_position_embeddings", 4096)}),
        Mapped(norm_eps, "norm_epsilon", float, default=1e-6),
    )


def _read_groups(config: dict) -> dict:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    return {"num_query_groups": kv if kv != heads else None}


def _write_groups(spec, vocab, base) -> dict:
    return {"num_key_value_heads": spec.groups}


def _read_head_dim(config: dict, default: int | None = None) -> dict:
    return {"kv_channels": int(config.get("head_dim") or default or
                               int(config["hidden_size"]) // int(config["num_attention_heads"]))}


def tie(default: bool) -> Rule:
    """``tie_word_embeddings`` (absent: the family's config class default)."""
    return Feature(("tie_word_embeddings",),
                   lambda c: {"tied_embeddings": bool(c.get("tie_word_embeddings", default))},
                   lambda s, v, b: {"tie_word_embeddings": s.tied_embeddings})


def fixed_false(*names: str) -> tuple[Rule, ...]:
    """Fields the family's table holds only as false (bias flags: true means tensors the
    table lacks)."""
    return tuple(Fixed(n, (False, None)) for n in names)



# --------------------------------------------------------------------------- RoPE

_SCALING_FIELDS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor",
                              "original_max_position_embeddings"),
                   "linear": ("factor",)}
_PLAIN = "the default type with rope_theta, or llama3 or linear scaling"


def _rope_params(config: dict) -> tuple[str | None, dict]:
    """(the field that holds RoPE's parameters, its value as a dict). transformers 5 reads
    an older file's ``rope_scaling`` over ``rope_parameters`` when both are there."""
    for name in ("rope_scaling", "rope_parameters"):
        value = config.get(name)
        if isinstance(value, dict):
            return name, value
    return None, {}


def _rope_type(params: dict):
    return params.get("rope_type", params.get("type"))


def _read_rope(config: dict) -> dict:
    _, params = _rope_params(config)
    # transformers 5 takes rope_scaling whole when it is set: its theta, else the top-level
    # rope_theta, else the class's (the family's ``absent``); never rope_parameters' beside it
    theta = params.get("rope_theta") or config.get("rope_theta") or 10000.0
    out = {"rotary_base": float(theta)}
    kind = _rope_type(params)
    if kind == "llama3" and not _rope_problem(config):
        out.update(rope_scaling="llama3", rope_scaling_factor=float(params["factor"]),
                   rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_positions=int(params["original_max_position_embeddings"]))
    elif kind == "linear" and not _rope_problem(config):
        out.update(rope_scaling="linear", rope_scaling_factor=float(params["factor"]))
    return out


def _rope_problem(config: dict) -> Problem | None:
    name, params = _rope_params(config)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        field = "partial_rotary_factor" if "partial_rotary_factor" in config else name
        return Problem(field, partial if field == "partial_rotary_factor" else params, "1.0 (full rotary)")
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            return Problem(key, value, _PLAIN)
    if name is None:
        return None
    kind = _rope_type(params)
    if kind in (None, "default"):
        extra = [k for k in params if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")]
        return Problem(name, params, _PLAIN) if extra else None
    need = _SCALING_FIELDS.get(kind) if isinstance(kind, str) else None
    allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *(need or ())}
    if need is None or any(k not in params for k in need) or set(params) - allowed:
        return Problem(name, params, _PLAIN)
    positions = params.get("original_max_position_embeddings")
    if positions is not None and type(positions) is not int:  # read as int, it would be another model
        return Problem(name, params, _PLAIN)
    return None


def _write_rope(spec, vocab, base: dict) -> dict:
    params = {"rope_type": spec.rope_scaling or "default", "rope_theta": spec.rotary_base}
    if spec.rope_scaling == "llama3":
        params.update(factor=spec.rope_scaling_factor, low_freq_factor=spec.rope_low_freq_factor,
                      high_freq_factor=spec.rope_high_freq_factor,
                      original_max_position_embeddings=spec.rope_original_max_positions)
    elif spec.rope_scaling == "linear":
        params.update(factor=spec.rope_scaling_factor)
    # Both spellings, the same content: transformers 5 reads rope_parameters (rope_scaling
    # first when it is set), transformers 4 reads rope_theta and rope_scaling only.
    return {"rope_parameters": params, "rope_theta": spec.rotary_base,
            "rope_scaling": None if spec.rope_scaling is None else
            {k: v for k, v in params.items() if k != "rope_theta"}}


ROPE = Feature(("rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor"),
               _read_rope, _write_rope, _rope_problem)
"""RoPE: theta, and the scaling ckptool carries (``llama3``, ``linear``)."""

# --------------------------------------------------------------------------- windows

_WINDOW_FIELDS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")


QWEN_WINDOWS = ("qwen2", "qwen2_moe", "qwen3_moe")
"""How transformers reads a Qwen config's window (its ``use_sliding_window``, default False,
gates the window everywhere): ``qwen2`` (Qwen2, Qwen3): without ``layer_types``, layers
``i >= max_window_layers``; ``qwen2_moe``: the even layers ``i < max_window_layers``;
``qwen3_moe``: every layer (``max_window_layers`` and ``layer_types`` unused)."""


def _window(config: dict, pattern: bool = False, qwen: str | None = None,
            layer_types: bool = True) -> tuple[int | None, Problem | None]:
    """The window every layer uses (None: full attention), or what is not one window
    (``pattern``: a per-layer pattern is read by :func:`_pattern` instead). ``qwen``: the
    family's reading of :data:`QWEN_WINDOWS` (only Qwen's classes read ``use_sliding_window``);
    ``layer_types``: whether the family's transformers class reads that field (Phi-3's and
    Mixtral's ignore it, and keep the window on every layer)."""
    window = config.get("sliding_window")
    if qwen and not config.get("use_sliding_window"):
        window = None  # a Qwen config without use_sliding_window: transformers' default, False
    if window is not None and (type(window) is not int or window < 1):
        return None, Problem("sliding_window", window, "a positive integer or null")
    types = config.get("layer_types") if layer_types else None
    if types is not None and not isinstance(types, list):
        return None, Problem("layer_types", types, "a list")
    if isinstance(types, list) and types and qwen != "qwen3_moe":
        kinds = set(types)
        if kinds == {"full_attention"} or qwen and window is None:
            return None, None  # Qwen's sliding layers without use_sliding_window attend to all
        if kinds <= {"sliding_attention", "full_attention"} and isinstance(window, int) and \
                (pattern or kinds == {"sliding_attention"}):
            return window, None
        return None, Problem("layer_types", types, "one kind of attention on every layer")
    if window is None or qwen not in ("qwen2", "qwen2_moe"):
        return window, None
    layers, below = int(config.get("num_hidden_layers") or 0), int(config.get("max_window_layers") or 0)
    # how many layers have the window (counted, not listed: the sizes are untrusted)
    windowed = max(0, layers - max(below, 0)) if qwen == "qwen2" else (min(below, layers) + 1) // 2
    if windowed <= 0:
        return None, None
    if windowed == layers:
        return window, None
    return None, Problem("max_window_layers", config.get("max_window_layers"),
                         "a window on every layer or on none with use_sliding_window (it sets "
                         f"{'the layers from it on' if qwen == 'qwen2' else 'the even layers below it'})")


def window(written: tuple[str, ...] = ("sliding_window",), qwen: str | None = None,
           layer_types: bool = True) -> Rule:
    """The sliding window: one per model, on every layer (per-layer patterns are refused).
    ``qwen``: the Qwen spelling (``use_sliding_window``, ``max_window_layers``), read as that
    family's transformers class reads it (:data:`QWEN_WINDOWS`). ``layer_types``: False for a
    class that ignores that field (as it ignores ``use_sliding_window``)."""
    assert qwen in (None, *QWEN_WINDOWS), qwen

    def write(spec, vocab, base):
        if qwen:
            return {"use_sliding_window": spec.window_size is not None,
                    "sliding_window": spec.window_size, "max_window_layers": 0,
                    "layer_types": ["sliding_attention" if spec.window_size else "full_attention"]
                    * spec.num_layers}
        out = {"sliding_window": spec.window_size}
        if "layer_types" in base:
            out["layer_types"] = ["sliding_attention" if spec.window_size else "full_attention"] \
                * spec.num_layers
        return out

    def read(config: dict) -> tuple[int | None, Problem | None]:
        return _window(config, qwen=qwen, layer_types=layer_types)

    return Feature(_WINDOW_FIELDS, lambda c: {"window_size": read(c)[0]}, write, lambda c: read(c)[1])


def _pattern(config: dict) -> str | None:
    """Gemma 2/3's per-layer pattern (``S`` sliding, ``F`` full), None when every layer
    is the same."""
    types = config.get("layer_types")
    if not isinstance(types, list) or len(set(types)) < 2:
        return None
    return "".join("S" if t == "sliding_attention" else "F" for t in types)


def _pattern_problem(config: dict) -> Problem | None:
    if not isinstance(config.get("layer_types"), list):
        return Problem("sliding_window", config.get("sliding_window"),
                       "a pattern given as layer_types (what transformers 5 writes)")
    return _window(config, pattern=True)[1]


def _write_pattern(spec, vocab, base) -> dict:
    kinds = spec.layer_windows or ("S" if spec.window_size else "F") * spec.num_layers
    out = {"sliding_window": spec.window_size or base.get("sliding_window"),
           "layer_types": ["sliding_attention" if k == "S" else "full_attention" for k in kinds]}
    return out


WINDOW_PATTERN = Feature(("sliding_window", "layer_types", "sliding_window_pattern",
                          "_sliding_window_pattern"),
                         lambda c: {"window_size": _window(c, pattern=True)[0], "layer_windows": _pattern(c)},
                         _write_pattern, _pattern_problem)
"""Gemma 2/3: the window on the layers ``layer_types`` names (``*sliding_window_pattern`` is
what transformers derived ``layer_types`` from: the list is what it runs)."""


NO_WINDOW = Feature(_WINDOW_FIELDS, lambda c: {}, lambda s, v, b: {},
                    lambda c: _window(c)[1] or (Problem("sliding_window", c["sliding_window"], "null")
                                                if _window(c)[0] is not None else None))
"""For a family whose table has no window: any window is a problem (carried only where the
config is kept as it is)."""


def activation(name: str, *values: str) -> Rule:
    return Fixed(name, values)
