"""A script's measurements run under torchrun: the launch, and the numbers it sends back.

``torchrun_worker`` starts ``script --worker --out DIR FLAGS`` on N ranks (gloo, one thread
each), waits, and returns what rank 0 wrote to ``DIR/results.json``; DIR (inside the repository,
so it is on the same disk the benchmarks write to) is removed afterwards. ``torchrun_script``
starts a whole script on N ranks instead (its rank 0 prints), and returns what rank 0 passed to
``hand_back``. On the ranks, ``slowest`` and ``rank0_decides`` are the two collectives a timed
loop needs. ``kill_group`` and ``last_json``: what a script that starts its own child processes
needs to stop them and read their result. Costs torchrun's start-up, ~2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .env import REPO

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))  # the venv's, beside its python
# What torchrun_script tells its ranks: the launcher's pid (ForeignLoad's root: every rank and
# worker below it counts as the benchmark's own load) and the file hand_back writes.
ROOT_ENV = "UNBROKEN_BENCH_ROOT_PID"
PARTS_ENV = "UNBROKEN_BENCH_PARTS"


def torchrun_worker(script: str, ranks: int, args: argparse.Namespace, *flags: str) -> Any:
    """Run ``script``'s worker on ``ranks`` ranks with ``args``' ``flags`` (attribute names; a
    boolean one is a ``store_true`` option, passed only when true)."""
    out = tempfile.mkdtemp(prefix=f"{Path(script).stem}-", dir=REPO)
    command = [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", script, "--worker"]
    for flag in flags:
        value, option = getattr(args, flag), f"--{flag.replace('_', '-')}"
        if isinstance(value, bool):
            command += [option] if value else []
        else:
            command += [option, str(value)]
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([*command, "--out", out], check=True, env=env)
        return json.loads(Path(out, "results.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def send_back(args: argparse.Namespace, data: Any) -> None:
    """A worker's end: rank 0 writes ``data`` where ``torchrun_worker`` reads it, and every rank
    leaves the process group (tear DDP models down before: after, it may abort the exit)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(args.out, "results.json").write_text(json.dumps(data))
    dist.destroy_process_group()


def parse_or_work(
    parser: argparse.ArgumentParser, worker: Callable[[argparse.Namespace], None]
) -> argparse.Namespace | None:
    """The arguments, with ``--worker``/``--out`` added (how ``torchrun_worker`` starts a rank);
    under ``--worker`` it runs ``worker(args)`` instead and returns None."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:
        return args
    worker(args)
    return None


def torchrun_script(script: str, ranks: int, argv: Sequence[str]) -> tuple[int, Any]:
    """Run ``script argv`` on ``ranks`` ranks under ``torchrun --standalone`` (one thread each,
    its output to this process's). Returns the exit status and what rank 0 passed to
    ``hand_back`` (None if the run failed or passed nothing)."""
    parts = Path(tempfile.mkdtemp(prefix=f"{Path(script).stem}-")) / "parts.json"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", **{ROOT_ENV: str(os.getpid()), PARTS_ENV: str(parts)}
    )
    command = [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", script, *argv]
    try:
        rc = subprocess.run(command, env=env, check=False).returncode
        data = json.loads(parts.read_text()) if rc == 0 and parts.exists() else None
        return rc, data
    finally:
        shutil.rmtree(parts.parent, ignore_errors=True)


def hand_back(data: Any) -> None:
    """On rank 0 of a ``torchrun_script`` run: ``data`` (JSON-able) goes back to the launcher."""
    import torch.distributed as dist

    if dist.get_rank() == 0 and os.environ.get(PARTS_ENV):
        Path(os.environ[PARTS_ENV]).write_text(json.dumps(data))


def launcher_pid() -> int:
    """The pid whose process tree is the run's own load: ``torchrun_script``'s, or torchrun's."""
    return int(os.environ.get(ROOT_ENV, os.getppid()))


def slowest(seconds: float) -> float:
    """The largest of every rank's value (the step that waits for all ranks waits for it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank0_decides(value: bool) -> bool:
    """Rank 0's ``value`` on every rank (e.g. whether to run another round)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(value)])
    dist.broadcast(t, src=0)
    return bool(t.item())


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``proc``'s process group (started with ``start_new_session=True``): its
    ranks and loader workers too. Nothing if the group is gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` that parses as a JSON object (how a child hands its result
    back on stdout, after whatever else it printed), or None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None
