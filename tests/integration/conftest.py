"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.procs import stop_leftovers


@pytest.fixture(autouse=True)
def _no_run_left_running() -> Iterator[None]:
    """A `staleflow` process a test started and left running (it failed, or timed out) is
    stopped with its Ray and Redis before the next test starts."""
    yield
    stop_leftovers()
