"""Versioned msgpack codec for `Group` records. Never pickle: bytes in Redis are untrusted.

Layout (schema 1), a msgpack map with short keys:

    schema  int             SCHEMA_VERSION
    run     str             run_id
    gid     str             group_id
    pid     str             prompt_id
    task    str             task
    prompt  [dtype, shape, bytes]   int32 [P]
    resp    [ {tok: [dtype, shape, bytes] int32 [L], logp: [..] float32 [L], r: float,
               fin: str, meta: {str: scalar}} ... ]   K >= 1
    ver     int             policy_version
    worker  str             worker_id
    t       float           created_at

Arrays travel as raw little-endian bytes with their dtype string and shape, and come back as
zero-copy read-only numpy views. `decode` checks every field (types, dtypes, shapes against
byte lengths, limits, finiteness) and raises `RecordError` naming the offending field; no input
makes it raise anything else, loop, or allocate more than a small multiple of the input size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from staleflow.buffer.records import (
    FINISH_REASONS,
    LOGP_DTYPE,
    SCHEMA_VERSION,
    TOKEN_DTYPE,
    Group,
    MetaValue,
    Response,
)

__all__ = ["LIMITS", "RecordError", "decode", "encode"]


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

_KEYS = frozenset({"schema", "run", "gid", "pid", "task", "prompt", "resp", "ver", "worker", "t"})
_RESPONSE_KEYS = frozenset({"tok", "logp", "r", "fin", "meta"})


# ----------------------------------------------------------------------------- encode


def encode(group: Group) -> bytes:
    """Serialise a group; raises RecordError if a field has the wrong type, dtype or size."""
    _check_str(group.run_id, "run_id")
    _check_str(group.group_id, "group_id")
    _check_str(group.prompt_id, "prompt_id")
    _check_str(group.task, "task")
    _check_str(group.worker_id, "worker_id")
    _check_int(group.policy_version, "policy_version")
    if not group.responses:
        raise RecordError("responses", "a group needs at least one response")
    if len(group.responses) > LIMITS["responses"]:
        raise RecordError("responses", f"{len(group.responses)} > limit {LIMITS['responses']}")
    responses = []
    for i, r in enumerate(group.responses):
        name = f"responses[{i}]"
        tokens = _array_out(r.token_ids, TOKEN_DTYPE, f"{name}.token_ids")
        logp = _array_out(r.behavior_logp, LOGP_DTYPE, f"{name}.behavior_logp")
        if len(r.token_ids) != len(r.behavior_logp):
            raise RecordError(
                f"{name}.behavior_logp",
                f"{len(r.behavior_logp)} log-probs for {len(r.token_ids)} tokens",
            )
        responses.append(
            {
                "tok": tokens,
                "logp": logp,
                "r": _check_reward(r.reward, f"{name}.reward"),
                "fin": _check_finish(r.finish_reason, f"{name}.finish_reason"),
                "meta": _check_meta(r.metadata, f"{name}.metadata"),
            }
        )
    payload = {
        "schema": SCHEMA_VERSION,
        "run": group.run_id,
        "gid": group.group_id,
        "pid": group.prompt_id,
        "task": group.task,
        "prompt": _array_out(group.prompt_token_ids, TOKEN_DTYPE, "prompt_token_ids"),
        "resp": responses,
        "ver": group.policy_version,
        "worker": group.worker_id,
        "t": float(group.created_at),
    }
    data: bytes = msgpack.packb(payload, use_bin_type=True)
    return data


def _array_out(array: Any, dtype: np.dtype, field: str) -> list[Any]:
    if not isinstance(array, np.ndarray):
        raise RecordError(field, f"expected a numpy array, got {type(array).__name__}")
    if array.dtype != dtype:
        raise RecordError(
            field,
            f"dtype {array.dtype}, expected {dtype} ({dtype.str}); Group.new converts for you",
        )
    if array.ndim != 1:
        raise RecordError(field, f"shape {array.shape}, expected one dimension")
    if len(array) > LIMITS["tokens"]:
        raise RecordError(field, f"{len(array)} entries > limit {LIMITS['tokens']}")
    _check_values(array, dtype, field)
    return [dtype.str, [len(array)], np.ascontiguousarray(array).tobytes()]


# ----------------------------------------------------------------------------- decode


def decode(data: bytes | bytearray | memoryview) -> Group:
    """Parse and validate an encoded group; raises RecordError naming the bad field."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError("<record>", f"expected bytes, got {type(data).__name__}")
    if len(data) > LIMITS["record_bytes"]:
        raise RecordError("<record>", f"{len(data)} bytes > limit {LIMITS['record_bytes']}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max(LIMITS["string"], LIMITS["meta_string"]),
            max_bin_len=LIMITS["tokens"] * 4,
            max_array_len=max(LIMITS["responses"], 3),
            max_map_len=max(LIMITS["meta_entries"], len(_KEYS)),
            max_ext_len=0,
        )
    except RecordError:
        raise
    except Exception as exc:  # msgpack raises many types on malformed input; all mean one thing
        raise RecordError("<record>", f"not a msgpack group record ({exc})") from None
    if not isinstance(obj, dict):
        raise RecordError("<record>", f"expected a map, got {type(obj).__name__}")
    schema = obj.get("schema")
    if schema != SCHEMA_VERSION:
        raise RecordError(
            "schema_version",
            f"{schema!r} is not a known schema version (this build reads {SCHEMA_VERSION})",
        )
    _check_keys(obj, _KEYS, "<record>")
    raw_responses = obj["resp"]
    if not isinstance(raw_responses, list) or not raw_responses:
        raise RecordError("responses", "expected a non-empty list of responses")
    responses = []
    for i, raw in enumerate(raw_responses):
        name = f"responses[{i}]"
        if not isinstance(raw, dict):
            raise RecordError(name, f"expected a map, got {type(raw).__name__}")
        _check_keys(raw, _RESPONSE_KEYS, name)
        tokens = _array_in(raw["tok"], TOKEN_DTYPE, f"{name}.token_ids")
        logp = _array_in(raw["logp"], LOGP_DTYPE, f"{name}.behavior_logp")
        if len(tokens) != len(logp):
            raise RecordError(
                f"{name}.behavior_logp", f"{len(logp)} log-probs for {len(tokens)} tokens"
            )
        responses.append(
            Response(
                token_ids=tokens,
                behavior_logp=logp,
                reward=_check_reward(raw["r"], f"{name}.reward"),
                finish_reason=_check_finish(raw["fin"], f"{name}.finish_reason"),
                metadata=_check_meta(raw["meta"], f"{name}.metadata"),
            )
        )
    created_at = obj["t"]
    if not isinstance(created_at, float) or not math.isfinite(created_at):
        raise RecordError("created_at", f"expected a finite float, got {created_at!r}")
    return Group(
        run_id=_check_str(obj["run"], "run_id"),
        group_id=_check_str(obj["gid"], "group_id"),
        prompt_id=_check_str(obj["pid"], "prompt_id"),
        task=_check_str(obj["task"], "task"),
        prompt_token_ids=_array_in(obj["prompt"], TOKEN_DTYPE, "prompt_token_ids"),
        responses=tuple(responses),
        policy_version=_check_int(obj["ver"], "policy_version"),
        worker_id=_check_str(obj["worker"], "worker_id"),
        created_at=created_at,
        schema_version=SCHEMA_VERSION,
    )


