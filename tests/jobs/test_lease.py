"""The lease on a run directory in object storage (the moto S3 server), raced by real processes:
one writer per URL however many start together, a holder known dead is replaced at once, an
unknown one only after ``lease_seconds``, and a holder that lost its lease writes nothing more.
The rules one at a time (a takeover that lands during a renewal, one that meets a holder's
renewal, a probe that fails, a release after the lease was lost) run in this process on a local
disk, on a clock the test moves. The Trainer's side (a frozen job, a restart's wait) is in
``test_lease_trainer.py``."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import secrets
import signal
import subprocess
import time

import pytest

from unbroken.checkpoint import FsspecStorage, LocalStorage
from unbroken.errors import DirectoryInUse
from unbroken.train.lease import Lease

SECONDS = 2.0  # lease_seconds here: a holder that stops renewing is replaced after this long
FORK = multiprocessing.get_context("fork")  # the children share this process's imports


def _url(s3, name: str) -> str:
    return s3.make_bucket(f"{name}-{secrets.token_hex(4)}") + "/runs/exp1"


def _leases(storage: FsspecStorage, url: str) -> dict[str, dict]:
    """The lease objects under ``url``, by name, with their holders."""
    storage.fs.invalidate_cache()
    names = [p for p in storage.fs.ls(url, detail=False) if "/.lock" in p and "probe" not in p]
    return {p.rpartition("/")[2]: json.loads(storage.fs.cat_file(p)) for p in names}


def _pause(paused: list[float], seconds: float) -> None:
    paused.append(seconds)
    time.sleep(seconds)


def _serve(bucket, options, orders) -> None:
    """A child: takes leases under ``bucket`` as told, with one client made (and connected)
    first, so that a race is over the lease, not over the client's start."""
    storage = FsspecStorage(bucket, options)
    storage.check()
    orders.send("ready")
    held = []
    while (order := orders.recv()) is not None:
        url, environment, start_at, keep = order
        os.environ.update(environment)  # torchrun's variables, read by the Lease
        paused: list[float] = []  # the lease's own waits: what a machine's load cannot add to
        lease = Lease(storage, url, SECONDS, sleep=functools.partial(_pause, paused))
        while time.time() < start_at:
            pass
        began = time.monotonic()
        try:
            lease.acquire()
        except DirectoryInUse as error:
            orders.send(("refused", str(error), time.monotonic() - began, sum(paused)))
            continue
        orders.send(("won", os.getpid(), time.monotonic() - began, sum(paused)))
        if keep:
            held.append(lease)  # held (and renewed) until this process is killed
            continue
        if orders.recv() == "write":  # the run directory's storage, fenced by its lease
            storage.fence = getattr(lease, "fence", None)
            try:
                storage.write(f"{url}/metrics.csv", lambda out: out.write(b"old\n"))
                orders.send("wrote")
            except DirectoryInUse as error:
                orders.send(f"refused: {error}")
            storage.fence = None
            orders.recv()
        lease.release()


class Taker:
    """A child process that takes leases (``take``) and holds each until told (``end``)."""

    def __init__(self, bucket, options) -> None:
        self.orders, theirs = FORK.Pipe()
        self.process = FORK.Process(target=_serve, args=(bucket, options, theirs), daemon=True)
        self.process.start()
        assert self.answer() == "ready"

    def take(self, url, environment=None, start_at=0.0, keep=False) -> None:
        self.orders.send((url, environment or {}, start_at, keep))

    def answer(self, timeout: float = 120):
        assert self.orders.poll(timeout), "the child did not answer"
        return self.orders.recv()

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()  # reaped: its pid is gone from this machine

    def close(self) -> None:
        if self.process.is_alive():
            self.kill()


