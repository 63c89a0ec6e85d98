"""Background saves: a thread per save, whose error reaches the caller or, failing that, stderr.

A ``save(blocking=False)`` that fails is raised by the Checkpointer's next ``save``, ``wait``,
``load_latest`` or ``close``. A script that calls none of these before it ends would lose the
failure silently, so every background save stays in a registry until its outcome was handed
over (or it was forgotten: a rank it needs died, ``Checkpointer.forget_background``), and an ``atexit`` hook (registered by the first background save, not at import) prints
each failure nobody saw to stderr: the checkpoint, the error with its traceback, and how to have
it raised instead. Python joins the writer threads (they are not daemons) before it runs atexit
hooks, so a pending save is finished by then, never cut off.

The exit status stays what the script made it. An atexit hook can change it only with
``os._exit``, which would skip the rest of the interpreter's shutdown (other libraries' exit
hooks, flushing files the script left open) and overwrite a status the script chose, such as a
requeue code after a preemption. Nothing is lost on disk: the directory still holds the earlier
checkpoints, and ``load_latest`` resumes from the newest of them.
"""

from __future__ import annotations

import atexit
import sys
import threading
import traceback
from collections.abc import Callable

from .storage import basename, parent

_unseen: set[BackgroundSave] = set()  # saves whose outcome no caller has been handed yet
_lock = threading.Lock()
_hooked = False


class BackgroundSave:
    """Runs ``write()`` in a thread; ``result()`` waits for it and raises what it raised."""

    def __init__(self, final: str, write: Callable[[], None]) -> None:
        global _hooked
        self.final = final
        self._write: Callable[[], None] | None = write
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"unbroken-save-{basename(final)}")
        with _lock:
            if not _hooked:
                atexit.register(_report_unseen)
                _hooked = True
            _unseen.add(self)
        self._thread.start()

    def _run(self) -> None:
        write, self._write = self._write, None
        assert write is not None  # each thread runs once
        try:
            write()
        except BaseException as error:  # handed to the caller's thread by result()
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"raised by the background save of {self.final}")
            # The frames hold the CPU copy of the state, possibly gigabytes, for as long as
            # the error lives: until result() or the end of the process.
            traceback.clear_frames(error.__traceback__)
            self._error = error
        else:
            _unseen.discard(self)
        finally:
            del write

    def done(self) -> bool:
        return not self._thread.is_alive()

    def forget(self) -> None:
        """No one will wait for it (``Checkpointer.forget_background``): its failure, expected,
        is not reported at exit."""
        with _lock:
            _unseen.discard(self)

    def result(self) -> None:
        self._thread.join()
        _unseen.discard(self)
        error, self._error = self._error, None
        if error is not None:
            raise error


def _report_unseen() -> None:
    stream = sys.stderr or sys.__stderr__
    for save in sorted(_unseen, key=lambda save: str(save.final)):
        save._thread.join()
        error = save._error
        if error is None or stream is None:
            continue
        stream.write(
            f"\nunbroken.Checkpointer: the background save of checkpoint {save.final} FAILED, "
            "and the script ended without calling wait() or close() (or another save or "
            "load_latest) on its Checkpointer, which would have raised it:\n"
            + "".join(traceback.format_exception(type(error), error, error.__traceback__))
            + f"The checkpoint was not written: load_latest resumes from the newest earlier "
            f"one in {parent(save.final)}. Call checkpointer.close() before the script ends, "
            "or use `with Checkpointer(...) as checkpointer:`, to have such a failure raised.\n"
        )
        stream.flush()
    _unseen.clear()
