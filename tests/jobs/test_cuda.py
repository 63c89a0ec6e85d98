"""Bit-exact resume on CUDA (skipped without a GPU): deterministic kernels, bf16 autocast and
fp16 with a GradScaler, a pinned two-worker loader; SIGKILLs at seeded random steps."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from locations import SUPPORT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
JOB = SUPPORT / "cuda_job.py"


def _job(directory, **options):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(JOB), str(directory), json.dumps(options)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sigkilled_cuda_runs_finish_bit_for_bit_like_an_uninterrupted_one(tmp_path, precision):
    reference = _job(tmp_path / "reference", precision=precision)
    assert reference.returncode == 0, reference.stderr[-3000:]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    directory, kills = tmp_path / "killed", 0
    for _ in range(6):  # 36 training batches in all: killed after 1-9 of them, 3 times
        kill_after = rng.randint(1, 9) if kills < 3 else None
        result = _job(directory, precision=precision, kill_after=kill_after)
        if result.returncode == 0:
            break
        assert result.returncode == -9, f"seed {seed}: {result.stderr[-3000:]}"
        kills += 1
    expected = torch.load(tmp_path / "reference" / "final.pt")
    got = torch.load(directory / "final.pt")
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"seed {seed}: {name} differs"
    assert kills == 3