def test_of_two_jobs_started_together_exactly_one_writes_20_times_over(s3):
    options, bucket = s3.storage_options, _url(s3, "pairs")
    storage = FsspecStorage(bucket, options)
    urls = [f"{bucket}/{pair}" for pair in range(20)]
    killed = Taker(bucket, options)  # half the pairs race to take over a SIGKILLed job's lease
    for url in urls[1::2]:
        killed.take(url, keep=True)
        assert killed.answer()[0] == "won"
    killed.kill()
    racers = [Taker(bucket, options) for _ in range(2)]
    try:
        for pair, url in enumerate(urls):
            start_at = time.time() + 0.05
            for racer in racers:
                racer.take(url, start_at=start_at)
            answers = [racer.answer() for racer in racers]
            leases = _leases(storage, url)
            for racer, answer in zip(racers, answers):
                if answer[0] == "won":
                    racer.orders.send("end")  # released once both have answered
            assert sorted(a[0] for a in answers) == ["refused", "won"], (pair, answers)
            winner = next(a[1] for a in answers if a[0] == "won")
            refusal = next(a[1] for a in answers if a[0] == "refused")
            assert f"in use by another training job (pid {winner} on " in refusal, refusal
            assert leases[max(leases)]["pid"] == winner, (pair, leases)  # the store agrees
    finally:
        for racer in racers:
            racer.close()


def test_a_torchrun_restart_takes_the_lease_at_once_and_an_unknown_holder_is_waited_for(s3):
    url, options = _url(s3, "torchrun"), s3.storage_options
    job = {"TORCHELASTIC_RUN_ID": "job-7", "TORCHELASTIC_RESTART_COUNT": "0"}
    holder, restarted, other = (Taker(url, options) for _ in range(3))
    try:
        holder.take(url, job, keep=True)
        assert holder.answer()[0] == "won"
        os.kill(holder.process.pid, signal.SIGSTOP)  # alive, silent: as seen from another node
        # The same torchrun job, restarted: its previous attempt is over.
        restarted.take(url, {**job, "TORCHELASTIC_RESTART_COUNT": "1"})
        outcome, _, took, paused = restarted.answer()
        # At once: not one pause to look again (its requests' time is the machine's load).
        assert outcome == "won" and paused == 0, (outcome, took, paused)
        restarted.orders.send("end")  # released: taken at once again
        restarted.take(url, job, keep=True)
        assert restarted.answer()[0] == "won"
        os.kill(restarted.process.pid, signal.SIGSTOP)
        # Another job (another run id) finds a live holder: it takes the lease once that
        # renewed nothing for a whole lease.
        other.take(url, {**job, "TORCHELASTIC_RUN_ID": "job-8"})
        outcome, _, took, paused = other.answer()
        assert outcome == "won" and took >= SECONDS and paused > 0, (outcome, took, paused)
    finally:
        for child in (holder, restarted, other):
            child.close()


def test_a_holder_frozen_past_its_lease_is_refused_its_next_change(s3):
    url, options = _url(s3, "frozen"), s3.storage_options
    holder, taker = Taker(url, options), Taker(url, options)
    try:
        holder.take(url)
        assert holder.answer()[0] == "won"
        os.kill(holder.process.pid, signal.SIGSTOP)
        taker.take(url)
        outcome, winner, took, _ = taker.answer()
        assert outcome == "won" and took >= SECONDS, (outcome, took)
        os.kill(holder.process.pid, signal.SIGCONT)
        holder.orders.send("write")
        said = holder.answer()
        assert said.startswith("refused: the run directory") and f"pid {winner} on" in said, said
        assert "no longer this job's" in said
        storage = FsspecStorage(url, options)
        assert not storage.exists(f"{url}/metrics.csv")  # nothing written
        leases = _leases(storage, url)
        assert leases[max(leases)]["pid"] == winner, leases
    finally:
        for child in (holder, taker):
            child.close()


