"""``unbroken inspect DIR`` and ``unbroken verify DIR``: what a run's checkpoints hold, and
whether a resume would find them whole. ``checkpoints`` finds and checks them, ``hf`` does the
same for Hugging Face folders, ``report`` says what a resume would do and prints it.

``DIR`` is a run directory (``unbroken.Trainer``'s: its checkpoints are in ``DIR/checkpoints``),
a ``Checkpointer`` directory (one ``step-*`` subdirectory per checkpoint), or one checkpoint
directory; a local path, or a URL in object storage (``s3://bucket/runs/exp1``, with
``--storage-options '{"endpoint_url": ...}'`` for its filesystem, or the ``AWS_*`` environment
variables). Nothing is changed on disk: leftovers of killed writers (``.tmp-*``) are ignored, and
a checkpoint moved aside (``.old-step-*``) is listed where ``load_latest`` would consider it.
Checkpoints moved into ``damaged/`` as damaged (``checkpoint.verdict``) are listed apart,
with why; they never fail ``verify``, since no resume reads them.

``DIR`` may also be, on a local disk, a Hugging Face output directory (``transformers.Trainer``'s
``output_dir``, holding ``checkpoint-<step>`` folders) or one ``checkpoint-<step>`` folder,
recognised by ``unbroken-seal.json`` or ``trainer_state.json`` in a folder of that name (see
``cli.hf``; unbroken's own kinds are looked for first). Each folder is ``ok`` when its seal
holds (``unbroken.hf.seal``: every listed file there with its size and sha256), ``unsealed``
without a seal (its save did not finish, or nothing of ``unbroken.hf`` sealed it) or
``damaged``; a resume is what ``unbroken.hf.Trainer`` does with ``resume_from_checkpoint``: the
newest sealed folder, skipping the newer ones, and none sealed (or one folder named that is not)
fails. ``inspect`` reads a sealed folder's position from rank 0's ``unbroken-state-rank0.json``
(its loader) and ``trainer_state.json`` (the global step, as ``optimizer_step``).

A checkpoint *verifies* when ``unbroken.checkpoint.verdict.classify`` finds it ``ok``: the one
judgement ``Checkpointer.load_latest`` makes too (its manifest intact, every listed file there with
its size and sha256, every file but DCP's shards loading with ``torch.load(weights_only=True)``
and fitting its manifest entry), so a file resealed over garbage or a pickle that would run code
is reported as corrupt, as ``load_latest`` would skip it. ``inspect`` also keeps the small entries, to find the
Trainer's loop counters (entry ``progress``) and the loaders' cursors (any saved
``unbroken.DataLoader``, ``CombinedLoader``, ``resumable`` or ``shuffle_buffer`` state, at the
top of an entry or nested in a dict); of a checkpoint saved by several ranks, rank 0's part.
``verify`` makes the same checks; it prints no positions. Both also check what a resume of a
Trainer's run needs besides a checkpoint: its ``metrics.csv`` (next to ``checkpoints/``) must
hold at least the bytes that the checkpoint a resume would load records, and those bytes must
hash to the sha256 it records (the log's rows up to a checkpoint are under its seal; a
checkpoint saved by a version of unbroken that recorded no sha256 is checked by size only).

Batches and samples are counts of what the user had received in the epoch (epochs count from
0), so "continue epoch 2 at batch 37" means 37 batches of epoch 2 were trained on and batch 37
(counting from 0) comes next.

Exit status: 0 when the newest checkpoint verifies (``inspect``: whenever checkpoints were
found); 1 (``verify``) when the newest checkpoint does not verify (of Hugging Face folders: is
unsealed or damaged), even if an older one does, or
when the run's ``metrics.csv`` is missing, shorter than it records, or changed in those bytes; 2 for a usage error, a
missing directory, no checkpoints found, or a store that could not be read
(``RemoteUnavailable``: a checkpoint not read is never called corrupt).

``--json`` prints one JSON document (``Report``) on stdout instead of the text::

    {"command": "inspect" | "verify",
     "directory": "<DIR as given>",
     "kind": "run" | "checkpoints" | "checkpoint" | "hf-run" | "hf-checkpoint",
     "checkpoints_directory": "<absolute path of the directory holding the checkpoints>",
     "checkpoints": [                       # oldest step first
        {"name": "step-000000120", "path": "<absolute path>", "step": 120,
         "written": "2025-01-31T12:00:00Z" | null,   # manifest.json's (the seal's) mtime, UTC
         "bytes": 123456,                            # every file under the directory
         "verified": true,
         "status": "ok" | "corrupt" | "unsupported", # unsupported: another format version
                   # (Hugging Face folders: "ok" | "unsealed" | "damaged")
         "problems": ["000-model.pt does not match its sha256 in the manifest", ...],
         "world_size": 1 | null, "entries": ["model", "optimizer", ...] | null,
                                    # (Hugging Face folders: the files, "model.safetensors", ...)
         "position": null | {"epoch": 2, "phase": "train" | "val" | "end" | null,
                             "batch": 37, "sample": 2368 | null,
                             "optimizer_step": 120 | null,
                             "source": "progress" | "<a loader's entry name>"
                                       | "unbroken-state-rank0.json"},
         "loaders": [<loader>, ...],                 # the loaders' cursors, as below
         "log_bytes": 5120 | null,                   # the Trainer's metrics.csv size it records
         "log_sha256": "<64 hex digits>" | null},    # and the sha256 of those bytes
        ...],
     "newest": "step-000000130",
     "ok": false,                            # the newest checkpoint verifies (and the log fits)
     "resume": {"checkpoint": "step-000000120" | null,   # what load_latest would restore
                "step": 120 | null,
                "skipped": ["step-000000130"],           # newer ones it would skip as corrupt
                                                         # (unsealed or damaged)
                "fails": null | "<why load_latest would raise instead>",
                "position": <as above> | null,
                "loaders": [<loader>, ...],              # of the checkpoint it would load
                "summary": "resume would load checkpoint step-000000120 and ..."},
     "log": null | {"path": "<DIR>/metrics.csv",            # a Trainer's run directory only
                    "bytes": 4096 | null,                   # null: missing
                    "expected": 5120,                       # what the resume's checkpoint records
                    "sha256": "<64 hex digits>" | null,     # of those bytes, as it records
                    "ok": false,                            # long enough, and those bytes hash so
                    "problem": "<path> has 4096 bytes, and checkpoint ... says 5120 were ..."},
     "damaged": [                           # moved aside as damaged: listed, never a failure
        {"name": "2025-01-31T12-00-00.000000Z-step-000000130",
         "path": "<absolute path, in damaged/>", "checkpoint": "<where it was>" | null,
         "moved": "2025-01-31T12:00:00Z" | null, "problems": ["<why it was judged damaged>"]},
        ...]}

    <loader>: {"name": "train_loader", "format": "unbroken.DataLoader", "version": 3,
               "seed": 0, "epoch": 2, "batches": 37, "samples": 2368}
               (the fields its state has: a CombinedLoader's "mode", and its children's in
               "loaders", named "train_loader[a]"; a resumable's "items")

``verify --json`` has the same shape, with every ``position`` null and every ``loaders`` empty. A usage
error prints ``{"command": ..., "directory": ..., "error": "<message>"}`` (and the message on
stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .checkpoints import EXIT_CORRUPT, EXIT_OK, EXIT_USAGE, UsageError
from .report import report, text

__all__ = ["main"]  # the console script; the rest is internal


# ------------------------------------------------------------------------------- the command


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "directory",
        metavar="DIR",
        help="a run directory (a Trainer's), a Checkpointer directory, or one checkpoint: a "
        "local path or a URL in object storage; or, local only, a Hugging Face output directory "
        "or one of its checkpoint-<step> folders",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument(
        "--storage-options",
        metavar="JSON",
        type=json.loads,
        default=None,
        help="for a URL (s3://bucket/runs/exp1): the fsspec options of its filesystem as JSON, "
        'e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\' (the AWS_* environment variables '
        "work too)",
    )
    main_parser = argparse.ArgumentParser(
        prog="unbroken",
        description="Inspect and verify unbroken checkpoints (nothing on disk is changed).",
    )
    commands = main_parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser(
        "inspect",
        parents=[common],
        help="list the checkpoints: position, time, size, whether they verify; what a resume "
        "would do",
        description="List every checkpoint (step, epoch and batch, time written, size, whether "
        "it verifies), the loaders' cursors in the newest one that verifies, and what a resume "
        "would do. Exit 0 if checkpoints were found, 2 otherwise.",
    )
    commands.add_parser(
        "verify",
        parents=[common],
        help="exit 0 if the newest checkpoint verifies, 1 if it is corrupt",
        description="Check every checkpoint's manifest and the sha256 of each of its files, "
        "and that a Trainer run's metrics.csv holds what the checkpoint to resume from "
        "records. Exit 0 if the newest checkpoint verifies (and the log fits), 1 if it does "
        "not (even if an older one does), 2 if there is no checkpoint or the store cannot be "
        "read.",
    )
    return main_parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``unbroken`` command: ``inspect`` or ``verify`` a checkpoint or run directory.

    Args:
        argv: The command line without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit status: 0 when every checkpoint checks out, 1 when one is corrupt, 2 for a
        usage error or a directory that cannot be read.
    """
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # argparse's usage errors (2) and --help (0)
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    command, directory, as_json = args.command, args.directory, args.json
    try:
        document = report(
            command,
            directory,
            read_states=command == "inspect",
            storage_options=args.storage_options,
        )
    except (UsageError, OSError, ValueError) as error:  # a directory that cannot be listed,
        # a URL whose store cannot be reached (RemoteUnavailable), an unknown protocol
        print(f"unbroken {command}: error: {error}", file=sys.stderr)
        if as_json:
            print(json.dumps({"command": command, "directory": directory, "error": str(error)}))
        return EXIT_USAGE
    if as_json:
        print(json.dumps(document, indent=2))
    else:
        print(text(document))
    if command == "verify" and not document["ok"]:
        return EXIT_CORRUPT
    return EXIT_OK
