"""The figure of each benchmark: a small spec that turns its JSON ``data`` into panels.

A spec says which metric, grouped by what, under which title; ``harness.plot.draw`` draws them
all the same way. ``report.py`` calls ``plot`` for every benchmark with results. Pure Python
over the JSON: a figure costs matplotlib's ~0.3 s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.plot import (
    PCT,
    Panel,
    Series,
    draw,
    pct,
    pct_interval,
    per_worker_ratios,
    ratio_series,
)

# A spec turns one benchmark's ``data`` into (figure title, panels, legend columns, caption).
Figure = tuple[str, list[Panel], int, str]
LOWER = "seconds (lower is better)"


def fig_overhead(data: dict, args: dict) -> Figure:
    setup = data.get("setup", {})
    titles = {
        "tiny": f"tiny loop: Linear(32, 2), batch {setup.get('tiny_batch', 2)}",
        "realistic": f"realistic loop: 2-conv CNN, batch {setup.get('image_batch', 32)}, crop+flip",
    }
    ylabel = "time per step vs torch DataLoader (%)\n+ = slower; bars: 95% CI"
    panels = [
        per_worker_ratios([r for r in data["rows"] if r["loop"] == loop], "ratio_ci95", ylabel, t)
        for loop, t in titles.items()
        if any(r["loop"] == loop for r in data["rows"])
    ]
    title = "Training-loop overhead per loader: time per step vs torch's DataLoader"
    return title, panels, 3, "Training-loop overhead per loader, % vs torch's DataLoader"


def fig_resume_latency(data: dict, args: dict) -> Figure:
    names = {"unbroken": "unbroken.DataLoader", "torchdata": "torchdata StatefulDataLoader"}
    series = []
    for name, lib in data["libraries"].items():
        spread = [(lo * 1e3, hi * 1e3) for lo, hi in zip(lib["min_s"], lib["max_s"])]
        values = [m * 1e3 for m in lib["median_s"]]
        series.append(Series(names.get(name, name), name, values, spread))
    groups = ["fresh start\n(no state)"] + [f"{p:.0%}" for p in data["positions"][1:]]
    ylabel = "load_state_dict + iter + next (ms, log scale)\nmedian, bars: min-max"
    where = "position in the epoch where the state was saved"
    panel = Panel(groups, series, ylabel, "", "{:.1f} ms", True, True, xlabel=where, legend=True)
    title = (
        f"Resume latency vs position in the epoch ({data['samples']:,}-sample epoch, batch "
        f"{data['batch_size']}, num_workers 0)"
    )
    return title, [panel], 2, "Resume latency vs position in the epoch, per library"


def fig_trainer_overhead(data: dict, args: dict) -> Figure:
    panels = []
    for work in dict.fromkeys(r["workload"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["workload"] == work]
        plain = next((r["us_per_step"] for r in rows if r["plain"]), 0.0)
        rows = [r for r in rows if not r["plain"]]
        groups = [
            r["variant"].removeprefix("Trainer, ").replace("checkpoint_every_steps=", "every\n")
            for r in rows
        ]
        texts = [f"{pct(r['ratio']):+.1f}%\n{r['extra_us_per_step']:+.0f} us" for r in rows]
        values = [pct(r["ratio"]) for r in rows]
        spread = [pct_interval(r["ratio_min_max"]) for r in rows]
        series = Series("unbroken.Trainer", "unbroken", values, spread, texts)
        ylabel = "time per step vs the plain loop (%)\nbars: min-max over rounds"
        title = f"{work} (plain loop: {plain:,.0f} us/step)"
        panels.append(Panel([g.replace(", ", ",\n") for g in groups], [series], ylabel, title))
        panels[-1].refs = {0.0: ""}
    title = "unbroken.Trainer vs a plain PyTorch loop over the same loader: time per step"
    return title, panels, 3, "Trainer overhead per step vs a plain loop"


def damage(row: dict) -> str:
    """A resumed run's bar label: samples repeated and skipped, in other epochs, weights."""
    others = sum(sum(d) for e, d in enumerate(row.get("per_epoch", [])) if e != row["epoch"])
    return (
        f"{row['repeated']} rep.\n+{row['skipped']} skip."
        + (f"\n(+{others} in\nother epochs)" if others else "")
        + f"\nequal: {'yes' if row['weights_equal'] else 'NO'}"
        + ("" if row.get("batches_once", True) else "\nnot once")
    )


