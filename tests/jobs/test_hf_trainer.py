"""``unbroken.hf.Trainer``: a transformers.Trainer job SIGKILLed at every boundary resumes bit
for bit (weights, every trained sample and its augmentation, every logged value), where stock
transformers does not; killed saves are skipped; SIGTERM saves and exits 75; 3 DDP ranks.

The job is ``tests/support/hf_trainer_job.py`` (96 samples, batch 8: 12 steps an epoch, 3 epochs, a
checkpoint every 4 steps). Each run is a real process forked from a ``multiprocessing``
forkserver that imported transformers once (a fresh interpreter would spend ~5 s importing it);
torchrun runs the 3-rank jobs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import forked
import hf_trainer_job
import pytest
import torch
from locations import ROOT, SUPPORT

import unbroken.hf
from unbroken.errors import CorruptCheckpoint, StateMismatch
from unbroken.hf import internals
from unbroken.hf.seal import SEAL
from unbroken.preemption import EXIT_CODE

N, BATCH = hf_trainer_job.N, 8


@pytest.fixture(scope="module")
def job():
    return forked.jobs(hf_trainer_job.main)


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """Uninterrupted runs, one per configuration, made once."""
    return forked.made_once(job, tmp_path_factory)


def records(out: str, rank: int = 0) -> dict[int, list[dict]]:
    """Each global step's batches, as the run that counted trained them: after a resume, the
    resumed run's (written later) replace the killed run's."""
    steps: dict[int, list[dict]] = {}
    with open(os.path.join(out, f"batches-rank{rank}.jsonl")) as lines:
        for line in lines:
            row = json.loads(line)
            steps.setdefault(row["step"], []).append(row)
    return steps


def history(out: str) -> list[dict]:
    with open(os.path.join(out, "history-rank0.json")) as file:
        logged = json.load(file)

    # Times (*_runtime, *_per_second) differ; the final summary's train_loss averages the
    # steps of this train() call, as transformers documents.
    def kept(key: str) -> bool:
        return not key.startswith("train_") and "runtime" not in key and "per_second" not in key

    return [{k: v for k, v in entry.items() if kept(k)} for entry in logged]


def assert_same_run(expected: str, resumed: str, ranks: int = 1) -> None:
    for rank in range(ranks):
        want, got = records(expected, rank), records(resumed, rank)
        for step, batches in want.items():
            assert got[step][-len(batches) :] == batches, f"rank {rank} step {step}"
        assert got.keys() == want.keys()
    assert history(resumed) == history(expected)
    weights = torch.load(os.path.join(expected, "weights-rank0.pt"))
    for name, value in torch.load(os.path.join(resumed, "weights-rank0.pt")).items():
        assert torch.equal(value, weights[name]), name


def kill_and_resume(job, out: str, cut: list[str], config: tuple[str, ...]) -> None:
    assert job(out, *cut, *config, expect=None) == -9  # SIGKILL
    job(out, "--resume", *config)


MLM = ("--mlm", "--max-steps", "16")  # a tiny BERT, into its second epoch

CUTS = [
    # (configuration, where the kill comes)
    ((), ["--kill-at", "10"]),  # mid-epoch: resumed from step 8
    ((), ["--kill-at", "13"]),  # an epoch's first step, after the save at the epoch's end (12)
    ((), ["--kill-at", "12"]),  # an epoch's last step: before its save, which waits for the end
    ((), ["--kill-at", "35"]),  # the run's last epoch, before the final save
    (("--workers", "2"), ["--kill-at", "14"]),  # workers, across an epoch boundary
    (("--accum", "5", "--save-every", "1"), ["--kill-at", "5"]),  # after a window, mid-epoch
    (("--accum", "5", "--save-every", "1"), ["--kill-in-window", "4"]),  # inside a window
    (("--accum", "5", "--save-every", "2"), ["--kill-at", "4"]),  # after the epoch's short window
    (("--max-steps", "20"), ["--kill-at", "15"]),  # max_steps over a map-style set
    (("--eval",), ["--kill-at", "13"]),  # an epoch-end save, after the epoch-end evaluation
    (("--draw", "--accum", "3", "--save-every", "1"), ["--kill-at", "6"]),  # numpy/random steps
    (("--stream", "--max-steps", "30"), ["--kill-at", "13"]),  # a stream, after a pass's end
    (("--stream", "--max-steps", "14", "--accum", "5", "--save-every", "2"), ["--kill-at", "9"]),
    (MLM, ["--kill-at", "9"]),  # a collator that draws (MLM masking), in this process
    ((*MLM, "--workers", "2"), ["--kill-at", "9"]),  # ... and in the workers
]


@pytest.mark.parametrize("config, cut", CUTS, ids=[" ".join(c + tuple(k)) for c, k in CUTS])
def test_a_killed_job_resumes_bit_for_bit(job, reference, tmp_path, config, cut):
    out = str(tmp_path / "run")
    kill_and_resume(job, out, cut, config)
    assert_same_run(reference(*config), out)


def test_the_uninterrupted_run_trains_the_documented_order(reference):
    # Not an oracle by itself: every epoch a permutation of the samples, each epoch another,
    # derived from the seed (7) as unbroken.DataLoader documents; a stream in its own order.
    steps = records(reference())
    epochs = [
        sum((steps[s][0]["index"] for s in range(e * 12, (e + 1) * 12)), []) for e in range(3)
    ]
    loader = unbroken.DataLoader(list(range(N)), batch_size=BATCH, shuffle=True, seed=7)
    for epoch, order in enumerate(epochs):
        assert sorted(order) == list(range(N))
        assert order == torch.cat(list(loader)).tolist(), f"epoch {epoch}"
    assert epochs[0] != epochs[1] != epochs[2]
    stream = records(reference("--stream", "--max-steps", "30"))
    assert sum((stream[s][0]["index"] for s in range(12)), []) == list(range(N))
    augmentations = [a for s in range(12) for a in stream[s][0]["aug"]]
    assert len(set(augmentations)) == N  # every sample drew its own augmentation


def test_a_masking_collator_masks_as_derived_at_any_worker_count(reference):
    """transformers' MLM collator draws its masks from torch's global generator, which the
    loader seeds for each batch's collate, in a worker or (num_workers=0) in this process: the
    masks are the documented derivation's, and 0 and 2 workers train bit for bit alike."""
    from transformers import DataCollatorForLanguageModeling

    from unbroken.data import keys
    from unbroken.data.rng import collate_seeds

    alone = reference(*MLM)
    assert_same_run(alone, reference(*MLM, "--workers", "2"))
    steps = records(alone)
    assert sorted(steps) == list(range(16))
    collator = DataCollatorForLanguageModeling(hf_trainer_job.tokenizer())
    loader = unbroken.DataLoader(list(range(N)), batch_size=BATCH, shuffle=True, seed=7)
    order = [[batch.tolist() for batch in loader] for epoch in range(2)]
    saved = torch.get_rng_state()
    try:
        for step in range(16):
            epoch, number = divmod(step, 12)
            indices = order[epoch][number]
            seeds = collate_seeds(keys.samples(7, epoch), number * BATCH)
            torch.default_generator.manual_seed(seeds[0])
            batch = collator([hf_trainer_job.Sentences()[i] for i in indices])
            (row,) = steps[step]
            assert row["input_ids"] == batch["input_ids"].tolist(), f"step {step}"
            assert row["labels"] == batch["labels"].tolist(), f"step {step}"
    finally:
        torch.set_rng_state(saved)
    labels = [
        label for rows in steps.values() for row in rows for seq in row["labels"] for label in seq
    ]
    assert 0 < sum(label != -100 for label in labels) < len(labels) / 2  # ~15% masked


