"""The parallel layout of a job: TP x PP x DP (x EP), virtual pipeline and ZeRO stage."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ckptool.core.errors import TopologyError


MAX_RANKS = 1 << 20
"""A million ranks: beyond any job, and a bound on what a plan sized by a topology a
checkpoint records (untrusted) may allocate."""


@dataclass(frozen=True, slots=True)
class Topology:
    """How a job is split. ``world = tp * pp * dp`` ("Total GPUs = TP x PP x DP").

    Expert parallelism (``ep``) re-divides the ranks of each pipeline stage for the expert
    layers: ``tp * dp = etp * ep * expert-dp`` (Megatron-Core's rule), so it does not
    multiply the world size. Expert tensor parallelism (``etp``) defaults to ``tp``; then
    ``ep`` must divide ``dp``.
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
    etp: int | None = None
    """Expert tensor-parallel size (Megatron ``expert_tensor_parallel_size``); None: ``tp``."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"Topology.{name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise TopologyError(f"Topology.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or isinstance(self.etp, bool)
                                     or self.etp < 1):
            raise TopologyError(f"Topology.etp must be a positive integer, got {self.etp!r}")
        if self.etp == self.tp:  # the default, spelt out (a manifest, args): it follows the TP
            object.__setattr__(self, "etp", None)  # on a TP change, as Megatron's default does
        if self.etp is None and self.dp % self.ep:
            raise TopologyError(f"expert parallel size ep={self.ep} must divide dp={self.dp}")
        if (self.tp * self.dp) % (self.expert_tp * self.ep):
            raise TopologyError(f"expert parallel ep={self.ep} x expert tensor parallel etp="
                                f"{self.expert_tp} must divide tp x dp = {self.tp * self.dp} "
                                "(Megatron-Core's expert-data-parallel rule)")
        if self.world * self.vpp > MAX_RANKS or self.ep > MAX_RANKS or self.expert_tp > MAX_RANKS:
            raise TopologyError(f"{self} is beyond any job (at most {MAX_RANKS} ranks)")
        if self.vpp > 1 and self.pp == 1:
            raise TopologyError("virtual pipeline (vpp > 1) needs pp > 1")

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size: ``etp``, or ``tp``."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: ``tp * dp / (etp * ep)``."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def mp(self) -> int:
        """Model-parallel size: the number of distinct model shards (tp * pp)."""
        return self.tp * self.pp

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["etp"] is None:  # the default (= tp): absent, as before ETP existed
            del out["etp"]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        known = {k: None if v is None else int(v) for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def __str__(self) -> str:
        text = f"TP{self.tp}/PP{self.pp}/DP{self.dp}"
        if self.ep > 1:
            text += f"/EP{self.ep}"
        if self.etp is not None and self.etp != self.tp:
            text += f"/ETP{self.etp}"
        if self.vpp > 1:
            text += f"/VPP{self.vpp}"
        if self.zero:
            text += f"/ZeRO-{self.zero}"
        return text
