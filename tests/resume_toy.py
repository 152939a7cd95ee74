"""A toy training run for ``tests/test_train_resume.py``, run as a script (``python
tests/resume_toy.py OUT FOLDER MODE KILL_AT``, or under ``accelerate launch``): a small MLP
trained 12 steps by ``mmspec.training.loop.train_loop`` with everything a recipe's run can hold
that decides its weights: Adam, a LambdaLR schedule, an ``EMA`` (``on_step``), batches drawn by
their own generator (sharded across processes), a loss drawing dropout masks from another
generator and noise from the global RNG (seeded per process). ``MODE``: ``none`` (no
checkpoints), ``save`` (a checkpoint every 3 steps), ``resume`` (the same, resuming), or
``resume-no-state`` (resuming with the dropout generator left out of ``state``: a deliberately
broken resume). At step ``KILL_AT`` every process SIGKILLs itself (0: never). Process 0 writes
the final weights and EMA averages to ``OUT`` (safetensors)."""

import os
import signal
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from mmspec.training.loop import EMA, Checkpoints, new_accelerator, shard, train_loop


def main(out: Path, folder: Path, mode: str, kill_at: int) -> None:
    torch.set_num_threads(1)
    acc = new_accelerator("resume-toy", distributed=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    ema = EMA(model, 0.9)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))
    order, dropout = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    torch.manual_seed(5 + acc.process_index)

    def batches():
        while True:
            idx = shard(torch.randperm(64, generator=order)[:8], acc)
            yield data[idx], target[idx]

    def loss(m, batch):
        x, y = batch
        keep = (torch.rand(x.shape, generator=dropout) > 0.2).float()
        return ((m(x * keep) - y - 0.01 * torch.randn(y.shape)) ** 2).mean()

    def on_step(step):
        ema.update(model)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoints = None if mode == "none" else Checkpoints(folder, 3, resume=mode.startswith("resume"))
    state = {"ema": ema} if mode == "resume-no-state" else {"ema": ema, "dropout": dropout}
    train_loop(model, optimizer, batches(), loss, steps=12, accelerator=acc, schedule=schedule, name="toy",
               log=lambda msg: None, on_step=on_step, checkpoints=checkpoints, state=state)
    if acc.is_main_process:
        tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
        tensors.update({f"ema.{k}": v for k, v in ema.shadow.items()})
        save_file(tensors, str(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
