"""Checkpoints in object storage, side by side: unbroken's ``Checkpointer`` on an ``s3://`` URL
against ``torch.save`` through an fsspec file and torch DCP's ``FsspecWriter``.

How it measures, and what the numbers mean: ``docs/benchmarks/remote-checkpoint.md``.

    .venv/bin/python benchmarks/remote_checkpoint.py               # ~100 MB, 3 rounds: ~1.5 min
    .venv/bin/python benchmarks/remote_checkpoint.py --quick       # 25 MB, 1 round: a smoke run, ~25 s
    .venv/bin/python benchmarks/remote_checkpoint.py --mb 400 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
WIDTH = 1024
SYSTEMS = ("unbroken", "unbroken-bg", "torchsave", "dcp", "s3torchconnector")
LABELS = {
    "unbroken": "unbroken blocking",
    "unbroken-bg": "unbroken background",
    "torchsave": "torch.save + fsspec",
    "dcp": "DCP FsspecWriter",
    "s3torchconnector": "s3torchconnector",
}
PEERS = ("torchsave", "dcp", "s3torchconnector")
PREFIX = {
    "unbroken": "unbroken",
    "unbroken-bg": "unbroken-bg",
    "torchsave": "torchsave/ckpt.pt",
    "dcp": "dcp",
    "s3torchconnector": "s3torchconnector/ckpt.pt",
}


# --------------------------------------------------------------------------- the state


def make_state(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    parts: list[torch.nn.Module] = []
    for i in range(layers):
        parts.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < layers - 1:
            parts.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*parts)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def layers_for(mb: float) -> int:
    """Layers whose parameters and AdamW state (3 x the parameters) come closest to ``mb``."""
    per_layer = 3 * 4 * (WIDTH * WIDTH + WIDTH) / 1e6
    return max(1, round(mb / per_layer))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    batch = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    optimizer.step()


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint holds: the parameters, then each one's optimizer state."""
    found = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        per_param = optimizer.state.get(p, {})
        found += [per_param[k] for k in sorted(per_param) if isinstance(per_param[k], torch.Tensor)]
    return found


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(model, optimizer))


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in state_tensors(model, optimizer):
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def host_copy(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The baseline: the model's and the optimizer's tensors copied to host memory."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in optimizer.state_dict()["state"].items()
        },
    }


def verify(model, optimizer, expected: list[torch.Tensor], where: str) -> None:
    got = state_tensors(model, optimizer)
    assert len(got) == len(expected), f"{where}: {len(got)} tensors loaded, {len(expected)} saved"
    n_params = len(list(model.parameters()))
    for i, (a, b) in enumerate(zip(got, expected)):
        what = "parameter" if i < n_params else "optimizer state tensor"
        assert torch.equal(a, b), f"{where}: {what} {i} differs from the one saved"


# --------------------------------------------------------------------------- the systems


def _quiet_dcp() -> None:
    # "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to
    # save in a single process": what we mean.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    # "Detected an existing checkpoint in s3://bench/dcp, overwriting since self.overwrite=True":
    # each round overwrites the last, as torch.save's object is overwritten.
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")


def _new_filesystems() -> None:
    """Forget fsspec's cached filesystem objects (and their connections and listings), so that
    a peer's load starts as fresh as a new Checkpointer, which makes its own."""
    import fsspec

    fsspec.AbstractFileSystem.clear_instance_cache()
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass


class System:
    """One way of checkpointing: ``save`` returns (stall seconds, save seconds); ``load`` fills
    a fresh model and optimizer and returns the seconds it took."""

    name = ""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url, self.options = url, options

    def save(self, step: int, model, optimizer) -> tuple[float, float]:
        raise NotImplementedError

    def load(self, model, optimizer) -> float:
        _new_filesystems()
        start = time.perf_counter()
        self.restore(f"{self.url}/{PREFIX[self.name]}", self.options, model, optimizer)
        return time.perf_counter() - start

    def restore(self, path: str, options: dict[str, Any], model, optimizer) -> None:
        raise NotImplementedError


def unbroken_checkpointer(directory: str, options: dict[str, Any], cache: str | bool) -> Any:
    """``Checkpointer(directory, storage_options=options)`` whose local copies of checkpoint
    files go to ``cache`` (False: none, as on a new machine, where every peer downloads too),
    checked as the plain constructor checks the bucket."""
    from unbroken.checkpoint import Checkpointer, FsspecStorage

    storage = FsspecStorage(directory, options, cache=cache)
    storage.check()
    return Checkpointer(directory, storage=storage)


