"""The ranks of one rewrite under ``torchrun`` (a single rank without it): target files
are dealt round-robin, rank 0 creates the output and commits once every rank has finished,
over gloo on CPU."""

from __future__ import annotations

import os

from ckptool.core.errors import CkptoolError
from ckptool.core.manifest import FileEntry
from ckptool.core.storage import Store


class Group:
    """The ranks of a ``torchrun ... -m ckptool reshard`` job (one rank without torchrun).

    Target files are dealt round-robin; rank 0 creates the output, and commits once every
    rank has finished. Coordination is over gloo on CPU.
    """

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @classmethod
    def from_env(cls) -> "Group":
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
            return cls()
        import torch.distributed as dist  # lazy: only under torchrun

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    def _broadcast(self, value):
        import torch.distributed as dist  # lazy: only under torchrun

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_rank0(self, make):
        """``make()`` on rank 0; its result (or its error) on every rank."""
        if self.world == 1:
            return make()
        value = error = None
        if self.rank == 0:
            try:
                value = make()
            except CkptoolError as exc:
                error = exc
        error = self._broadcast(error)
        if error is not None:
            raise error
        url = self._broadcast(value.store.url if self.rank == 0 else None)
        return value if self.rank == 0 else Remote(url)

    def gather_entries(self, written, error: BaseException | None = None):
        """Every rank's finished entries (and how many were kept from an earlier run);
        raises on every rank if any rank failed."""
        if self.world == 1:
            if error is not None:
                raise error
            return [e for e, _ in written], sum(1 for _, kept in written if kept)
        import torch.distributed as dist  # lazy: only under torchrun

        mine = None if error is not None else \
            ([(e.path, e.size, e.xxh3_128) for e, _ in written], sum(1 for _, kept in written if kept))
        out = [None] * self.world
        dist.all_gather_object(out, mine)
        if error is not None:
            raise error
        failed = [r for r, o in enumerate(out) if o is None]
        if failed:
            raise OSError(f"reshard failed on rank(s) {failed}; their errors are in their logs")
        return [FileEntry(*e) for part, _ in out for e in part], sum(n for _, n in out)

    def first_problem(self, problem: str | None) -> str | None:
        """The first rank's problem (a string, or None where it found none), on every rank."""
        if self.world == 1:
            return problem
        import torch.distributed as dist  # lazy: only under torchrun

        out = [None] * self.world
        dist.all_gather_object(out, problem)
        return next((p for p in out if p is not None), None)

    def gather_records(self, writer) -> None:
        """Rank 0's writer absorbs the per-file records of the files other ranks wrote."""
        if self.world == 1:
            return
        import torch.distributed as dist  # lazy: only under torchrun

        out = [None] * self.world
        dist.all_gather_object(out, writer.records())
        if self.rank == 0:
            for records in out[1:]:
                writer.absorb(records)

    def close(self) -> None:
        """Tear the process group down after the last collective, every rank together (gloo
        aborts a process at exit otherwise, "terminate called without an active exception":
        seen once in CI when one rank tore down while the other still used the connection)."""
        if self.world > 1:
            import torch.distributed as dist  # lazy: only under torchrun

            if dist.is_initialized():
                try:
                    dist.barrier()
                finally:
                    dist.destroy_process_group()

    def commit_done(self, error: str | None = None):
        if self.world > 1:
            self._broadcast(error or "committed")

    def wait_commit(self):
        status = self._broadcast(None)
        if status != "committed":
            raise OSError(status)


class Remote:
    """What ranks other than 0 know of the output: where to write."""

    def __init__(self, url: str):
        self.store = Store.open(url)
