"""Saves that fail: a full disk, and background saves that fail after the script stopped looking.

A full disk is tested three ways: a real 1 MiB tmpfs (when this runs as root and may mount),
writes routed to ``/dev/full`` (the kernel's ENOSPC through Python's and torch's writers, on
every machine), and an fsync that reports ENOSPC (as NFS does). Exit-time reports are checked
in real subprocesses.
"""

import builtins
import errno
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tmpfs

from unbroken.checkpoint import Checkpointer


def _committed(directory):
    return sorted(p.name for p in Path(directory).iterdir())


def _save_step_1(directory):
    checkpointer = Checkpointer(directory)
    checkpointer.save(1, {"x": torch.ones(10)})
    return checkpointer


def _fail(checkpointer, blocking, big=300_000, step=2):
    """The error of a save of ``big`` float32 zeros that must fail (in ``wait`` if async)."""
    with pytest.raises(OSError) as error:
        checkpointer.save(step, {"x": torch.zeros(big)}, blocking=blocking)
        checkpointer.wait()
    return error.value


def _assert_disk_full(error, directory, at_least):
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, repr(error)
    message = str(error)
    assert "No space left on device" in message and "disk" in message and "full" in message
    assert str(directory) in message, message
    needed = re.search(r"needs about \S+ \S+ \((\d+) bytes, an estimate", message)
    assert needed and int(needed.group(1)) >= at_least, message
    assert re.search(r"\((\d+) bytes\) (is|are) free", message), message
    return message


def _assert_untouched(directory):
    assert _committed(directory) == ["step-000000001"]  # no temporary directory left
    restored = Checkpointer(directory).load_latest({"x": None})
    assert restored.step == 1 and torch.equal(restored.values["x"], torch.ones(10))


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs: a file system that really fills up."""
    with tmpfs(tmp_path / "disk") as mountpoint:
        yield mountpoint


@pytest.mark.parametrize("blocking", [True, False])
def test_a_full_disk_is_an_enospc_oserror_that_says_so_on_a_real_tmpfs(tiny_disk, blocking):
    directory = tiny_disk / "ckpt"
    checkpointer = _save_step_1(directory)
    error = _fail(checkpointer, blocking)
    message = _assert_disk_full(error, directory, at_least=1_200_000)
    free = int(re.search(r"\((\d+) bytes\) (is|are) free", message).group(1))
    assert free == shutil.disk_usage(directory).free  # measured after the clean-up
    _assert_untouched(directory)
    _assert_disk_full(_fail(checkpointer, blocking, step=1), directory, 1_200_000)
    _assert_untouched(directory)  # replacing a step failed: the old one is back


@pytest.fixture
def dev_full(monkeypatch):
    """Route the writes of new files whose names match a pattern to /dev/full."""
    real_open = builtins.open

    def route(pattern):
        def routed(path, mode="r", *args, **kwargs):
            if "x" in mode and re.search(pattern, Path(path).name):
                real_open(path, mode).close()  # the file exists, as it would
                return real_open("/dev/full", mode.replace("x", "w"), *args, **kwargs)
            return real_open(path, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", routed)

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    return route


@pytest.mark.parametrize(
    "where, big",
    [("data file, inside torch.save", 300_000), ("data file, at the flush", 1), ("manifest", 1)],
)
@pytest.mark.parametrize("blocking", [True, False])
def test_writes_the_kernel_refuses_with_enospc_say_the_disk_is_full(
    tmp_path, dev_full, where, big, blocking
):
    directory = tmp_path / "ckpt"
    checkpointer = _save_step_1(directory)
    dev_full(r"^\d+-x\.pt$" if where.startswith("data") else r"^manifest\.json$")
    error = _fail(checkpointer, blocking, big=big)
    _assert_disk_full(error, directory, at_least=4 * big)
    _assert_untouched(directory)


@pytest.mark.parametrize("blocking", [True, False])
def test_an_fsync_that_reports_enospc_says_the_disk_is_full(tmp_path, monkeypatch, blocking):
    directory = tmp_path / "ckpt"
    checkpointer = _save_step_1(directory)

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    error = _fail(checkpointer, blocking)
    monkeypatch.undo()
    _assert_disk_full(error, directory, at_least=1_200_000)
    _assert_untouched(directory)


def test_other_write_errors_are_raised_as_themselves_not_as_torch_runtime_errors(
    tmp_path, monkeypatch
):
    """torch.save turns an error of the file it writes into "unexpected pos": the cause is kept."""
    directory = tmp_path / "ckpt"
    checkpointer = _save_step_1(directory)
    real_open = builtins.open

    class Failing:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.file.close()

    def failing_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return Failing(file) if "x" in mode else file

    monkeypatch.setattr(builtins, "open", failing_open)
    error = _fail(checkpointer, blocking=True)
    assert error.errno == errno.EIO and "Input/output error" in str(error)
    monkeypatch.undo()
    _assert_untouched(directory)


# ------------------------------------------------------------------------- exit-time reports

_SCRIPT = """
import gc, resource, signal, sys
import torch
from unbroken import Checkpointer

directory, mode = sys.argv[1], sys.argv[2]
checkpointer = Checkpointer(directory)
checkpointer.save(1, {"x": torch.ones(10)})
if mode != "succeeds":
    # Files over 64 KiB now fail with EFBIG, as on a file system with a file size limit.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
checkpointer.save(2, {"x": torch.zeros(100_000)}, blocking=False)
if mode == "dropped":
    del checkpointer
    gc.collect()
if mode == "waited":
    try:
        checkpointer.wait()
    except OSError as error:
        print("caught", error.errno, flush=True)
if mode == "raises":
    raise KeyError("the script's own error")
print("end of script", flush=True)
"""


def _run(tmp_path, mode):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    directory = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, str(script), str(directory), mode],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, directory


@pytest.mark.parametrize("mode", ["forgotten", "dropped"])
def test_a_failed_background_save_never_waited_for_is_reported_at_exit(tmp_path, mode):
    done, directory = _run(tmp_path, mode)
    assert "end of script" in done.stdout
    assert "unbroken.Checkpointer" in done.stderr and "FAILED" in done.stderr, done.stderr
    assert str(directory / "step-000000002") in done.stderr
    assert "File too large" in done.stderr and "Traceback" in done.stderr
    assert "close()" in done.stderr  # says how to have it raised instead
    # The exit status stays the script's: see unbroken/_background.py for why.
    assert done.returncode == 0
    assert _committed(directory) == ["step-000000001"]


def test_a_pending_background_save_is_finished_at_exit(tmp_path):
    done, directory = _run(tmp_path, "succeeds")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert Checkpointer(directory).load_latest({"x": None}).step == 2


def test_a_failure_already_raised_by_wait_is_not_reported_again(tmp_path):
    done, _ = _run(tmp_path, "waited")
    assert done.returncode == 0 and f"caught {errno.EFBIG}" in done.stdout
    assert "unbroken" not in done.stderr, done.stderr


def test_the_report_comes_with_the_scripts_own_error(tmp_path):
    done, directory = _run(tmp_path, "raises")
    assert done.returncode == 1
    assert 'KeyError: "the script\'s own error"' in done.stderr
    assert str(directory / "step-000000002") in done.stderr and "FAILED" in done.stderr
