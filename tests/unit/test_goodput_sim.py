"""benchmarks/goodput_sim.py, the discrete-event model of goodput under failures: exact without
failures, hand-computed on replayed failure times, Young's first-order goodput at a small
failure rate, at most one step lost per failure with just-in-time saves, the library's own
Daly interval for ``auto``, and the replay of a file of real runs. Pure Python: about a second."""

import importlib.util
import json
import sys

import numpy as np
import pytest
from locations import ROOT

from unbroken.train import schedule

SIM = ROOT / "benchmarks" / "goodput_sim.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("goodput_sim", SIM)
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    sys.modules["goodput_sim"] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # it puts benchmarks/ on the path for its harness: not for other tests
    yield module
    sys.modules.pop("goodput_sim", None)


def run(sim, policy, times, costs=None, work=10.0, coin=0):
    costs = costs or sim.Costs(step=1.0, save=2.0, jit_save=3.0, restart=5.0)
    return sim.simulate(work, costs, policy, sim.Trace(times), np.random.default_rng(coin))


def test_no_failures_costs_exactly_the_saves(sim):
    costs = sim.Costs(step=1.0, save=3.0, jit_save=5.0, restart=7.0)
    # Interval 11 s from save start to save start: 8 steps, then a save; 100 steps: 12 saves
    # (none after the last step).
    for policy in (sim.Policy("fixed", 11.0), sim.Policy("jit", 11.0, jit=True)):
        for failures in (sim.Trace([]), sim.Poisson(0.0, np.random.default_rng(0))):
            out = sim.simulate(100.0, costs, policy, failures, np.random.default_rng(0))
            assert (out.saves, out.failures) == (12, [])
            assert out.goodput == 100.0 / (100.0 + 12 * 3.0)
            assert out.spent == {"train": 100.0, "saves": 36.0, "jit": 0.0, "restart": 0.0}


def test_replayed_failures_give_the_hand_computed_wall_time(sim):
    # step 1, save 2, JIT save 3, restart 5; interval 6: train 0-4, save 4-6, train 6-10,
    # save 10-12, train 12-14: 14 s for 10 steps without a failure.
    fixed, jit = sim.Policy("fixed", 6.0), sim.Policy("jit", 6.0, jit=True)
    assert run(sim, fixed, []).wall == 14.0
    # At 5.0, inside the first save: it is lost with its 4 steps; restart 5-10; at 9.5, inside
    # the restart: again, 9.5-14.5; then the whole job, 14 s.
    out = run(sim, fixed, [5.0, 9.5])
    assert out.wall == 28.5
    assert [(f.time, f.phase, f.lost, f.steps) for f in out.failures] == [
        (5.0, "save", 4.0, 4),
        (9.5, "restart", 0.0, 0),
    ]
    # JIT: the survivors write the 4 steps (5-8), restart 8-13 struck at 9.5 (9.5-14.5), then
    # 6 steps with one save: 8 s.
    out = run(sim, jit, [5.0, 9.5])
    assert out.wall == 22.5 and [f.lost for f in out.failures] == [0.0, 0.0]
    # Mid-step at 2.5: fixed loses 2.5 s (3 steps started again), restart 2.5-7.5, 14 s.
    out = run(sim, fixed, [2.5])
    assert out.wall == 21.5 and (out.failures[0].lost, out.failures[0].steps) == (2.5, 3)
    # JIT keeps 2 steps (2.5-5.5), restart 5.5-10.5, 8 steps with one save (10 s).
    out = run(sim, jit, [2.5])
    assert out.wall == 20.5 and (out.failures[0].lost, out.failures[0].steps) == (0.5, 1)
    # A JIT save that fails (p = 1) or is struck (at 4.0) falls back to the last save (none).
    out = run(sim, sim.Policy("jit", 6.0, jit=True, p_jit_fail=1.0), [2.5])
    assert out.wall == 24.5 and out.failures[0].lost == 2.5
    out = run(sim, jit, [2.5, 4.0])
    assert out.wall == 23.0
    assert [(f.phase, f.lost) for f in out.failures] == [("train", 2.5), ("jit", 0.0)]
    # A failure after the job's end is not replayed.
    assert run(sim, fixed, [14.0]).ignored == 1


def test_jit_loses_at_most_one_step_per_failure(sim):
    costs = sim.Costs(step=2.0, save=5.0, jit_save=3.0, restart=10.0)
    kept, struck, without = [], [], []  # JIT saves committed and struck; the same without JIT
    for seed in range(20):
        for policy in (sim.Policy("auto", 60.0), sim.Policy("jit", 60.0, jit=True)):
            failures = sim.Poisson(1 / 50, np.random.default_rng(seed))
            out = sim.simulate(3000.0, costs, policy, failures, np.random.default_rng(seed))
            if not policy.jit:
                without += [f.lost for f in out.failures]
                continue
            for failure, after in zip(out.failures, [*out.failures[1:], None]):
                # A failure whose JIT save a second one struck falls back to the last save.
                hit = after is not None and after.phase == "jit"
                (struck if hit else kept).append((failure.lost, failure.steps))
    assert len(kept) > 1000 and len(struck) > 10
    assert all(seconds <= 2.0 and steps <= 1 for seconds, steps in kept)
    assert sum(steps == 1 for _, steps in kept) > 500  # mid-step failures were seen
    assert max(seconds for seconds, _ in struck) > 2.0
    # The same failures without JIT lose up to a whole interval: the bound above is JIT's.
    assert max(without) > 40.0


