"""Versioned codec for `Group` records: a msgpack header plus raw little-endian arrays.

Never pickle: bytes in Redis are untrusted. A group is four fields (schema 1):

    h       msgpack map: schema, run, gid, pid, task, ver, worker, t (created_at),
            lens [int] * K, r [float] * K, fin [str] * K, meta [{str: scalar}] * K,
            arrays {prompt: [dtype, shape], tok: [dtype, shape], logp: [dtype, shape]}
    prompt  raw bytes   int32 [P]
    tok     raw bytes   int32 [sum(lens)], every response's tokens, concatenated
    logp    raw bytes   float32 [sum(lens)], their behaviour log-probs

In Redis the four are fields of one stream entry, so the arrays are written straight from the
group's memory and read back as zero-copy views: a 66 KB group costs a few microseconds of
header work on top of moving its bytes. `encode`/`decode` wrap the same fields into one msgpack
map for files and tests.

Decoding checks every field (types, dtypes, shapes against byte lengths, limits, finiteness of
log-probs and rewards) and raises `RecordError` naming the offending field; no input makes it
raise anything else, loop, or allocate more than a small multiple of the input size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from staleflow.buffer.records import (
    FINISH_REASONS,
    LENGTH_DTYPE,
    LOGP_DTYPE,
    REWARD_DTYPE,
    SCHEMA_VERSION,
    TOKEN_DTYPE,
    Group,
    MetaValue,
)

__all__ = [
    "ARRAY_FIELDS",
    "LIMITS",
    "RecordError",
    "decode",
    "decode_fields",
    "encode",
    "encode_fields",
]


class RecordError(ValueError):
    """A record that cannot be encoded or decoded; `field` names where, the message says why."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid group record: {field}: {problem}")
        self.field = field
        self.problem = problem


LIMITS = {
    "record_bytes": 256 << 20,  # a whole encoded group
    "tokens": 1 << 20,  # one prompt or one response
    "responses": 4096,  # K
    "string": 1024,  # ids, names
    "meta_entries": 64,
    "meta_string": 4096,
}
"""Upper bounds checked on decode (and encode), so a hostile record cannot exhaust memory."""

ARRAY_FIELDS = {"prompt": TOKEN_DTYPE, "tok": TOKEN_DTYPE, "logp": LOGP_DTYPE}
"""The raw-array fields of a record and their dtypes."""
_FIELDS = frozenset({"h", *ARRAY_FIELDS})
_FIELD_BYTES = {name: name.encode() for name in sorted(_FIELDS)}
_HEADER_KEYS = frozenset(
    {"schema", "run", "gid", "pid", "task", "ver", "worker", "t", "lens", "r", "fin", "meta",
     "arrays"}
)  # fmt: skip
_FINISH = frozenset(FINISH_REASONS)
_ARRAY_NAMES = {"prompt": "prompt_token_ids", "tok": "token_ids", "logp": "behavior_logp"}
# Per array field, what decoding checks it against: dtype, its string, item size, Group field.
_ARRAY_IN = {
    name: (dtype, dtype.str, dtype.itemsize, _ARRAY_NAMES[name])
    for name, dtype in ARRAY_FIELDS.items()
}
# Exact types (bool is not an int here); `_types(xs) <= _INT` checks a list in one C loop,
# several times faster than all(type(x) is int for x in xs) on a group's K values.
_INT, _NUMBER, _STR, _DICT = (frozenset(t) for t in ({int}, {float, int}, {str}, {dict}))


def _types(values: list[Any] | tuple[Any, ...]) -> set[type]:
    return set(map(type, values))


# ----------------------------------------------------------------------------- encode


