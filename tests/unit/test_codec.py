"""The group record codec: round trips, clear errors per field, and a fuzzed decoder."""

from __future__ import annotations

import dataclasses
import pickle
import resource

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.buffer.codec import LIMITS, RecordError, decode, encode
from staleflow.buffer.records import LOGP_DTYPE, SCHEMA_VERSION, TOKEN_DTYPE, Group, Response


def make_group(k: int = 3, length: int = 5, version: int = 2, seed: int = 0) -> Group:
    rng = np.random.default_rng(seed)
    return Group.new(
        run_id="run-1",
        prompt_id="arith-17",
        task="arithmetic",
        prompt_token_ids=rng.integers(0, 50_000, 7),
        responses=[
            Response(
                token_ids=rng.integers(0, 50_000, length + i),
                behavior_logp=-rng.random(length + i),
                reward=float(i % 2),
                finish_reason="length" if i else "stop",
                metadata={"answer": str(i), "parsed": i > 0, "score": 0.5, "n": None},
            )
            for i in range(k)
        ],
        policy_version=version,
        worker_id="worker-0",
    )


def test_round_trip_keeps_every_field():
    group = make_group()
    back = decode(encode(group))
    assert back == group
    assert back.prompt_token_ids.dtype == TOKEN_DTYPE
    assert back.responses[1].behavior_logp.dtype == LOGP_DTYPE
    assert back.responses[2].metadata == {"answer": "2", "parsed": True, "score": 0.5, "n": None}
    assert back.schema_version == SCHEMA_VERSION
    assert back.rewards.tolist() == [0.0, 1.0, 0.0]
    assert back.num_tokens == 5 + 6 + 7


def test_round_trip_of_empty_response_and_large_group():
    empty = Group.new(
        run_id="r", prompt_id="p", task="t", prompt_token_ids=[], policy_version=0,
        responses=[Response([], [], 0.0, "length")], worker_id="w",
    )  # fmt: skip
    assert decode(encode(empty)) == empty
    big = make_group(k=8, length=1024)
    assert decode(encode(big)) == big


def test_arrays_are_raw_little_endian_bytes_not_pickle():
    group = make_group(k=1)
    raw = msgpack.unpackb(encode(group), raw=False)
    dtype, shape, data = raw["resp"][0]["tok"]
    assert (dtype, shape) == ("<i4", [5])
    assert data == group.responses[0].token_ids.astype("<i4").tobytes()
    assert b"\x80\x04" not in encode(group)[:2]  # not a pickle stream


def test_pickle_bytes_are_refused():
    # a pickle is never executed: it fails to parse as a record
    with pytest.raises(RecordError, match="<record>"):
        decode(pickle.dumps({"schema": 1}))


# ----------------------------------------------------------------------------- errors


def _tamper(group: Group, **changes: object) -> bytes:
    raw = msgpack.unpackb(encode(group), raw=False)
    for path, value in changes.items():
        node = raw
        *parents, last = path.split("__")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[last] = value
    return msgpack.packb(raw, use_bin_type=True)


TOK0, LOGP0 = "responses[0].token_ids", "responses[0].behavior_logp"
NAN5 = np.full(5, np.nan, "<f4").tobytes()


