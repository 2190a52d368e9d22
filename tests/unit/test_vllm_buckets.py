"""Bucketing of weight updates for the vLLM engine (pure; vLLM itself is not imported)."""

from __future__ import annotations

import numpy as np

from staleflow.actors.vllm_engine import buckets


def test_buckets_respect_the_size_and_keep_order():
    weights = {
        f"p{i}": np.zeros(n, dtype=np.float32) for i, n in enumerate([100, 100, 300, 50, 10])
    }
    parts = list(buckets(weights, bucket_bytes=1000))  # 1000 bytes = 250 floats
    assert [names for names, _ in parts] == [["p0", "p1"], ["p2"], ["p3", "p4"]]
    assert all(
        a is weights[n] for names, arrays in parts for n, a in zip(names, arrays, strict=True)
    )


def test_an_oversized_array_is_its_own_bucket():
    weights = [("big", np.zeros(1000, np.float32)), ("small", np.zeros(1, np.float32))]
    assert [names for names, _ in buckets(weights, bucket_bytes=16)] == [["big"], ["small"]]


def test_no_weights_no_buckets():
    assert list(buckets({}, bucket_bytes=16)) == []