def test_stock_transformers_resumes_other_augmentations_and_weights(job, reference, tmp_path):
    # Side by side: the same job and cut under transformers.Trainer itself.
    expected = reference("--stock")
    out = str(tmp_path / "stock")
    job(out, "--stock", "--kill-at", "10", expect=None)
    job(out, "--stock", "--resume")
    want, got = records(expected), records(out)
    assert [got[s][-1]["index"] for s in want] == [want[s][0]["index"] for s in want]  # order
    assert [got[s][-1]["aug"] for s in range(8, 12)] != [want[s][0]["aug"] for s in range(8, 12)]
    weights = torch.load(os.path.join(expected, "weights-rank0.pt"))
    resumed = torch.load(os.path.join(out, "weights-rank0.pt"))
    assert not all(torch.equal(resumed[k], weights[k]) for k in weights)


@pytest.mark.parametrize("where", ["--kill-in-save", "--kill-before-seal"])
def test_a_save_killed_midway_is_skipped_with_a_message(job, reference, tmp_path, where):
    out = str(tmp_path / "run")
    assert job(out, where, "8", expect=None) == -9
    assert unbroken.hf.check(os.path.join(out, "checkpoint-8")).status == "unsealed"
    job(out, "--resume")
    with open(out + ".log") as log:
        said = log.read()
    assert f"skipping checkpoint {out}/checkpoint-8: it has no unbroken-seal.json" in said
    assert f"resuming from {out}/checkpoint-4" in said
    assert_same_run(reference(), out)
    assert unbroken.hf.check(os.path.join(out, "checkpoint-8")).sealed  # written again