@pytest.mark.parametrize(
    ("changes", "field", "problem"),
    [
        ({"schema": 99}, "schema_version", "not a known schema version"),
        ({"ver": -1}, "policy_version", "outside"),
        ({"ver": "3"}, "policy_version", "expected an integer"),
        ({"gid": 5}, "group_id", "expected a string"),
        ({"run": "x" * 2000}, "run_id", "limit"),
        ({"resp": []}, "responses", "non-empty"),
        ({"resp__0__r": float("nan")}, "responses[0].reward", "finite"),
        ({"resp__0__r": True}, "responses[0].reward", "expected a number"),
        ({"resp__1__fin": "eos"}, "responses[1].finish_reason", "not one of"),
        ({"resp__0__tok": ["<i8", [5], b"\0" * 40]}, TOK0, "not allowed"),
        ({"resp__0__tok": ["<i4", [6], b"\0" * 20]}, TOK0, "data bytes"),
        ({"resp__0__tok": ["<i4", [5, 1], b"\0" * 20]}, TOK0, "shape"),
        ({"resp__0__tok": ["<i4", [1], b"\xff\xff\xff\xff"]}, TOK0, "negative"),
        ({"resp__0__logp": ["<f4", [4], b"\0" * 16]}, LOGP0, "4 log-probs for 5"),
        ({"resp__0__logp": ["<f4", [5], NAN5]}, LOGP0, "finite"),
        ({"resp__0__meta": {"x": [1, 2]}}, "responses[0].metadata.x", "scalar"),
        ({"resp__0__meta": "nope"}, "responses[0].metadata", "expected a map"),
        ({"resp__0__extra": 1}, "responses[0]", "unexpected keys"),
        ({"prompt": ["<i4", [2 << 20], b""]}, "prompt_token_ids", "outside"),
        ({"t": "yesterday"}, "created_at", "finite float"),
    ],
)  # fmt: skip
def test_decode_names_the_bad_field(changes, field, problem):
    with pytest.raises(RecordError) as err:
        decode(_tamper(make_group(), **changes))
    assert err.value.field == field
    assert problem in err.value.problem


def test_missing_key_is_named():
    raw = msgpack.unpackb(encode(make_group()), raw=False)
    del raw["worker"]
    with pytest.raises(RecordError, match=r"missing keys \['worker'\]"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_encode_refuses_wrong_dtypes_and_mismatched_lengths():
    group = make_group(k=1)
    bad_dtype = dataclasses.replace(
        group,
        responses=(dataclasses.replace(group.responses[0], token_ids=np.arange(5)),),
    )
    with pytest.raises(RecordError, match=r"responses\[0\].token_ids: dtype int64"):
        encode(bad_dtype)
    short = dataclasses.replace(
        group,
        responses=(
            dataclasses.replace(group.responses[0], behavior_logp=np.zeros(2, dtype=LOGP_DTYPE)),
        ),
    )
    with pytest.raises(RecordError, match="2 log-probs for 5 tokens"):
        encode(short)
    with pytest.raises(RecordError, match="at least one response"):
        encode(dataclasses.replace(group, responses=()))


def test_oversized_record_is_refused_before_parsing(monkeypatch):
    monkeypatch.setitem(LIMITS, "record_bytes", 100)
    with pytest.raises(RecordError, match="bytes > limit 100"):
        decode(encode(make_group()))


# ----------------------------------------------------------------------------- fuzzing

VALID = encode(make_group(k=2, length=4))
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_record_error(data: bytes) -> None:
    try:
        group = decode(data)
    except RecordError:
        return
    # anything accepted must survive its own re-encoding unchanged
    assert decode(encode(group)) == group


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data):
    _decode_or_record_error(data)


@FUZZ
@given(st.data())
def test_fuzz_mutated_valid_records(data):
    buf = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    _decode_or_record_error(bytes(buf[:cut]))


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=64)
)
msgpack_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=30,
)


@FUZZ
@given(msgpack_values)
def test_fuzz_well_formed_msgpack_of_the_wrong_shape(value):
    _decode_or_record_error(msgpack.packb(value, use_bin_type=True))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(msgpack.unpackb(VALID, raw=False))), msgpack_values))
def test_fuzz_records_with_wrong_field_values(fields):
    raw = msgpack.unpackb(VALID, raw=False)
    raw.update(fields)
    _decode_or_record_error(msgpack.packb(raw, use_bin_type=True))


def test_hostile_length_headers_do_not_allocate():
    # msgpack headers claiming 4 GiB strings / 2^32-entry arrays, with no data behind them
    hostile = [
        b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
        b"\xdd\xff\xff\xff\xff",  # array32 of 2^32 entries
        b"\xdf\xff\xff\xff\xff",  # map32 of 2^32 entries
        b"\x91" * 100_000,  # 100k nested arrays
    ]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for data in hostile:
        with pytest.raises(RecordError):
            decode(data)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024  # far below the gigabytes the headers claim
