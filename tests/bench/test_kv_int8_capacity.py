"""bench.kv_int8_capacity: how many whole sequences a number of KV blocks holds."""

from __future__ import annotations

from bench.kv_int8_capacity import batch_that_fits


def test_each_sequence_takes_its_blocks_rounded_up() -> None:
    assert batch_that_fits(num_kv_blocks=364, block_size=16, seq_len=384) == 15  # 24 blocks each
    assert batch_that_fits(num_kv_blocks=48, block_size=16, seq_len=385) == 1  # 25 blocks each
    assert batch_that_fits(num_kv_blocks=10, block_size=16, seq_len=24) == 5


def test_no_sequence_fits_fewer_blocks_than_one_needs() -> None:
    assert batch_that_fits(num_kv_blocks=1, block_size=16, seq_len=17) == 0
