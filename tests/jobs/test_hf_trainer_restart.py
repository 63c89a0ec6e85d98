"""``unbroken.hf.Trainer`` under ``torchrun --max-restarts``: torchrun's own restart resumes bit
for bit when the script made the group with ``unbroken.distributed.init_process_group``, and a
group made by transformers' ``TrainingArguments`` (torch's own call) is refused at construction.

The job is ``tests/support/hf_restart_job.py``: ``tests/support/hf_trainer_job.py``'s (96 samples, batch 8 per
rank: 4 steps an epoch on 3 ranks, 2 epochs, a checkpoint every 4 steps).
"""

from __future__ import annotations

import os

import hf_trainer_job
import pytest
import torch
from test_hf_accelerate import torchrun as accelerate_torchrun
from test_hf_trainer import assert_same_run

import unbroken.distributed
import unbroken.hf


def read(path: str) -> str:
    with open(path, errors="replace") as file:
        return file.read()


def torchrun(out: str, *args: str, restarts: int = 0) -> int:
    """3 ranks of ``tests/support/hf_restart_job.py`` (``test_hf_accelerate.torchrun``: a hang fails)."""
    return accelerate_torchrun(
        3, out, *args, restarts=restarts, timeout=180, job="hf_restart_job.py"
    )


def test_torchruns_own_restart_resumes_bit_for_bit(tmp_path):
    # Rank 1 alone is SIGKILLed at step 6 of the first attempt, after checkpoint-4; torchrun
    # stops the others and starts all three again against the same store. A group made by
    # TrainingArguments (torch's init_process_group) would read the dead attempt's addresses
    # there ("connectFullMesh failed", or a hang): it is refused at construction, with the fix
    # (the test below). The job makes it with unbroken's, which TrainingArguments adopt.
    expected, out = str(tmp_path / "reference"), str(tmp_path / "run")
    cut = ("--epochs", "2", "--kill-at", "6", "--kill-rank", "1")
    assert torchrun(expected, "--epochs", "2") == 0, read(expected + ".log")[-3000:]
    assert torchrun(out, *cut, restarts=1) == 0, read(out + ".log")[-3000:]
    said = read(out + ".log")
    assert "(exitcode: -9) local_rank: 1 " in said  # rank 1 alone was killed; the job went on
    assert f"resuming from {os.path.join(out, 'checkpoint-4')}" in said
    assert_same_run(expected, out, ranks=3)


# The refusal, in this process: a world of one under the environment torchrun gives its ranks,
# the agent's store a TCPStore served here.


@pytest.fixture
def agent(monkeypatch):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environment = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    environment |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    environment |= {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "1"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_group_of_torchs_own_is_refused_at_construction_with_the_fix(agent, tmp_path):
    import torch.distributed as dist
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")

    def build() -> unbroken.hf.Trainer:
        model = hf_trainer_job.MLP(hf_trainer_job.MLPConfig())
        return unbroken.hf.Trainer(model=model, args=args, train_dataset=hf_trainer_job.Samples())

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(
        RuntimeError,
        match=r"max-restarts=1.*TrainingArguments.*unbroken\.distributed\.init_process_group"
        r".*before building the TrainingArguments",
    ):
        build()
    agent.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # a relaunch is a new torchrun: no refusal
    build()
    dist.destroy_process_group()
    agent.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    unbroken.distributed.init_process_group("gloo")
    build()
    assert torch.distributed.get_world_size() == 1
