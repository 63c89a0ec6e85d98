"""Suite-wide settings: tests/support on the import path, Hypothesis without deadlines (worker
processes start at their own pace), and the preemption signals at their default action."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The shared helpers and job scripts (tests/support) import by bare name from any folder:
# `from pipelines import Counting`, `from trainer_job import run`, `from locations import SUPPORT`.
# Set here, not in pyproject.toml, so mutmut's copy of tests/ finds them too; a forkserver started
# later inherits this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# Tests signal their own process; if unbroken failed to install its handlers, the default action
# kills the test run loudly. A runner may have installed its own (mutmut's fork server makes
# SIGTERM exit with status 0, which would read as a pass), so put the defaults back.
for _signal in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_signal, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _default_preemption_signals():
    """A preempted Trainer run in-process leaves SIGTERM/SIGUSR1 ignored (as it must on its way
    out of a real process): put their default action back for the next test."""
    yield
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("default")


@pytest.fixture(autouse=True, scope="session")
def _local_copies(tmp_path_factory):
    """FsspecStorage keeps local copies of checkpoint files under $XDG_CACHE_HOME: the suite's
    (and its subprocesses') go to a temporary directory, never the user's cache."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def s3():
    """One real S3 protocol server (moto's, on 127.0.0.1) for the whole session."""
    from unbroken.testing import S3Server

    with S3Server() as server:
        yield server


@contextlib.contextmanager
def tmpfs(mountpoint, size: str = "1m"):
    """A real tmpfs of ``size`` mounted on ``mountpoint`` (created), unmounted afterwards; the
    test is skipped where this process may not mount (it needs root)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mountpoint.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def reseal(checkpoint: Path, file: str | None = None, **changes) -> None:
    """Make a checkpoint's ``manifest.json`` vouch for ``file`` as it is now, with ``changes``
    to its fields (the format's documented seal): damage a hash cannot see."""
    manifest = {**json.loads((checkpoint / "manifest.json").read_text()), **changes}
    if file is not None:
        data = (checkpoint / file).read_bytes()
        manifest["files"][file] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    del manifest["sha256"]
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["sha256"] = hashlib.sha256(canonical).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


# Test tiers (TESTING.md): `make test` runs every test; `make test-fast` deselects these markers.
# Assigned here, by what a test needs, so a new test lands in its tier without a decorator.
_KINDS = {
    "distributed": ("test_distributed_", "test_exact_reduction", "test_just_in_time", "test_lease"),
    "lightning": ("test_lightning",),
    "hf": ("test_hf_", "test_huggingface", "test_cli_hf"),
}
# Tests that start processes of their own (a killed run, workers, torchrun) or train for seconds.
_SLOW_MODULES = (
    "test_trainer_signals",
    "test_streaming_faults",
    "test_restart_cost",
    "test_readme",
)
_SLOW_WORDS = re.compile(
    r"kill|sigterm|signal|torchrun|process_group|worker|preempt|restart|subprocess|interrupt"
    r"|resumes_bit|bit_for_bit|end_bit|demo|tmpfs|disk",
    re.IGNORECASE,
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        for marker, prefixes in _KINDS.items():
            if module.startswith(prefixes):
                item.add_marker(marker)
        if "s3" in getattr(item, "fixturenames", ()):
            item.add_marker("s3")
        if module.startswith(_SLOW_MODULES) or _SLOW_WORDS.search(item.name):
            item.add_marker("slow")
