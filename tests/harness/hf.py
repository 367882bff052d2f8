"""Hugging Face checkpoints as transformers reads them: :func:`load_hf` loads one strictly
(no weight missing from the files, none in them left unused); :func:`hf_logits` is a
model's forward on :func:`tests.harness.mcore.tokens`, the batch the Megatron harness
feeds its own models.

Import this module after ``tests.conftest.peer("transformers")``: it imports transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.harness.mcore import tokens


def load_hf(path: Path | str, cls=None, **from_pretrained):
    """``cls.from_pretrained(path, **from_pretrained)`` in eval mode (``cls``:
    ``AutoModelForCausalLM`` unless given), after checking that the files held every
    weight the model has and no other."""
    cls = cls or transformers.AutoModelForCausalLM
    model, info = cls.from_pretrained(path, output_loading_info=True, **from_pretrained)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def hf_logits(model, vocab: int) -> torch.Tensor:
    """``model``'s logits on ``tokens(vocab)``, without gradients."""
    with torch.no_grad():
        return model(tokens(vocab)).logits
