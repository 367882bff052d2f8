"""A tiny language model trained on CPU with ckptool checkpoints, killed and resumed.

    python examples/quickstart.py --root RUN --steps 30 --save-every 10
    python examples/quickstart.py --root RUN --steps 40 --resume
    python examples/quickstart.py --root NEW --steps 40 --resume-from RUN

Each save is a committed DCP checkpoint (``ckptool.json`` written last, then an atomic
rename). ``--resume`` asks ``ckptool.latest`` for the newest checkpoint that verifies, so a
corrupt or half-written newer one is skipped. Batches are a function of the step, so a
resumed run sees the same data as an uninterrupted one and prints the same losses.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckptool  # noqa: E402
from converters import dcp as ckpt_dcp  # noqa: E402

VOCAB, DIM, SEQ, BATCH = 97, 32, 16, 8
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.mlp(h)))


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ + 1) * 3) % VOCAB  # a learnable pattern


def state_of(model, optim, step):
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="run root holding step_XXXXXX checkpoints")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--resume", action="store_true", help="resume from the newest valid checkpoint in --root")
    ap.add_argument("--resume-from", metavar="ROOT", help="resume from the newest valid checkpoint in ROOT")
    args = ap.parse_args(argv)
    resume_root = args.resume_from or (args.root if args.resume else None)

    torch.manual_seed(0)
    model = TinyLM()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    if resume_root:
        found = ckptool.latest(resume_root)
        for s in found.skipped:
            print(f"[resume] skipped {s.path}: {s.reason}")
        # Adam moments exist only after a step; create them so DCP has somewhere to load into.
        model(batch(0)[:, :-1]).sum().mul(0).backward()
        optim.step()
        state = state_of(model, optim, 0)
        dcp.load(state, checkpoint_id=found.path)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = int(state["step"])
        print(f"[resume] from {found.path} at step {start}")

    for step in range(start + 1, args.steps + 1):
        tokens = batch(step)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        print(f"step {step:4d}  loss {loss.item():.6f}")
        if step % args.save_every == 0:
            path = Path(args.root) / f"step_{step:06d}"
            ckpt_dcp.save(state_of(model, optim, step), str(path), iteration=step,
                          topology={"tp": 1, "pp": 1, "dp": 1},
                          model_config={"vocab_size": VOCAB, "hidden_size": DIM})
            print(f"[save] {path}")


if __name__ == "__main__":
    main()