class Unbroken(System):
    def __init__(self, url: str, options: dict[str, Any], background: bool) -> None:
        super().__init__(url, options)
        self.name = "unbroken-bg" if background else "unbroken"
        self.background = background
        self.directory = f"{url}/{PREFIX[self.name]}"
        # The saver keeps its local copies (the default, whose disk writes count), in a
        # temporary directory rather than the user's cache.
        self.copies = tempfile.mkdtemp(prefix="unbroken-bench-copies-")
        weakref.finalize(self, shutil.rmtree, self.copies, True)
        self.checkpointer = unbroken_checkpointer(self.directory, options, self.copies)
        self.construct_s: list[float] = []

    def save(self, step, model, optimizer):
        state = {"model": model, "optimizer": optimizer}
        start = time.perf_counter()
        self.checkpointer.save(step, state, blocking=not self.background)
        returned = time.perf_counter()
        self.checkpointer.wait()
        done = time.perf_counter()
        return returned - start, done - start

    def load(self, model, optimizer):
        start = time.perf_counter()
        reader = unbroken_checkpointer(self.directory, self.options, cache=False)
        built = time.perf_counter()
        restored = reader.load_latest({"model": model, "optimizer": optimizer})
        done = time.perf_counter()
        assert restored is not None, f"{self.directory}: no checkpoint found"
        self.construct_s.append(built - start)
        return done - start


class TorchSave(System):
    name = "torchsave"

    def save(self, step, model, optimizer):
        import fsspec

        start = time.perf_counter()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        with fsspec.open(f"{self.url}/{PREFIX[self.name]}", "wb", **self.options) as f:
            torch.save(state, f)
        seconds = time.perf_counter() - start
        return seconds, seconds

    def restore(self, path, options, model, optimizer):
        torchsave_load(path, options, model, optimizer)


