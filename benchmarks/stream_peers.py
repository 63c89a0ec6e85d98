"""Streaming datasets from a local S3-protocol server, side by side: MosaicML Streaming 0.13
(MDS, written by ``MDSWriter``), LitData 0.2.76 (written by ``optimize``) and unbroken's
``unbroken.streaming`` (written by ``write_shards``).

How it measures, and what the numbers mean: ``docs/benchmarks/stream-peers.md``.

    .venv/bin/python benchmarks/stream_peers.py                       # full size
    .venv/bin/python benchmarks/stream_peers.py --samples 20000       # quick
    .venv/bin/python benchmarks/stream_peers.py --quick               # and each resume once
    .venv/bin/python benchmarks/stream_peers.py --libraries unbroken  # one library
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, add_json_option, add_options
from harness.jobs import kill_group, last_json

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "stream_peer_worker.py"
PEERS_DIR = REPO / ".venv-peers"
TORCH = "torch==2.13.0"
PEERS = {
    "streaming": {"package": "mosaicml-streaming==0.13.0", "module": "streaming"},
    "litdata": {"package": "litdata==0.2.76", "module": "litdata"},
}
LIBRARIES = ("streaming", "litdata", "unbroken")


# ---------------------------------------------------------------------------------------------
# Virtual environments
# ---------------------------------------------------------------------------------------------


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, **kw)


def _imports(python: Path, module: str) -> tuple[bool, str]:
    out = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True)
    return out.returncode == 0, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""


def ensure_peer_venv(name: str) -> dict[str, Any]:
    """Create ``.venv-peers/NAME`` if it is missing or cannot import the peer; report the time."""
    spec = PEERS[name]
    venv = PEERS_DIR / name
    python = venv / "bin" / "python"
    if python.exists():
        ok, err = _imports(python, spec["module"])
        if ok:
            return {"python": str(python), "created": False}
        print(f"[venv] {venv}: `import {spec['module']}` fails ({err}); recreating", flush=True)
        shutil.rmtree(venv)
    t0 = time.perf_counter()
    PEERS_DIR.mkdir(exist_ok=True)
    print(f"[venv] creating {venv} for {spec['package']}", flush=True)
    _run(["python3", "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    notes = []
    first = _run([*pip, TORCH, spec["package"]])
    if first.returncode != 0:
        notes.append(f"{spec['package']} refused {TORCH}; pip picks the torch it wants")
        _run([*pip, spec["package"]], check=True)
    ok, err = _imports(python, spec["module"])
    if not ok and "torchvision" in err:
        # MosaicML Streaming imports torchvision at import time (streaming.vision). The local
        # mirror has only CUDA builds of torchvision, which cannot load against the CPU build of
        # torch 2.13 ("operator torchvision::nms does not exist"); let pip install the torch and
        # torchvision pair it resolves together instead.
        notes.append(
            f"torchvision does not load against {TORCH} ({err}); reinstalled the "
            "torch + torchvision pair pip resolves"
        )
        _run([*pip, "--upgrade", "torch", "torchvision"], check=True)
        ok, err = _imports(python, spec["module"])
    if not ok:
        raise RuntimeError(f"{venv}: `import {spec['module']}` still fails: {err}")
    seconds = time.perf_counter() - t0
    print(f"[venv] {venv} ready in {seconds:.0f}s", flush=True)
    return {"python": str(python), "created": True, "seconds": seconds, "notes": notes}


# ---------------------------------------------------------------------------------------------
# Running the workers
# ---------------------------------------------------------------------------------------------


def run_worker(
    lib: str,
    python: str,
    endpoint: str,
    samples: int,
    work: Path,
    timeout: float,
    resume_repeats: int = 3,
) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(
        {
            "S3_ENDPOINT_URL": endpoint,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.pop("PYTHONPATH", None)
    if lib == "unbroken":
        env["PYTHONPATH"] = str(REPO / "src")
    cmd = [
        python,
        str(WORKER),
        "--library",
        lib,
        "--endpoint",
        endpoint,
        "--remote",
        f"s3://bench/{lib}",
        "--work",
        str(work / lib),
        "--samples",
        str(samples),
        "--resume-repeats",
        str(resume_repeats),
    ]
    print(f"\n=== {lib}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    log = work / f"{lib}.stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, _ = proc.communicate()
            return {"library": lib, "error": f"timed out after {timeout:.0f}s (log: {log})"}
    seconds = time.perf_counter() - t0
    text = log.read_text()
    steps = [line for line in text.splitlines() if line.startswith(f"[{lib}]")]
    for line in steps:
        print("   " + line)
    result = last_json(out)
    if result is None:
        return {
            "library": lib,
            "error": f"no JSON (exit {proc.returncode}); log tail: " + text[-2000:],
        }
    result["worker_seconds"] = seconds
    if "error" in result:
        print(f"   {lib} FAILED: {result['error']}\n{result.get('trace', '')}", flush=True)
    return result


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _get(d: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _fmt(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if unit == "s":
        return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"
    if unit == "/s":
        return f"{v:,.0f}"
    if unit == "MB":
        return f"{v / 1e6:.1f} MB"
    if unit == "f":
        return f"{v:.3f}"
    return str(v)


def _exact(entry: Any) -> str | None:
    """ "yes" if every resume of a position gave the uninterrupted run's batch, else which not."""
    if not isinstance(entry, dict):
        return None
    runs = {k: v for k, v in entry.items() if isinstance(v, dict)}
    if not runs:
        return None
    wrong = [k for k, v in runs.items() if v.get("exact") is not True]
    return "yes" if not wrong else "no: " + ", ".join(wrong)


