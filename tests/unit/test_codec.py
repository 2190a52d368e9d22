"""The group record codec: round trips, clear errors per field, and a fuzzed decoder."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import warnings

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.buffer.codec import (
    LIMITS,
    RecordError,
    decode,
    decode_fields,
    encode,
    encode_fields,
)
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
    assert back.behavior_logp.dtype == LOGP_DTYPE
    assert back.responses[2].metadata == {"answer": "2", "parsed": True, "score": 0.5, "n": None}
    assert back.schema_version == SCHEMA_VERSION
    assert back.rewards.tolist() == [0.0, 1.0, 0.0]
    assert back.num_tokens == 5 + 6 + 7
    assert [len(r.token_ids) for r in back.responses] == [5, 6, 7]
    assert back.responses == group.responses


def test_round_trip_through_stream_fields():
    group = make_group(k=8, length=1024)
    fields = encode_fields(group)
    assert set(fields) == {"h", "prompt", "tok", "logp"}
    # arrays are zero-copy views of the group's memory on the way out ...
    assert isinstance(fields["tok"], memoryview)
    assert np.shares_memory(np.frombuffer(fields["tok"], TOKEN_DTYPE), group.token_ids)
    # ... and Redis hands back bytes keys and values
    back = decode_fields({k.encode(): bytes(v) for k, v in fields.items()})
    assert back == group


def test_round_trip_of_an_empty_response():
    empty = Group.new(
        run_id="r", prompt_id="p", task="t", prompt_token_ids=[], policy_version=0,
        responses=[Response([], [], 0.0, "length")], worker_id="w",
    )  # fmt: skip
    assert decode(encode(empty)) == empty


def test_arrays_are_raw_little_endian_bytes_not_pickle():
    group = make_group(k=2)
    fields = msgpack.unpackb(encode(group), raw=False)
    header = msgpack.unpackb(fields["h"], raw=False)
    assert header["arrays"]["tok"] == ["<i4", [11]]
    assert header["lens"] == [5, 6]
    assert fields["tok"] == group.token_ids.astype("<i4").tobytes()
    assert fields["logp"] == group.behavior_logp.astype("<f4").tobytes()


def test_pickle_bytes_are_refused():
    # a pickle is never executed: it fails to parse as a record
    with pytest.raises(RecordError, match="<record>"):
        decode(pickle.dumps({"schema": 1}))


def test_group_new_rejects_mismatched_response_arrays():
    with pytest.raises(ValueError, match="equal length"):
        Group.new(
            run_id="r", prompt_id="p", task="t", prompt_token_ids=[1], policy_version=0,
            responses=[Response([1, 2], [-0.1], 1.0)], worker_id="w",
        )  # fmt: skip


# ----------------------------------------------------------------------------- errors


def _tamper(group: Group, header: dict | None = None, **arrays: object) -> bytes:
    fields = msgpack.unpackb(encode(group), raw=False)
    h = msgpack.unpackb(fields["h"], raw=False)
    h.update(header or {})
    fields["h"] = msgpack.packb(h, use_bin_type=True)
    fields.update(arrays)
    return msgpack.packb(fields, use_bin_type=True)


NAN = np.array([np.nan], "<f4").tobytes()


@pytest.mark.parametrize(
    ("header", "arrays", "field", "problem"),
    [
        ({"schema": 99}, {}, "schema_version", "not a known schema version"),
        ({"ver": -1}, {}, "policy_version", "outside"),
        ({"ver": "3"}, {}, "policy_version", "expected an integer"),
        ({"gid": 5}, {}, "group_id", "expected a string"),
        ({"run": "x" * 2000}, {}, "run_id", "limit"),
        ({"lens": []}, {}, "responses", "at least one response"),
        ({"lens": [5, 6, -1]}, {}, "lengths", "must be in"),
        ({"lens": [5, 6, "7"]}, {}, "lengths", "list of integers"),
        ({"lens": [5, 6, 8]}, {}, "token_ids", "lengths sum to 19"),
        ({"r": [0.0, float("nan"), 1.0]}, {}, "rewards", "finite"),
        ({"r": [0.0, True, 1.0]}, {}, "rewards", "expected numbers"),
        ({"r": [0.0]}, {}, "rewards", "expected 3 numbers"),
        ({"fin": ["stop", "eos", "stop"]}, {}, "finish_reasons", "'eos' is not one of"),
        ({"meta": [{}, {"x": [1, 2]}, {}]}, {}, "metadata[1].x", "scalar"),
        ({"meta": [{}, "nope", {}]}, {}, "metadata[1]", "expected a map"),
        ({"extra": 1}, {}, "header", "unexpected keys"),
        ({"arrays": {"tok": ["<i4", [18]]}}, {}, "header.arrays", "expected specs"),
        ({"arrays": {"prompt": ["<i4", [7]], "tok": ["<i8", [18]], "logp": ["<f4", [18]]}},
         {}, "token_ids", "not allowed"),
        ({"arrays": {"prompt": ["<i4", [7]], "tok": ["<i4", [18, 1]], "logp": ["<f4", [18]]}},
         {}, "token_ids", "shape"),
        ({}, {"tok": b"\0" * 20}, "token_ids", "data bytes"),
        ({}, {"logp": NAN * 18}, "behavior_logp", "finite"),
        ({}, {"prompt": b"\xff" * 28}, "prompt_token_ids", "negative"),
        ({"t": "yesterday"}, {}, "created_at", "finite float"),
    ],
)  # fmt: skip
def test_decode_names_the_bad_field(header, arrays, field, problem):
    with pytest.raises(RecordError) as err:
        decode(_tamper(make_group(), header, **arrays))
    assert err.value.field == field
    assert problem in err.value.problem


def test_missing_fields_are_named():
    fields = msgpack.unpackb(encode(make_group()), raw=False)
    del fields["logp"]
    with pytest.raises(RecordError, match=r"missing fields \['logp'\]"):
        decode(msgpack.packb(fields, use_bin_type=True))
    header = msgpack.unpackb(encode(make_group()), raw=False)["h"]
    h = msgpack.unpackb(header, raw=False)
    del h["worker"]
    with pytest.raises(RecordError, match=r"missing keys \['worker'\]"):
        decode(_tamper(make_group(), None, h=msgpack.packb(h)))


def test_encode_refuses_wrong_dtypes_and_mismatched_lengths():
    group = make_group(k=1)
    with pytest.raises(RecordError, match="token_ids: dtype int64"):
        encode(dataclasses.replace(group, token_ids=np.arange(5)))
    with pytest.raises(RecordError, match="2 log-probs for 5 tokens"):
        encode(dataclasses.replace(group, behavior_logp=np.zeros(2, dtype=LOGP_DTYPE)))
    with pytest.raises(RecordError, match="at least one response"):
        encode(dataclasses.replace(group, lengths=np.zeros(0, dtype="<i4")))
    with pytest.raises(RecordError, match="finite"):
        encode(dataclasses.replace(group, behavior_logp=np.full(5, np.inf, dtype=LOGP_DTYPE)))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's, on -2e19
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -2e19])
def test_a_non_finite_log_prob_anywhere_is_refused(bad):
    # The check is one BLAS dot product, which works on blocks of values: a bad value first,
    # in the middle or in the last two places, in arrays whose lengths leave every remainder
    # of a block, is seen. (-2e19 is finite, but its square overflows float32: documented as
    # refused.)
    for total in (1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 65, 8191):
        fields = {
            k.encode(): bytes(v) for k, v in encode_fields(make_group(k=1, length=total)).items()
        }
        good = np.frombuffer(fields[b"logp"], LOGP_DTYPE)
        assert decode_fields(fields).num_tokens == total
        for i in sorted({0, total // 2, total - 2, total - 1} - {-1}):
            logp = good.copy()
            logp[i] = bad
            with pytest.raises(RecordError, match="behavior_logp: log-probs must be finite"):
                decode_fields({**fields, b"logp": logp.tobytes()})


def test_an_overflowing_log_prob_is_a_bad_record_even_where_overflows_raise():
    # The square of -2e19 overflows: numpy warns, or raises under np.seterr(over="raise") or
    # with warnings as errors. Either way the decoder says the record is bad (a stray
    # exception would leave the entry in the consumer's pool, failing every later take).
    fields = {k.encode(): bytes(v) for k, v in encode_fields(make_group(k=1)).items()}
    logp = np.frombuffer(fields[b"logp"], LOGP_DTYPE).copy()
    logp[2] = -2e19
    bad = {**fields, b"logp": logp.tobytes()}
    with np.errstate(over="raise"), pytest.raises(RecordError, match="must be finite"):
        decode_fields(bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RecordError, match="must be finite"):
            decode_fields(bad)


def test_a_decoded_group_has_every_field_of_the_dataclass():
    # decode builds the Group without its __init__: a field added to Group (with a default)
    # but not to the decoder would be missing from every decoded group
    decoded = decode_fields({k.encode(): bytes(v) for k, v in encode_fields(make_group()).items()})
    assert vars(decoded).keys() == {f.name for f in dataclasses.fields(Group)}


def test_decoding_bytes_or_str_field_names_gives_the_same_group():
    group = make_group()
    fields = encode_fields(group)
    from_redis = decode_fields({k.encode(): bytes(v) for k, v in fields.items()})
    from_str = decode_fields({k: bytes(v) for k, v in fields.items()})
    assert from_redis == from_str == group
    # built without the dataclass's __init__, but a Group all the same: frozen, replaceable
    with pytest.raises(dataclasses.FrozenInstanceError):
        from_redis.task = "other"  # type: ignore[misc]
    assert dataclasses.replace(from_redis, task="other").task == "other"
    assert pickle.loads(pickle.dumps(from_redis)) == group


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


VALID_FIELDS = msgpack.unpackb(VALID, raw=False)
VALID_HEADER = msgpack.unpackb(VALID_FIELDS["h"], raw=False)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(VALID_HEADER)), msgpack_values))
def test_fuzz_headers_with_wrong_values(changes):
    header = {**VALID_HEADER, **changes}
    fields = {**VALID_FIELDS, "h": msgpack.packb(header, use_bin_type=True)}
    _decode_or_record_error(msgpack.packb(fields, use_bin_type=True))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(VALID_FIELDS)), msgpack_values))
def test_fuzz_fields_with_wrong_values(changes):
    _decode_or_record_error(msgpack.packb({**VALID_FIELDS, **changes}, use_bin_type=True))


def test_hostile_length_headers_do_not_allocate():
    # msgpack headers claiming 4 GiB strings / 2^32-entry arrays, with no data behind them.
    # Decoded in a process whose address space is capped 1 GiB above what it has mapped: an
    # allocation of what a header claims fails there (MemoryError, not RecordError), even
    # one never touched, which the resident size would not show.
    script = """