def fig_lightning_resume(data: dict, args: dict) -> Figure:
    names = {
        "torch": "torch DataLoader (plain Lightning)",
        "unbroken": "unbroken.DataLoader + ExactResume",
    }
    panels = []
    for w in dict.fromkeys(r["workers"] for r in data["rows"]):
        mine = [r for r in data["rows"] if r["workers"] == w]
        rows = {(r["loader"], r["cut"], r.get("every", 5)): r for r in mine}
        cuts = list(dict.fromkeys(k[1:] for k in rows))
        first = [next(r for k, r in rows.items() if k[1:] == c) for c in cuts]
        groups = [
            f"step {c[0]} ({r.get('kind', 'mid-epoch')})\nfrom "
            f"{r['resumed_from'] if r['resumed_from'] is not None else 'scratch'}, "
            f"every {c[1]}\n(epoch {r['epoch']})"
            for c, r in zip(cuts, first)
        ]
        series = []
        for name in dict.fromkeys(k[0] for k in rows):
            found = [rows.get((name, *c)) for c in cuts]
            values = [None if r is None else r["repeated"] + r["skipped"] for r in found]
            texts = ["" if r is None else damage(r) for r in found]
            series.append(Series(names.get(name, name), name, values, (), texts))
        whole = {r["loader"]: r["whole_s"] for r in rows.values()}
        title = f"num_workers={w} (uninterrupted: " + ", ".join(
            f"{n} {s:.1f} s" for n, s in whole.items()
        )
        ylabel = f"samples repeated + skipped in the epoch\nof the kill (of {data['samples']})"
        panels.append(Panel(groups, series, ylabel, title + ")", headroom=1.8))
        panels[-1].xlabel = (
            f"{data['epochs']} epochs of {data['steps_per_epoch']} steps; SIGKILL at the end "
            "of the step, resumed from the last checkpoint before it"
        )
    title = (
        f"Lightning {data.get('lightning', '2.x')}: SIGKILLed and resumed from last.ckpt, "
        "per loader"
    )
    return title, panels, 2, "Lightning resumed: samples repeated and skipped, torch vs unbroken"


def fig_hf_resume(data: dict, args: dict) -> Figure:
    found = data["exactness"]
    systems = list(dict.fromkeys(key.split("|")[0] for key in found))
    workers = list(dict.fromkeys(key.split("|")[1] for key in found))
    colors = ["torch", "torch skip indices", "torchdata", "unbroken"]
    series = [
        Series(name, colors[i % 4], [found[f"{name}|{w}"]["same_augmentations"] for w in workers])
        for i, name in enumerate(systems)
    ]
    places = next(iter(found.values()))["places"]
    equal = [n for n in systems if all(found[f"{n}|{w}"]["weights_equal"] for w in workers)]
    ylabel = f"resumed samples whose augmentation equals\nthe uninterrupted run's (of {places})"
    left = Panel([f"num_workers={w}" for w in workers], series, ylabel, fmt="{:.0f}")
    left.title = f"final weights bit-equal after the resume: {', '.join(equal) or 'none'}"
    left.refs = {places: ""}
    timed = data["first_step_s"]
    groups = [f"{key.split('|')[0]}\n{float(key.split('|')[1]):.0%}" for key in timed]
    stock = Series("transformers.Trainer", "torch", [timed[key]["stock"] for key in timed])
    ours = Series("unbroken.hf.Trainer", "unbroken", [timed[key]["unbroken"] for key in timed])
    right = Panel(groups, [stock, ours], "seconds from train() to the first step")
    right.title = f"{args['n']:,} samples an epoch, {args['cost_us']:g} us a sample"
    right.xlabel = "dataset, and where in the epoch its checkpoint was saved"
    title = "transformers and Accelerate SIGKILLed mid-epoch and resumed: stock vs unbroken.hf"
    return title, [left, right], 4, "transformers and Accelerate resumed, stock vs unbroken.hf"


def fig_checkpoint_blocking(data: dict, args: dict) -> Figure:
    med = data["median_s"]
    groups = [
        "save returns\n(the loop is blocked)",
        "checkpoint committed\n(on disk, fsynced)",
        f"save + {data['steps']} training steps,\ncommitted",
    ]
    sync = Series("blocking=True", "torch", [med["sync"], med["sync"], med["sync_steps"]])
    background = [med["async"], med["async_done"], med["async_steps"]]
    series = [sync, Series("blocking=False (background write)", "unbroken", background)]
    panel = Panel(groups, series, f"seconds (median of {data['reps']} rounds)", fmt="{:.3f} s")
    title = (
        f"Checkpointer.save of {data['megabytes']:.0f} MB (model + Adam), every file fsynced: "
        "how long the loop waits"
    )
    return title, [panel], 2, "Checkpoint blocking time, sync vs async"


