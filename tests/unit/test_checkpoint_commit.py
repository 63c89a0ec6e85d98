"""A local checkpoint's commit, in the order a power loss needs: every file and the staged
directory made durable before the rename that commits it, and that rename made durable (its
parent directory fsynced) after it, before ``save`` returns."""

from __future__ import annotations

import os

import pytest
import torch

from unbroken.checkpoint import Checkpointer


@pytest.mark.parametrize("replaced", [False, True])
def test_a_commit_rename_is_made_durable_after_everything_it_commits(
    tmp_path, monkeypatch, replaced
):
    said: list[tuple] = []
    fsync, rename = os.fsync, os.rename

    def synced(fd):
        said.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def renamed(source, target):
        rename(source, target)
        said.append(("rename", os.path.basename(target)))

    root = tmp_path / "checkpoints"
    checkpointer = Checkpointer(root)
    state = {"model": torch.nn.Linear(3, 2), "epoch": 1}
    if replaced:  # a save of a step already there moves the old one aside first
        checkpointer.save(1, state)
    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "rename", renamed)
    final = checkpointer.save(1, state)
    checkpointer.wait()
    name = os.path.basename(final)
    commit = said.index(("rename", name))
    before = {ino for how, ino in said[:commit] if how == "fsync"}
    after = {ino for how, ino in said[commit + 1 :] if how == "fsync"}
    files = [os.path.join(final, file) for file in os.listdir(final)]
    assert len(files) >= 3  # the two entries and the manifest
    for file in files:
        assert os.stat(file).st_ino in before, f"{file} not fsynced before the commit"
    assert os.stat(final).st_ino in before  # the staged directory's entries
    assert os.stat(root).st_ino in after, "the commit's rename not made durable in its parent"
