"""`make demo-hf`: a transformers.Trainer job killed twice and resumed, bit for bit.

The job (``tests/support/hf_trainer_job.py``): a 3-layer MLP with dropout as a ``PreTrainedModel``, 96
samples with a random augmentation, batch 8, 3 epochs, a checkpoint every 4 steps, trained by
``unbroken.hf.Trainer``. It runs once uninterrupted. Then it is SIGKILLed after step 10,
restarted with the same command and SIGKILLed again inside the write of ``checkpoint-20``, and
restarted once more: the last start skips the half-written folder, resumes from ``checkpoint-16``
and finishes. The demo compares the final weights, every sample trained and its augmentation,
and the logged losses with the uninterrupted run, and does the same with stock
``transformers.Trainer``. It exits 1 unless unbroken's run is bit-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "..", "tests", "support", "hf_trainer_job.py")


def run(out: str, *args: str) -> int:
    with open(out + ".log", "ab") as log:
        return subprocess.run(
            [sys.executable, JOB, "--out", out, *args], stdout=log, stderr=log
        ).returncode


def trained(out: str) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    with open(os.path.join(out, "batches-rank0.jsonl")) as lines:
        for line in lines:
            row = json.loads(line)
            steps[row["step"]] = row  # a step trained again after a resume replaces the first
    return steps


def losses(out: str) -> list[float]:
    with open(os.path.join(out, "history-rank0.json")) as file:
        return [entry["loss"] for entry in json.load(file) if "loss" in entry]


def compare(name: str, reference: str, out: str) -> bool:
    want, got = trained(reference), trained(out)
    samples = sum(got[s]["index"] == want[s]["index"] for s in want)
    augmented = sum(got[s]["aug"] == want[s]["aug"] for s in want)
    expected = torch.load(os.path.join(reference, "weights-rank0.pt"))
    final = torch.load(os.path.join(out, "weights-rank0.pt"))
    weights = all(torch.equal(final[k], expected[k]) for k in expected)
    logged = losses(out) == losses(reference)
    print(
        f"{name:22s} steps with the same samples {samples}/{len(want)}, same augmentations "
        f"{augmented}/{len(want)}, logged losses {'equal' if logged else 'differ'}, final "
        f"weights {'bit-identical' if weights else 'differ'}"
    )
    return samples == augmented == len(want) and weights and logged


def main() -> int:
    root = tempfile.mkdtemp(prefix="demo-hf-")
    print(f"runs in {root}")
    exact = True
    for name, flags in (("unbroken.hf.Trainer", []), ("transformers.Trainer", ["--stock"])):
        reference, out = os.path.join(root, f"{name}-reference"), os.path.join(root, name)
        assert run(reference, *flags) == 0, f"see {reference}.log"
        print(f"{name}: uninterrupted run done")
        assert run(out, *flags, "--kill-at", "10") == -9
        print(f"{name}: SIGKILLed after step 10")
        if not flags:
            assert run(out, "--resume", "--kill-in-save", "20") == -9
            sealed = os.path.exists(os.path.join(out, "checkpoint-20", "unbroken-seal.json"))
            print(f"{name}: resumed, SIGKILLed inside the save of checkpoint-20 (sealed: {sealed})")
        assert run(out, *flags, "--resume") == 0, f"see {out}.log"
        with open(out + ".log") as log:
            for line in log:
                if line.startswith("unbroken:") or "UnsealedCheckpointWarning" in line:
                    print("   ", line.strip())
        print(f"{name}: resumed to the end")
        same = compare(name, reference, out)
        if not flags:  # stock transformers is shown for comparison, not judged
            exact = same
    print(f"unbroken.hf.Trainer bit-identical to the uninterrupted run: {'yes' if exact else 'NO'}")
    if exact:
        shutil.rmtree(root, ignore_errors=True)
    else:  # kept for a look at the runs' logs and records
        print(f"the runs are kept in {root}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
