"""The report of ``inspect``/``verify``: what a resume would do, and the text printed.

A resume of a Trainer's run needs more than a checkpoint that verifies: its ``metrics.csv`` must
hold at least the bytes that checkpoint records (the resume cuts the log back to them), and
those bytes must hash to the sha256 it records (the resume checks it), so the report checks that
too (``log``), in the run directory whose ``checkpoints/`` it found. Costs: one read of the
log's first bytes (a download of the whole object, in a store)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .._units import human
from ..checkpoint import verdict as quarantine
from ..checkpoint.fsspec_storage import is_url, storage_for
from ..checkpoint.storage import Storage, basename, join, parent
from ..train.csvlog import read_sha256
from ..train.rundir import CHECKPOINTS, METRICS
from . import hf
from .checkpoints import (
    CheckpointReport,
    LoaderReport,
    LogReport,
    Position,
    Report,
    Resume,
    UsageError,
    check,
    damaged,
    locate,
)

# -------------------------------------------------------------------------------- the report


def report(
    command: str, given: str, read_states: bool, storage_options: dict[str, Any] | None = None
) -> Report:
    """Everything the command prints, as data; ``given`` is a local path or a URL (with the
    fsspec ``storage_options`` of its filesystem). Raises ``UsageError`` if there is nothing to
    report on."""
    storage, directory = storage_for(given, storage_options, cache=False)  # the store itself
    directory = directory if is_url(given) else directory.rstrip("/") or "/"
    try:
        kind, root, found = locate(directory, storage)
    except UsageError:  # not unbroken's: a Hugging Face output directory or checkpoint?
        located = None if is_url(given) else hf.locate(directory)
        if located is None:
            raise
        kind, root, found = located
    if kind in hf.KINDS:
        checked = [hf.check(path, step, read_states) for step, path in found]
    else:
        checked = [check(storage, path, step, read_states) for step, path in found]
    resume = _resume(checked, kind, root)
    chosen = next((c for c in checked if c["name"] == resume["checkpoint"]), None)
    log = _log(storage, root, chosen, is_url(given))
    if log is not None and not log["ok"] and resume["fails"] is None:
        resume["fails"] = log["problem"]
        resume["summary"] = _summary(
            None, resume["skipped"], log["problem"], kind == "checkpoint", []
        )
    return Report(
        command=command,
        directory=given,
        kind=kind,
        checkpoints_directory=root if is_url(given) else os.path.abspath(root),
        checkpoints=checked,
        newest=checked[-1]["name"],
        ok=checked[-1]["verified"] and (log is None or log["ok"]),
        resume=resume,
        log=log,
        damaged=damaged(storage, root),
    )


def _log(
    storage: Storage, root: str, chosen: CheckpointReport | None, remote: bool
) -> LogReport | None:
    """The run's ``metrics.csv`` against the size and the sha256 of its first bytes that the
    checkpoint a resume would load records (``None`` when that is no Trainer checkpoint in a
    run directory's ``checkpoints``). A checkpoint that records no sha256 (saved by an earlier
    version) is checked by the size only, as the resume does."""
    if chosen is None or chosen["log_bytes"] is None or basename(root) != CHECKPOINTS:
        return None
    path = join(parent(root), METRICS)
    path = path if remote else os.path.abspath(path)
    expected, sha256 = chosen["log_bytes"], chosen["log_sha256"]
    try:
        actual: int | None = storage.size(path)
    except FileNotFoundError:
        actual = None
    found = "is missing" if actual is None else f"has {actual} bytes"
    problem = None
    if actual is None or actual < expected:
        problem = (
            f"{path} {found}, and checkpoint {chosen['name']} says {expected} were logged: a "
            "resume would fail. Restore the log (from a copy, or an earlier version of the "
            "object if the store keeps them), or train in a new run directory"
        )
    elif sha256 is not None and (hashed := _prefix_sha256(storage, path, expected)) != sha256:
        problem = (
            f"{path} changed since checkpoint {chosen['name']} was taken: the sha256 of its "
            f"first {expected} bytes is {hashed}, and the checkpoint says {sha256}: a resume "
            "would fail. Restore the log (from a copy, or an earlier version of the object if "
            "the store keeps them), or train in a new run directory"
        )
    return LogReport(
        path=path,
        bytes=actual,
        expected=expected,
        sha256=sha256,
        ok=problem is None,
        problem=problem,
    )


def _prefix_sha256(storage: Storage, path: str, size: int) -> str:
    """The sha256 of the first ``size`` bytes of ``path`` (which holds at least that many)."""
    with storage.open_read(path) as opened:
        try:
            return read_sha256(opened, size, path).hexdigest()
        except OSError as error:  # shortened since its size was read: no hash of those bytes
            return f"not computable ({error})"


def _resume(checked: list[CheckpointReport], kind: str, root: str) -> Resume:
    """What ``load_latest`` would do: try the newest first, skip the corrupt ones, raise at one
    of another format version. Of Hugging Face folders, what ``unbroken.hf.Trainer`` would do
    (``unbroken.hf.last_sealed``): the newest sealed, skipping the newer ones; none: raise."""
    skipped: list[str] = []
    why: list[str] = []  # each skipped folder's status, said of Hugging Face folders
    chosen: CheckpointReport | None = None
    fails = None
    for candidate in reversed(checked):
        if candidate["status"] == "unsupported":
            fails = candidate["problems"][0]
            break
        if candidate["verified"]:
            chosen = candidate
            break
        skipped.append(candidate["name"])
        why.append(candidate["status"])
    if chosen is None and kind in hf.KINDS:
        fails = hf.no_resume(kind, root, checked)
        if kind == hf.HF_CHECKPOINT:  # a folder named to resume from is refused, not skipped
            skipped, why = [], []
    one = kind == "checkpoint"
    return Resume(
        checkpoint=chosen["name"] if chosen else None,
        step=chosen["step"] if chosen else None,
        skipped=skipped,
        fails=fails,
        position=chosen["position"] if chosen else None,
        loaders=chosen["loaders"] if chosen else [],
        summary=_summary(chosen, skipped, fails, one, why if kind in hf.KINDS else []),
    )


def _summary(
    chosen: CheckpointReport | None,
    skipped: list[str],
    fails: str | None,
    one: bool,
    why: list[str],
) -> str:
    """``why``: each skipped checkpoint's status, said after its name (else "corrupt", once)."""
    each = ", ".join(f"{name} ({status})" for name, status in zip(skipped, why))
    if fails is not None:
        skips = f" (skipping {each or _names(skipped) + ': corrupt'})" if skipped else ""
        return f"a resume would fail{skips}: {fails}"
    if chosen is None:
        what = "this checkpoint does not verify" if one else "no checkpoint verifies"
        return f"{what}: a resume would skip {_names(skipped)} and start fresh"
    where = _where(chosen["position"])
    text = f"resume would load checkpoint {chosen['name']}{where}"
    if skipped:
        text += f"; it would skip {each or _names(skipped) + ' (corrupt)'}"
    return text


