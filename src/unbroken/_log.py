"""The library's run messages: ``logging.getLogger("unbroken")``.

The run's course (started or resumed from where, a preemption saved, how it finished) is logged
at INFO, its details (the reasons of a checkpoint interval, a fresh start's way to its first
step) at DEBUG; warnings stay ``warnings``. A user who configures
nothing sees each message on stderr as ``unbroken: <message>``, flushed at once: a batch job's
log shows it as it happens. A user who configures logging decides:

- a console handler on the root logger (``logging.basicConfig()``) takes the messages over, in
  its own format (the default line steps aside, so nothing is printed twice);
- ``logging.getLogger("unbroken").setLevel(logging.WARNING)`` silences them;
- a filter or handler on the ``"unbroken"`` logger filters or redirects them.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("unbroken")


class _Console(logging.Handler):
    """The default output: ``unbroken: <message>`` on the current ``sys.stderr`` (looked up at
    each message, so a redirected stderr receives it), unless the user gave the root logger a
    console handler of their own."""

    def emit(self, record: logging.LogRecord) -> None:
        if _user_console():
            return
        try:
            print(f"unbroken: {record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


def _user_console() -> bool:
    """Whether the root logger has a plain ``StreamHandler`` on stdout or stderr (what
    ``logging.basicConfig()`` adds); test harnesses' capture handlers are subclasses."""
    consoles = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    return any(
        type(handler) is logging.StreamHandler and handler.stream in consoles
        for handler in logging.getLogger().handlers
    )


if not any(isinstance(handler, _Console) for handler in logger.handlers):
    logger.addHandler(_Console())
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)
