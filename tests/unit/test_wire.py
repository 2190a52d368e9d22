"""The wire format of weight buckets that cross a serialiser (vLLM's multiprocess IPC)."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest
import torch

from staleflow.actors.vllm_engine import buckets
from staleflow.learner.publish import pack_bucket, unpack_bucket


def sample_bucket() -> dict[str, np.ndarray]:
    bf16 = torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.bfloat16)
    return {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": bf16.view(torch.int16).numpy(),  # bfloat16 travels as its int16 bit pattern
        "scalar": np.array(7.0, dtype=np.float32),
        "empty": np.zeros((0, 5), dtype=np.float32),
    }


@pytest.mark.parametrize(
    "serialise",
    [
        # plain msgpack, no numpy or extension hooks: what any IPC layer can at least do
        lambda x: msgpack.unpackb(msgpack.packb(x, use_bin_type=True), raw=False),
        lambda x: pickle.loads(pickle.dumps(x)),
    ],
    ids=["msgpack", "pickle"],
)
def test_a_bucket_survives_a_serialiser_bit_exactly(serialise):
    bucket = sample_bucket()
    layout, data = serialise(list(pack_bucket(bucket)))
    assert isinstance(data, bytes)
    # 12 floats * 4 + 3 int16 * 2 + 1 float * 4 + 0 = 58 bytes, one copy of the data
    assert len(data) == 58
    out = unpack_bucket(layout, data)
    assert list(out) == ["w", "b", "scalar", "empty"]
    for name, array in bucket.items():
        assert out[name].dtype == array.dtype
        assert out[name].shape == array.shape
        np.testing.assert_array_equal(out[name], array)
    restored = torch.from_numpy(out["b"].copy()).view(torch.bfloat16)
    assert restored.tolist() == torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.bfloat16).tolist()


def test_arrays_turned_into_lists_are_refused_with_the_reason():
    # what vLLM's multiprocess IPC did to numpy arrays: they arrived as nested lists
    layout, _ = pack_bucket(sample_bucket())
    with pytest.raises(TypeError, match="must arrive as bytes, got list"):
        unpack_bucket(layout, [[0.0, 1.0], [2.0, 3.0]])


def test_a_truncated_or_padded_bucket_is_refused():
    layout, data = pack_bucket(sample_bucket())
    with pytest.raises(ValueError, match="parameter 'b': the bucket ends at byte 50"):
        unpack_bucket(layout, data[:50])  # "w" takes bytes 0-48, "b" needs 48-54
    with pytest.raises(ValueError, match="2 bytes the layout does not name"):
        unpack_bucket(layout, data + b"xx")
    with pytest.raises(ValueError, match="bad layout"):
        unpack_bucket([["w", [3, 4], "<U8"]], data)


def test_unsupported_dtypes_are_refused_when_packing():
    with pytest.raises(TypeError, match="parameter 's': dtype <U1"):
        pack_bucket({"s": np.array(["a"])})


def test_vllm_buckets_are_packed_in_order_and_size():
    weights = {f"p{i}": np.full(n, i, dtype=np.float32) for i, n in enumerate([100, 100, 300, 50])}
    parts = list(buckets(weights, bucket_bytes=1000))  # 1000 bytes = 250 floats
    assert [[e[0] for e in layout] for layout, _ in parts] == [["p0", "p1"], ["p2"], ["p3"]]
    assert [len(data) for _, data in parts] == [800, 1200, 200]
    second = unpack_bucket(*parts[1])
    assert second["p2"].tolist() == [2.0] * 300