import resource, sys
from staleflow.buffer.codec import RecordError, decode
hostile = [
    b"\\xdb\\xff\\xff\\xff\\xff",  # str32 of 4 GiB
    b"\\xc6\\xff\\xff\\xff\\xff",  # bin32 of 4 GiB
    b"\\xdd\\xff\\xff\\xff\\xff",  # array32 of 2^32 entries
    b"\\xdf\\xff\\xff\\xff\\xff",  # map32 of 2^32 entries
    b"\\x91" * 100_000,  # 100k nested arrays
]
mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
for data in hostile:
    try:
        decode(data)
    except RecordError:
        continue
    sys.exit(f"decoded {data[:5]!r} without a RecordError")
print("all refused")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "all refused"


def test_strings_at_their_character_limit_round_trip_in_any_script():
    # the limits count characters, msgpack's decoder bytes: 1500 CJK characters (4500 bytes
    # of UTF-8) were encoded, then refused on decode, and the group dropped as invalid
    from staleflow.buffer.codec import LIMITS

    text = "漢" * LIMITS["meta_string"]  # 3 bytes each
    emoji = "🙂" * LIMITS["string"]  # 4 bytes each
    response = Response(token_ids=[1, 2], behavior_logp=[-0.1, -0.2], reward=1.0,
                        finish_reason="stop", metadata={emoji: text})  # fmt: skip
    group = Group.new(run_id="r", prompt_id=emoji, task="t", prompt_token_ids=[3],
                      responses=[response], policy_version=0, worker_id="w")  # fmt: skip
    back = decode(encode(group))
    assert back.responses[0].metadata == {emoji: text}
    assert back.prompt_id == emoji


