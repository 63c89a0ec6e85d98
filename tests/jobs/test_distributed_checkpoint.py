"""The Checkpointer under torch.distributed: one checkpoint per step for the whole job, committed
only when every rank's part is durable; ranks that never load different steps; failures and
absent ranks that raise on every rank instead of hanging; a directory the ranks do not share
refused; PerRank entries on another number of ranks refused, or resized as asked.

The collective scenarios run in one torchrun job of 2 gloo ranks (dist_checkpoint_job.py); the
resize ones load that job's checkpoints here, in one process."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from locations import SUPPORT

import unbroken
from unbroken import Checkpointer, PerRank
from unbroken.checkpoint.layout import MANIFEST
from unbroken.errors import StateMismatch


@pytest.fixture(scope="module")
def job(tmp_path_factory, s3):
    out = tmp_path_factory.mktemp("dist_checkpoint")
    url = s3.make_bucket("dist-checkpoint") + "/ckpt"
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",
            str(SUPPORT / "dist_checkpoint_job.py"),
        ]
        + [str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(
            os.environ,
            OMP_NUM_THREADS="1",
            UNBROKEN_TEST_S3_URL=url,
            UNBROKEN_TEST_S3_OPTIONS=json.dumps(s3.storage_options),
        ),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return out


def _seen(job, scenario):
    return [json.loads((job / f"{scenario}.rank{r}.json").read_text()) for r in range(2)]


def test_replicated_entries_are_written_once_and_per_rank_ones_by_every_rank(job):
    ranks = _seen(job, "same_world")
    assert [r["counter"] for r in ranks] == [300, 301]  # each rank its own part
    assert [r["step"] for r in ranks] == [3, 3] and [r["world_size"] for r in ranks] == [2, 2]
    assert [r["values"] for r in ranks] == [{"step": 3}, {"step": 3}]  # rank 0's value
    assert ranks[0]["files"] == [
        "000-model.pt",
        "001-counter.rank-00000.pt",
        "001-counter.rank-00001.pt",
        "002-step.pt",
        MANIFEST,
    ]


def test_a_checkpoint_one_rank_finds_broken_is_skipped_by_every_rank(job):
    ranks = _seen(job, "skip")
    # Step 3: rank 1's part is corrupt (rank 0's files are fine); step 2: rank 1's part is gone.
    assert [r["step"] for r in ranks] == [1, 1] and [r["counter"] for r in ranks] == [100, 101]
    for r in ranks:
        first, second = r["warnings"]
        assert (
            "step-000000003: rank 1: 001-counter.rank-00001.pt does not match its sha256" in first
        )
        assert "step-000000002: rank 0: 001-counter.rank-00001.pt is unreadable" in second


def test_a_failure_on_one_rank_raises_on_every_rank_and_commits_nothing(job):
    ranks = _seen(job, "one_rank_fails")
    assert ranks[1]["error"][0] == "ValueError" and "meta device" in ranks[1]["error"][1]
    kind, message = ranks[0]["error"]
    assert kind == "RankFailure"
    assert "preparing checkpoint step 4 failed on rank 1, so on every rank" in message
    assert "meta device" in message
    assert _seen(job, "after_failures")[0]["steps"] == [f"step-00000000{s}" for s in (1, 2, 3)]


def test_ranks_saving_different_steps_are_refused_on_every_rank(job):
    for rank in _seen(job, "other_steps"):
        kind, message = rank["error"]
        assert kind == "ValueError" and "different steps" in message
        assert "{0: (5, ['counter']), 1: (6, ['counter'])}" in message


def test_a_background_save_commits_every_ranks_part(job):
    assert _seen(job, "background") == [{"step": 6, "counter": 600}, {"step": 6, "counter": 601}]


def test_the_ranks_exchange_verdicts_and_digests_not_the_state(job):
    # A save and a load of a 4 MB replicated tensor: each collective carries under 4 kB.
    for rank in _seen(job, "exchanged"):
        assert rank["count"] >= 4 and rank["largest"] < 4096, rank


def test_a_directory_the_ranks_do_not_share_is_refused_on_every_rank(job):
    for rank in _seen(job, "not_shared"):
        kind, message = rank["error"]
        assert kind == "DirectoryNotShared" and "ranks [1] do not see the file" in message


def test_an_absent_rank_is_a_rank_failure_after_the_timeout_not_a_hang(job):
    kind, message = _seen(job, "timeout")[0]["error"]
    assert kind == "RankFailure"
    assert (
        "listing the checkpoints failed: another rank died, did not answer within the timeout of 3 s"
        in message
    )


# ------------------------------------------------------- another number of ranks (here: one)


class Counter:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _load(job, counter):
    torch.manual_seed(0)
    return Checkpointer(job / "shared", keep=3).load_latest(
        {"model": torch.nn.Linear(3, 2), "counter": counter}
    )


def test_a_per_rank_entry_is_refused_on_another_number_of_ranks_by_default(job):
    for counter in (PerRank(Counter(-1)), Counter(-1)):  # wrapped or not: it was saved per rank
        with pytest.raises(StateMismatch, match=r"state\['counter'\] was saved per rank by 2") as e:
            _load(job, counter)
        assert (e.value.field, e.value.saved, e.value.current) == ("world_size", 2, 1)


def test_resize_says_what_a_rank_loads_on_another_number_of_ranks(job):
    first = Counter(-1)
    assert _load(job, PerRank(first, resize="rank0")).world_size == 2
    assert first.value == 600
    kept = Counter(-1)
    assert _load(job, PerRank(kept, resize="skip")).step == 6 and kept.value == -1
    calls = []

    def total(parts, rank, world_size):
        calls.append((rank, world_size))
        return {"value": sum(part["value"] for part in parts)}

    summed = Counter(-1)
    _load(job, PerRank(summed, resize=total))
    assert summed.value == 1201 and calls == [(0, 1)]


def test_an_unrequested_per_rank_entry_of_another_world_is_not_returned(job):
    torch.manual_seed(0)
    restored = Checkpointer(job / "shared", keep=3).load_latest({"model": torch.nn.Linear(3, 2)})
    assert set(restored.unrequested) == {"step"}  # not another rank's "counter"


# ------------------------------------------------------------------------- one process


def test_per_rank_entries_of_one_process_save_and_load(tmp_path):
    Checkpointer(tmp_path).save(1, {"counter": PerRank(Counter(7)), "x": PerRank([1, 2])})
    assert sorted(p.name for p in (tmp_path / "step-000000001").iterdir()) == [
        "000-counter.rank-00000.pt",
        "001-x.rank-00000.pt",
        MANIFEST,
    ]
    counter = Counter(0)
    restored = Checkpointer(tmp_path).load_latest({"counter": PerRank(counter), "x": None})
    assert counter.value == 7 and restored.values == {"x": [1, 2]} and restored.world_size == 1


@pytest.mark.parametrize("resize", ["nope", 3, None])
def test_a_bad_resize_or_a_double_wrap_is_refused(resize):
    with pytest.raises(ValueError, match="resize must be one of"):
        PerRank(Counter(0), resize=resize)
    with pytest.raises(ValueError, match="wrap the object once"):
        PerRank(PerRank(Counter(0)))


def _reseal(checkpoint, change):
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    del manifest["sha256"]
    change(manifest)
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["sha256"] = hashlib.sha256(canonical).hexdigest()
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def test_a_version_1_manifest_still_loads_as_one_rank(tmp_path):
    path = Path(Checkpointer(tmp_path).save(3, {"counter": Counter(5)}))

    def to_version_1(manifest):
        manifest["version"] = 1
        del manifest["world_size"]

    _reseal(path, to_version_1)
    counter = Counter(0)
    restored = Checkpointer(tmp_path).load_latest({"counter": counter})
    assert (restored.step, restored.world_size, counter.value) == (3, 1, 5)


@pytest.mark.parametrize(
    "change, why",
    [
        (
            lambda m: m["entries"]["c"].update(file="000-c.rank-00000.pt"),
            "one of 'file', 'ranks' and 'dcp'",
        ),
        (lambda m: m["entries"]["c"]["ranks"].append("x.pt"), r"lists 2 files, expected one per"),
        (lambda m: m.update(world_size=0), r"manifest\['world_size'\] is 0"),
        (lambda m: m["entries"]["c"].update(ranks=[3]), r"\['ranks'\]\[0\] is an int"),
        (lambda m: m["entries"]["c"].update(ranks=["9-c.pt"]), "not in manifest"),
        (lambda m: m.update(version=1), "one of 'file', 'ranks' and 'dcp'"),  # v1 had no ranks
        (lambda m: m["entries"]["c"].update(param_shapes=[]), "'param_shapes' but no 'file'"),
    ],
)
def test_a_manifest_with_bad_rank_parts_is_skipped_naming_the_field(tmp_path, change, why):
    Checkpointer(tmp_path).save(1, {"c": PerRank(Counter(1))})
    path = Path(Checkpointer(tmp_path).save(2, {"c": PerRank(Counter(2))}))
    _reseal(path, change)
    counter = Counter(0)
    with pytest.warns(UserWarning, match=why):
        assert Checkpointer(tmp_path).load_latest({"c": PerRank(counter)}).step == 1
    assert counter.value == 1


def test_the_timeout_must_be_positive(tmp_path):
    for timeout in (0, -1, "5", True):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            Checkpointer(tmp_path, timeout=timeout)
    assert unbroken.errors.RankFailure.__mro__[1] is RuntimeError


# -------------------------------------------------------------- FSDP2 through DCP (Sharded)


def _plain_net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)


def test_an_fsdp2_model_saved_on_2_ranks_reloads_there_with_dcp(job):
    for rank in _seen(job, "fsdp"):
        assert rank["step"] == 3 and rank["equal"] and rank["local"] == ["DTensor"]
        assert rank["shards"] == {
            "dcp": "000-net.dcp",
            "shards": [
                "000-net.dcp/.metadata",
                "000-net.dcp/__0_0.distcp",
                "000-net.dcp/__1_0.distcp",
            ],
        }


def test_an_fsdp2_model_saved_on_2_ranks_to_s3_reloads_there(job, s3):
    ranks = _seen(job, "fsdp_s3")
    assert [(r["step"], r["equal"], r["counter"]) for r in ranks] == [(3, True, 70), (3, True, 71)]
    assert all(r["sent"] > 0 for r in ranks)  # each rank uploaded its own parts
    from unbroken.checkpoint import FsspecStorage

    url = "s3://dist-checkpoint/ckpt/step-000000003"
    storage = FsspecStorage(url, s3.storage_options)
    names = sorted(p.rpartition("/")[2] for p in storage.fs.find(url))
    assert names == [
        ".metadata",
        "001-counter.rank-00000.pt",
        "001-counter.rank-00001.pt",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
    ]


def test_an_fsdp2_checkpoint_of_2_ranks_loads_whole_in_one_process(job):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = torch.load(job / "fsdp_full.pt", weights_only=True)
    net, adam = _plain_net()
    restored = Checkpointer(job / "fsdp").load_latest(
        {"net": unbroken.Sharded(net, adam), "note": 0}
    )
    assert (restored.step, restored.world_size, restored.values) == (3, 2, {"note": "fsdp"})
    assert full["model"].keys() == net.state_dict().keys()
    for key, value in full["model"].items():
        assert torch.equal(net.state_dict()[key], value), key
    optim = get_optimizer_state_dict(net, adam)
    assert optim["state"].keys() == full["optim"]["state"].keys()
    for key, state in full["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(optim["state"][key][name], value), (key, name)


def test_a_changed_shard_skips_the_checkpoint_and_a_mismatched_request_is_refused(job, tmp_path):
    copy = tmp_path / "fsdp"
    shutil.copytree(job / "fsdp", copy)
    net, adam = _plain_net()
    with pytest.raises(StateMismatch, match="saved through DCP by a Sharded"):
        Checkpointer(copy).load_latest({"net": net})
    with pytest.raises(StateMismatch, match="as one object, not by a Sharded"):
        Checkpointer(copy).load_latest({"note": unbroken.Sharded(net, adam)})
    shard = copy / "step-000000003" / "000-net.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="000-net.dcp/__1_0.distcp does not match its sha256"):
        assert Checkpointer(copy).load_latest({"net": unbroken.Sharded(net, adam)}) is None


def test_a_sharded_entry_of_one_process_saves_and_loads_through_dcp(tmp_path):
    net, adam = _plain_net()
    net(torch.ones(2, 6)).sum().backward()
    adam.step()
    expected = {key: value.clone() for key, value in net.state_dict().items()}
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, {"net": unbroken.Sharded(net, adam)}, blocking=False)
    with torch.no_grad():  # changed while the background save runs: the save keeps its copy
        for p in net.parameters():
            p.add_(1.0)
    checkpointer.wait()
    other, other_adam = _plain_net()
    assert Checkpointer(tmp_path).load_latest({"net": unbroken.Sharded(other, other_adam)})
    for key, value in expected.items():
        assert torch.equal(other.state_dict()[key], value), key
    assert other_adam.state_dict()["state"][0]["step"] == 1


RESIZE_JOB = """
import json, sys
import torch.distributed as dist
import unbroken.distributed
from unbroken import Checkpointer, PerRank

