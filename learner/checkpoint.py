"""Learner checkpoints: exact resume without unpickling anything.

A checkpoint is a directory, written under a temporary name and renamed into place (a crash
leaves the previous checkpoint intact, never half a new one):

    model.safetensors      the policy's weights
    optimizer.safetensors  every tensor of the optimizer state, keyed by its path (ZeRO 1-3 on
                           several ranks: optimizer-rank<r>.safetensors / .json per rank)
    rng.safetensors        torch's CPU generator state
    trainer.json           format, step, scheduler, python/numpy RNG states, the non-tensor
                           optimizer state, the run config, and caller data (`extra`, e.g.
                           what the buffer has acked)

Loading checks the format, every parameter's name and shape, and that the files parse, and
raises `CheckpointError` naming the file and the problem. Only JSON and safetensors are read.

Optimizer state is stored as its tensors plus a JSON skeleton. Leaves that are neither (ZeRO's
loss scaler, enums, layout tuples) are configuration, not training state: the skeleton marks
them opaque and loading takes them from the live optimizer, which must have the same type there.
ZeRO 0 with any number of ranks: rank 0 writes everything (every rank holds the same state).
ZeRO 1-3 over several ranks: each rank writes its own optimizer partition
(`optimizer-rank<r>.safetensors` + `.json`), and a resume needs the same number of ranks;
ZeRO 3 gathers the parameters around saving and loading.
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

from staleflow.configs.loader import redacted_dict
from staleflow.learner.durable import fsync_dir, fsync_file

__all__ = [
    "FORMAT",
    "CheckpointError",
    "check_files",
    "export_hf",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or is refused on load."""


def save_checkpoint(
    learner: Any, path: str | os.PathLike[str], extra: dict[str, Any] | None = None
) -> Path:
    """Write the learner's full training state to the directory `path` (atomically).

    With several ranks every rank calls this at once (the directory must be on storage all
    ranks share): ZeRO 3 gathers the parameters, and with ZeRO 1-3 each rank writes its own
    optimizer partition (`optimizer-rank<r>.*`); rank 0 writes the rest and renames."""
    from safetensors.torch import save_file

    rank, world = _rank(learner)
    sharded = learner.cfg.learner.zero_stage > 0 and world > 1
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"  # one name every rank agrees on
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-save
        tmp.mkdir()
    _barrier(world)
    try:
        skeleton: Any = None
        model: dict[str, torch.Tensor] = {}
        failed: Exception | None = None
        try:  # whatever fails here, every rank must still reach the count below
            with _gathered(learner, modify=False):  # a collective under ZeRO 3: every rank
                if rank == 0:
                    model = {
                        k: v.detach().cpu().clone() for k, v in learner.model.state_dict().items()
                    }
            if sharded:
                tensors, shard = _flatten(learner.optimizer.state_dict())
                save_file(tensors, tmp / f"optimizer-rank{rank}.safetensors")
                (tmp / f"optimizer-rank{rank}.json").write_text(json.dumps(shard))
            elif rank == 0:  # ZeRO 0: every rank holds the same state
                tensors, skeleton = _flatten(learner.optimizer.state_dict())
                save_file(tensors, tmp / "optimizer.safetensors")
        except Exception as exc:  # (a full disk, no memory for the copy)
            failed = exc
        # In place of a barrier: a rank whose write failed met rank 0 at its own barrier, and
        # rank 0 went on to rename the checkpoint without that rank's optimizer shard.
        failures = _failures(world, failed is not None, getattr(learner, "device", None))
        if failed is not None:
            raise failed
        if failures:
            raise CheckpointError(
                f"{failures} of {world} learner ranks could not write their part of the "
                f"checkpoint into {tmp} (their errors are in their logs): checkpoint "
                f"{path.name} is not made, and the previous one stays the newest"
            )
        if rank == 0:
            save_file(_untie(model), tmp / "model.safetensors")
            save_file({"torch_cpu": torch.get_rng_state()}, tmp / "rng.safetensors")
            python_state = random.getstate()
            # the legacy global numpy state is what code calling np.random.* uses
            numpy_state: Any = np.random.get_state()  # noqa: NPY002
            trainer = {
                "format": FORMAT,
                "zero_stage": learner.cfg.learner.zero_stage,
                "world_size": world,
                "sharded": sharded,
                "steps": learner.version,  # batches trained: the policy version
                "optimizer_steps": learner.optimizer_steps,
                "scheduler": learner.scheduler.state_dict(),
                "optimizer": skeleton,
                "rng": {
                    "python": [python_state[0], list(python_state[1]), python_state[2]],
                    "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
                },
                "config": redacted_dict(learner.cfg),  # no passwords
                "extra": extra or {},
            }
            (tmp / "trainer.json").write_text(json.dumps(trainer, default=_json_scalar))
            for f in tmp.iterdir():
                fsync_file(f)
            fsync_dir(tmp)
            old = None
            if path.exists():
                old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
                path.rename(old)
            tmp.rename(path)
            fsync_dir(path.parent)
            if old is not None:
                shutil.rmtree(old)
    finally:
        _barrier(world)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def check_files(path: str | os.PathLike[str]) -> dict[str, Any]:
    """CheckpointError naming the first file of checkpoint `path` that is missing or damaged
    (trainer.json's format, every safetensors header and size), without loading a tensor;
    returns trainer.json. Cheap: what a resume checks before it changes anything."""
    from safetensors import safe_open

    path = Path(path)
    trainer = _read_trainer(path)
    names = ["model.safetensors", "rng.safetensors"]
    if trainer.get("sharded"):  # ZeRO 1-3 over several ranks: one partition per rank
        ranks = range(int(trainer.get("world_size", 1)))
        names += [f"optimizer-rank{r}.safetensors" for r in ranks]
        for r in ranks:  # each rank's skeleton beside its tensors
            _read_json(path / f"optimizer-rank{r}.json")
    else:
        names.append("optimizer.safetensors")
    for name in names:
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing")
        try:
            with safe_open(str(path / name), "np") as f:  # reads the header, checks the size
                f.keys()
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{path / name}: corrupt: {exc}") from None
    return trainer