def test_save_total_limit_keeps_the_last_sealed_checkpoint_through_a_killed_save(job, tmp_path):
    out = str(tmp_path / "run")
    job(out, "--keep", "1", "--kill-before-seal", "8", expect=None)
    # transformers' own rotation would have removed checkpoint-4 before checkpoint-8 was whole.
    assert unbroken.hf.check(os.path.join(out, "checkpoint-4")).sealed
    job(out, "--keep", "1", "--resume")
    kept = [name for name in os.listdir(out) if name.startswith("checkpoint-")]
    assert kept == ["checkpoint-36"]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigterm_saves_at_the_step_and_exits_75(job, reference, tmp_path, workers):
    out = str(tmp_path / "run")
    assert job(out, "--workers", workers, "--term-at", "6", expect=None) == EXIT_CODE
    assert unbroken.hf.check(os.path.join(out, "checkpoint-6")).sealed
    job(out, "--workers", workers, "--resume")
    assert_same_run(reference("--workers", workers), out)


def torchrun(ranks: int, out: str, *args: str) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={ranks}", os.path.join(SUPPORT, "hf_trainer_job.py")]
    with open(out + ".log", "ab") as log:
        done = subprocess.run([*command, "--out", out, *args], stdout=log, stderr=log, timeout=300)
    return done.returncode


def test_three_ddp_ranks_resume_bit_for_bit(tmp_path):
    expected, out = str(tmp_path / "reference"), str(tmp_path / "run")
    assert torchrun(3, expected) == 0
    assert torchrun(3, out, "--kill-at", "6") != 0  # every rank SIGKILLed at step 6
    assert torchrun(3, out, "--resume") == 0, open(out + ".log").read()[-3000:]
    assert_same_run(expected, out, ranks=3)


def test_two_ddp_ranks_agree_on_a_sigterm_to_one_and_resume_bit_for_bit(tmp_path):
    # Only rank 0 gets the signal; at the step's end both save, seal and exit 75.
    expected, out = str(tmp_path / "reference"), str(tmp_path / "run")
    assert torchrun(2, expected, "--workers", "2") == 0
    assert torchrun(2, out, "--workers", "2", "--term-at", "5") != 0
    with open(out + ".log") as log:
        said = log.read()
    assert len(re.findall(r"exitcode\s+: 75", said)) == 2, said[-3000:]  # torchrun's summary
    assert unbroken.hf.check(os.path.join(out, "checkpoint-5")).sealed
    for rank in range(2):
        assert os.path.exists(os.path.join(out, "checkpoint-5", f"rng_state_{rank}.pth"))
    assert torchrun(2, out, "--workers", "2", "--resume") == 0, open(out + ".log").read()[-3000:]
    assert_same_run(expected, out, ranks=2)


# Refusals.


def test_resuming_from_an_unsealed_path_or_a_stock_checkpoint_is_refused(job, tmp_path):
    out = str(tmp_path / "run")
    job(out, "--stock", "--max-steps", "4")
    stock = os.path.join(out, "checkpoint-4")
    unbroken.hf.seal(stock)
    trainer = hf_trainer_job.build(hf_trainer_job.main_options(["--out", out]))
    with pytest.raises(StateMismatch, match="not saved by unbroken.hf.Trainer"):
        trainer.train(resume_from_checkpoint=stock)
    os.remove(os.path.join(stock, SEAL))
    with pytest.raises(CorruptCheckpoint, match="no unbroken-seal.json"):
        trainer.train(resume_from_checkpoint=stock)
    with pytest.raises(CorruptCheckpoint, match="no sealed checkpoint"):
        trainer.train(resume_from_checkpoint=True)


def test_a_collator_with_a_generator_of_its_own_is_refused(tmp_path):
    trainer = hf_trainer_job.build(hf_trainer_job.main_options(["--out", str(tmp_path), *MLM]))
    trainer.data_collator.seed = 3  # as DataCollatorForLanguageModeling(seed=3) keeps it
    with pytest.raises(ValueError, match="DataCollatorForLanguageModeling has seed=3"):
        trainer.get_train_dataloader()
    trainer.data_collator.seed = None
    trainer.get_train_dataloader()


def test_an_untested_transformers_is_refused_unless_asked(monkeypatch):
    monkeypatch.setattr(internals.transformers, "__version__", "5.99.0")
    with pytest.raises(internals.UntestedTransformers, match="5.99.0 is installed"):
        internals.check_version()
    monkeypatch.setenv("UNBROKEN_HF_UNTESTED", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        internals.check_version()
    assert "5.99.0" in str(caught[0].message)


def test_the_hf_extra_pins_the_tested_transformers_versions():
    """The `[hf]` extra installs only what internals.TESTED accepts (a fresh install took a
    newer, untested transformers when the pin was open-ended)."""
    import tomllib

    root = str(ROOT)
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
    (pin,) = [r for r in extra if r.startswith("transformers")]
    (low, high) = internals.TESTED
    assert pin == f"transformers>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"