def encode_fields(group: Group) -> dict[str, bytes | memoryview]:
    """The record as stream-entry fields: the header and three zero-copy array views."""
    for name in ("run_id", "group_id", "prompt_id", "task", "worker_id"):
        _check_str(getattr(group, name), name)
    _check_int(group.policy_version, "policy_version")
    lens = _array_out(group.lengths, LENGTH_DTYPE, "lengths", LIMITS["responses"]).tolist()
    k = _check_lengths(lens)
    per_group = LIMITS["tokens"] * k
    arrays = {
        "prompt": _array_out(
            group.prompt_token_ids, TOKEN_DTYPE, "prompt_token_ids", LIMITS["tokens"]
        ),
        "tok": _array_out(group.token_ids, TOKEN_DTYPE, "token_ids", per_group),
        "logp": _array_out(group.behavior_logp, LOGP_DTYPE, "behavior_logp", per_group),
    }
    _check_arrays(arrays, sum(lens))
    if not isinstance(group.rewards, np.ndarray) or group.rewards.dtype != REWARD_DTYPE:
        raise RecordError("rewards", f"expected float64 [{k}], got {_describe(group.rewards)}")
    if not isinstance(group.created_at, int | float) or not math.isfinite(group.created_at):
        # (decode refuses it: the group was pushed, then dropped as invalid by the next take)
        raise RecordError("created_at", f"expected a finite time, got {group.created_at!r}")
    header = {
        "schema": SCHEMA_VERSION,
        "run": group.run_id,
        "gid": group.group_id,
        "pid": group.prompt_id,
        "task": group.task,
        "ver": int(group.policy_version),
        "worker": group.worker_id,
        "t": float(group.created_at),
        "lens": lens,
        "r": _check_rewards(group.rewards.tolist(), k),
        "fin": list(_check_finish(group.finish_reasons, k)),
        "meta": list(_check_metadata(group.metadata, k)),
        "arrays": {name: [a.dtype.str, [len(a)]] for name, a in arrays.items()},
    }
    fields: dict[str, bytes | memoryview] = {"h": msgpack.packb(header, use_bin_type=True)}
    for name, a in arrays.items():
        fields[name] = (a if a.flags.c_contiguous else np.ascontiguousarray(a)).data
    return fields


def encode(group: Group) -> bytes:
    """The record as one msgpack map of its fields (for files and tests)."""
    data: bytes = msgpack.packb(encode_fields(group), use_bin_type=True)
    return data


def _array_out(array: Any, dtype: np.dtype, field: str, limit: int) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise RecordError(field, f"expected a numpy array, got {type(array).__name__}")
    if array.dtype != dtype:
        raise RecordError(
            field,
            f"dtype {array.dtype}, expected {dtype} ({dtype.str}); Group.new converts for you",
        )
    if array.ndim != 1:
        raise RecordError(field, f"shape {array.shape}, expected one dimension")
    if len(array) > limit:
        raise RecordError(field, f"{len(array)} entries > limit {limit}")
    return array


# ----------------------------------------------------------------------------- decode


