"""``unbroken.Trainer.fit`` under ``torchrun --max-restarts`` refuses a process group made by
torch's own ``init_process_group``, which a restart could not start again, with the fix.

In this process: a world of one under the environment torchrun gives its ranks, the agent's store
a TCPStore served here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import unbroken
import unbroken.distributed


@pytest.fixture
def agent(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environment = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    environment |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    environment |= {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


def fit(directory) -> dict:
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(2), torch.randn(1)) for _ in range(4)]
    trainer = unbroken.Trainer(directory, max_epochs=1, progress_bar=False, tensorboard=False)
    return trainer.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        unbroken.DataLoader(data, batch_size=2, seed=1),
        training_step=lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
    )


def test_fit_refuses_a_group_of_torchs_own_with_the_fix(agent, tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(
        RuntimeError,
        match=r"max-restarts=3.*your script made it with torch\.distributed\.init_process_group.*"
        r"unbroken\.distributed\.init_process_group\(backend\).*instead of torch",
    ):
        fit(tmp_path / "refused")
    assert not (tmp_path / "refused" / "checkpoints").exists()  # refused before any step
    dist.destroy_process_group()
    unbroken.distributed.init_process_group("gloo")  # behind this attempt's keys: taken
    assert fit(tmp_path / "run")
