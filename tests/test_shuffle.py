import tracemalloc

import numpy as np
from hypothesis import given, strategies as st

from unbroken._shuffle import IndexShuffle, derive_key


@given(n=st.integers(0, 3000), key=st.integers(0, 2**64 - 1))
def test_is_a_permutation_of_range_n(n, key):
    indices = IndexShuffle(n, key).range(0, n)
    assert sorted(indices) == list(range(n))


@given(n=st.integers(1, 500), key=st.integers(0, 2**64 - 1), data=st.data())
def test_any_slice_equals_the_slice_of_the_whole(n, key, data):
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    shuffle = IndexShuffle(n, key)
    assert shuffle.range(start, stop) == shuffle.range(0, n)[start:stop]


def test_keys_give_different_orders_and_are_not_the_identity():
    orders = {tuple(IndexShuffle(100, derive_key(7, epoch)).range(0, 100)) for epoch in range(20)}
    assert len(orders) == 20
    assert tuple(range(100)) not in orders


def test_positions_spread_uniformly_over_indices():
    # Where does position 0 land, over many epochs? Each of 8 indices about 1/8 of the time.
    counts = np.bincount(
        [IndexShuffle(8, derive_key(1, epoch)).range(0, 1)[0] for epoch in range(4000)],
        minlength=8,
    )
    assert counts.min() > 400 and counts.max() < 600, counts


def test_a_billion_indices_cost_no_memory_growing_with_n():
    tracemalloc.start()
    shuffle = IndexShuffle(10**9, derive_key(3, 0))
    tail = shuffle.range(10**9 - 4096, 10**9)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(set(tail)) == 4096 and all(0 <= i < 10**9 for i in tail)
    assert peak < 4 * 2**20, f"peak {peak} bytes for a 4096-index block"
