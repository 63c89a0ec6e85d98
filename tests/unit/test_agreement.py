"""``train.agreement.Carrier``: the row of what the ranks agree on, handed to the gradient
reduction before a backward and read after it, without torch.distributed (the reduction is a
stand-in that sums nothing: one rank's view). The 3-rank jobs are in test_just_in_time.py."""

import torch

from unbroken.distributed.world import World
from unbroken.train.agreement import Carrier


class Reduction:
    """Takes the row and gives back its "sum" after the backward: a tensor of its own, as the
    packed all-reduce returns (on the CPU, read at once; on a device, a batch later)."""

    def __init__(self):
        self.row = None

    def carry(self, row):
        self.row = row

    def carried(self):
        row, self.row = self.row, None
        return None if row is None else row.clone()


def loss_bytes(value):
    return list(torch.tensor([value], dtype=torch.float64).view(torch.uint8).tolist())


def test_the_row_holds_the_flags_the_log_size_and_this_ranks_loss_in_its_own_bytes():
    reduction = Reduction()
    carrier = Carrier(reduction, World(rank=1, size=3), torch.device("cpu"))
    carrier.send(True, False, 1234, rows=7, ticks=40, loss=torch.tensor(0.25, requires_grad=True))
    row = reduction.row.tolist()
    assert len(row) == Carrier.width(3) == 16 + 3 * 8 and reduction.row.dtype == torch.uint8
    assert row[:2] == [1, 0] and row[2:8] == [0] * 6
    assert row[8:16] == [1234 % 256, 1234 // 256, 0, 0, 0, 0, 0, 0]  # little-endian int64
    assert row[16:24] == [0] * 8 and row[24:32] == loss_bytes(0.25) and row[32:] == [0] * 8
    losses, received = carrier.receive()
    assert losses.dtype == torch.float64 and losses.tolist() == [0.0, 0.25, 0.0]
    assert (received.preempted, received.time_due, received.log_bytes) == (True, False, 1234)
    assert (received.rows, received.ticks) == (7, 40)
    # The next batch's row starts from zeros: nothing of the last one is carried again.
    carrier.send(False, True, 2**40 + 99, rows=8, ticks=41, loss=torch.tensor(0.5))
    losses, received = carrier.receive()
    assert losses.tolist() == [0.0, 0.5, 0.0]
    assert (received.preempted, received.time_due, received.log_bytes) == (False, True, 2**40 + 99)


def test_the_ranks_rows_summed_byte_by_byte_give_every_loss_bit_for_bit():
    # What the reduction does with three ranks' rows: a saturated byte-wise sum. Losses that
    # need all 64 bits (and a NaN) come back exactly; flags sent by several ranks stay set.
    values = [1 / 3, float("nan"), -2.5e-300]
    rows = []
    for rank, value in enumerate(values):
        reduction = Reduction()
        Carrier(reduction, World(rank=rank, size=3), torch.device("cpu")).send(
            rank > 0, False, 77 if rank == 0 else 0, 1, 1, torch.tensor(value, dtype=torch.float64)
        )
        rows.append(reduction.row.to(torch.float32))
    summed = torch.stack(rows).sum(0).clamp(max=255).to(torch.uint8)

    class Summed(Reduction):
        def carried(self):
            return summed

    carrier = Carrier(Summed(), World(rank=0, size=3), torch.device("cpu"))
    losses, received = carrier.receive()
    got = losses.view(torch.int64).tolist()
    assert got == torch.tensor(values, dtype=torch.float64).view(torch.int64).tolist()
    assert received.preempted and not received.time_due and received.log_bytes == 77


def test_a_loss_of_every_floating_dtype_rides_in_float64_exactly():
    # Each value is one its dtype holds exactly, so its float64 is known; a loss that requires
    # grad and has a shape of one element, as a step may return it.
    for dtype, value in [
        (torch.float16, 0.333251953125),
        (torch.float32, 1 / 3),
        (torch.float64, 1 / 3),
        (torch.bfloat16, 0.333984375),
    ]:
        reduction = Reduction()
        carrier = Carrier(reduction, World(rank=1, size=2), torch.device("cpu"))
        loss = torch.tensor(value, dtype=dtype, requires_grad=True)
        carrier.send(False, False, 0, rows=0, ticks=1, loss=loss.reshape(1) * 1)
        losses, _ = carrier.receive()
        assert losses.tolist() == [0.0, float(loss.detach().to(torch.float64))], dtype


def test_no_reduction_since_the_send_gives_nothing_to_agree_on():
    carrier = Carrier(Reduction(), World(rank=0, size=2), torch.device("cpu"))
    assert carrier.receive() is None  # e.g. a validation batch: the loop falls back


def test_on_a_device_the_flags_are_acted_on_one_batch_later_with_their_own_tags():
    carrier = Carrier(Reduction(), World(rank=0, size=2), torch.device("cpu"))
    carrier.lag = True  # as on an accelerator: the flags travel to the host during a batch
    carrier.send(True, False, 10, rows=1, ticks=5, loss=torch.tensor(1.0))
    losses, received = carrier.receive()
    assert losses.tolist() == [1.0, 0.0] and received is None  # still travelling
    carrier.send(False, False, 20, rows=2, ticks=6, loss=torch.tensor(2.0))
    losses, received = carrier.receive()
    assert losses.tolist() == [2.0, 0.0]  # this batch's losses, at once (on the device)
    assert received.preempted and (received.log_bytes, received.rows, received.ticks) == (10, 1, 5)