def fig_stream_overhead(data: dict, args: dict) -> Figure:
    ylabel = "time per step vs torch DataLoader (%)\n(+ = slower; bars: min-max)"
    panel = per_worker_ratios(data["rows"], "ratio_min_max", ylabel)
    target = pct(data.get("target_ratio", 1.03))
    panel.refs[target] = f"target: unbroken within {target:.0f}%"
    title = "Iterable dataset, batch 2: time per step vs torch's DataLoader (start-up included)"
    return title, [panel], 2, "Iterable dataset state shipping overhead vs torch"


def fig_ddp_loader(data: dict, args: dict) -> Figure:
    panels = []
    if "epochs" in data:
        rows = data["epochs"]["rows"]
        keys = list(dict.fromkeys((r["dataset"], r["workers"]) for r in rows))
        series = ratio_series(rows, lambda r: (r["dataset"], r["workers"]), keys, "ratio_ci95")
        groups = [f"{d} dataset\nnum_workers={w}" for d, w in keys]
        ylabel = "epoch time vs torch (%)\n(+ = slower; 95% CI)"
        title = "DDP training epoch vs torch DataLoader + DistributedSampler"
        panels.append(Panel(groups, series, ylabel, title, PCT, refs={0.0: ""}, legend=True))
    if "resume" in data:
        rows = data["resume"]["rows"]
        positions = list(dict.fromkeys(r["position"] for r in rows))
        series = []
        for method in dict.fromkeys(r["method"] for r in rows):
            by = {r["position"]: r for r in rows if r["method"] == method}
            values = [by[p]["median_ms"] if p in by else None for p in positions]
            spread = [(by[p]["min_ms"], by[p]["max_ms"]) if p in by else None for p in positions]
            series.append(Series(method, method, values, spread))
        groups = [f"resume at {p:.0%}" for p in positions]
        ylabel = "construct + resume + first batch\n(ms, log scale; bars: min-max)"
        title = f"resume to the first batch ({data['resume']['samples']:,} rows, num_workers 0)"
        panels.append(Panel(groups, series, ylabel, title, "{:.1f} ms", log=True, legend=True))
    title = "Data-parallel training, 2 ranks (torchrun, gloo, CPU)"
    return title, panels, 3, "DDP: epoch time vs torch, and resume latency"


def fig_ddp_checkpoint(data: dict, args: dict) -> Figure:
    keys = ["sync", "async returns", "async committed", "load"]
    groups = [
        "save(blocking=True)",
        "save(blocking=False):\nloop blocked",
        "save(blocking=False):\ncommitted",
        "load_latest",
    ]
    colors = {"DDP (rank 0 writes)": "torch"}
    series = [
        Series(name, colors.get(name, "unbroken"), [m[k] for k in keys])
        for name, m in data["median_ms"].items()
    ]
    panel = Panel(groups, series, f"ms (median of {data['reps']} rounds)", fmt="{:.0f} ms")
    title = (
        f"Checkpoints of a 2-rank job ({data['megabytes']:.0f} MB: model + AdamW), "
        "torchrun + gloo on CPU"
    )
    return title, [panel], 2, "DDP vs FSDP2 checkpoint save and load times"


def fig_stream_peers(data: dict, args: dict) -> Figure:
    results = {k: v for k, v in data["results"].items() if "error" not in v}
    libs = [lib for lib in ("streaming", "litdata", "unbroken") if lib in results]
    names = {"streaming": "MosaicML Streaming", "litdata": "LitData", "unbroken": "unbroken"}
    keys = ["w0_cold", "w0_warm", "w2_cold", "w2_warm"]
    groups = [f"{k[1]} workers\n{k[3:]}" for k in keys]
    rates = [[results[lib].get("throughput", {}).get(k) for k in keys] for lib in libs]
    throughput = [
        Series(names[lib], lib, [None if v is None else v / 1000 for v in vals])
        for lib, vals in zip(libs, rates)
    ]
    first = Panel(groups, throughput, "thousand samples/s (higher is better)", fmt="{:.0f}k")
    first.title = "throughput of a shuffled epoch (cold: empty cache)"

    def resume(lib: str, pos: str, field: str, run: str = "cold") -> float | None:
        value = results[lib].get("resume", {}).get(pos, {}).get(run, {}).get(field)
        return value if isinstance(value, (int, float)) else None

    positions = ["1%", "50%", "99%"]
    runs = [(p, run, w) for p in positions for run, w in (("warm", 0), ("warm_w2", 2))]
    spawn = [
        Series(names[lib], lib, [resume(lib, p, "process_seconds", run) for p, run, _ in runs])
        for lib in libs
    ]
    second = Panel([f"{p}\n{w} wkr" for p, _, w in runs], spawn, "seconds, imports included")
    second.title = "resume in a new process, warm cache:\nfrom its spawn to the first batch"
    cached = [[resume(lib, p, "cache_bytes") for p in positions] for lib in libs]
    mb = [
        Series(names[lib], lib, [None if v is None else v / 1e6 for v in vals])
        for lib, vals in zip(libs, cached)
    ]
    third = Panel([f"at {p}" for p in positions], mb, "MB in the local cache (lower is better)")
    third.title, third.fmt = "resume with an empty cache:\ndownloaded by then", "{:.0f}"
    title = f"Streaming {data['samples']:,} samples of 1 KiB from a local S3 server, batch 64"
    return title, [first, second, third], 3, "Streaming vs MosaicML Streaming and LitData"


