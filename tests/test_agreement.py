"""``train.agreement.Carrier``: the row of what the ranks agree on, handed to the gradient
reduction before a backward and read after it, without torch.distributed (the reduction is a
stand-in that sums nothing: one rank's view). The 3-rank jobs are in test_just_in_time.py."""

import torch

from unbroken.distributed.world import World
from unbroken.train.agreement import Carrier


class Reduction:
    """Takes the row and gives it back after the "backward": as it is (the CPU way), or as a
    tensor of its own (what a device's reduction returns, read a batch later)."""

    def __init__(self, own_tensor=False):
        self.own_tensor, self.row = own_tensor, None

    def carry(self, row):
        self.row = row

    def carried(self):
        row, self.row = self.row, None
        if row is None:
            return None
        return row.clone() if self.own_tensor else row


def test_the_row_holds_the_flags_the_log_size_and_this_ranks_loss_in_its_slot():
    reduction = Reduction()
    carrier = Carrier(reduction, World(rank=1, size=3), torch.device("cpu"))
    carrier.send(True, False, 1234, rows=7, ticks=40, loss=torch.tensor(0.25, requires_grad=True))
    assert reduction.row.tolist() == [1.0, 0.0, 1234.0, 0.0, 0.25, 0.0]
    assert not reduction.row.requires_grad
    losses, received = carrier.receive()
    assert losses.tolist() == [0.0, 0.25, 0.0]
    assert (received.preempted, received.time_due, received.log_bytes) == (True, False, 1234)
    assert (received.rows, received.ticks) == (7, 40)
    # The next batch's row starts from zeros: nothing of the last one is carried again.
    carrier.send(False, True, 99, rows=8, ticks=41, loss=torch.tensor(0.5))
    assert reduction.row.tolist() == [0.0, 1.0, 99.0, 0.0, 0.5, 0.0]


def test_no_reduction_since_the_send_gives_nothing_to_agree_on():
    carrier = Carrier(Reduction(), World(rank=0, size=2), torch.device("cpu"))
    assert carrier.receive() is None  # e.g. a validation batch: the loop falls back


def test_a_row_read_back_from_a_device_is_acted_on_one_batch_later_with_its_own_tags():
    carrier = Carrier(Reduction(own_tensor=True), World(rank=0, size=2), torch.device("cpu"))
    carrier.send(True, False, 10, rows=1, ticks=5, loss=torch.tensor(1.0))
    losses, received = carrier.receive()
    assert losses.tolist() == [1.0, 0.0] and received is None  # still travelling
    carrier.send(False, False, 20, rows=2, ticks=6, loss=torch.tensor(2.0))
    losses, received = carrier.receive()
    assert losses.tolist() == [2.0, 0.0]  # this batch's losses, at once (on the device)
    assert received.preempted and (received.log_bytes, received.rows, received.ticks) == (10, 1, 5)