def load_checkpoint(learner: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore a learner saved by `save_checkpoint` (every rank calls it, with the world size
    it was written with if it is sharded); returns its `extra` data."""
    from safetensors.torch import load_file

    rank, world = _rank(learner)
    path = Path(path)
    trainer = _read_trainer(path)
    stage = learner.cfg.learner.zero_stage
    if trainer.get("zero_stage") != stage:
        raise CheckpointError(
            f"{path}: incompatible: written at ZeRO stage {trainer.get('zero_stage')}, this "
            f"learner runs stage {stage} (optimizer states differ between stages)"
        )
    sharded = stage > 0 and world > 1
    if bool(trainer.get("sharded")) != sharded or (sharded and trainer["world_size"] != world):
        raise CheckpointError(
            f"{path}: incompatible: written by {trainer.get('world_size', 1)} learner rank(s) "
            f"at ZeRO stage {stage}, this learner has {world}; resume with "
            f"learner.num_ranks={trainer.get('world_size', 1)} (each rank holds its own "
            "optimizer partition)"
        )
    model = _read_safetensors(path / "model.safetensors", load_file)
    with _gathered(learner, modify=False):  # full shapes, also under ZeRO 3
        current = learner.model.state_dict()
        shapes = {name: tuple(t.shape) for name, t in current.items()}
        tied = {name for name in current if _is_tied(name, current)}
    for name, shape in shapes.items():
        if name not in model and name not in tied:
            raise CheckpointError(f"{path}: incompatible: parameter {name!r} is missing")
        if name in model and tuple(model[name].shape) != shape:
            raise CheckpointError(
                f"{path}: incompatible: parameter {name!r} has shape {tuple(model[name].shape)}, "
                f"the model has {shape}"
            )
    unknown = sorted(set(model) - set(shapes))
    if unknown:
        raise CheckpointError(f"{path}: incompatible: unknown parameters {unknown[:5]}")
    if sharded:
        skeleton = _read_json(path / f"optimizer-rank{rank}.json")
        tensors = _read_safetensors(path / f"optimizer-rank{rank}.safetensors", load_file)
    else:
        skeleton = trainer["optimizer"]
        tensors = _read_safetensors(path / "optimizer.safetensors", load_file)
    optimizer = _unflatten(skeleton, tensors, learner.optimizer.state_dict())
    rng = _read_safetensors(path / "rng.safetensors", load_file)
    try:
        with _gathered(learner, modify=True):
            learner.model.load_state_dict(model, strict=False)
        if learner.cfg.learner.zero_stage == 0:
            learner.optimizer.load_state_dict(optimizer)
        else:  # DeepSpeed's ZeRO optimizers take a list indexed by rank (each reads its own)
            learner.optimizer.load_state_dict(
                [optimizer] * world, load_optimizer_states=True, load_from_fp32_weights=True
            )
        learner.scheduler.load_state_dict(trainer["scheduler"])
        python_state = trainer["rng"]["python"]
        random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
        numpy_state = trainer["rng"]["numpy"]
        np.random.set_state(  # noqa: NPY002 (restore what get_state saved)
            (numpy_state[0], np.array(numpy_state[1], dtype=np.uint32), *numpy_state[2:])
        )
        torch.set_rng_state(rng["torch_cpu"])
    except (KeyError, ValueError, TypeError, RuntimeError, AssertionError) as exc:
        raise CheckpointError(f"{path}: cannot restore the training state: {exc}") from exc
    learner.version = int(trainer["steps"])
    learner.optimizer_steps = int(trainer.get("optimizer_steps", trainer["steps"]))
    extra: dict[str, Any] = trainer.get("extra", {})
    return extra


def export_hf(learner: Any, tokenizer: Any, path: str | Path) -> Path:
    """A plain Hugging Face directory (safetensors) that transformers and vLLM load."""
    path = Path(path)
    learner.model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- internals


def _gathered(learner: Any, modify: bool) -> Any:
    """Under ZeRO 3, make the full parameters visible (and, with `modify`, write back)."""
    import contextlib

    if learner.cfg.learner.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    params = list(learner.model.parameters())
    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)


def _rank(learner: Any) -> tuple[int, int]:
    return int(getattr(learner, "rank", 0)), int(getattr(learner, "world_size", 1))


def _failures(world: int, failed: bool, device: Any) -> int:
    """How many ranks say `failed`, summed over every rank (a collective: each must call
    it). `device`: the rank's, as NCCL reduces CUDA tensors only."""
    if world == 1:
        return int(failed)
    import torch.distributed as dist

    count = torch.tensor([int(failed)], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    return int(count.item())


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


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
    return {}, {"__opaque__": type(obj).__name__}  # configuration: taken from the live optimizer


def _unflatten(
    skeleton: Any, tensors: dict[str, torch.Tensor], current: Any, path: str = ""
) -> Any:
    """Rebuild the state from `skeleton` and `tensors`; opaque leaves come from `current`
    (the live optimizer's state dict at the same path)."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            key = skeleton["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"optimizer.safetensors lacks {key!r}")
            return tensors[key]
        if "__opaque__" in skeleton:
            if type(current).__name__ != skeleton["__opaque__"]:
                raise CheckpointError(
                    f"incompatible optimizer: {path} was a {skeleton['__opaque__']}, the live "
                    f"optimizer has {type(current).__name__} (different ZeRO settings?)"
                )
            return current
        if "__dict__" in skeleton:
            as_int = skeleton.get("__int_keys__", False)
            live = current if isinstance(current, dict) else {}
            out = {}
            for k, v in skeleton["__dict__"].items():
                key = int(k) if as_int else k
                out[key] = _unflatten(v, tensors, live.get(key), f"{path}/{k}")
            return out
        if "__list__" in skeleton:
            live_items = list(current) if isinstance(current, list | tuple) else []
            items = [
                _unflatten(
                    v, tensors, live_items[i] if i < len(live_items) else None, f"{path}[{i}]"
                )
                for i, v in enumerate(skeleton["__list__"])
            ]
            return tuple(items) if skeleton.get("__tuple__") else items
    return skeleton


def _read_trainer(path: Path) -> dict[str, Any]:
    """trainer.json of checkpoint `path`, refused unless this build reads its format."""
    trainer = _read_json(path / "trainer.json")
    if trainer.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {trainer.get('format')!r}, this build reads {FORMAT}"
        )
    return trainer


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
