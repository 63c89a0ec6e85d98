"""A store that stops answering (the moto S3 server SIGSTOPped: connections are accepted by the
kernel, and nothing answers) turns into a reported failure within ``remote_timeout``, at start,
during a download and during an upload; a Trainer whose periodic save meets it (blocking or in
the background) reports it and trains on, and ends as a run that never met it. The server is
this module's own (the suite's shared one is never stopped), and always continued (SIGCONT) on
the way out, and by a timer at the latest, so that code that would wait forever ends, late."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
import time

import pytest
import torch

import unbroken
from unbroken.checkpoint import Checkpointer, FsspecStorage, layout
from unbroken.errors import RemoteUnavailable
from unbroken.testing import assert_same

TIMEOUT = 1.5  # remote_timeout where nothing must succeed: seconds without progress
# remote_timeout where the store must answer first (a start, a listing, a first part, a lease):
# right after a test thawed the server, which then answers the requests it held first, or on a
# loaded machine, an answer that normally takes milliseconds may take longer than TIMEOUT.
RUN_TIMEOUT = 2 * TIMEOUT
BOUND = RUN_TIMEOUT + 6.0  # when a failure must be reported by, on a loaded machine
THAW_AFTER = 60.0  # the safety timer: a frozen server is continued after this long anyway


class Freezer:
    """Stops (SIGSTOP) and continues (SIGCONT) an S3 server's process."""

    def __init__(self, server) -> None:
        self.pid = server._process.pid
        self.timer: threading.Timer | None = None

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.timer = threading.Timer(THAW_AFTER, self.thaw)
        self.timer.start()

    def thaw(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def server():
    from unbroken.testing import S3Server

    with S3Server() as own:
        yield own


@pytest.fixture
def freezer(server):
    freezer = Freezer(server)
    yield freezer
    freezer.thaw()  # whatever the test did


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run that never met a frozen store, on a local disk: its weights and its log."""
    from trainer_job import run

    directory = tmp_path_factory.mktemp("reference")
    return run(directory, epochs=2).state_dict(), (directory / "metrics.csv").read_bytes()


def _url(server, name: str) -> str:
    return server.make_bucket(f"{name}-{secrets.token_hex(4)}") + "/runs/exp1"


def _options(server) -> dict:
    return {**server.storage_options, "default_block_size": 5 << 20}  # 5 MiB parts


def test_a_frozen_store_at_start_fails_within_the_deadline(server, freezer, tmp_path):
    url = _url(server, "start")
    freezer.freeze()
    began = time.monotonic()
    with pytest.raises(
        RemoteUnavailable, match=f"could not reach {url.split('/runs')[0]}: the store did not"
    ):
        Checkpointer(f"{url}/checkpoints", storage_options=_options(server), remote_timeout=TIMEOUT)
    assert time.monotonic() - began < BOUND
    model = torch.nn.Linear(8, 3)
    loader = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 8)), seed=0)
    trainer = unbroken.Trainer(
        url, storage_options=_options(server), remote_timeout=TIMEOUT, max_epochs=1
    )
    began = time.monotonic()
    with pytest.raises(
        RemoteUnavailable, match=f"could not reach .*: the store did not answer within {TIMEOUT} s"
    ):
        trainer.fit(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            training_step=lambda model, batch: model(batch[0]).sum(),
        )
    assert time.monotonic() - began < BOUND


def test_a_store_frozen_during_a_download_fails_it_and_deletes_nothing(
    server, freezer, monkeypatch
):
    checkpoints = _url(server, "download") + "/checkpoints"
    options = _options(server)
    for step in (1, 2):
        Checkpointer(checkpoints, storage_options=options).save(step, {"w": torch.ones(3) * step})
    real = layout.candidates

    def listed_then_frozen(storage, root):
        found = real(storage, root)
        freezer.freeze()
        return found

    monkeypatch.setattr(layout, "candidates", listed_then_frozen)
    checkpointer = Checkpointer(checkpoints, storage_options=options, remote_timeout=RUN_TIMEOUT)
    began = time.monotonic()
    with pytest.raises(RemoteUnavailable, match="could not read the checkpoints in") as raised:
        checkpointer.load_latest({"w": None})
    assert time.monotonic() - began < BOUND
    assert "step-000000002/manifest.json: the store did not answer" in str(raised.value)
    freezer.thaw()
    monkeypatch.setattr(layout, "candidates", real)
    assert checkpointer.load_latest({"w": None}).step == 2  # both still there


def test_a_store_frozen_during_an_upload_fails_it_and_the_upload_is_aborted(server, freezer):
    url = _url(server, "upload")
    storage = FsspecStorage(url, _options(server), timeout=RUN_TIMEOUT, cache=False)

    def fill(out):
        out.write(os.urandom(6 << 20))  # the multipart upload begins, its first part goes
        freezer.freeze()
        out.write(os.urandom(6 << 20))  # the next part meets the frozen store

    began = time.monotonic()
    with pytest.raises(RemoteUnavailable, match=f"could not upload {url}/big.pt: the store did"):
        storage.write(f"{url}/big.pt", fill)
    assert time.monotonic() - began < BOUND
    freezer.thaw()
    # The attempt given up stops at its next write, once its part is answered, and aborts.
    bucket = url.split("/")[2]
    for _ in range(100):
        if not storage.fs.list_multipart_uploads(bucket):
            break
        time.sleep(0.1)
    assert storage.fs.list_multipart_uploads(bucket) == []
    assert not storage.exists(f"{url}/big.pt")
    storage.write(f"{url}/small.pt", lambda out: out.write(b"the store is back"))


class FreezeInASave:
    """Freezes the store as the ``nth`` save uploads its first file (from the thread that saves:
    the training loop's, or the background save's), and continues it after the first batch
    that ends with that save over (failed)."""

    def __init__(self, freezer: Freezer, nth: int, monkeypatch) -> None:
        self.freezer, self.nth = freezer, nth
        self.saves, self.frozen = 0, False
        real = FsspecStorage.write

        def write(storage, path, fill):
            if "/checkpoints/step-" in path and "/000-" in path:  # a save's first file
                self.saves += 1
                if self.saves == self.nth:
                    self.freezer.freeze()
                    self.frozen = True
            return real(storage, path, fill)

        monkeypatch.setattr(FsspecStorage, "write", write)

    def on_train_batch_end(self, trainer, logs) -> None:
        if self.frozen and not trainer.checkpointer.in_flight:
            self.freezer.thaw()


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "background"])
def test_a_periodic_save_meeting_a_frozen_store_is_reported_and_training_goes_on(
    server, freezer, reference, capfd, monkeypatch, async_save
):
    from trainer_job import run

    url = _url(server, "train")
    freeze = FreezeInASave(freezer, nth=2, monkeypatch=monkeypatch)
    began = time.monotonic()
    model = run(
        url,
        epochs=2,
        callbacks=[freeze],
        storage_options=_options(server),
        remote_timeout=RUN_TIMEOUT,
        async_save=async_save,
    )
    assert freeze.frozen
    said = capfd.readouterr().err
    failed = "the background checkpoint failed (" if async_save else "failed (could not"
    assert failed in said and "the store did not answer" in said, said
    assert "training goes on" in said
    assert time.monotonic() - began < 60
    weights, log = reference
    assert_same(model.state_dict(), weights, "weights")
    storage = FsspecStorage(url, server.storage_options, cache=False)
    assert storage.fs.cat_file(f"{url}/metrics.csv") == log
    restored = Checkpointer(f"{url}/checkpoints", storage=storage).load_latest({"progress": None})
    assert restored.values["progress"]["epoch"] == 2  # the final save reached the store


def test_a_store_frozen_during_the_leases_renewal_fails_its_fence_in_time_not_a_hang(
    server, freezer
):
    # A run directory's lease renews every lease_seconds / 4 and lets writes through only while
    # a renewal is recent. The store freezes: the heartbeat cannot renew, the next write's fence
    # tries to confirm and fails within the deadline (the write with it: a failed save); once
    # the store answers again the lease is still this job's and the fence lets writes through.
    from unbroken.errors import DirectoryInUse
    from unbroken.train.lease import Lease

    url = _url(server, "lease")
    storage = FsspecStorage(url, server.storage_options, timeout=RUN_TIMEOUT)
    lease = Lease(storage, url, seconds=3.0)
    lease.acquire()
    try:
        freezer.freeze()
        time.sleep(2.5)  # past 2/3 of the lease: no renewal could land
        began = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            lease.fence()
        assert time.monotonic() - began < BOUND  # without the deadline: botocore's retries, ~21 s
        freezer.thaw()
        lease.fence()  # the store answers again, and nobody took the lease: confirmed
    except DirectoryInUse as error:
        pytest.fail(f"the lease was lost to nobody: {error}")
    finally:
        freezer.thaw()
        began = time.monotonic()
        lease.release()  # the heartbeat, stuck in a frozen request, stops in time too
        assert time.monotonic() - began < BOUND


def _writes(monkeypatch) -> list[str]:
    """The paths written through FsspecStorage.write from now on (uploads of whole objects)."""
    written: list[str] = []
    real = FsspecStorage.write

    def write(storage, path, fill):
        written.append(path)
        return real(storage, path, fill)

    monkeypatch.setattr(FsspecStorage, "write", write)
    return written


def test_a_store_frozen_during_a_resume_shows_the_resumes_error_and_uploads_nothing(
    server, freezer, monkeypatch
):
    # The clean-up must not upload metrics.csv to the frozen store: its RemoteUnavailable
    # would replace the resume's, which says that nothing was skipped or deleted.
    url = _url(server, "resume")
    Checkpointer(f"{url}/checkpoints", storage_options=_options(server)).save(
        2, {"w": torch.ones(3)}
    )
    real = layout.candidates
    frozen_at = []

    def listed_then_frozen(storage, root):
        found = real(storage, root)
        freezer.freeze()
        frozen_at.append(time.monotonic())
        return found

    monkeypatch.setattr(layout, "candidates", listed_then_frozen)
    written = _writes(monkeypatch)
    model = torch.nn.Linear(8, 3)
    loader = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 8)), seed=0)
    trainer = unbroken.Trainer(
        url, storage_options=_options(server), remote_timeout=RUN_TIMEOUT, max_epochs=1, signals=()
    )
    with pytest.raises(RemoteUnavailable, match="could not read the checkpoints in") as raised:
        trainer.fit(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            training_step=lambda model, batch: model(batch[0]).sum(),
        )
    assert "No checkpoint was skipped, restored or deleted" in str(raised.value)
    assert not getattr(raised.value, "__notes__", None)  # the clean-up had nothing to add
    assert not [path for path in written if path.endswith("metrics.csv")], written
    # The resume's deadline, then the lease's release (its heartbeat and its mark, each bounded).
    assert time.monotonic() - frozen_at[0] < 3 * RUN_TIMEOUT + 6.0


def test_a_clean_up_failing_on_a_frozen_store_is_added_to_the_error_that_ended_the_run(
    server, freezer, caplog
):
    from trainer_job import Crash, run

    class FreezeThenCrash:
        """After the first batch (logged: metrics.csv has rows to upload), the store freezes
        and the user's code fails."""

        def on_train_batch_end(self, trainer, logs) -> None:
            freezer.freeze()
            raise Crash("the user's code failed")

    url = _url(server, "crash")
    with pytest.raises(Crash, match="the user's code failed") as raised:
        run(
            url,
            epochs=1,
            callbacks=[FreezeThenCrash()],
            storage_options=_options(server),
            remote_timeout=RUN_TIMEOUT,
        )
    if sys.version_info >= (3, 11):  # a note, shown under the error's traceback
        (said,) = raised.value.__notes__
        assert said.startswith("then, cleaning up after it: RemoteUnavailable: could not ")
    else:  # logged
        (said,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert said.startswith("cleaning up after Crash (the user's code failed): ")
    assert "RemoteUnavailable: could not " in said and "the store did not answer" in said, said
