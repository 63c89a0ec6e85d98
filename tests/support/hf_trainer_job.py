"""A transformers.Trainer job for the tests of ``unbroken.hf`` (and its benchmark and demo).

A 3-layer MLP with dropout as a ``PreTrainedModel`` built from a config (nothing downloaded),
96 samples whose ``__getitem__`` draws ``torch.rand`` (an augmentation), AdamW, a linear
schedule. Every training batch is appended to ``OUT/batches.jsonl`` as it is trained on (the
global step, this rank, the sample indices, the augmentation's sum), with the loss, so a test
can compare what a killed and resumed run trained on with an uninterrupted one. At the end the
weights go to ``OUT/weights-rank<r>.pt`` and the log history to ``OUT/history-rank<r>.json``.

``--kill-at STEP`` SIGKILLs the process at the end of optimizer step STEP (after its save, if
any); ``--kill-in-save STEP`` SIGKILLs it inside the save of STEP, after transformers wrote the
optimizer and before the rest; ``--kill-before-seal STEP`` after transformers' files are
written and before unbroken's state and seal. ``--kill-in-window STEP`` inside the accumulation window after step STEP (after its first
micro-batch). ``--term-at STEP`` sends SIGTERM to itself
there (a preemption). ``--stock`` runs transformers.Trainer itself.

``--mlm`` trains a tiny BERT (from a config) on masked language modelling instead: 96 token
sequences, masked by transformers' ``DataCollatorForLanguageModeling``, which draws torch's
global generator; the tokenizer it needs is a word-level one built here, offline. Each batch is
recorded with its masked ``input_ids`` and ``labels``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import sys

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, TrainerCallback, TrainingArguments

N = 96


class MLPConfig(PretrainedConfig):
    model_type = "unbroken-test-mlp"

    def __init__(self, width: int = 48, dropout: float = 0.2, **kwargs):
        super().__init__(**kwargs)
        self.width, self.dropout = width, dropout


class MLP(PreTrainedModel):
    config_class = MLPConfig

    def __init__(self, config: MLPConfig):
        super().__init__(config)
        self.net = nn.Sequential(
            nn.Linear(4, config.width),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.width, config.width),
            nn.ReLU(),
            nn.Linear(config.width, 2),
        )
        self.post_init()

    def _init_weights(self, module):
        pass  # nn.Linear's own initialisation, from the seeded generator

    def forward(self, x, labels=None, index=None, aug=None):
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, labels)
        if self.training and DRAW[0]:  # a step drawing from numpy and random, not only torch
            loss = loss * (1 + 0.01 * (np.random.rand() + random.random()))
        if self.training and RECORD is not None:
            RECORD.write(
                json.dumps(
                    {
                        "step": STEP[0],
                        "rank": RANK,
                        "index": index.tolist(),
                        "aug": aug.tolist(),
                        "loss": loss.item(),
                    }
                )
                + "\n"
            )
            RECORD.flush()
        return {"loss": loss, "logits": logits}


BASE = torch.Generator().manual_seed(1234)
INPUTS = torch.randn(N, 4, generator=BASE)


def item(index: int) -> dict:
    noise = torch.rand(4) * 0.1  # the augmentation: the process's (or worker's) generator
    return {
        "x": INPUTS[index] + noise,
        "labels": torch.tensor(index % 2),
        "index": torch.tensor(index),
        "aug": noise.sum(),
    }


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict:
        return item(index)


class Stream(torch.utils.data.IterableDataset):
    """A global-cursor stream without len(): the items [start, stop) of the epoch."""

    def read_range(self, start: int, stop: int) -> list[dict]:
        return [item(i) for i in range(start, min(stop, N))]

    def __iter__(self):
        return iter(self.read_range(0, N))


RECORD = None
STEP = [0]
DRAW = [False]
RANK = int(os.environ.get("RANK", "0"))


class Tracer(TrainerCallback):
    """Records the step, and kills the process where the test asks."""

    def __init__(self, options):
        self.options = options

    def on_step_begin(self, args, state, control, **kwargs):
        STEP[0] = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.options.term_at and RANK == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_substep_end(self, args, state, control, **kwargs):  # inside an accumulation window
        if state.global_step == self.options.kill_in_window:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.options.kill_before_seal:
            os.kill(os.getpid(), signal.SIGKILL)


# --mlm: [PAD] [UNK] [CLS] [SEP] [MASK], then 20 words.
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(20)]


def tokenizer():
    """A word-level fast tokenizer over ``SPECIAL + WORDS``, built in code (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    words = Tokenizer(WordLevel(vocabulary, unk_token="[UNK]"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


class Sentences(torch.utils.data.Dataset):
    """Sequence i: [CLS], 10 words derived from i, [SEP]; nothing random (the collator is)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict:
        first = len(SPECIAL)
        words = [first + (index * 7 + 3 * j * j) % len(WORDS) for j in range(10)]
        return {"input_ids": [2, *words, 3]}


def masked_lm():
    from transformers import BertConfig, BertForMaskedLM

    class MaskedLM(BertForMaskedLM):
        """Records each training batch as the model receives it: masks and all."""

        def forward(self, input_ids=None, labels=None, **kwargs):
            output = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            if self.training and RECORD is not None:
                row = {"step": STEP[0], "rank": RANK, "input_ids": input_ids.tolist()}
                row.update(labels=labels.tolist(), loss=output.loss.item())
                RECORD.write(json.dumps(row) + "\n")
                RECORD.flush()
            return output

    config = BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    return MaskedLM(config)


def build(options):
    import unbroken.hf

    base = unbroken.hf.Trainer if not options.stock else __import__("transformers").Trainer

    class Job(base):
        def _save_optimizer_and_scheduler(self, output_dir):
            super()._save_optimizer_and_scheduler(output_dir)
            if self.state.global_step == options.kill_in_save:
                os.kill(os.getpid(), signal.SIGKILL)

    args = TrainingArguments(
        output_dir=options.out,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=options.accum,
        num_train_epochs=options.epochs,
        max_steps=options.max_steps,
        learning_rate=0.01,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=options.log_every,
        save_steps=options.save_every,
        save_total_limit=options.keep,
        eval_strategy="epoch" if options.eval else "no",
        per_device_eval_batch_size=8,
        # transformers' default for a PreTrainedModel is True, with which DDP never rebuilds
        # its buckets; False (faster) is the case exact_reduce is for.
        ddp_find_unused_parameters=False,
        dataloader_num_workers=options.workers,
        seed=7,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        remove_unused_columns=False,
    )
    torch.manual_seed(0)
    model = MLP(MLPConfig()) if not options.mlm else masked_lm()
    dataset = Stream() if options.stream else Samples()
    collator = None
    if options.mlm:
        from transformers import DataCollatorForLanguageModeling

        dataset, collator = Sentences(), DataCollatorForLanguageModeling(tokenizer())
    evaluation = torch.utils.data.Subset(Samples(), range(16)) if options.eval else None
    DRAW[0] = options.draw
    trainer = Job(
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=evaluation,
        data_collator=collator,
        callbacks=[Tracer(options)],
    )
    # The Tracer kills before unbroken's on_save seals: put it before unbroken's callback.
    callbacks = trainer.callback_handler.callbacks
    callbacks.sort(key=lambda c: not isinstance(c, Tracer))
    return trainer


def main_options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--keep", type=int, default=None)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--mlm", action="store_true", help="BERT, masked by the collator")
    parser.add_argument("--eval", action="store_true", help="evaluate at each epoch's end")
    parser.add_argument("--draw", action="store_true", help="the step draws numpy and random")
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-in-save", type=int, default=-1)
    parser.add_argument("--kill-before-seal", type=int, default=-1)
    parser.add_argument("--kill-in-window", type=int, default=-1)
    parser.add_argument("--term-at", type=int, default=-1)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    global RECORD
    options = main_options(argv)
    os.makedirs(options.out, exist_ok=True)
    RECORD = open(os.path.join(options.out, f"batches-rank{RANK}.jsonl"), "a")
    trainer = build(options)
    if options.kill_at >= 0:

        class Killer(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):  # after unbroken's seal
                if state.global_step == options.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == options.kill_at and not control.should_save:
                    os.kill(os.getpid(), signal.SIGKILL)

        trainer.add_callback(Killer())
    trainer.train(resume_from_checkpoint=True if options.resume else None)
    torch.save(trainer.model.state_dict(), os.path.join(options.out, f"weights-rank{RANK}.pt"))
    with open(os.path.join(options.out, f"history-rank{RANK}.json"), "w") as out:
        json.dump(trainer.state.log_history, out)
    if torch.distributed.is_initialized():
        # As the docs say: the DDP model goes first, then its gloo group. The interpreter's
        # teardown would free the model after the group, which aborts a rank now and then
        # ("terminate called without an active exception", seen in a full suite run).
        del trainer
        gc.collect()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
