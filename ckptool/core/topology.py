"""The parallel layout of a job: TP x PP x DP (x EP), virtual pipeline and ZeRO stage."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ckptool.core.errors import TopologyError


@dataclass(frozen=True, slots=True)
class Topology:
    """How a job is split. ``world = tp * pp * dp`` ("Total GPUs = TP x PP x DP").

    Expert parallelism (``ep``) subdivides the data-parallel ranks for expert layers, so it
    does not multiply the world size; it must divide ``dp``.
    """

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (number of stages)."""
    dp: int = 1
    """Data-parallel size."""
    ep: int = 1
    """Expert-parallel size; divides dp."""
    vpp: int = 1
    """Virtual pipeline chunks per stage (Megatron interleaved schedule)."""
    zero: int = 0
    """ZeRO stage 0-3 on the DP axis (0: plain DP or Megatron distributed optimizer off)."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"Topology.{name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise TopologyError(f"Topology.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.dp % self.ep:
            raise TopologyError(f"expert parallel size ep={self.ep} must divide dp={self.dp}")
        if self.vpp > 1 and self.pp == 1:
            raise TopologyError("virtual pipeline (vpp > 1) needs pp > 1")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def mp(self) -> int:
        """Model-parallel size: the number of distinct model shards (tp * pp)."""
        return self.tp * self.pp

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        known = {k: int(v) for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def __str__(self) -> str:
        text = f"TP{self.tp}/PP{self.pp}/DP{self.dp}"
        if self.ep > 1:
            text += f"/EP{self.ep}"
        if self.vpp > 1:
            text += f"/VPP{self.vpp}"
        if self.zero:
            text += f"/ZeRO-{self.zero}"
        return text