def test_a_lease_deleted_under_its_holder_is_not_made_again_and_stops_its_writes(s3):
    url, options = _url(s3, "deleted"), s3.storage_options
    storage = FsspecStorage(url, options)
    lease = Lease(storage, url, SECONDS)
    lease.acquire()
    storage.fence = getattr(lease, "fence", None)
    try:
        storage.write(f"{url}/metrics.csv", lambda out: out.write(b"a\n"))
        for name in _leases(storage, url):
            storage.fs.rm_file(f"{url}/{name}")
        heartbeat = lease._thread
        assert heartbeat is not None
        with pytest.warns(UserWarning, match="no longer this job's: its lease .* is gone"):
            # The heartbeat ends once it found the lease gone (at its next beat, SECONDS / 4
            # from now); the bound is for a heartbeat that never finds it, not for the load.
            heartbeat.join(timeout=120)
            assert not heartbeat.is_alive(), "the heartbeat renews a lease deleted under it"
        assert _leases(storage, url) == {}  # not made again by its old holder
        with pytest.raises(DirectoryInUse, match="is gone"):
            storage.write(f"{url}/metrics.csv", lambda out: out.write(b"b\n"))
        assert storage.fs.cat_file(f"{url}/metrics.csv") == b"a\n"
    finally:
        storage.fence = None
        lease.release()


def test_a_holder_is_known_gone_by_its_pid_and_start_time_on_this_machine():
    from unbroken.train.lock import gone, identity

    me = identity()
    child = subprocess.Popen(["sleep", "60"])
    try:
        with open(f"/proc/{child.pid}/stat") as stat:
            started = int(stat.read().rsplit(")", 1)[1].split()[19])
        alive = {**me, "pid": child.pid, "started": started}
        assert gone(alive, me) is None
        ended = "its process is gone from this machine"
        assert gone({**alive, "started": started - 1}, me) == ended  # its pid, reused
        assert gone({**alive, "machine": "another"}, me) is None  # another machine's pid 7
        assert gone({**alive, "released": True}, me) == "it released the lease as it ended"
        elsewhere = {**alive, "machine": "another", "run_id": "job-7", "restart": 0}
        restarted = {**me, "run_id": "job-7", "restart": 1}
        assert gone(elsewhere, restarted) == "torchrun restarted job job-7 (restart 0 -> 1)"
        assert gone(elsewhere, {**restarted, "restart": 0}) is None  # the same attempt's
        # torchrun's default run id is the same for every job: it tells nothing.
        assert gone({**elsewhere, "run_id": "none"}, {**restarted, "run_id": "none"}) is None
    finally:
        child.kill()
        child.wait()
    assert gone(alive, me) == ended


# The lease's rules, one at a time, in this process on a local disk (``LocalStorage`` has every
# operation a lease needs), with the time injected: what the lease decides by time (a watch, a
# whole lease's wait) is decided by the test, not by the machine's load. LONG keeps the
# heartbeat (every LONG / 4 seconds of real time) out of the way: each test renews by hand.
LONG = 60.0
ELSEWHERE = {"token": "0", "host": "elsewhere", "machine": "another", "pid": 7, "started": 1}


class Clock:
    """Seconds that pass only as the lease sleeps (``sleep``); each call is ``said``."""

    def __init__(self, said: list) -> None:
        self.now, self.said = 1000.0, said

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.said.append(("sleep", seconds))
        self.now += seconds


class Store(LocalStorage):
    """A local disk whose ``create``/``overwrite`` of a name ending in a key of ``before`` or
    ``after`` runs that function first or last (another job acting just then), and says each."""

    def __init__(self, said: list) -> None:
        self.said, self.before, self.after = said, {}, {}

    def _around(self, how, path: str, data: bytes, operation) -> None:
        name = path.rpartition("/")[2]
        self.said.append((how, name))
        if name in self.before:
            self.before.pop(name)()
        operation(path, data)
        if name in self.after:
            self.after.pop(name)()

    def create(self, path: str, data: bytes) -> None:
        self._around("create", path, data, super().create)

    def overwrite(self, path: str, data: bytes) -> None:
        self._around("overwrite", path, data, super().overwrite)


def _generation(n: int) -> str:
    return f".lock.{n:012d}"


def _lease(tmp_path, **holder) -> tuple[Lease, Store, Clock, list]:
    """A lease on ``tmp_path``, on the clock of the test; ``holder``: generation 1 is there
    already, held by a job on another machine (with these fields)."""
    said: list = []
    store, clock = Store(said), Clock(said)
    if holder:
        store.create(str(tmp_path / _generation(1)), json.dumps({**ELSEWHERE, **holder}).encode())
        said.clear()
    return Lease(store, str(tmp_path), LONG, clock=clock, sleep=clock.sleep), store, clock, said


