"""vLLM for the tests that run it: skipped where it is not installed, except where the command
says it must be there (STALEFLOW_REQUIRE_VLLM=1: `make test-vllm-cpu`, `bench/gpu.sh tests`),
so that a broken vLLM install fails instead of passing with its tests skipped."""

from __future__ import annotations

import importlib
import os

import pytest


def need_vllm() -> None:
    if os.environ.get("STALEFLOW_REQUIRE_VLLM") == "1":
        importlib.import_module("vllm")
    else:
        pytest.importorskip("vllm")
