"""Which device a role runs on: decided by its GPU share, never by what the machine has.

A role with no GPU share (`learner.gpus_per_rank: 0`, `rollout.gpus_per_worker: 0`) runs on the
CPU even on a machine with GPUs; Ray does not hide the machine's GPUs from an actor given
`num_gpus=0`, so the placement (cluster/placement.py) also hides them through
CUDA_VISIBLE_DEVICES, and the learner tells DeepSpeed to use its CPU accelerator. A role with a
share runs on `cuda:0` of what it sees (Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned);
if it sees none, it fails with what to change, instead of falling back to the CPU.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the driver needs hidden_gpus_env, not torch
    import torch

__all__ = ["DeviceError", "hidden_gpus_env", "role_device"]


class DeviceError(RuntimeError):
    """A role asked for a GPU share but its process sees no CUDA device."""


def role_device(gpus: float, setting: str) -> torch.device:
    """The device of a role given `gpus` (its GPU share, the config key named `setting`)."""
    import torch

    if gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise DeviceError(
            f"{setting}={gpus:g} asks for a GPU, but this process sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, "
            f"CUDA_VISIBLE_DEVICES={visible}); set {setting}=0 to run this role on the CPU, "
            "or install a CUDA build of torch on a machine with a GPU"
        )
    return torch.device("cuda", 0)


def hidden_gpus_env(gpus: float) -> dict[str, str]:
    """Environment for a process with `gpus` share: CPU roles see no GPU at all."""
    return {"CUDA_VISIBLE_DEVICES": ""} if gpus <= 0 else {}
