"""DeepSpeed output for a Hugging Face model: the engine a model becomes (``convert HF DST
--to deepspeed``), with only its module, or with ``--init-optimizer`` a fresh ZeRO
optimizer state (fp32 masters equal to the weights, zero moments, step 0) in the HF
Trainer's param groups. The files are the engine writer's
(:class:`~converters.deepspeed.engine.DeepSpeedWriter`); what differs is where the
engine's structure comes from: the model's config and ``named_parameters()`` order
instead of a source engine.
"""

from __future__ import annotations

import json

from ckptool.core.errors import TopologyError, UsageError
from ckptool.core.index import CheckpointIndex
from ckptool.core.lazy import lazy
from ckptool.core.optimizer import FreshState, decay_groups
from ckptool.core.topology import Topology
from converters.deepspeed.engine import DeepSpeedWriter, _loss_scaler
from converters.deepspeed.zero import Layout
from converters.schemas.hf import HfModel, spec_from_config, tied_aliases

torch = lazy("torch", globals())


class HfModelWriter(DeepSpeedWriter):
    """The ``deepspeed`` writer for a source that is a model alone under a Hugging Face
    model's names (an hf checkpoint's native view): no engine layout, a config.json. It
    becomes a fresh engine's module, and the config goes beside ``latest``."""

    @classmethod
    def serves(cls, index: CheckpointIndex) -> bool:
        model = index.layout(HfModel)
        return index.layout(Layout) is None and model is not None and model.family is not None

    def engine_layout(self, index: CheckpointIndex, source: Topology, target: Topology) -> Layout:
        if (index.model_config or {}).get("num_experts"):
            raise UsageError("a Mixture-of-Experts model is not written as a DeepSpeed engine yet: "
                             "transformers holds its experts fused (mlp.experts.gate_up_proj), not "
                             "under the names its files have", path=index.url,
                             hint="Convert to megatron or dcp")
        return _hf_layout(index, target, self.param_groups or "decay")

    def config_json(self) -> bytes | None:
        return json.dumps(self._config, indent=2).encode()

    def bind(self, opened) -> None:
        super().bind(opened)
        self._config = opened.index.layout(HfModel).config

    def notes(self, index: CheckpointIndex) -> list[str]:
        if index.layout(FreshState) is None:
            return ["model weights only (no optimizer state was asked for): load with "
                    "engine.load_checkpoint(DST, load_module_only=True) into a ZeRO-0/1/2 engine "
                    "at any DP size; --init-optimizer --zero S --dp N writes ZeRO files (ZeRO-3 "
                    "needs them)"]
        groups = "one param group" if self.param_groups == "single" else \
            "two param groups (decay; no decay for biases and 1-D parameters)"
        return [f"fresh optimizer state (fp32 masters = the weights, zero Adam moments, step 0) "
                f"in {groups}, in the model's parameter order: load with engine.load_checkpoint("
                "DST, load_optimizer_states=False, load_lr_scheduler_states=False) (ZeRO-3 reads "
                "the masters from these files; ZeRO-1/2 rebuild the same ones from the module). "
                "With load_optimizer_states=True the files' param groups replace your optimizer's "
                "and carry no hyperparameters: put yours back before the first step. ZeRO-1/2 "
                "engines with round_robin_gradients (their flat order depends on DP) should load "
                "the module alone (load_module_only=True)"]



FRESH_DS_VERSION = "0.16.0"
"""``ds_version`` of files written for an hf source: any version from 0.3.17 (ZeRO-1's
layout change) reads the layout written here; DeepSpeed refuses an empty one."""


def _hf_layout(index: CheckpointIndex, target: Topology, param_groups: str) -> Layout:
    """The structure of the engine a Hugging Face model becomes: its parameters in
    ``named_parameters()`` order (the hf reader's native index), tied aliases sharing their
    owner's tensor, no buffers, in ``param_groups`` (``decay``: Megatron's and the HF
    Trainer's split, weight decay off for biases and 1-D parameters; ``single``)."""
    for axis in ("tp", "pp", "ep", "vpp"):
        if getattr(target, axis) != 1:
            raise TopologyError(f"DeepSpeed output with {axis.upper()}{getattr(target, axis)} is not "
                                "supported from a Hugging Face model", hint="Keep --tp 1 --pp 1")
    fresh = index.layout(FreshState) is not None
    if target.zero and not fresh:
        raise UsageError(f"a ZeRO-{target.zero} DeepSpeed checkpoint holds optimizer state, and a "
                         "Hugging Face model has none", path=index.url,
                         hint="Pass --init-optimizer for a fresh state, or leave out --zero: the "
                              "model states alone load with load_checkpoint(..., load_module_only=True)")
    if fresh and not target.zero:
        raise UsageError("--init-optimizer writes ZeRO optimizer files: give --zero 1, 2 or 3",
                         path=index.url)
    model = index.layout(HfModel)
    family = model.family
    spec = spec_from_config(model.config, family)
    params = [(k, tuple(t.shape), t.dtype) for k, t in index.tensors.items()
              if not k.startswith("optimizer.")]
    aliases = tied_aliases(spec, family)
    owners = {name: (shape, dtype) for name, shape, dtype in params}
    module = params + [(alias, *owners[owner]) for alias, owner in aliases.items()]
    if param_groups == "single":
        groups = [[(n, s) for n, s, _ in params]]
    else:
        groups = [g for g in decay_groups([(n, len(s)) for n, s, _ in params]) if g]
        groups = [[(n, owners[n][0]) for n in g] for g in groups]
    dtypes = {d for _, _, d in params}
    if fresh and torch.float16 in dtypes:
        # ZeRO files carry the loss scaler, and DeepSpeed's loader puts theirs in place of the
        # engine's: a fresh state has none to give, and a static scale of 1 would end the
        # fp16 engine's loss scaling
        raise UsageError("a fresh ZeRO state for fp16 weights would replace the fp16 engine's "
                         "dynamic loss scaler with a static scale of 1", path=index.url,
                         hint="Leave out --zero/--init-optimizer: the model states alone load "
                              "with load_checkpoint(..., load_module_only=True) and keep the "
                              "engine's scaler")
    bf16 = dtypes == {torch.bfloat16}
    return Layout(
        tag="global_step0", stage=target.zero, bf16_files=bf16, bf16_optimizer=False,
        groups=groups, frozen=[], shared=aliases, module=module,
        model_states=dict(buffer_names=[], optimizer=None, lr_scheduler=None, data_sampler=None,
                          random_ltd=None, skipped_steps=0, global_steps=0, global_samples=0,
                          mp_world_size=1, ds_version=FRESH_DS_VERSION),
        optim_file={"ds_version": FRESH_DS_VERSION},
        osd={"loss_scaler": _loss_scaler(), "dynamic_loss_scale": False, "overflow": False,
             "zero_stage": target.zero, "ds_version": FRESH_DS_VERSION},
        hyper=[{} for _ in groups], steps=[torch.tensor(0.0) for _ in groups])
