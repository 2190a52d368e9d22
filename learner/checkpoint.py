"""Learner checkpoints: exact resume without unpickling anything.

A checkpoint is a directory, written under a temporary name and renamed into place (a crash
leaves the previous checkpoint intact, never half a new one):

    model.safetensors      the policy's weights
    optimizer.safetensors  every tensor of the optimizer state, keyed by its path
    rng.safetensors        torch's CPU generator state
    trainer.json           format, step, scheduler, python/numpy RNG states, the non-tensor
                           optimizer state, the run config, and caller data (`extra`, e.g.
                           what the buffer has acked)

Loading checks the format, every parameter's name and shape, and that the files parse, and
raises `CheckpointError` naming the file and the problem. Only JSON and safetensors are read.
Supported for ZeRO stage 0 (the optimizer is then the client torch AdamW); ZeRO 1-3 partition
the optimizer state into DeepSpeed objects that cannot be stored this way yet.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["FORMAT", "CheckpointError", "export_hf", "load_checkpoint", "save_checkpoint"]

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or is refused on load."""


def save_checkpoint(
    learner: Any, path: str | os.PathLike[str], extra: dict[str, Any] | None = None
) -> Path:
    """Write the learner's full training state to the directory `path` (atomically)."""
    from safetensors.torch import save_file

    _check_supported(learner)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        model = {k: v.detach().cpu().contiguous() for k, v in learner.model.state_dict().items()}
        save_file(_untie(model), tmp / "model.safetensors")
        tensors, skeleton = _flatten(learner.optimizer.state_dict())
        save_file(tensors, tmp / "optimizer.safetensors")
        save_file({"torch_cpu": torch.get_rng_state()}, tmp / "rng.safetensors")
        python_state = random.getstate()
        # the legacy global numpy state is what code calling np.random.* uses
        numpy_state: Any = np.random.get_state()  # noqa: NPY002
        trainer = {
            "format": FORMAT,
            "steps": learner.steps,
            "scheduler": learner.scheduler.state_dict(),
            "optimizer": skeleton,
            "rng": {
                "python": [python_state[0], list(python_state[1]), python_state[2]],
                "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
            },
            "config": learner.cfg.model_dump(mode="json"),
            "extra": extra or {},
        }
        (tmp / "trainer.json").write_text(json.dumps(trainer, default=_json_scalar))
        for f in tmp.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_checkpoint(learner: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore a learner saved by `save_checkpoint`; returns its `extra` data."""
    from safetensors.torch import load_file

    _check_supported(learner)
    path = Path(path)
    trainer = _read_json(path / "trainer.json")
    if trainer.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {trainer.get('format')!r}, this build reads {FORMAT}"
        )
    model = _read_safetensors(path / "model.safetensors", load_file)
    current = learner.model.state_dict()
    for name, tensor in current.items():
        if name not in model and not _is_tied(name, current):
            raise CheckpointError(f"{path}: incompatible: parameter {name!r} is missing")
        if name in model and tuple(model[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{path}: incompatible: parameter {name!r} has shape {tuple(model[name].shape)}, "
                f"the model has {tuple(tensor.shape)}"
            )
    unknown = sorted(set(model) - set(current))
    if unknown:
        raise CheckpointError(f"{path}: incompatible: unknown parameters {unknown[:5]}")
    optimizer = _unflatten(
        trainer["optimizer"], _read_safetensors(path / "optimizer.safetensors", load_file)
    )
    rng = _read_safetensors(path / "rng.safetensors", load_file)
    try:
        learner.model.load_state_dict(model, strict=False)
        learner.optimizer.load_state_dict(optimizer)
        learner.scheduler.load_state_dict(trainer["scheduler"])
        python_state = trainer["rng"]["python"]
        random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
        numpy_state = trainer["rng"]["numpy"]
        np.random.set_state(  # noqa: NPY002 (restore what get_state saved)
            (numpy_state[0], np.array(numpy_state[1], dtype=np.uint32), *numpy_state[2:])
        )
        torch.set_rng_state(rng["torch_cpu"])
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: cannot restore the training state: {exc}") from exc
    learner.steps = int(trainer["steps"])
    extra: dict[str, Any] = trainer.get("extra", {})
    return extra


def export_hf(learner: Any, tokenizer: Any, path: str | Path) -> Path:
    """A plain Hugging Face directory (safetensors) that transformers and vLLM load."""
    path = Path(path)
    learner.model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- internals


def _check_supported(learner: Any) -> None:
    if learner.cfg.learner.zero_stage != 0:
        raise CheckpointError(
            f"checkpoints support ZeRO stage 0 for now (learner.zero_stage is "
            f"{learner.cfg.learner.zero_stage}); export_hf works at any stage"
        )


def _untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied embeddings): keep the first of each."""
    seen: dict[int, str] = {}
    out = {}
    for name, t in tensors.items():
        key = t.data_ptr()
        if key in seen and t.numel():
            continue
        seen[key] = name
        out[name] = t
    return out


def _is_tied(name: str, state: dict[str, torch.Tensor]) -> bool:
    ptr = state[name].data_ptr()
    return any(other != name and t.data_ptr() == ptr for other, t in state.items())


def _flatten(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Tensors out to a flat dict keyed by path; the rest stays as a JSON skeleton."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().cpu().contiguous()}, {"__tensor__": prefix}
    if isinstance(obj, dict):
        tensors, skeleton = {}, {}
        for key, value in obj.items():
            t, s = _flatten(value, f"{prefix}/{key}")
            tensors.update(t)
            skeleton[str(key)] = s
        return tensors, {"__dict__": skeleton, "__int_keys__": all(isinstance(k, int) for k in obj)}
    if isinstance(obj, list | tuple):
        tensors, items = {}, []
        for i, value in enumerate(obj):
            t, s = _flatten(value, f"{prefix}[{i}]")
            tensors.update(t)
            items.append(s)
        return tensors, {"__list__": items, "__tuple__": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return {}, obj
    raise CheckpointError(f"cannot store optimizer state of type {type(obj).__name__} at {prefix}")


def _unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            key = skeleton["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"optimizer.safetensors lacks {key!r}")
            return tensors[key]
        if "__dict__" in skeleton:
            as_int = skeleton.get("__int_keys__", False)
            return {
                (int(k) if as_int else k): _unflatten(v, tensors)
                for k, v in skeleton["__dict__"].items()
            }
        if "__list__" in skeleton:
            items = [_unflatten(v, tensors) for v in skeleton["__list__"]]
            return tuple(items) if skeleton.get("__tuple__") else items
    return skeleton


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing; is {path.parent} a staleflow checkpoint?"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: corrupt: expected a JSON object")
    return data


def _read_safetensors(path: Path, load_file: Any) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return dict(load_file(str(path)))
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"{path}: corrupt: {exc}") from None


def _json_scalar(value: Any) -> Any:
    if isinstance(value, np.integer | np.floating):
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
