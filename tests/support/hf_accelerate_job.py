"""A training loop of one's own with Accelerate, for tests/jobs/test_hf_accelerate.py.

The recipe of docs/accelerate.md: an MLP with dropout and AdamW prepared by an ``Accelerator``
(CPU; DDP over gloo under torchrun), an ``unbroken.DataLoader`` kept out of ``prepare`` and
registered for checkpointing, ``unbroken.hf.accelerate.save_state`` every ``--save-every``
optimizer steps (keeping ``--keep``) and ``load_state`` at the start. 96 samples whose ``__getitem__`` draws
``torch.rand`` (an augmentation), batch 8 per process, 3 epochs. Every micro-batch is appended
to ``OUT/batches-rank<r>.jsonl`` as it is trained on (its number, the optimizer step, the sample
indices, each augmentation's sum, the loss); the final weights go to ``OUT/weights-rank<r>.pt``.

Under torchrun the process group comes from ``unbroken.distributed.init_process_group``, so
``--max-restarts`` can start it again. Cuts, each a SIGKILL of the process itself:
``--kill-at STEP`` after optimizer step STEP and its save, if any (with ``--kill-rank R``, on
rank R alone; never in a torchrun restart); ``--kill-in-window BATCH`` after micro-batch BATCH
inside an accumulation window; ``--kill-in-save STEP`` inside the save of STEP, after
Accelerate wrote the model, optimizer, random states and loader, before the last registered
object and the seal.
``--prepare`` passes the loader through ``accelerator.prepare`` instead (what goes wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
from accelerate import Accelerator
from torch import nn

import unbroken
import unbroken.distributed
import unbroken.hf.accelerate
from unbroken.distributed import exact_reduce

N, BATCH, EPOCHS, SEED = 96, 8, 3, 7
INPUTS = torch.randn(N, 4, generator=torch.Generator().manual_seed(1234))


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int):
        noise = torch.rand(4) * 0.1  # the augmentation: from torch's generator
        return INPUTS[index] + noise, index % 2, index, noise.sum()


class KillSwitch:
    """Registered last for checkpointing: its ``state_dict`` kills the process inside the save
    of one step, once Accelerate has written everything else."""

    def __init__(self, step: int) -> None:
        self.step, self.now = step, -1

    def state_dict(self) -> dict:
        if self.now == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def first_attempt() -> bool:
    """Whether this is torchrun's first attempt (or no torchrun): its restarts do not kill."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def train(options: argparse.Namespace) -> None:
    if "LOCAL_RANK" in os.environ:  # under torchrun: a group its restarts can start again
        unbroken.distributed.init_process_group("gloo")
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=options.accum)
    rank, attempt = accelerator.process_index, os.environ.get("TORCHELASTIC_RESTART_COUNT")
    print(f"rank {rank} of {accelerator.num_processes}: {accelerator.distributed_type}, {attempt=}")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 48), nn.ReLU(), nn.Dropout(0.2), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # Built after the Accelerator: under torchrun it reads the ranks from the process group.
    loader = unbroken.DataLoader(
        Samples(), batch_size=BATCH, shuffle=True, num_workers=options.workers, seed=SEED
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator.num_processes >= 3:
        exact_reduce(model)  # DDP's bucket order would change the sums after a resume
    switch = KillSwitch(options.kill_in_save)
    accelerator.register_for_checkpointing(loader, switch)
    step = unbroken.hf.accelerate.load_state(accelerator, options.out)
    batch_number = step * options.accum  # windows run across epochs: each is whole
    record = open(os.path.join(options.out, f"batches-rank{rank}.jsonl"), "a")

    def epochs():
        if not options.prepare:
            while loader.epoch < EPOCHS:  # the loader knows its epoch, restored with it
                yield loader
        else:  # what goes wrong: Accelerate rebuilds the loader around its sampler
            prepared = accelerator.prepare(loader)
            for epoch in range(loader.epoch, EPOCHS):
                prepared.set_epoch(epoch)
                yield prepared

    model.train()
    for batches in epochs():
        for x, y, index, aug in batches:
            batch_number += 1
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            row = {"batch": batch_number, "step": step + 1, "index": index.tolist()}
            row |= {"aug": aug.tolist(), "loss": loss.item()}
            record.write(json.dumps(row) + "\n")
            record.flush()
            if not accelerator.sync_gradients:
                if batch_number == options.kill_in_window:
                    os.kill(os.getpid(), signal.SIGKILL)
                continue
            step += 1
            if step % options.save_every == 0:
                switch.now = step
                unbroken.hf.accelerate.save_state(accelerator, options.out, step, options.keep)
            if step == options.kill_at and options.kill_rank in (-1, rank) and first_attempt():
                os.kill(os.getpid(), signal.SIGKILL)
    weights = accelerator.unwrap_model(model).state_dict()
    torch.save(weights, os.path.join(options.out, f"weights-rank{rank}.pt"))
    accelerator.end_training()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--keep", type=int, default=None, help="sealed checkpoints kept")
    parser.add_argument("--prepare", action="store_true")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1, help="the rank --kill-at kills")
    parser.add_argument("--kill-in-window", type=int, default=-1)
    parser.add_argument("--kill-in-save", type=int, default=-1)
    options = parser.parse_args(argv)
    os.makedirs(options.out, exist_ok=True)
    train(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