def _median_imports(resume: Any) -> float | None:
    """The median time of ``import <library>`` over a run's resume processes."""
    if not isinstance(resume, dict):
        return None
    times = sorted(
        run["imports_s"]
        for entry in resume.values()
        if isinstance(entry, dict)
        for run in entry.values()
        if isinstance(run, dict) and isinstance(run.get("imports_s"), (int, float))
    )
    if not times:
        return None
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def table(results: dict[str, dict[str, Any]]) -> str:
    libs = [lib for lib in LIBRARIES if lib in results]
    rows: list[tuple[str, str, str, str]] = [  # label, path, unit, better ("hi"/"lo"/"")
        ("write to S3", "write.seconds", "s", "lo"),
        ("samples/s, 0 workers, cold cache", "throughput.w0_cold", "/s", "hi"),
        ("samples/s, 0 workers, warm cache", "throughput.w0_warm", "/s", "hi"),
        ("samples/s, 2 workers, cold cache", "throughput.w2_cold", "/s", "hi"),
        ("samples/s, 2 workers, warm cache", "throughput.w2_warm", "/s", "hi"),
        (
            "first batch of a cold epoch, from building the loader (0 workers)",
            "throughput.w0_cold_build_first_batch_s",
            "s",
            "lo",
        ),
        ("resume: `import <library>` in the new process (median)", "resume", "imports", "lo"),
    ]
    for pos in ("1%", "50%", "99%"):
        for cache, kind in (("warm", "warm cache"), ("cold", "empty cache")):
            for workers in (0, 2):
                key = f"resume.{pos}.{cache}" + ("" if workers == 0 else f"_w{workers}")
                where = f"resume at {pos}, {kind}, {workers} workers"
                rows += [
                    (f"{where}: process start to 1st batch", f"{key}.process_seconds", "s", "lo"),
                    (f"{where}: building the loader to 1st batch", f"{key}.seconds", "s", "lo"),
                ]
                if cache == "cold":
                    rows.append((f"{where}: downloaded", f"{key}.cache_bytes", "MB", "lo"))
        rows.append(
            (
                f"resume at {pos}: exact (warm and empty cache, 0 and 2 workers)",
                f"resume.{pos}",
                "exact",
                "",
            )
        )
    rows += [
        ("same order with 0 and 2 workers (epoch 0)", "order_w0_vs_w2.epoch0.same_order", "", ""),
        ("same order with 0 and 2 workers (epoch 1)", "order_w0_vs_w2.epoch1.same_order", "", ""),
        ("shuffle: mean |id[k+1]-id[k]| / N", "shuffle.mean_jump", "f", ""),
        ("shuffle: median |id[k+1]-id[k]| / N", "shuffle.median_jump", "f", ""),
        ("shuffle: distinct shards per batch of 64", "shuffle.shards_per_batch", "f", ""),
        ("shuffle: shards in the data set", "shuffle.shards", "", ""),
        ("shuffle: distinct samples in the epoch", "shuffle.distinct", "", ""),
        ("kill: /dev/shm entries left", "kill.shm_left_after_kill", "n", ""),
        (
            "kill: other non-empty files in cache (partial/markers)",
            "kill.cache_partial_files",
            "n",
            "",
        ),
        ("kill: empty (lock/marker) files in cache", "kill.cache_empty_files", "n", ""),
        ("kill: restart on same cache works", "kill.restart.works", "", ""),
        ("kill: restart exact (same order, bytes)", "kill.restart.exact", "", ""),
    ]
    peers = [lib for lib in libs if lib != "unbroken"]
    head = ["metric", *libs] + (["unbroken vs best peer"] if "unbroken" in libs and peers else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, path, unit, better in rows:
        vals = {lib: _get(results[lib], path) for lib in libs}
        if unit == "n":
            vals = {k: (len(v) if isinstance(v, list) else None) for k, v in vals.items()}
        if unit == "exact":
            vals = {k: _exact(v) for k, v in vals.items()}
        if unit == "imports":
            vals = {k: _median_imports(v) for k, v in vals.items()}
            unit = "s"
        cells = []
        nums = {
            k: v for k, v in vals.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        best = None
        if better and nums:
            best = max(nums.values()) if better == "hi" else min(nums.values())
        for lib in libs:
            cell = _fmt(vals[lib], unit)
            if best and lib in nums and nums[lib] and len(nums) > 1:
                factor = (best / nums[lib]) if better == "hi" else (nums[lib] / best)
                cell += " (best)" if factor == 1 else f" ({factor:.2f}x)"
            cells.append(cell)
        if "unbroken" in libs and peers:
            u = nums.get("unbroken")
            pv = [nums[p] for p in peers if p in nums]
            if better and u and pv:
                bp = max(pv) if better == "hi" else min(pv)
                ratio = (u / bp) if better == "hi" else (bp / u)
                cells.append(
                    f"{ratio:.2f}x {'(faster)' if ratio > 1 else '(slower)' if ratio < 1 else ''}".strip()
                    if better
                    else ""
                )
            else:
                cells.append("")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    lines.append("")
    lines.append(
        "Cells: value (factor vs the best of the three: x times slower / larger; 1 = best). "
        "Last column: unbroken's speed relative to the best peer (>1 = unbroken faster)."
    )
    return "\n".join(lines)


def details(results: dict[str, dict[str, Any]]) -> str:
    out = []
    for lib in LIBRARIES:
        r = results.get(lib)
        if r is None:
            continue
        if "error" in r:
            out.append(f"- {lib}: FAILED: {r['error']}")
            continue
        k = r.get("kill", {})
        out.append(
            f"- {lib} {r.get('version')} (torch {r.get('torch')}): write {r['write']}; "
            f"shard bounds from {r['shuffle'].get('shard_bounds')}; state JSON-able: "
            f"{r.get('state_json')}; worker wall time {r.get('worker_seconds', 0):.0f}s"
        )
        out.append(
            f"  - kill: killed after {k.get('killed_after_batches')}/{k.get('of_batches')} "
            f"batches, {k.get('cache_bytes_at_kill', 0) / 1e6:.1f} MB in cache; /dev/shm left: "
            f"{k.get('shm_left_after_kill')}; other files in cache: {k.get('cache_other_files')}; "
            f"restart: {k.get('restart')}"
        )
        if "restart_after_clean_stale_shared_memory" in k:
            out.append(
                f"  - restart after clean_stale_shared_memory(): "
                f"{k['restart_after_clean_stale_shared_memory']}"
            )
        for pos, e in (r.get("resume") or {}).items():
            for kind in ("warm", "cold"):
                v = e.get(kind, {})
                if "error" in v or v.get("exact") is False:
                    out.append(f"  - resume {pos} {kind}: {json.dumps(v)[:1500]}")
        o = r.get("order_w0_vs_w2", {})
        out.append(f"  - order 0 vs 2 workers: {o}")
        if r.get("shm_left_at_end"):
            out.append(f"  - /dev/shm entries new at the end: {r['shm_left_at_end']}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=200_000)
    add_json_option(ap, "stream_peers")
    ap.add_argument(
        "--out", dest="json", default=argparse.SUPPRESS, help="the same as --json (its former name)"
    )
    add_options(ap, {
        "libraries": (",".join(LIBRARIES), None),
        "work": (None, "scratch dir (default: a new temp dir, removed)"),
        "timeout": (3600.0, "per library, seconds"),
    })  # fmt: skip
    ap.add_argument(
        "--resume-repeats",
        type=int,
        default=None,
        help="runs of each resume measurement, in rounds; the table shows the median (default 3; "
        "1 with --quick)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 20,000 samples, each resume once (--samples 20000 --resume-repeats 1)",
    )
    args = ap.parse_args()
    if args.quick:
        args.samples = 20_000
    if args.resume_repeats is None:
        args.resume_repeats = 1 if args.quick else 3
    record = Results("stream_peers", args.json, args)
    libs = [lib.strip() for lib in args.libraries.split(",") if lib.strip()]

    pythons: dict[str, str] = {}
    venvs: dict[str, Any] = {}
    for lib in libs:
        if lib in PEERS:
            venvs[lib] = ensure_peer_venv(lib)
            pythons[lib] = venvs[lib]["python"]
        elif lib == "unbroken":
            python = REPO / ".venv" / "bin" / "python"
            ok, err = _imports(python, "unbroken.streaming")
            if not ok:
                print(f"[unbroken] `import unbroken.streaming` fails: {err}; skipped", flush=True)
                venvs[lib] = {"error": err}
                continue
            pythons[lib] = str(python)

    sys.path.insert(0, str(REPO / "src"))
    from unbroken.testing import S3Server

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="stream-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        with S3Server() as s3:
            s3.make_bucket("bench")
            print(f"S3 server: {s3.endpoint}; scratch: {work}", flush=True)
            for lib in libs:
                if lib in pythons:
                    results[lib] = run_worker(
                        lib,
                        pythons[lib],
                        s3.endpoint,
                        args.samples,
                        work,
                        args.timeout,
                        args.resume_repeats,
                    )
                else:
                    results[lib] = {"library": lib, "error": f"not available: {venvs[lib]}"}
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    header = (
        f"Streaming from a local S3 server (moto), {args.samples:,} samples of 1 KiB, "
        f"8 MiB shards, batch 64; started {started}; load average at the end {load}; "
        f"{os.cpu_count()} CPUs"
    )
    print("\n" + header + "\n")
    print(record.table("unbroken vs MosaicML Streaming and LitData", table(results)))
    print()
    print(details(results))
    record.notes = [
        header,
        "Resume, the same for all three: a new process per measurement (spawned by the "
        "library's benchmark process, in the library's venv), which imports the library, builds "
        "its dataset and loader with 0 or 2 workers, loads the state that loader's own "
        "num_workers saved (through JSON) and takes the first batch; each measurement taken "
        f"{args.resume_repeats} times, in rounds, the median shown. *Process start to 1st "
        "batch*: from just before the spawn (the interpreter, every import, building, the "
        "first batch: what a restarted job waits); *building the loader to 1st batch*: from "
        "the call that builds the dataset, after `import streaming` / `import litdata` / "
        "`import unbroken` alone (what each imports later, e.g. unbroken's pyarrow, is inside). "
        "Warm: the cache the epochs filled; empty: an empty cache directory. "
        "First batch of a cold epoch: in the benchmark process (after its write), from building "
        "the loader.",
        "Method until 2026-11-24 (issue 22, item 7): a resume was timed only from building the "
        "loader, with 0 workers, and unbroken's process had imported pyarrow.parquet, fsspec and "
        "s3fs before that clock (the peers' only their own package, which for LitData already "
        "holds its downloader): unbroken's warm resumes left out the import of its reader and "
        "the full garbage collection that import sets off, ~0.1-0.2 s a restarted process pays.",
    ]
    ran = {lib: r for lib, r in results.items() if "error" not in r}
    if ran:
        record.notes.append(
            "Versions: "
            + ", ".join(
                f"{lib} {r.get('version')} (torch {r.get('torch')})" for lib, r in ran.items()
            )
            + (
                ". The torch builds differ (ensure_peer_venv lets pip pick the torch a peer's "
                "torchvision loads with when torch 2.13+cpu will not do), so the process-start "
                "times include imports of different torch builds."
                if len({r.get("torch") for r in ran.values()}) > 1
                else "."
            )
        )
    record.data = {"header": header, "samples": args.samples, "venvs": venvs, "results": results}
    record.write()
    if record.path:
        print(f"\nwrote {record.path}")


if __name__ == "__main__":
    main()
