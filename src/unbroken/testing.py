"""Check your own pipeline: ``assert_resumes_exactly(make_loader, epochs=2)``.

It runs the loader uninterrupted for ``epochs`` epochs, saving the state after every batch
(inside the loop) and after every epoch's loop has ended, then restores each saved state into
a fresh loader and checks that the rest of the stream is equal, batch by batch, with
``torch.equal`` and the same structure. The saved states go through ``json.dumps``/``loads``
on the way, as they would through a checkpoint.

Cost: one full run plus one partial run per cut point, i.e. quadratic in the number of
batches; pass ``cuts`` to check a subset of the cut points on a large pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

__all__ = ["S3Server", "assert_resumes_exactly", "assert_same"]


def assert_resumes_exactly(
    make_loader: Callable[[], Any],
    epochs: int = 2,
    *,
    resume_with: Callable[[], Any] | None = None,
    cuts: Iterable[int] | None = None,
) -> int:
    """Check that a loader resumed from each saved state continues the uninterrupted stream.

    Args:
        make_loader: Builds a fresh loader each call (same dataset, seed and settings).
        epochs: How many epochs the uninterrupted run iterates, at least 1.
        resume_with: Builds the loader that resumes (default: ``make_loader``), e.g. with
            another ``num_workers``.
        cuts: The cut points to check, by index into the saved states (0 is before the first
            batch); all of them by default.

    Returns:
        The number of cut points checked.

    Raises:
        AssertionError: at the first cut point whose resumed stream differs; it names the
            cut point and the batch.
        ValueError: ``epochs`` is below 1, or a cut is out of range.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    stream, saved = _record(make_loader(), epochs)
    resume_with = resume_with or make_loader
    chosen = range(len(saved)) if cuts is None else sorted(set(cuts))
    for cut in chosen:
        if not 0 <= cut < len(saved):
            raise ValueError(f"cut {cut} is out of range: there are {len(saved)} cut points")
        received, label, state = saved[cut]
        loader = resume_with()
        loader.load_state_dict(json.loads(state))
        rest = [batch for _ in range(loader.epoch, epochs) for batch in loader]
        expected = stream[received:]
        where = f"resumed from the state saved {label} ({received} batches received)"
        if len(rest) != len(expected):
            raise AssertionError(
                f"{where}: got {len(rest)} batches, the uninterrupted run has {len(expected)}"
            )
        for i, (got, want) in enumerate(zip(rest, expected)):
            assert_same(got, want, f"{where}: batch {received + i}")
    return len(chosen)


def _record(loader: Any, epochs: int) -> tuple[list, list[tuple[int, str, str]]]:
    stream: list = []
    saved = [(0, "before the first batch", json.dumps(loader.state_dict()))]
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            stream.append(batch)
            label = f"inside epoch {epoch} after its batch {i}"
            saved.append((len(stream), label, json.dumps(loader.state_dict())))
        saved.append(
            (len(stream), f"after epoch {epoch}'s loop ended", json.dumps(loader.state_dict()))
        )
    return stream, saved


def assert_same(got: Any, want: Any, where: str = "value") -> None:
    """Assert equal structure and values; tensors are compared with ``torch.equal``.

    Types, dtypes, shapes, dict keys and their order must be equal too.

    Args:
        got: The value to check: a tensor, a numpy array, a dict, list or tuple of them, or any
            value comparable with ``==``.
        want: The expected value.
        where: How the message names the value; nested parts get ``[key]`` appended.

    Raises:
        AssertionError: the first difference, naming where it is.
    """
    if type(got) is not type(want):
        raise AssertionError(f"{where}: type {type(got).__name__} != {type(want).__name__}")
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(f"{where}: tensors differ:\n{got}\n!=\n{want}")
    elif isinstance(want, np.ndarray):
        if got.dtype != want.dtype or not np.array_equal(got, want):
            raise AssertionError(f"{where}: arrays differ:\n{got}\n!=\n{want}")
    elif isinstance(want, dict):
        if list(got) != list(want):
            raise AssertionError(f"{where}: keys {list(got)} != {list(want)}")
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        if len(got) != len(want):
            raise AssertionError(f"{where}: length {len(got)} != {len(want)}")
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    elif got != want:
        raise AssertionError(f"{where}: {got!r} != {want!r}")


class S3Server:
    """A real S3 protocol server on 127.0.0.1 for tests and demos.

    It is moto's standalone server (``pip install "moto[server]" s3fs``) in a process of its
    own, started and stopped by ``with``. Clients talk HTTP to it exactly as to S3, through
    ``storage_options``::

        with S3Server() as s3:
            s3.make_bucket("data")
            unbroken.write_shards(rows, "s3://data/ds", storage_options=s3.storage_options)

    The server runs in its own process group, so a test that signals its own group does not
    stop it, and ``stop()`` (or leaving the ``with``) kills it and anything it started.

    Args:
        port: The port to listen on; 0 takes a free one when it starts.
    """

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self._process: Any = None

    @property
    def endpoint(self) -> str:
        """The server's URL, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this server (any key and secret are accepted)."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def start(self) -> S3Server:
        """Start the server and wait, up to 60 s, until it answers.

        Returns:
            This ``S3Server``.

        Raises:
            RuntimeError: the server did not start (is ``moto[server]`` installed?).
        """
        import socket
        import subprocess
        import sys
        import time
        import urllib.request

        if self.port == 0:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.port = probe.getsockname()[1]
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"the S3 server (moto) did not start on {self.endpoint}; is "
                        '"moto[server]" installed?'
                    ) from None
                time.sleep(0.1)

    def make_bucket(self, name: str) -> str:
        """Create a bucket, if it is missing.

        Args:
            name: The bucket's name.

        Returns:
            Its URL, ``s3://<name>``.
        """
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        if not fs.exists(name):
            fs.mkdir(name)
        return f"s3://{name}"

    def stop(self) -> None:
        """Kill the server and anything it started; a no-op when it is not running."""
        import os
        import signal

        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        self._process = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