def _where(position: Position | None) -> str:
    if position is None:
        return ""
    epoch, batch, phase = position["epoch"], position["batch"], position["phase"]
    sample = f" (sample {position['sample']})" if position["sample"] is not None else ""
    step = position["optimizer_step"]
    steps = f", optimizer step {step}" if step is not None else ""
    if phase == "val":
        return f" and continue the validation of epoch {epoch} at batch {batch}{sample}{steps}"
    if phase == "end":
        return f" and finish epoch {epoch}, then start epoch {epoch + 1}{steps}"
    if batch == 0 and phase == "train":
        # Only the save at the end of fit is taken before an epoch's first batch.
        finished = " (where the run ended: only a larger max_epochs or max_steps trains on)"
        finished = finished if epoch else ""
        return f" and start epoch {epoch} at its first batch{steps}{finished}"
    return f" and continue epoch {epoch} at batch {batch}{sample}{steps}"


def _names(names: list[str]) -> str:
    return ", ".join(names)


# ---------------------------------------------------------------------------------- printing


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Rows aligned under their headers; the columns in ``right`` right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [
            str(cell).rjust(width) if i in right else str(cell).ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def text(document: Report) -> str:
    inspecting = document["command"] == "inspect"
    where = document["checkpoints_directory"]
    kind = {
        "run": "run directory",
        "checkpoints": "checkpoint directory",
        hf.HF_RUN: "Hugging Face output directory",
    }.get(document["kind"])
    one = "Hugging Face checkpoint" if document["kind"] == hf.HF_CHECKPOINT else "checkpoint"
    lines = [
        f"{kind} {document['directory']}: checkpoints in {where}"
        if kind
        else f"{one} {document['directory']}",
        "",
    ]
    headers = ["CHECKPOINT", "STEP"]
    if inspecting:
        headers += ["EPOCH", "BATCH", "SAMPLE", "OPT STEP"]
    headers += ["WRITTEN (UTC)", "SIZE", "VERIFIED"]
    rows = []
    for checkpoint in document["checkpoints"]:
        row = [checkpoint["name"], str(checkpoint["step"])]
        if inspecting:
            position = checkpoint["position"]
            if position is None:
                row += ["-", "-", "-", "-"]
            else:
                batch = str(position["batch"])
                if position["phase"] in ("val", "end"):
                    batch = f"{position['phase']} {batch}"
                row += [
                    str(position["epoch"]),
                    batch,
                    _cell(position["sample"]),
                    _cell(position["optimizer_step"]),
                ]
        verdict = {"ok": "ok", "corrupt": "CORRUPT", "unsupported": "UNSUPPORTED"}
        verdict.update(unsealed="UNSEALED", damaged="DAMAGED")  # Hugging Face folders
        row += [
            checkpoint["written"] or "-",
            human(checkpoint["bytes"]),
            verdict[checkpoint["status"]],
        ]
        rows.append(row)
    right = {1, 2, 3, 4, 5, 7} if inspecting else {1, 3}
    lines += table(headers, rows, right)
    troubled = [c for c in document["checkpoints"] if c["problems"]]
    if troubled:
        lines.append("")
    for checkpoint in troubled:
        for problem in checkpoint["problems"]:
            lines.append(f"{checkpoint['name']}: {problem}")
    if document["damaged"]:  # out of a resume's view: listed, never a failure
        lines += ["", f"moved aside as damaged, in {join(where, quarantine.DIRECTORY)}:"]
        for found in document["damaged"]:
            why = "; ".join(found["problems"]) or "why is not recorded"
            lines.append(f"  {found['name']} (was {found['checkpoint'] or '?'}): {why}")
    resume = document["resume"]
    if inspecting and resume["loaders"]:
        lines += ["", f"loaders in {resume['checkpoint']}:"]
        rows = []

        def add(loader: LoaderReport) -> None:
            rows.append(
                [
                    loader["name"],
                    loader.get("format", "-"),
                    loader.get("mode", "-"),
                    _cell(loader.get("seed")),
                    _cell(loader.get("epoch")),
                    _cell(loader.get("batches")),
                    _cell(loader.get("samples", loader.get("items"))),
                ]
            )
            for child in loader.get("loaders", []):
                add(child)

        for loader in resume["loaders"]:
            add(loader)
        headers = ["NAME", "FORMAT", "MODE", "SEED", "EPOCH", "BATCHES", "SAMPLES"]
        lines += ["  " + line for line in table(headers, rows, {3, 4, 5, 6})]
    lines.append("")
    lines.append(_verdict(document) if not inspecting else _sentence(resume["summary"]))
    return "\n".join(lines)


def _verdict(document: Report) -> str:
    """``verify``'s last line: whether the newest checkpoint verifies, and if not, what a
    resume would do instead."""
    newest, resume, log = document["checkpoints"][-1], document["resume"], document["log"]
    if document["ok"]:
        return f"OK: the newest checkpoint, {newest['name']}, verifies"
    if newest["verified"] and log is not None and not log["ok"]:
        return f"FAILED: the newest checkpoint, {newest['name']}, verifies, but {log['problem']}"
    if newest["status"] == "unsupported":  # load_latest raises at it rather than skip it
        return (
            f"FAILED: the newest checkpoint, {newest['name']}, is of another format version; "
            f"a resume would fail: {newest['problems'][0]}"
        )
    if resume["checkpoint"] is not None:
        then = (
            f"a resume would skip {_names(resume['skipped'])} and fall back to "
            f"{resume['checkpoint']} (step {resume['step']})"
        )
    elif resume["fails"] is not None:
        then = (
            "a resume would fail"
            + (f" (after skipping {_names(resume['skipped'])})" if resume["skipped"] else "")
            + f": {resume['fails']}"
        )
    else:
        then = "no checkpoint verifies: a resume would start fresh"
    return (
        f"FAILED: the newest checkpoint, {newest['name']}, does not verify "
        f"({newest['problems'][0]}); {then}"
    )


def _sentence(summary: str) -> str:
    return summary[:1].upper() + summary[1:] + "."
