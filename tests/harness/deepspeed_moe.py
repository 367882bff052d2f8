"""A DeepSpeed engine with a ``deepspeed.moe.layer.MoE`` layer (4 experts, EP 1, ZeRO-1) on
CPU over gloo, trained one step and saved: what ``deepspeed.moe`` writes (expert files
``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` beside the model and optimizer states).

Run as ``python -m tests.harness.deepspeed_moe ROOT PORT`` (one process: DeepSpeed keeps
process-wide state, so tests run it in a subprocess)."""

from __future__ import annotations

import os
import sys


def main(root: str, port: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed("gloo")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)
            expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
            self.moe = MoE(hidden_size=8, expert=expert, num_experts=4, ep_size=1, k=2)

        def forward(self, x):
            y, aux, _ = self.moe(self.inp(x))
            return y.sum() + aux

    torch.manual_seed(0)
    model = Net()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                    "name": "params"})
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    loss = eng(torch.randn(2, 8))
    eng.backward(loss)
    eng.step()
    eng.save_checkpoint(root)


if __name__ == "__main__":
    main(*sys.argv[1:])
