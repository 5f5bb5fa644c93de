"""dsv4_ort.bench.ortgraph: the data pool serves views that never repeat one another (onnxruntime's MatMul gives
identical weights one pre-packed copy, so repeated contents would be timed from the cache) and that are valid in every
format the ops read."""

from __future__ import annotations

import numpy as np

from dsv4_ort.bench.ortgraph import DataPool

MIB = 1 << 20


def test_views_of_any_size_never_repeat():
    pool = DataPool(48 * MIB)
    # sizes that divide the 8 MiB tile and sizes that span tiles, taken back to back as the benchmarks take them
    for nbytes in (2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB):
        pool.cursor = 0
        views = [pool.take((nbytes,), "uint8").copy() for _ in range(48 * MIB // nbytes)]
        for i in range(len(views)):
            for j in range(i + 1, len(views)):
                assert not np.array_equal(views[i], views[j]), (nbytes, i, j)


def test_every_byte_is_valid_in_every_format():
    pool = DataPool(24 * MIB)
    assert not np.any((pool.data & 0x7F) == 0x7F)  # no FP8 E4M3 NaN code anywhere
    f32 = pool.data.view(np.float32)
    assert np.isfinite(f32).all()
    bf16 = pool.data.view(np.uint16)
    assert ((bf16 >> 7) & 0xFF).max() < 0xFF  # finite bfloat16 values
    assert np.count_nonzero(bf16) > bf16.size // 2