def test_values_a_record_would_change_or_refuse_later_are_refused_at_once():
    # Group.new cast 1.7 to 1 and an int64 2**32 + 7 to 7 silently; a NaN created_at was
    # pushed, then dropped as invalid by the next take
    import dataclasses

    import numpy as np

    from staleflow.buffer.codec import RecordError, encode
    from staleflow.buffer.records import Group, Response

    def new(prompt=(1, 2), tokens=(4, 5)):
        return Group.new(run_id="r", prompt_id="p", task="t", prompt_token_ids=prompt,
                         responses=[Response(tokens, [-0.1, -0.2], 1.0)], policy_version=0,
                         worker_id="w")  # fmt: skip

    with pytest.raises(ValueError, match=r"response 0: token ids must be integers .*1\.7"):
        new(tokens=[1.7, 2.9])
    with pytest.raises(ValueError, match=r"prompt_token_ids: token ids must be integers in"):
        new(prompt=np.array([2**32 + 7, 5], dtype=np.int64))
    assert new(prompt=np.array([7, 5], dtype=np.int64)).prompt_token_ids.tolist() == [7, 5]
    with pytest.raises(RecordError, match="created_at"):
        encode(dataclasses.replace(new(), created_at=float("nan")))
    # a version of 1.9 became 1 (int()); a numpy integer is a version like any other
    with pytest.raises(ValueError, match=r"policy_version must be an integer .* got 1\.9"):
        Group.new(run_id="r", prompt_id="p", task="t", prompt_token_ids=[1],
                  responses=[Response([4], [-0.1], 1.0)], policy_version=1.9,
                  worker_id="w")  # fmt: skip
    assert dataclasses.replace(new(), policy_version=np.int64(3)).policy_version == 3


def test_rewards_whose_sum_overflows_are_named_as_too_large_not_as_infinite():
    # 1e308 is finite, but 1e308 + 1e308 is inf: the message said "must be finite"
    import dataclasses

    import numpy as np

    from staleflow.buffer.codec import RecordError, encode
    from staleflow.buffer.records import Group, Response

    group = Group.new(run_id="r", prompt_id="p", task="t", prompt_token_ids=[1],
                      responses=[Response([4], [-0.1], 1e308)] * 2, policy_version=0,
                      worker_id="w")  # fmt: skip
    with pytest.raises(RecordError, match="sum overflows float64: scale them down"):
        encode(group)
    inf = dataclasses.replace(group, rewards=np.array([1.0, np.inf]))
    with pytest.raises(RecordError, match="rewards must be finite"):
        encode(inf)
