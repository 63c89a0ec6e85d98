"""``checkpoint.scan.classify``, behind ``unbroken verify``: a checkpoint is checked whole, every
rank's part of a ``PerRank`` entry loaded, not only rank 0's, so that what verify says is what a
resume on any number of ranks would do."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from conftest import reseal
from torch import nn

import unbroken.cli
from unbroken import PerRank
from unbroken.checkpoint import Checkpointer, LocalStorage
from unbroken.checkpoint.layout import MANIFEST
from unbroken.checkpoint.verdict import classify


def _two_ranks(checkpoint: Path, second: bytes) -> str:
    """Make the checkpoint's ``PerRank`` entry a two-rank one whose rank 1 wrote ``second``,
    sealed as a writer would have: it hashes to what the manifest says."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    first = manifest["entries"]["counter"]["ranks"][0]
    other = first.replace(".rank-00000.", ".rank-00001.")
    (checkpoint / other).write_bytes(second)
    entries = {**manifest["entries"], "counter": {"ranks": [first, other]}}
    reseal(checkpoint, other, world_size=2, entries=entries)
    return other


def test_verify_loads_every_ranks_part_of_a_per_rank_entry(tmp_path, capsys):
    checkpointer = Checkpointer(tmp_path)
    for step in (1, 2):
        checkpointer.save(step, {"counter": PerRank({"seen": step}), "model": nn.Linear(2, 2)})
    path = tmp_path / "step-000000002"
    # Two ranks' parts that load: verified.
    other = _two_ranks(path, torch_bytes({"seen": 7}))
    assert classify(LocalStorage(), str(path), 2).ok
    assert unbroken.cli.main(["verify", str(tmp_path)]) == 0
    # Rank 1's part whole as written (its sha256 matches), but no state torch can load.
    _two_ranks(path, b"rank 1 wrote this instead of its state")
    verdict = classify(LocalStorage(), str(path), 2)
    assert verdict.status == "corrupt"
    (problem,) = verdict.problems
    assert problem.startswith(
        f"state['counter']: {other} does not load with torch.load(weights_only=True)"
    ), problem
    capsys.readouterr()
    assert unbroken.cli.main(["verify", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["status"]) for c in report["checkpoints"]] == [(1, "ok"), (2, "corrupt")]


def torch_bytes(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
