"""Jobs run as real processes forked from one ``multiprocessing`` forkserver.

A fresh interpreter spends ~4 s importing transformers or Accelerate; the forkserver imports
them once (``PRELOAD``) and forks a process per job in ~0.1 s. A job is a ``main(argv)`` of a
module on the tests' path, run with its output in a log file, and ends with its exit status
(-9 when it SIGKILLed itself). The server starts once per pytest process, so it preloads what
every test module using it needs.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from functools import partial

PRELOAD = ["unbroken.hf.trainer", "unbroken.hf.accelerate", "accelerate"]


def run_in_child(main: Callable[[list[str]], int], argv: list[str], log: str) -> None:
    """In the forked process: ``main(argv)`` with its output going to ``log``. Its DataLoader
    workers fork, as in a job started from a shell (a forkserver's children would start them
    through the server, with every dataset pickled)."""
    multiprocessing.set_start_method("fork", force=True)
    with open(log, "ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.exit(main(argv))


def jobs(main: Callable[[list[str]], int]) -> Callable[..., int]:
    """``run(out, *args, expect=0)``: ``main(["--out", out, *args])`` in a forked process,
    logged to ``out + ".log"``; its exit status, checked against ``expect`` unless None."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)

    def run(out: str, *args: str, expect: int | None = 0) -> int:
        process = context.Process(
            target=partial(run_in_child, main), args=(["--out", out, *args], out + ".log")
        )
        process.start()
        process.join(120)
        assert process.exitcode is not None, f"the job in {out} hangs"
        if expect is not None:
            with open(out + ".log") as log:
                assert process.exitcode == expect, log.read()[-3000:]
        return process.exitcode

    return run


def made_once(run: Callable[..., int], tmp_path_factory: object) -> Callable[..., str]:
    """``get(*config)``: the output folder of an uninterrupted run of that configuration, made
    at the first request and shared by the module's tests."""
    made: dict[tuple[str, ...], str] = {}

    def get(*config: str) -> str:
        if config not in made:
            out = str(tmp_path_factory.mktemp("reference") / "run")  # type: ignore[attr-defined]
            run(out, *config)
            made[config] = out
        return made[config]

    return get