def fig_remote_checkpoint(data: dict, args: dict) -> Figure:
    systems = data["systems"]
    names = [n for n in ("unbroken", "unbroken-bg", "torchsave", "dcp") if systems[n]["median_s"]]
    colors = {"unbroken-bg": "unbroken torch-only", "torchsave": "torch"}
    med = {n: systems[n]["median_s"] for n in names}

    def series(*keys: str) -> list[Series]:
        return [
            Series(systems[n].get("label", n), colors.get(n, n), [med[n][k] for k in keys])
            for n in names
        ]

    save = series("save", "stall")
    save.append(Series("copy to host memory", "control", [None, data["host_copy_median_s"]]))
    panels = [
        Panel(["save\n(committed)", "loop stall\nper save"], save, LOWER, "save"),
        Panel(["load into a\nnew model"], series("load"), LOWER, "load, in the running process"),
        Panel(["new process:\nspawn to loaded"], series("fresh"), LOWER, "fresh-machine resume"),
    ]
    title = f"Checkpoint of {data['megabytes']:.0f} MB (MLP + AdamW) to a local S3 server (moto)"
    return title, panels, 5, "Checkpoints in object storage vs torch.save+fsspec and DCP"


def fig_goodput(data: dict, args: dict) -> Figure:
    traces = data["traces"]
    groups = [
        f"MTBF {t['mtbf_s']:g} s\nN={t['every_steps']} ({t['best_interval_s']:g} s)" for t in traces
    ] + ["no\nfailures"]
    series = []
    for key, label, color, style, marker in data["lines"]:
        runs = [
            t["runs"][t["best_key"]] if key == "trainer-best" else t["runs"].get(key)
            for t in traces
        ]
        runs.append(data["references"].get(key))
        values = [None if r is None else r.get("goodput") for r in runs]
        hollow = [r is not None and r.get("finished") is False for r in runs]
        if any(v is not None for v in values):
            series.append(Series(label, color, values, (), (), style, marker, hollow))
    ylabel = "goodput: failure-free time / wall time\n(higher is better)"
    panel = Panel(groups, series, ylabel, fmt="", lines=True, refs={1.0: ""}, headroom=1.0)
    panel.xlabel = "mean time between failures; hollow: not finished at the cap"
    title = (
        f"Goodput under random SIGKILLs and preemptions ({data['steps']} steps, "
        f"{data['reference_s']:.0f} s without failures)"
    )
    return title, [panel], 2, "Goodput against the mean time between failures, per system"


FIGURES: dict[str, Callable[[dict, dict], Figure]] = {
    "overhead": fig_overhead,
    "resume_latency": fig_resume_latency,
    "trainer_overhead": fig_trainer_overhead,
    "lightning_resume": fig_lightning_resume,
    "hf_resume": fig_hf_resume,
    "checkpoint_blocking": fig_checkpoint_blocking,
    "stream_overhead": fig_stream_overhead,
    "ddp_loader": fig_ddp_loader,
    "ddp_checkpoint": fig_ddp_checkpoint,
    "stream_peers": fig_stream_peers,
    "remote_checkpoint": fig_remote_checkpoint,
    "goodput": fig_goodput,
}  # ddp_reduction: a table only


def plot(name: str, payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    """Draw benchmark ``name``'s figure into ``out``; returns [(file, caption)] (none without
    a spec, or without data for one)."""
    if name not in FIGURES:
        return []
    title, panels, ncol, caption = FIGURES[name](payload["data"], payload.get("args", {}))
    panels = [p for p in panels if p.series]
    if not panels:
        return []
    draw(payload, title, panels, out / f"{name}.png", ncol)
    return [(f"{name}.png", caption)]