def test_goodput_matches_young_at_a_small_failure_rate(sim):
    # Young's first-order model: 1 / (1 + C/T + lambda (T/2 + R)), T the training between saves.
    save, between, restart, rate = 1.0, 100.0, 30.0, 1 / 5000
    costs = sim.Costs(step=1.0, save=save, jit_save=1.0, restart=restart)
    policy = sim.Policy("fixed", between + save)
    goodput = [
        sim.simulate(
            200_000.0,
            costs,
            policy,
            sim.Poisson(rate, np.random.default_rng(k)),
            np.random.default_rng(k),
        ).goodput
        for k in range(1000)
    ]
    young = 1 / (1 + save / between + rate * (between / 2 + restart))
    # The model's mean is 0.9744 +- 0.0002; dropping the restarts (+0.006) or the lost work
    # (+0.010) moves it well outside this.
    assert np.mean(goodput) == pytest.approx(young, abs=1e-3)


def test_auto_uses_the_librarys_daly_interval(sim, monkeypatch):
    costs = sim.Costs(step=2.0, save=20.0, jit_save=20.0, restart=300.0)
    mtbf = sim.LLAMA3_GPU_MTBF / 16384
    chosen = {p.name: p.interval for p in sim.policies([300.0], costs, mtbf, 0.0)}
    assert chosen == {
        "fixed 300 s": 300.0,
        "auto": schedule.daly_interval(20.0, mtbf),
        "jit": chosen["auto"],
    }
    assert 600 < chosen["auto"] < 700  # Daly's sqrt(2 C M), not a bound
    monkeypatch.setattr(schedule, "daly_interval", lambda cost, mtbf: 123.0)
    chosen = {p.name: p.interval for p in sim.policies([300.0], costs, mtbf, 0.0)}
    assert chosen["auto"] == chosen["jit"] == 123.0


def synthetic_runs(path, **changes):
    data = {
        "measured": {"step_seconds": 1.0, "save_seconds": 2.0, "jit_save_seconds": 3.0, "restart_seconds": 5.0},
        "runs": [
            {"policy": "periodic", "ranks": 3, "interval_seconds": 6.0, "work_seconds": 10.0,
             "failure_times": [5.0, 9.5], "goodput": 0.3, "steps_recomputed": [4, 0]},
            {"policy": "jit", "ranks": 3, "interval_seconds": 6.0, "work_seconds": 10.0,
             "failure_times": [2.5], "goodput": 0.5, "steps_recomputed": [1]},
        ],
    }  # fmt: skip
    for field, value in changes.items():
        data["runs"][1][field] = value
    path.write_text(json.dumps(data))
    return path


def test_check_replays_real_runs_with_their_measured_costs(sim, tmp_path, capsys):
    path = synthetic_runs(tmp_path / "goodput_ranks.json")
    out = tmp_path / "sim.json"
    sim.main(["--check", str(path), "--measured", str(path), "--gpus", "8", "--work-days", "0.01",
              "--replicas", "2", "--json", str(out)])  # fmt: skip
    runs = json.loads(out.read_text())["data"]["check"]["runs"]
    assert [r["predicted"] for r in runs] == [10.0 / 28.5, 10.0 / 20.5]  # the walls above
    assert [r["steps_predicted"] for r in runs] == [[4, 0], [1]]
    printed = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in printed.splitlines()]
    assert ["0", "periodic", "6", "2 (2)", "0.300", "0.351", "+0.051", "4 0", "4 0"] in rows
    assert ["1", "jit", "6", "1 (1)", "0.500", "0.488", "-0.012", "1", "1"] in rows
    assert "measured costs: step 1 s, save 2 s, JIT save 3 s, restart 5 s" in printed


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"policy": "sometimes"}, "runs[1].policy is 'sometimes'; expected 'periodic' or 'jit'"),
        ({"failure_times": [2.5, -1]}, "runs[1].failure_times[1] is -1; expected a number >= 0"),
        ({"work_seconds": None}, "runs[1].work_seconds is None"),
    ],
)
def test_check_names_a_wrong_field(sim, tmp_path, changes, named):
    path = synthetic_runs(tmp_path / "goodput_ranks.json", **changes)
    with pytest.raises(SystemExit, match=named.replace("[", r"\[").replace("]", r"\]")):
        sim.check(path)
