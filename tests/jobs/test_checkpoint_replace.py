"""A checkpoint saved again at the same step, by a writer SIGKILLed mid-way (a forked process of
this test, killed at a chosen call to its storage): on a local disk the old checkpoint stays in
view until the new one is renamed into place; in object storage the old one leaves view whole
(its manifest first) before the new one is written, so a kill leaves the previous checkpoints
and never a mix of the two."""

from __future__ import annotations

import os
import secrets
import signal
import warnings
from collections.abc import Callable

import pytest

from unbroken.checkpoint import Checkpointer, FsspecStorage, LocalStorage, layout
from unbroken.checkpoint.storage import basename


def _killed_while(save: Callable[[], object]) -> None:
    """Run ``save`` in a forked process, which must die of SIGKILL inside it (its storage
    kills it): no ``except`` or ``finally`` of the writer runs, as after a real kill."""
    pid = os.fork()
    if pid == 0:  # the writer
        try:
            save()
        finally:
            os._exit(3)  # not killed: the test fails below
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _KilledAtTheCommit(LocalStorage):
    """Killed as it renames the new checkpoint into place."""

    def rename(self, source: str, target: str) -> None:
        if basename(source).startswith(".tmp-"):
            _die()
        super().rename(source, target)


def test_a_writer_killed_replacing_a_checkpoint_on_disk_leaves_the_old_one(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    for step, value in ((1, "one"), (2, "two")):
        checkpointer.save(step, {"value": value})
    _killed_while(
        lambda: Checkpointer(tmp_path, storage=_KilledAtTheCommit()).save(2, {"value": "new"})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = Checkpointer(tmp_path).load_latest({"value": None})
    assert restored is not None and (restored.step, restored.values) == (2, {"value": "two"})
    # The next save puts it back in its place, then replaces it whole.
    Checkpointer(tmp_path).save(2, {"value": "new"})
    assert sorted(os.listdir(tmp_path)) == ["step-000000001", "step-000000002"]
    restored = Checkpointer(tmp_path).load_latest({"value": None})
    assert restored is not None and restored.values == {"value": "new"}


class _KilledInTheStore(FsspecStorage):
    """Killed as it deletes the old checkpoint's parts (after one of them went), or once it
    uploaded the new checkpoint's first file."""

    def __init__(self, *args, at: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.at = at

    def remove_tree(self, path: str) -> None:
        if self.at == "delete" and basename(path) == "step-000000002":
            self.fs.rm_file(sorted(self.fs.find(path))[0])  # one object goes, then the kill
            _die()
        super().remove_tree(path)

    def write(self, path, fill):
        digest = super().write(path, fill)
        if self.at == "upload" and "/step-000000002/" in path:
            _die()
        return digest


@pytest.mark.parametrize("at", ["delete", "upload"])
def test_a_writer_killed_replacing_a_checkpoint_in_object_storage_leaves_no_mix(s3, at):
    url = s3.make_bucket(f"replace-{secrets.token_hex(4)}") + "/run/checkpoints"
    checkpointer = Checkpointer(url, storage_options=s3.storage_options)
    for step, value in ((1, "one"), (2, "two")):
        checkpointer.save(step, {"value": value})
    _killed_while(
        lambda: Checkpointer(
            url, storage=_KilledInTheStore(url, s3.storage_options, cache=False, at=at)
        ).save(2, {"value": "new"})
    )
    storage = FsspecStorage(url, s3.storage_options, cache=False)
    assert [step for step, _ in layout.candidates(storage, url)] == [1]  # nothing half there
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a damaged step 2: none
        restored = Checkpointer(url, storage=storage).load_latest({"value": None})
    assert restored is not None and (restored.step, restored.values) == (1, {"value": "one"})