def torchsave_load(path: str, options: dict[str, Any], model, optimizer) -> None:
    import fsspec

    with fsspec.open(path, "rb", **options) as f:
        state = torch.load(f, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


class DCP(System):
    name = "dcp"

    def save(self, step, model, optimizer):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict

        _quiet_dcp()
        start = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        writer = FsspecWriter(f"{self.url}/{PREFIX[self.name]}", **self.options)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
        seconds = time.perf_counter() - start
        return seconds, seconds

    def restore(self, path, options, model, optimizer):
        dcp_load(path, options, model, optimizer)


def dcp_load(path: str, options: dict[str, Any], model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _quiet_dcp()
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the templates DCP loads into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=FsspecReader(path, **options))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def make_system(name: str, url: str, options: dict[str, Any]) -> System:
    if name in ("unbroken", "unbroken-bg"):
        return Unbroken(url, options, background=name == "unbroken-bg")
    if name == "torchsave":
        return TorchSave(url, options)
    if name == "dcp":
        return DCP(url, options)
    raise ValueError(name)


def s3torchconnector_skip_reason() -> str | None:
    """Why s3torchconnector is not measured; None if it could be."""
    try:
        import s3torchconnector  # noqa: F401
    except ImportError as error:
        return (
            f"s3torchconnector is not installed in this interpreter ({sys.executable}): "
            f"{type(error).__name__}: {error}"
        )
    # Its CRT client takes an endpoint (S3ClientConfig / endpoint=) but not every version does;
    # measuring it would need code of its own here, which this benchmark does not have yet.
    return "s3torchconnector is installed, but this benchmark has no driver for it yet"


# --------------------------------------------------------------------------- a fresh process


def process_age() -> float:
    """Seconds since this process started (``/proc``, to the kernel's 10 ms tick; nan
    elsewhere): the interpreter's start and every import included."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def child(args: argparse.Namespace) -> None:
    """``--child SYSTEM``: build the model, load the newest checkpoint of SYSTEM, say so (the
    parent stops its clock there), then print the digest of what was loaded."""
    options = json.loads(args.storage_options)
    path = f"{args.url}/{PREFIX[args.child]}"
    model, optimizer = make_state(args.layers)
    # Every system reads through fsspec's s3fs: imported before the split clock for all, so
    # that "imports" and "load" divide alike (the parent's clock counts both either way).
    import fsspec  # noqa: F401
    import s3fs  # noqa: F401

    if args.child in ("unbroken", "unbroken-bg"):
        imported, age = time.perf_counter(), process_age()
        restored = unbroken_checkpointer(path, options, cache=False).load_latest(
            {"model": model, "optimizer": optimizer}
        )
        assert restored is not None, f"{path}: no checkpoint found"
    elif args.child == "torchsave":
        imported, age = time.perf_counter(), process_age()
        torchsave_load(path, options, model, optimizer)
    elif args.child == "dcp":
        import torch.distributed.checkpoint._fsspec_filesystem
        import torch.distributed.checkpoint.state_dict  # noqa: F401

        imported, age = time.perf_counter(), process_age()
        dcp_load(path, options, model, optimizer)
    else:
        raise SystemExit(f"unknown system {args.child!r}")
    loaded = time.perf_counter()
    print(f"LOADED {age:.6f} {loaded - imported:.6f}", flush=True)
    print(f"DIGEST {digest(model, optimizer)}", flush=True)


def fresh_resume(name: str, args: argparse.Namespace, url: str, options: dict[str, Any]):
    """Seconds from before Popen to the child's LOADED line; (seconds, the child's age when
    its imports and model were ready, the child's load seconds, its digest)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        "--url",
        url,
        "--storage-options",
        json.dumps(options),
        "--layers",
        str(args.layers),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    loaded_at = None
    inner: tuple[float, float] = (float("nan"), float("nan"))
    found = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("LOADED") and loaded_at is None:
            loaded_at = time.perf_counter()
            _, a, b = line.split()
            inner = (float(a), float(b))
        elif line.startswith("DIGEST"):
            found = line.split()[1]
    code = proc.wait(timeout=600)
    if code != 0 or loaded_at is None or found is None:
        raise RuntimeError(f"{' '.join(cmd[:4])}: exit status {code}, no LOADED/DIGEST line")
    return loaded_at - start, inner[0], inner[1], found


# --------------------------------------------------------------------------- counting requests


@contextlib.contextmanager
def _marking_thread_start():
    """The time at which a background save's writer thread is made (``BackgroundSave``), in
    the list yielded: the requests sent before it are the ones the training loop waits for.
    The time ``save`` returns would be later than the thread's first request at times."""
    import unbroken.checkpoint.manager as manager

    original = getattr(manager, "BackgroundSave", None)
    started: list[float] = []
    if original is None:
        yield started
        return

    class Marked(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            started.append(time.perf_counter())
            super().__init__(*args, **kwargs)

    manager.BackgroundSave = Marked
    try:
        yield started
    finally:
        manager.BackgroundSave = original


def count_requests(systems, step, model, optimizer, layers) -> dict[str, dict[str, Any]]:
    from harness.s3 import RequestCounter

    counter = RequestCounter()
    found: dict[str, dict[str, Any]] = {}
    try:
        for system in systems:
            counter.take()
            entry: dict[str, Any] = {}
            if isinstance(system, Unbroken) and system.background:
                ckpt = system.checkpointer
                with _marking_thread_start() as started:
                    ckpt.save(step, {"model": model, "optimizer": optimizer}, blocking=False)
                returned = started[0] if started else time.perf_counter()
                ckpt.wait()
                entry["save_before_return"] = counter.take(before=returned)
                entry["save"] = {}
                for name, n in [*entry["save_before_return"].items(), *counter.take().items()]:
                    entry["save"][name] = entry["save"].get(name, 0) + n
                entry["save"] = dict(sorted(entry["save"].items()))
            else:
                system.save(step, model, optimizer)
                entry["save"] = counter.take()
            m2, o2 = make_state(layers)
            system.load(m2, o2)
            entry["load"] = counter.take()
            found[system.name] = entry
    finally:
        counter.close()
    return found


# --------------------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="state size, MB (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument(
        "--quick", action="store_true", help="--mb 20 (2 layers: 25 MB), 1 round: a smoke run"
    )
    parser.add_argument("--no-count", action="store_true", help="skip the request count pass")
    # A fresh process's resume (internal).
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--storage-options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    sys.path.insert(0, str(HERE))
    if "--child" not in sys.argv:  # a --child process imports only what its system needs
        from harness import add_json_option

        add_json_option(parser, "remote_checkpoint")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    from harness import ForeignLoad, Results, environment
    from harness.s3 import requests_text
    from harness.stats import median as _median
    from harness.stats import spread as _spread

    from unbroken.testing import S3Server

    if args.quick:
        args.mb, args.repeats = 20.0, 1
    args.layers = layers_for(args.mb)
    results = Results("remote_checkpoint", args.json, args)
    foreign = ForeignLoad()

    torch.manual_seed(0)
    model, optimizer = make_state(args.layers)
    train_step(model, optimizer, 0)  # AdamW's state exists from here on
    nbytes = state_bytes(model, optimizer)
    mb = nbytes / 1e6

    skipped = {"s3torchconnector": s3torchconnector_skip_reason()}
    names = ["unbroken", "unbroken-bg", "torchsave", "dcp"]
    times: dict[str, dict[str, list[float]]] = {
        n: {"save": [], "stall": [], "load": [], "fresh": [], "child_imports": [], "child_load": []}
        for n in names
    }
    copy_s: list[float] = []
    errors: dict[str, str] = {}
    requests: dict[str, Any] = {}
    construct: dict[str, list[float]] = {}

    print(
        f"[state: {args.layers} x Linear({WIDTH}, {WIDTH}) + AdamW, {mb:.1f} MB of tensors; "
        f"{args.repeats} round(s)]",
        file=sys.stderr,
        flush=True,
    )
    with S3Server() as s3:
        url = s3.make_bucket("bench")
        options = s3.storage_options
        systems: dict[str, System] = {}
        for name in names:
            try:
                systems[name] = make_system(name, url, options)
            except Exception as error:  # a system that cannot run is reported, not fatal
                errors[name] = f"{type(error).__name__}: {error}"
        step = 0
        for system in systems.values():  # warm-up: imports, connections, first objects
            step += 1
            system.save(step, model, optimizer)
            m2, o2 = make_state(args.layers)
            system.load(m2, o2)
            verify(m2, o2, state_tensors(model, optimizer), f"{system.name} warm-up load")
        host_copy(model, optimizer)

        load_start = foreign.snapshot()
        for rep in range(args.repeats):
            train_step(model, optimizer, rep + 1)  # every value changes: a stale load fails
            expected = [t.clone() for t in state_tensors(model, optimizer)]
            start = time.perf_counter()
            host_copy(model, optimizer)
            copy_s.append(time.perf_counter() - start)
            order = list(systems)[rep % len(systems) :] + list(systems)[: rep % len(systems)]
            step += 1
            for name in order:
                system = systems[name]
                stall, seconds = system.save(step, model, optimizer)
                m2, o2 = make_state(args.layers)
                loaded = system.load(m2, o2)
                verify(m2, o2, expected, f"{LABELS[name]} load, round {rep + 1}")
                del m2, o2
                times[name]["stall"].append(stall)
                times[name]["save"].append(seconds)
                times[name]["load"].append(loaded)
            print(f"[round {rep + 1}/{args.repeats} done]", file=sys.stderr, flush=True)
        inprocess_foreign = ForeignLoad.cores(load_start, foreign.snapshot())

        # A fresh process per resume, every system's newest checkpoint holding the last round.
        want = digest(model, optimizer)
        fresh_start = foreign.snapshot()
        for rep in range(args.repeats):
            order = list(systems)[rep % len(systems) :] + list(systems)[: rep % len(systems)]
            for name in order:
                seconds, imports, load_s, found = fresh_resume(name, args, url, options)
                assert found == want, f"{LABELS[name]}: the fresh process loaded other values"
                times[name]["fresh"].append(seconds)
                times[name]["child_imports"].append(imports)
                times[name]["child_load"].append(load_s)
            print(f"[fresh-process round {rep + 1}/{args.repeats} done]", file=sys.stderr)
        fresh_foreign = ForeignLoad.cores(fresh_start, foreign.snapshot())

        for name, system in systems.items():
            if isinstance(system, Unbroken):
                construct[name] = system.construct_s
        if not args.no_count:
            try:
                step += 1
                requests = count_requests(
                    list(systems.values()), step, model, optimizer, args.layers
                )
            except Exception as error:
                requests = {"error": f"{type(error).__name__}: {error}"}

    med = {n: {k: _median(v) for k, v in t.items()} for n, t in times.items() if t["save"]}
    copy_med = _median(copy_s)

    print("# Checkpoints in object storage: unbroken vs torch.save + fsspec vs DCP FsspecWriter\n")
    print("\n".join(environment()))
    print(
        f"- state: {args.layers} x Linear({WIDTH}, {WIDTH}) + AdamW after one step, "
        f"{mb:.1f} MB of tensors ({nbytes:,} bytes); S3 protocol server: moto on 127.0.0.1 "
        "(same machine, loopback)"
    )
    print(
        f"- {args.repeats} round(s), medians (min-max); one untimed warm-up save+load per "
        "system; every load verified with torch.equal against the saved state"
    )
    print(
        f"- other processes kept {inprocess_foreign:.2f} cores busy during the in-process "
        f"rounds, {fresh_foreign:.2f} during the fresh-process resumes (this machine has "
        f"{len(os.sched_getaffinity(0))} cores)"
    )
    print(
        f"- copy of the state to host memory ({{k: v.detach().clone()}}): "
        f"{copy_med:.3f} s ({mb / copy_med:,.0f} MB/s)\n"
    )
    rows = []
    for name in names:
        if name not in med:
            rows.append([LABELS[name], *["failed"] * 7])
            continue
        m, t = med[name], times[name]
        rows.append(
            [
                LABELS[name],
                _spread(t["save"]),
                f"{mb / m['save']:,.0f}",
                _spread(t["stall"]),
                f"{m['stall'] / copy_med:,.1f}x",
                _spread(t["load"]),
                f"{mb / m['load']:,.0f}",
                _spread(t["fresh"]),
            ]
        )
    for name, why in skipped.items():
        if why:
            rows.append([LABELS[name], *["skipped"] * 7])
    header = [
        "system",
        "save s",
        "save MB/s",
        "loop stall per save s",
        "stall / host copy",
        "load s",
        "load MB/s",
        "fresh-process resume s",
    ]
    results.show("Save, load and resume, seconds (median, min-max)", header, rows)

    # Ratios against the best peer of each metric.
    peers = [n for n in PEERS if n in med]
    ratio_rows = []
    ratios: dict[str, Any] = {}
    if peers:

        def best(metric: str) -> str:
            return min(peers, key=lambda n: med[n][metric])  # seconds: lower is better

        specs = [
            ("save MB/s (higher is better)", "save", "save", True),
            ("loop stall per save (lower is better)", "stall", "stall", False),
            ("load MB/s (higher is better)", "load", "load", True),
            ("fresh-process resume s (lower is better)", "fresh", "fresh", False),
        ]
        for title, metric, peer_metric, rate in specs:
            b = best(peer_metric)
            row = [title]
            for name in ("unbroken", "unbroken-bg"):
                if name not in med:
                    row.append("-")
                    continue
                # MB/s ratio = peer seconds / our seconds; a time ratio = ours / peer's.
                r = (
                    med[b][peer_metric] / med[name][metric]
                    if rate
                    else med[name][metric] / med[b][peer_metric]
                )
                ratios[f"{name} {metric}"] = {"best_peer": b, "ratio": r}
                row.append(f"{r:.2f}")
            shown = (
                f"{mb / med[b][peer_metric]:,.0f} MB/s" if rate else f"{med[b][peer_metric]:.3f} s"
            )
            row.append(f"{LABELS[b]}: {shown}")
            ratio_rows.append(row)
        print()
        results.show("unbroken against the best peer of each metric", [
            "ratio to the best peer", "unbroken blocking", "unbroken background", "best peer",
        ], ratio_rows)  # fmt: skip

    notes = []
    for name in names:
        if name in med:
            notes.append(
                f"{LABELS[name]}: fresh process: interpreter start, imports and model build "
                f"{med[name]['child_imports']:.2f} s (its age from /proc, 10 ms ticks), then the "
                f"load {med[name]['child_load']:.3f} s"
            )
    for name, values in construct.items():
        notes.append(
            f"{LABELS[name]}: of its load, the new Checkpointer's construction (it checks the "
            f"bucket and the directory) took {_median(values):.3f} s"
        )
    if isinstance(requests, dict) and "error" not in requests:
        for name, counts in requests.items():
            before = counts.get("save_before_return")
            notes.append(
                f"{LABELS[name]}: S3 requests per save {requests_text(counts['save'])}"
                + (
                    f" (of which before its writer thread started, i.e. in the loop's stall: "
                    f"{requests_text(before)})"
                    if before is not None
                    else ""
                )
                + f"; per load {requests_text(counts['load'])}"
            )
    elif requests:
        notes.append(f"request count failed: {requests['error']}")
    for name, why in skipped.items():
        if why:
            notes.append(f"{LABELS[name]} skipped: {why}")
    for name, why in errors.items():
        notes.append(f"{LABELS[name]} failed: {why}")
    notes.append(
        "each peer's load starts from a new fsspec filesystem (instance cache cleared), as a "
        "new Checkpointer makes its own; their saves reuse fsspec's cached one, as unbroken's "
        "saves reuse their Checkpointer's"
    )
    results.finish(
        notes,
        {
            "megabytes": mb,
            "bytes": nbytes,
            "layers": args.layers,
            "width": WIDTH,
            "repeats": args.repeats,
            "host_copy_s": copy_s,
            "host_copy_median_s": copy_med,
            "foreign_cores": {"in_process": inprocess_foreign, "fresh_process": fresh_foreign},
            "systems": {
                name: {"label": LABELS[name], "times_s": times[name], "median_s": med.get(name)}
                for name in names
            },
            "checkpointer_construct_s": construct,
            "ratios_to_best_peer": ratios,
            "requests": requests,
            "skipped": {k: v for k, v in skipped.items() if v},
            "errors": errors,
        },
    )


if __name__ == "__main__":
    main()
