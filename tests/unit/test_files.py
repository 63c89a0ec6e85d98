"""``_files.atomic_write``: a file replaced whole or not at all, durable once it returns."""

from __future__ import annotations

import os

import pytest

from unbroken import _files
from unbroken._files import atomic_write


class Boom(Exception):
    pass


def _half_then(error: BaseException):
    def fill(out):
        out.write(b"new, half of it")
        out.flush()
        raise error

    return fill


@pytest.mark.parametrize("temporary", [None, ".named.tmp"])
def test_a_failed_fill_leaves_the_old_file_and_no_temporary(tmp_path, temporary):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    with pytest.raises(Boom):
        atomic_write(target, _half_then(Boom()), temporary=temporary)
    assert target.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["state.json"]
    with pytest.raises(KeyboardInterrupt):  # not an Exception: removed all the same
        atomic_write(target, _half_then(KeyboardInterrupt()), temporary=temporary)
    assert sorted(os.listdir(tmp_path)) == ["state.json"]


def test_a_process_killed_mid_write_leaves_the_old_file_whole(tmp_path):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    pid = os.fork()
    if pid == 0:  # the child dies in the middle of its write, as under SIGKILL
        try:
            atomic_write(target, lambda out: (out.write(b"new, half"), out.flush(), os._exit(9)))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert target.read_bytes() == b"old"  # a reader never sees the half


def test_the_result_is_whole_and_synced_with_its_directory(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd)))
    target = tmp_path / "weights.bin"
    target.write_bytes(b"old")
    payload = bytes(range(256)) * 4096  # 1 MiB, written in pieces
    atomic_write(
        target, lambda out: [out.write(payload[i : i + 4096]) for i in range(0, len(payload), 4096)]
    )
    assert target.read_bytes() == payload
    assert len(synced) == 2  # the file, then the directory that names it
    atomic_write(target, b"bytes too")
    assert target.read_bytes() == b"bytes too"
    assert sorted(os.listdir(tmp_path)) == ["weights.bin"]


def test_sync_directory_is_a_no_op_where_directories_cannot_be_opened(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "name", "nt")
    monkeypatch.setattr(os, "open", lambda *a, **k: pytest.fail("opened a directory"))
    _files.sync_directory(tmp_path)
