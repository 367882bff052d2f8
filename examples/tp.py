"""Megatron's tensor-parallel primitives over one ``torch.distributed`` group (gloo on CPU),
shared by the examples: a column-parallel linear copies its input to the TP ranks (its
gradient is summed over them), a row-parallel one sums its partial outputs, and the output
layer gathers the vocabulary shards of the logits.

:func:`use` sets this process's TP group once the groups exist; with a TP size of 1 every
primitive is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _TP:
    group: object = None
    rank: int = 0
    size: int = 1


TP = _TP()


def use(group, rank: int, size: int) -> None:
    """This process's tensor-parallel group, its rank in it and the group's size."""
    TP.group, TP.rank, TP.size = group, rank, size


def tp_sum(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    if TP.size > 1:
        x = x.clone()
        dist.all_reduce(x, group=TP.group)
    return x


class CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over TP backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return tp_sum(grad)


class ReduceFromTP(torch.autograd.Function):
    """All-reduce over TP forward; identity backward."""

    @staticmethod
    def forward(ctx, x):
        return tp_sum(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class GatherFromTP(torch.autograd.Function):
    """All-gather of the last dimension forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        if TP.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(TP.size)]
        dist.all_gather(parts, x.contiguous(), group=TP.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        if TP.size == 1:
            return grad
        return grad.chunk(TP.size, dim=-1)[TP.rank].contiguous()
