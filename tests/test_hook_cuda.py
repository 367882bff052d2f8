"""AsyncCheckpointer with GPU state: pinned staging, the snapshot is the values at save().

Skipped without a CUDA device (CI has none); run on a GPU machine with
``python -m pytest tests/test_hook_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _values(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(step)
    return {"w": torch.randn(4096, 4096, device="cuda", generator=g),
            "h": torch.randn(1031, 77, device="cuda", generator=g).bfloat16(),
            "b": torch.randn(4096, device="cuda", generator=g)}


def _busy_gpu(ms: float) -> None:
    """Queue about ``ms`` of work on the current stream (an optimizer step still running)."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    end.synchronize()
    for _ in range(max(1, int(ms / max(start.elapsed_time(end), 1e-3)))):
        a = a @ a
        a /= a.norm()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_gpu_state_is_snapshotted_when_save_returns(tmp_path, writer):
    import torch.distributed.checkpoint as dcp

    from ckptool.checkpoints.verify import verify
    from training import AsyncCheckpointer

    state = {"model": {k: torch.zeros_like(v) for k, v in _values(0).items()}, "step": 0}
    ckpt = AsyncCheckpointer(str(tmp_path / "run"), keep_last=None, writer=writer)
    expect = {}
    try:
        for step in (1, 2):
            # The step that produces these values is still queued on the GPU when save() is
            # called; save() must hold exactly them, not what the staging buffer had before.
            _busy_gpu(200)
            new = _values(step)
            for k, t in state["model"].items():
                t.copy_(new[k])
            state["step"] = step
            ckpt.save(step, state)
            expect[step] = {k: v.cpu() for k, v in new.items()}
            for t in state["model"].values():  # the next step updates in place at once
                t.mul_(-3.0)
        ckpt.wait()
        assert all(b.is_pinned() for b in ckpt._buffers.values()), "staging is not page-locked"
    finally:
        ckpt.close()

    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
    assert AsyncCheckpointer(str(tmp_path / "run")).load_latest(fresh) == 2
    for k, v in expect[2].items():
        assert torch.equal(fresh["model"][k].cpu(), v), k
    assert fresh["step"] == 2

    first = sorted((tmp_path / "run").glob("step_*"))[0]
    plain = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
    dcp.load(plain, checkpoint_id=str(first))  # plain DCP, onto the GPU
    for k, v in expect[1].items():
        assert plain["model"][k].is_cuda and torch.equal(plain["model"][k].cpu(), v), k
    assert verify(str(first), deep=True).ok