class Value:
    def __init__(self, value):
        self.value = value
    def state_dict(self):
        return {"value": self.value}
    def load_state_dict(self, state):
        self.value = state["value"]

unbroken.distributed.init_process_group("gloo")
rank = dist.get_rank()
directory, mode = sys.argv[1], sys.argv[2]
checkpointer = Checkpointer(directory, keep=2)
if mode == "save":
    checkpointer.save(1, {"value": PerRank(Value(100 + rank))})
else:
    value = Value(-1)
    checkpointer.load_latest({"value": PerRank(value, resize="rank0")})
    # A file per rank: the ranks share torchrun's stdout, where two lines can interleave.
    with open(f"{directory}/loaded-{rank}.json", "w") as file:
        json.dump({"rank": rank, "value": value.value}, file)
dist.destroy_process_group()
"""


def test_resize_rank0_gives_every_rank_rank_0s_part_also_ranks_that_existed_before(tmp_path):
    # Saved by 3 ranks (each its own value), loaded on 2: rank 1 existed before and has a part
    # of its own, but "rank0" means rank 0's part, on every rank.
    script = tmp_path / "resize_job.py"
    script.write_text(RESIZE_JOB)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for ranks, mode in ((3, "save"), (2, "load")):
        done = subprocess.run(
            [
                torchrun,
                "--standalone",
                f"--nproc-per-node={ranks}",
                str(script),
                str(tmp_path / "c"),
                mode,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    loaded = [json.loads(path.read_text()) for path in (tmp_path / "c").glob("loaded-*.json")]
    assert sorted((r["rank"], r["value"]) for r in loaded) == [(0, 100), (1, 100)]