def decode(data: bytes | bytearray | memoryview) -> Group:
    """Parse and validate a record made by `encode`; raises RecordError naming the field."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError("<record>", f"expected bytes, got {type(data).__name__}")
    if len(data) > LIMITS["record_bytes"]:
        raise RecordError("<record>", f"{len(data)} bytes > limit {LIMITS['record_bytes']}")
    fields = _unpack(data, "<record>", max_bin_len=LIMITS["record_bytes"])
    if not isinstance(fields, dict):
        raise RecordError("<record>", f"expected a map, got {type(fields).__name__}")
    return decode_fields(fields)


def decode_fields(fields: Mapping[Any, Any]) -> Group:
    """Parse and validate a record from its stream-entry fields (str or bytes keys)."""
    if all(key in fields for key in _FIELD_BYTES.values()):  # as read from Redis: no renaming
        named = {name: fields[key] for name, key in _FIELD_BYTES.items()}
    else:
        named = {
            (k.decode("utf-8", "replace") if isinstance(k, bytes) else k): v
            for k, v in fields.items()
        }
        missing = sorted(_FIELDS - named.keys())
        if missing:
            raise RecordError("<record>", f"missing fields {missing}")
    raw_header = named["h"]
    if not isinstance(raw_header, bytes) or len(raw_header) > LIMITS["record_bytes"]:
        raise RecordError("header", "expected the msgpack header as bytes")
    header = _unpack(raw_header, "header", max_bin_len=0)
    if not isinstance(header, dict):
        raise RecordError("header", f"expected a map, got {type(header).__name__}")
    schema = header.get("schema")
    if schema != SCHEMA_VERSION:
        raise RecordError(
            "schema_version",
            f"{schema!r} is not a known schema version (this build reads {SCHEMA_VERSION})",
        )
    if header.keys() != _HEADER_KEYS:
        missing = sorted(_HEADER_KEYS - header.keys())
        extra = sorted(map(repr, header.keys() - _HEADER_KEYS))
        raise RecordError("header", f"missing keys {missing}, unexpected keys {extra}")
    lens = header["lens"]
    if not (isinstance(lens, list) and _types(lens) <= _INT):
        raise RecordError("lengths", "expected a list of integers")
    k = _check_lengths(lens)
    specs = header["arrays"]
    if not (isinstance(specs, dict) and specs.keys() == ARRAY_FIELDS.keys()):
        raise RecordError("header.arrays", f"expected specs for {sorted(ARRAY_FIELDS)}")
    arrays = {
        name: _array_in(
            specs[name], named[name], name, LIMITS["tokens"] * (1 if name == "prompt" else k)
        )
        for name in ARRAY_FIELDS
    }
    _check_arrays(arrays, sum(lens))
    created_at = header["t"]
    if not isinstance(created_at, float) or not math.isfinite(created_at):
        raise RecordError("created_at", f"expected a finite float, got {created_at!r}")
    return _group(
        run_id=_check_str(header["run"], "run_id"),
        group_id=_check_str(header["gid"], "group_id"),
        prompt_id=_check_str(header["pid"], "prompt_id"),
        task=_check_str(header["task"], "task"),
        prompt_token_ids=arrays["prompt"],
        token_ids=arrays["tok"],
        behavior_logp=arrays["logp"],
        lengths=np.array(lens, dtype=LENGTH_DTYPE),
        rewards=np.array(_check_rewards(header["r"], k), dtype=REWARD_DTYPE),
        finish_reasons=_check_finish(header["fin"], k),
        metadata=_check_metadata(header["meta"], k),
        policy_version=_check_int(header["ver"], "policy_version"),
        worker_id=_check_str(header["worker"], "worker_id"),
        created_at=created_at,
        schema_version=SCHEMA_VERSION,
    )


def _group(**values: Any) -> Group:
    """Group(**values) for values just checked, without the frozen dataclass's __init__ (one
    object.__setattr__ per field: about a microsecond a group, a tenth of a decode)."""
    group: Group = object.__new__(Group)
    group.__dict__.update(values)
    return group


def _unpack(data: Any, field: str, max_bin_len: int) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            # bytes, while the limits count characters (checked after): UTF-8 takes up to 4
            max_str_len=4 * max(LIMITS["string"], LIMITS["meta_string"]),
            max_bin_len=max_bin_len,
            max_array_len=LIMITS["responses"],
            max_map_len=max(LIMITS["meta_entries"], len(_HEADER_KEYS)),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types on malformed input; all mean one thing
        raise RecordError(field, f"not valid msgpack ({exc})") from None


def _array_in(spec: Any, buf: Any, name: str, limit: int) -> np.ndarray:
    dtype, dtype_str, itemsize, field = _ARRAY_IN[name]
    if not (isinstance(spec, list) and len(spec) == 2):
        raise RecordError(field, "expected [dtype, shape] in the header")
    header_dtype, shape = spec
    if header_dtype != dtype_str:
        raise RecordError(field, f"dtype {header_dtype!r} not allowed here, expected {dtype_str!r}")
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int):
        raise RecordError(field, f"shape {shape!r}, expected [length]")
    (length,) = shape
    if not 0 <= length <= limit:
        raise RecordError(field, f"length {length} outside [0, {limit}]")
    if not isinstance(buf, bytes) or len(buf) != length * itemsize:
        size = len(buf) if isinstance(buf, bytes) else type(buf).__name__
        raise RecordError(field, f"{size} data bytes for shape [{length}] of {dtype_str}")
    return np.frombuffer(buf, dtype)


# ----------------------------------------------------------------------------- field checks
# NumPy calls cost microseconds each even on tiny arrays, so these use as few as possible:
# K-sized values are checked as Python lists, token-sized arrays with one reduction each.


def _check_lengths(lens: list[int]) -> int:
    if not lens:
        raise RecordError("responses", "a group needs at least one response")
    if len(lens) > LIMITS["responses"]:
        raise RecordError("responses", f"{len(lens)} > limit {LIMITS['responses']}")
    if min(lens) < 0 or max(lens) > LIMITS["tokens"]:
        raise RecordError("lengths", f"each response length must be in [0, {LIMITS['tokens']}]")
    return len(lens)


def _check_arrays(arrays: dict[str, np.ndarray], total: int) -> None:
    tokens, logp = arrays["tok"], arrays["logp"]
    if len(tokens) != total:
        raise RecordError("token_ids", f"{len(tokens)} tokens but the lengths sum to {total}")
    if len(logp) != total:
        raise RecordError("behavior_logp", f"{len(logp)} log-probs for {total} tokens")
    for name in ("tok", "prompt"):
        if len(arrays[name]) and int(arrays[name].min()) < 0:
            raise RecordError(_ARRAY_NAMES[name], "negative token id")
    # A sum of squares is NaN or inf when any term is (log-probs so large that the sum of
    # their squares overflows float32, 1.9e19 in magnitude or less, are rejected too: no
    # sampler produces them). The dot product is one vectorised BLAS call, 3x faster than sum().
    # An overflow also warns, or raises where warnings are errors or np.seterr(over="raise")
    # is set: that too is a bad record, never an error from the decoder itself.
    if total:
        try:
            finite = math.isfinite(float(logp.dot(logp)))
        except (FloatingPointError, RuntimeWarning):
            finite = False
        if not finite:
            raise RecordError("behavior_logp", "log-probs must be finite")


def _check_rewards(rewards: Any, k: int) -> list[float]:
    if not (isinstance(rewards, list) and len(rewards) == k):
        raise RecordError("rewards", f"expected {k} numbers, got {_describe(rewards)}")
    if not _types(rewards) <= _NUMBER:
        raise RecordError("rewards", "expected numbers")
    if not math.isfinite(sum(rewards)):
        if all(map(math.isfinite, rewards)):  # 1e308 + 1e308: the advantages would be NaN
            raise RecordError(
                "rewards", "rewards so large that their sum overflows float64: scale them down"
            )
        raise RecordError("rewards", "rewards must be finite")
    return rewards


def _check_finish(values: Any, k: int) -> tuple[str, ...]:
    if not isinstance(values, list | tuple) or len(values) != k:
        raise RecordError("finish_reasons", f"expected {k} entries, got {_describe(values)}")
    if not _types(values) <= _STR or not _FINISH.issuperset(values):
        bad = next(v for v in values if type(v) is not str or v not in _FINISH)
        raise RecordError("finish_reasons", f"{bad!r} is not one of {', '.join(FINISH_REASONS)}")
    return tuple(values)


def _check_metadata(values: Any, k: int) -> tuple[dict[str, MetaValue], ...]:
    if not isinstance(values, list | tuple) or len(values) != k:
        raise RecordError("metadata", f"expected {k} entries, got {_describe(values)}")
    if not any(values) and _types(values) <= _DICT:
        return tuple(values)  # the common case: no metadata at all
    return tuple(_check_meta(m, f"metadata[{i}]") for i, m in enumerate(values))


def _check_meta(value: Any, field: str) -> dict[str, MetaValue]:
    if not isinstance(value, Mapping):
        raise RecordError(field, f"expected a map, got {type(value).__name__}")
    if len(value) > LIMITS["meta_entries"]:
        raise RecordError(field, f"{len(value)} entries > limit {LIMITS['meta_entries']}")
    out: dict[str, MetaValue] = {}
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > LIMITS["string"]:
            raise RecordError(field, f"key {key!r} must be a string of <= {LIMITS['string']}")
        if isinstance(item, str) and len(item) > LIMITS["meta_string"]:
            raise RecordError(f"{field}.{key}", f"string longer than {LIMITS['meta_string']}")
        if isinstance(item, float) and not math.isfinite(item):
            raise RecordError(f"{field}.{key}", f"must be finite, got {item}")
        if isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 2**63:
            raise RecordError(f"{field}.{key}", "integer out of the int64 range")
        if item is not None and not isinstance(item, str | int | float | bool):
            raise RecordError(f"{field}.{key}", f"must be a scalar, got {type(item).__name__}")
        out[key] = item
    return out


def _check_str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RecordError(field, f"expected a string, got {type(value).__name__}")
    if len(value) > LIMITS["string"]:
        raise RecordError(field, f"{len(value)} characters > limit {LIMITS['string']}")
    return value


def _check_int(value: Any, field: str) -> int:
    if type(value) is not int and not isinstance(value, np.integer):
        raise RecordError(field, f"expected an integer, got {type(value).__name__}")
    if not 0 <= int(value) < 2**53:
        raise RecordError(field, f"{value} outside [0, 2**53)")
    return int(value)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    if isinstance(value, list | tuple | str | bytes | dict):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__