def _takes_over(store: Store, tmp_path, generation: int) -> None:
    """Another job takes the lease over as ``generation``, as ``Lease`` does: it creates the
    generation, then deletes the one below."""
    LocalStorage.create(
        store, str(tmp_path / _generation(generation)), json.dumps(ELSEWHERE).encode()
    )
    os.unlink(tmp_path / _generation(generation - 1))


def test_a_takeover_that_lands_during_a_renewal_is_seen_and_stops_the_next_write(tmp_path):
    lease, store, clock, _ = _lease(tmp_path)
    lease.acquire()
    try:
        assert lease.generation == 1
        store.fence = lease.fence
        # Another job takes the lease over while this renewal is on its way: after the renewal
        # listed the generations, before it landed.
        store.after[_generation(1)] = lambda: _takes_over(store, tmp_path, 2)
        clock.now += LONG  # past 2/3 of the lease: the next write renews first
        with pytest.raises(DirectoryInUse, match=r"pid 7 on elsewhere took its lease over"):
            store.write(str(tmp_path / "metrics.csv"), lambda out: out.write(b"late\n"))
        assert not (tmp_path / "metrics.csv").exists()
        assert "no longer this job's" in (lease.lost or "")
    finally:
        store.fence = None
        lease.release()


@pytest.mark.parametrize("renewed", [True, False])
def test_a_takeover_waits_a_whole_lease_for_a_holder_that_renewed_as_it_was_taken(
    tmp_path, renewed
):
    lease, store, clock, said = _lease(tmp_path, renewal=1)

    def renew() -> None:
        holder = json.dumps({**ELSEWHERE, "renewal": 2}).encode()
        LocalStorage.overwrite(store, str(tmp_path / _generation(1)), holder)

    if renewed:  # the holder woke up (a frozen process continued) just as it was taken over
        store.before[_generation(2)] = renew
    lease.acquire()
    try:
        assert lease.generation == 2
        took = said.index(("create", _generation(2)))
        pauses = [s for how, s in said[:took] if how == "sleep"]
        assert sum(pauses) == pytest.approx(LONG + 1)  # watched a whole lease, one look a second
        after = [s for how, s in said[took:] if how == "sleep"]
        # The old holder may trust its renewal for 2/3 of a lease: the new one writes nothing
        # before that holder has seen the new generation.
        assert after == ([LONG] if renewed else []), said[took:]
    finally:
        lease.release()


def test_a_probe_that_fails_is_no_proof_of_a_stale_lease_and_the_holder_is_watched(tmp_path):
    lease, store, clock, said = _lease(tmp_path, renewal=1)

    def unreachable() -> None:
        raise ConnectionError("the store did not answer")

    store.before[f".lock-probe-{lease.me['token']}"] = unreachable
    lease.acquire()
    try:
        assert lease.generation == 2
        assert lease.waited > LONG, said  # watched for a whole lease, not taken at once
    finally:
        lease.release()


@pytest.mark.parametrize("noticed", [True, False])
@pytest.mark.parametrize("deleted", [True, False])
def test_a_release_after_the_lease_was_lost_writes_nothing(tmp_path, noticed, deleted):
    lease, store, _, said = _lease(tmp_path)
    lease.acquire()
    LocalStorage.create(store, str(tmp_path / _generation(2)), json.dumps(ELSEWHERE).encode())
    if deleted:  # as the new holder does once it holds generation 2
        os.unlink(tmp_path / _generation(1))
    mine = None if deleted else (tmp_path / _generation(1)).read_bytes()
    if noticed:
        with pytest.raises(DirectoryInUse, match="took its lease over"):
            lease.confirm()
    said.clear()
    lease.release()
    assert said == []  # nothing written: not its generation, not the new holder's
    assert json.loads((tmp_path / _generation(2)).read_bytes()) == ELSEWHERE
    if deleted:
        assert not (tmp_path / _generation(1)).exists()  # a lease deleted is never made again
    else:
        assert (tmp_path / _generation(1)).read_bytes() == mine
