"""``tests/support/hf_trainer_job.py``'s ``unbroken.hf.Trainer`` job for a restart of torchrun's own.

The process group comes from ``unbroken.distributed.init_process_group("gloo")``, called before
the ``TrainingArguments`` (whose construction starts Accelerate's state, which adopts the group);
``--torch-group`` leaves it to transformers and Accelerate, which call torch's own.
``--kill-at STEP --kill-rank R`` SIGKILLs rank R alone at the end of optimizer step STEP (after
its save, if any), in torchrun's first attempt only: the restarted attempt runs to the end.
Every run resumes from the newest sealed checkpoint of ``--out`` (none: from the start).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_trainer_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--torch-group", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=-1)
    ours, rest = parser.parse_known_args(argv)
    options = hf_trainer_job.main_options(rest)
    rank = hf_trainer_job.RANK
    if not ours.torch_group:
        import unbroken.distributed

        unbroken.distributed.init_process_group("gloo")
    os.makedirs(options.out, exist_ok=True)
    hf_trainer_job.RECORD = open(os.path.join(options.out, f"batches-rank{rank}.jsonl"), "a")
    trainer = hf_trainer_job.build(options)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == ours.kill_rank and first_attempt:

        class Killer(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):  # after unbroken's seal
                if state.global_step == options.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == options.kill_at and not control.should_save:
                    os.kill(os.getpid(), signal.SIGKILL)

        trainer.add_callback(Killer())
    trainer.train(resume_from_checkpoint=True)
    torch.save(trainer.model.state_dict(), os.path.join(options.out, f"weights-rank{rank}.pt"))
    with open(os.path.join(options.out, f"history-rank{rank}.json"), "w") as out:
        json.dump(trainer.state.log_history, out)
    del trainer  # the DDP model goes before its gloo group (see hf_trainer_job.main)
    gc.collect()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