def _array_in(raw: Any, dtype: np.dtype, field: str) -> np.ndarray:
    if not (isinstance(raw, list) and len(raw) == 3):
        raise RecordError(field, "expected [dtype, shape, bytes]")
    dtype_str, shape, buf = raw
    if dtype_str != dtype.str:
        raise RecordError(field, f"dtype {dtype_str!r} not allowed here, expected {dtype.str!r}")
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int):
        raise RecordError(field, f"shape {shape!r}, expected [length]")
    (length,) = shape
    if not 0 <= length <= LIMITS["tokens"]:
        raise RecordError(field, f"length {length} outside [0, {LIMITS['tokens']}]")
    if not isinstance(buf, bytes) or len(buf) != length * dtype.itemsize:
        size = len(buf) if isinstance(buf, bytes) else type(buf).__name__
        raise RecordError(field, f"{size} data bytes for shape [{length}] of {dtype.str}")
    array = np.frombuffer(buf, dtype=dtype)
    _check_values(array, dtype, field)
    return array


# ----------------------------------------------------------------------------- field checks


def _check_values(array: np.ndarray, dtype: np.dtype, field: str) -> None:
    if len(array) == 0:
        return
    if dtype == TOKEN_DTYPE and int(array.min()) < 0:
        raise RecordError(field, "negative token id")
    if dtype == LOGP_DTYPE and not np.isfinite(array).all():
        raise RecordError(field, "log-probs must be finite")


def _check_keys(obj: dict[Any, Any], expected: frozenset[str], field: str) -> None:
    keys = set(obj)
    if keys != expected:
        missing, extra = sorted(expected - keys), sorted(map(repr, keys - expected))
        raise RecordError(field, f"missing keys {missing}, unexpected keys {extra}")


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


def _check_reward(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
        raise RecordError(field, f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise RecordError(field, f"must be finite, got {value}")
    return float(value)


def _check_finish(value: Any, field: str) -> str:
    if value not in FINISH_REASONS:
        raise RecordError(field, f"{value!r} is not one of {', '.join(FINISH_REASONS)}")
    return str(value)


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
