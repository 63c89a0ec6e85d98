"""``unbroken.distributed.exact_reduce``: DDP gradient sums that do not depend on DDP's bucket
layout, so a process resumed on 3 ranks steps as the uninterrupted one did.

The collective checks run in one torchrun job of 3 gloo ranks (reduction_job.py): 2 ranks
would hide the bug (each element is one addition there, and a + b == b + a). The Trainer's
own 3-rank kills are in test_distributed_trainer.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from locations import SUPPORT

from unbroken.distributed import exact_reduce
from unbroken.distributed.reduction import is_exact, rebuilt_layout


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("reduction")
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=3", str(SUPPORT / "reduction_job.py")]
        + [str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((out / "seen.json").read_text())


def test_a_users_loop_resumed_by_a_fresh_ddp_model_ends_bit_exact_with_exact_reduce(seen):
    # The job also checked (or failed) that exact_reduce gives one result in the first and the
    # rebuilt layout at any bucket size, equal to the chunked sum computed without DDP.
    assert seen["exact resumed equal"] and seen["exact max diff"] == 0.0
    assert seen["exact warned"] == 0


def test_a_carried_row_rides_in_one_layout_and_a_resumed_loop_ends_bit_exact(seen):
    # The job checked that the row's sum arrives after each backward, in both ways, and that
    # the gradients are the chunked sum with the row packed after the smallest chunk. Packing
    # changes that all-reduce's length, hence its sums (the hazard of packing in one way only).
    assert seen["carrying cap 0.002 differs from not carrying"]
    assert seen["carrying resumed equal"] and seen["carrying max diff"] == 0.0


def test_a_predivided_reduction_only_sums_and_a_resumed_loop_ends_bit_exact(seen):
    # The Trainer's way without accumulation: each rank's loss divided by the world size, the
    # hook only sums (no pass over the gradients). The job checked one result in every layout,
    # equal to the packed chunked sum of those gradients undivided, and close to the mean.
    assert seen["predivided resumed equal"] and seen["predivided max diff"] == 0.0


def test_backwards_under_no_sync_before_the_first_reduced_one_leave_the_chunks_as_they_are(seen):
    # The chunks of a loop whose first backwards accumulate under no_sync: each parameter once,
    # in the reduced backward's order, as for a process whose first backward is reduced; and
    # only the first step copies. (Learnt from every backward's order, each parameter came
    # twice, and every step took the copying way in a layout no other process had.)
    assert seen["no_sync first: chunks"] == seen["reduced first: chunks"] == [[5, 4, 3, 2], [1, 0]]
    assert seen["no_sync first: copies"] == 1


def test_the_trainers_ddp_step_is_the_ranks_mean_gradient_with_and_without_accumulation(seen):
    # The job checked it (allclose): its reduction sums gradients of a loss it divided by the
    # world size, or divides accumulated gradients itself.
    assert seen["trainer step 1 is the mean"] and seen["trainer step 2 is the mean"]


def test_without_it_the_resumed_run_differs_and_the_resume_warns(seen):
    # The hazard is real on 3 ranks: DDP's own layouts sum one batch's gradients differently,
    # and a resumed loop ends with other weights; the Checkpointer says so as it loads.
    assert seen["stock layouts differ"]
    assert not seen["stock resumed equal"] and 0 < seen["stock max diff"] < 1e-5
    assert seen["stock warned"] == 1


def test_ddp_that_never_rebuilds_its_buckets_is_exact_without_the_hook_and_not_warned(seen):
    assert seen["unused resumed equal"] and seen["unused warned"] == 0


def test_a_model_with_its_own_hook_is_refused_with_the_reason(seen):
    assert "already has a communication hook" in seen["second hook"]
    assert "can only be called once" in seen["second hook"]


LAYOUTS = st.lists(
    st.tuples(st.integers(1, 3000), st.sampled_from([torch.float32, torch.float64, torch.float16])),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(layout=LAYOUTS, limits=st.lists(st.integers(1, 20000), min_size=1, max_size=3))
def test_the_chunks_are_ddps_rebuilt_buckets(layout, limits):
    # torch's own bucket assignment (the function DDP's reducer runs on the ready order) is the
    # reference; a difference would cost a copy each step, not exactness.
    tensors = [torch.zeros(n, dtype=dtype) for n, dtype in layout]
    theirs, _ = torch.distributed._compute_bucket_assignment_by_size(
        tensors, limits, [False] * len(tensors), list(range(len(tensors)))
    )
    sizes = [(t.numel() * t.element_size(), (t.dtype, t.device)) for t in tensors]
    assert rebuilt_layout(sizes, limits) == [list(bucket) for bucket in theirs]


def test_only_a_ddp_model_is_taken():
    with pytest.raises(TypeError, match="wrap the model in DDP first"):
        exact_reduce(torch.nn.Linear(2, 2))
    assert is_exact(torch.nn.Linear(2, 2))  # nothing to reduce: exact as it is
