"""A script's measurements run under torchrun: the launch, and the numbers it sends back.

``torchrun_worker`` starts ``script --worker --out DIR FLAGS`` on N ranks (gloo, one thread
each), waits, and returns what rank 0 wrote to ``DIR/results.json``; DIR (inside the repository,
so it is on the same disk the benchmarks write to) is removed afterwards. Costs torchrun's
start-up, ~2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .env import REPO


def torchrun_worker(script: str, ranks: int, args: argparse.Namespace, *flags: str) -> Any:
    """Run ``script``'s worker on ``ranks`` ranks with ``args``' ``flags`` (attribute names)."""
    out = tempfile.mkdtemp(prefix=f"{Path(script).stem}-", dir=REPO)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", f"--nproc-per-node={ranks}", script, "--worker"]
    for flag in flags:
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
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
