"""Workers for benchmarks/hf_resume.py: stock Accelerate loops, and the time to the first step.

How it measures, and what the numbers mean: ``docs/benchmarks/hf-resume.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
import hf_trainer_job  # noqa: E402

STEPS_PER_EPOCH = hf_trainer_job.N // 8


def loop(options: argparse.Namespace) -> None:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    stateful = options.how == "stateful"
    # use_seedable_sampler: Accelerate's way to a reproducible order (the sampler seeded from
    # the seed and the epoch), without which a resume reshuffles the interrupted epoch.
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful, use_seedable_sampler=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    set_seed(7)
    torch.manual_seed(0)
    model = hf_trainer_job.MLP(hf_trainer_job.MLPConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(
        hf_trainer_job.Samples(), batch_size=8, shuffle=True, num_workers=options.workers
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    folders = sorted(
        (int(name.split("-")[1]), name)
        for name in os.listdir(options.out)
        if name.startswith("ckpt-")
    )
    step = 0
    if folders:
        step, name = folders[-1]
        accelerator.load_state(os.path.join(options.out, name))
    records = open(os.path.join(options.out, "batches-rank0.jsonl"), "a")
    model.train()
    for epoch in range(step // STEPS_PER_EPOCH, 3):
        loader.set_epoch(epoch)
        batches = loader
        skip = step - epoch * STEPS_PER_EPOCH
        if skip and not stateful:
            batches = accelerator.skip_first_batches(loader, skip)
        for batch in batches:
            record = {"step": step, "index": batch["index"].tolist(), "aug": batch["aug"].tolist()}
            records.write(json.dumps(record) + "\n")
            records.flush()
            loss = model(**batch)["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 4 == 0:
                accelerator.save_state(os.path.join(options.out, f"ckpt-{step}"))
            if step == options.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    torch.save(
        accelerator.unwrap_model(model).state_dict(), os.path.join(options.out, "weights-rank0.pt")
    )


class Costly(torch.utils.data.Dataset):
    """``n`` samples, each costing ``cost`` seconds of CPU (decoding, say)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return sample(index, self.cost)


class CostlyStream(torch.utils.data.IterableDataset):
    """The same samples as a stream without ``len()``: a global-cursor stream (``read_range``)
    for unbroken, plain iteration for transformers."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def read_range(self, start: int, stop: int) -> Iterator[dict]:
        return (sample(i, self.cost) for i in range(start, min(stop, self.n)))

    def __iter__(self) -> Iterator[dict]:
        return self.read_range(0, self.n)


def sample(index: int, cost: float) -> dict:
    end = time.perf_counter() + cost
    while time.perf_counter() < end:
        pass
    noise = torch.rand(4) * 0.1
    return {
        "x": hf_trainer_job.INPUTS[index % hf_trainer_job.N] + noise,
        "labels": torch.tensor(index % 2),
    }


def first_step(options: argparse.Namespace) -> None:
    import transformers
    from transformers import TrainerCallback, TrainingArguments

    import unbroken.hf

    make = options.phase == "make"
    steps = options.at if make else options.at + 1
    args = TrainingArguments(
        output_dir=options.out,
        per_device_train_batch_size=8,
        max_steps=steps,
        save_steps=options.at,
        save_strategy="steps" if make else "no",
        logging_steps=10**9,
        learning_rate=0.01,
        seed=7,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
    )
    cost = options.cost_us * 1e-6
    dataset = CostlyStream(options.n, cost) if options.stream else Costly(options.n, cost)
    first: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not first:
                first.append(time.perf_counter())

    system = unbroken.hf.Trainer if options.system == "unbroken" else transformers.Trainer
    torch.manual_seed(0)
    model = hf_trainer_job.MLP(hf_trainer_job.MLPConfig())
    trainer = system(model=model, args=args, train_dataset=dataset, callbacks=[Clock()])
    checkpoint = None if make else os.path.join(options.out, f"checkpoint-{options.at}")
    began = time.perf_counter()
    trainer.train(resume_from_checkpoint=checkpoint)
    if not make:
        print(json.dumps({"seconds": first[0] - began}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["loop", "first-step"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--how", choices=["skip", "stateful"], default="skip")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--system", choices=["stock", "unbroken"], default="unbroken")
    parser.add_argument("--phase", choices=["make", "resume"], default="make")
    parser.add_argument("--at", type=int, default=1)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--cost-us", type=float, default=50.0)
    parser.add_argument("--stream", action="store_true")
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)
    if options.mode == "loop":
        loop(options)
    else:
        first_step(options)


if __name__ == "__main__":
    main()
