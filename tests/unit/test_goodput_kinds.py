"""The kinds of failure in the goodput benchmarks: ``benchmarks/goodput_sim.py`` gives each
failure its kind's restart and loses the background save a ``save`` kill strikes, draws kinds
from a mix without moving the failure times, and replays real runs with each kind's measured
cost; ``benchmarks/goodput_ranks.py``'s trace strikes rank 0 and a background save. Pure
Python: about a second."""

import importlib.util
import json
import sys

import numpy as np
import pytest
from locations import ROOT

BENCHMARKS = ROOT / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # it puts benchmarks/ on the path for its harness: not for other tests
    return module


@pytest.fixture(scope="module")
def sim():
    yield load("goodput_sim")
    sys.modules.pop("goodput_sim", None)


def costs(sim, **kinds):
    return sim.Costs(step=1.0, save=2.0, jit_save=3.0, restart=5.0, kinds=kinds)


def test_a_hang_costs_its_own_restart(sim):
    # step 1, save 2, interval 6 (4 steps, then a save), 10 steps: 14 s without a failure.
    # A kill at 2.5 (restart 5: 2.5-7.5), then a hang 1.5 s into the next session (9.0) whose
    # restart is 35 s (9.0-44.0), then the whole job: 58 s; with a kill's restart, 28 s.
    c = costs(sim, hang=sim.KindCost(35.0))
    trace = sim.Trace([2.5, 9.0], ["kill", "hang"])
    out = sim.simulate(10.0, c, sim.Policy("fixed", 6.0), trace, np.random.default_rng(0))
    assert out.wall == 58.0 and out.spent["restart"] == 40.0
    assert [(f.kind, f.lost) for f in out.failures] == [("kill", 2.5), ("hang", 1.5)]
    single = sim.simulate(10.0, c.single(), sim.Policy("fixed", 6.0), sim.Trace([2.5, 9.0]),
                          np.random.default_rng(0))  # fmt: skip
    assert single.wall == 28.0


def test_a_kill_in_a_background_save_loses_that_save(sim):
    # At 7.0, 1 s into the second cycle: the save of 4-6 was still being written, so a save
    # kill falls back to step 0 (5 s lost), a kill to step 4 (1 s lost).
    fixed, jit = sim.Policy("fixed", 6.0), sim.Policy("jit", 6.0, jit=True)
    rng = np.random.default_rng
    out = sim.simulate(10.0, costs(sim), fixed, sim.Trace([7.0], ["save"]), rng(0))
    assert (out.failures[0].lost, out.failures[0].steps, out.wall) == (5.0, 5, 26.0)
    out = sim.simulate(10.0, costs(sim), fixed, sim.Trace([7.0], ["kill"]), rng(0))
    assert (out.failures[0].lost, out.failures[0].steps, out.wall) == (1.0, 1, 20.0)
    # JIT: the survivors write step 5 whatever the kind: one step in flight lost.
    out = sim.simulate(10.0, costs(sim), jit, sim.Trace([7.0], ["save"]), rng(0))
    assert (out.failures[0].lost, out.failures[0].steps) == (0.0, 0)


def test_kinds_are_drawn_from_the_mix_without_moving_the_times(sim):
    def draw(mix):
        trace = sim.Poisson(0.1, np.random.default_rng(7), mix, np.random.default_rng(8))
        return [(trace.pop(), trace.kind) for _ in range(4000)]

    kills = draw(None)
    mixed = draw({"kill": 0.7, "save": 0.1, "hang": 0.2})
    assert [t for t, _ in mixed] == [t for t, _ in kills]
    assert {k for _, k in kills} == {"kill"}
    share = {k: sum(kind == k for _, kind in mixed) / 4000 for k in ("kill", "save", "hang")}
    assert share == pytest.approx({"kill": 0.7, "save": 0.1, "hang": 0.2}, abs=0.03)
    assert sim.parse_mix("kill=3,hang=1") == {"kill": 3.0, "hang": 1.0}
    with pytest.raises(Exception, match="'stop=1': expected KIND=WEIGHT"):
        sim.parse_mix("kill=1,stop=1")


def ranks_file(path):
    """Two real runs as goodput_ranks.py writes them: a kill and a hang each, the hang's restart
    35 s (the periodic run) and 36 s (the jit run), the kills' 5 s and 7 s."""

    def failure(kind, restart, jit_save=None):
        return {"kind": kind, "restart": restart, "jit_save": jit_save, "noticed": 0.1}

    data = {
        "measured": {"step_seconds": 1.0, "save_seconds": 2.0, "jit_save_seconds": 3.0,
                     "restart_seconds": 5.0},
        "runs": [
            {"policy": "periodic", "interval_seconds": 6.0, "work_seconds": 10.0,
             "failure_times": [2.5, 9.0], "goodput": 10.0 / 58.0, "steps_recomputed": [3, 2],
             "failures": [failure("kill", 5.0), failure("hang", 35.0)]},
            {"policy": "jit", "interval_seconds": 6.0, "work_seconds": 10.0,
             "failure_times": [2.5], "failure_kinds": ["hang"], "goodput": 0.2,
             "steps_recomputed": [1], "failures": [failure("hang", 36.0, 3.0)]},
        ],
    }  # fmt: skip
    path.write_text(json.dumps(data))
    return path


def test_check_replays_each_failure_with_its_kinds_measured_cost(sim, tmp_path, capsys):
    path = ranks_file(tmp_path / "goodput_ranks.json")
    rows, _, _ = sim.check(path)
    # The periodic run: the hand-computed 58 s above, where one restart cost gave 28 s.
    assert rows[0]["predicted"] == 10.0 / 58.0
    assert rows[0]["predicted_one_restart"] == 10.0 / 28.0
    # The jit run: a hang at 2.5 (2 steps kept by a 3-s JIT save, 2.5-5.5), its 36-s restart
    # (5.5-41.5), then 8 steps and one save (10 s): 51.5 s.
    assert rows[1]["predicted"] == 10.0 / 51.5 and rows[1]["kinds"] == ["hang"]
    periodic, jit, mix = sim.measured_model(path)
    assert (periodic.restart_of("hang"), jit.restart_of("hang"), jit.restart_of("kill")) == (
        35.0, 36.0, 5.0,
    )  # fmt: skip
    assert mix == {"kill": 1 / 3, "hang": 2 / 3}
    sim.main(["--check", str(path), "--measured", str(path), "--gpus", "8", "--work-days",
              "0.01", "--replicas", "2", "--json", ""])  # fmt: skip
    printed = capsys.readouterr().out
    assert (
        "0 periodic: +0.185 with one restart for every failure, +0.000 with each kind's" in printed
    )
    assert "33% kill (restart 5 s), 67% hang (restart 35 s / 36 s with JIT)" in printed


@pytest.fixture(scope="module")
def ranks():
    pytest.importorskip("torch")
    yield load("goodput_ranks")
    for name in ("goodput_ranks", "goodput_ranks_job"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("seed", range(5))
def test_the_trace_strikes_rank_0_and_background_saves(ranks, seed):
    trace = ranks.failure_trace(seed, 21, 4, 100.0)
    assert [f.kind for f in trace].count("save") == 4 and trace[-1].kind == "hang"
    assert len(trace) == 21 and sum(f.rank == 0 for f in trace) >= 3
    assert any(f.rank == 0 for f in trace if f.kind == "save")
    assert {f.rank for f in trace} == {0, 1, 2}
    assert sum(f.gap for f in trace) == pytest.approx(80.0)
