"""Hugging Face output for an architecture ckptool has no family table for: a DeepSpeed
engine whose module is such a model (the HF Trainer's run of a Phi-3, a Gemma...). Its
tensors keep their names and its ``config.json`` is kept as it is, so the output is
DeepSpeed's own ``zero_to_fp32`` (the fp32 masters where the source has them), in
safetensors, with no table needed. A layout change (Megatron, TP/PP) needs the table."""

from __future__ import annotations

from ckptool.core.errors import UsageError
from ckptool.core.index import CheckpointIndex
from ckptool.core.layout import ModelSpec
from ckptool.core.optimizer import OPTIMIZER_PREFIX
from ckptool.core.regions import Region
from ckptool.core.topology import Topology
from ckptool.core.view import Entry as HfTensor
from converters.hf.format import HfWriter
from converters.schemas.hf import HfModel


class StoredNamesWriter(HfWriter):
    """The ``hf`` writer for a source recorded as an HF model without a table
    (:func:`converters.schemas.hf.stored_view`)."""

    @classmethod
    def serves(cls, index: CheckpointIndex) -> bool:
        model = index.layout(HfModel)
        return model is not None and model.family is None

    def target_spec(self, index: CheckpointIndex, source: Topology, target: Topology,
                    true_vocab_size: int | None) -> None:
        if true_vocab_size:
            raise self._refusal(index, "--true-vocab-size")
        if self.model_family:
            raise self._refusal(index, "--model-family")
        return None

    def _refusal(self, index, flag: str) -> UsageError:
        return UsageError(f"{flag} does not apply: the model's tensors and config.json are written "
                          "as they are", path=index.url, hint=f"Drop {flag}")

    def model_tensors(self, index: CheckpointIndex, spec: ModelSpec | None) -> list[HfTensor]:
        return [HfTensor(key, info.shape, ((0, Region.whole(key, info.shape)),))
                for key, info in index.tensors.items() if not key.startswith(OPTIMIZER_PREFIX)]

    def config_json(self) -> dict:
        config = dict(self._config or {})
        config["torch_dtype" if "dtype" not in config else "dtype"] = str(self._dtype).replace("torch.", "")
        return config

    def notes(self, index: CheckpointIndex) -> list[str]:
        model_type = (index.layout(HfModel).config or {}).get("model_type")
        return [f"ckptool has no table for model_type {model_type!r}: the tensors keep the source's "
                "names and config.json is kept as it is (what DeepSpeed's zero_to_fp32 gives, in "
                "safetensors); converting it to Megatron or another layout needs a family table"]


__all__ = ["StoredNamesWriter"]
