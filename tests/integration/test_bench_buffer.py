"""bench/buffer.py runs end to end on a few small rounds and prints every figure the README
quotes from it (the ratios, the push beside raw XADD with encoding, the push's breakdown, the
server's time per call)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_buffer_bench_prints_its_ratios_and_the_push_breakdown():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "buffer.py"), "--groups", "16", "--rounds", "2",
         "--batch", "4"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    ratios = re.findall(r"^ratio (.+?) staleflow/raw: ([\d.]+)x", out, re.M)
    assert [name.strip() for name, _ in ratios] == [
        "push, one per call", "push, batches of 4", "take+ack", "take, ack piggyback",
        "no read-ahead",
    ]  # fmt: skip
    assert all(float(r) > 0 for _, r in ratios)
    # the push beside raw redis-py that encodes each group with the same codec first
    assert re.search(r"^  the same, encoding included\s+\d+\s+[\d.]+$", out, re.M)
    encoded = re.search(r"raw XADD that also encodes each group, same codec: ([\d.]+)x", out)
    assert encoded is not None
    assert float(encoded[1]) > 0
    breakdown = out.split("where a push's time goes", 1)[1]
    rows = dict(re.findall(r"^  (\S.*?)\s+([\d.]+)$", breakdown, re.M))
    assert list(rows) == [
        "raw XADD", "+ MULTI/EXEC, empty EVAL", "admit script instead (Producer._add)",
        "encode_fields alone", "encode_fields, then Producer._add", "ReplayBuffer.push",
    ]  # fmt: skip
    assert all(float(v) > 0 for v in rows.values())
    bound = re.search(r"transaction alone, on groups encoded beforehand / raw XADD: ([\d.]+)x", out)
    assert bound is not None
    assert float(bound[1]) == pytest.approx(
        float(rows["raw XADD"]) / float(rows["admit script instead (Producer._add)"]), abs=0.011
    )
    decode = re.search(r"^decode one group as read from Redis: ([\d.]+) us", out, re.M)
    assert decode is not None
    assert float(decode[1]) > 0
    assert re.search(r"admit script [\d.]+ per push, ack script [\d.]+ per 4 acked", out)
    assert re.search(r"XREADGROUP of 4 [\d.]+ \(raw: [\d.]+, and XACK of 4 [\d.]+\)", out)
    split = re.search(
        r"take-then-ack loop, us per batch of 4: staleflow take (\d+), ack (\d+); "
        r"raw XREADGROUP (\d+), XACK (\d+)",
        out,
    )
    assert split is not None
    assert all(int(x) > 0 for x in split.groups())
