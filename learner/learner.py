"""The learner: batches of groups -> DeepSpeed optimizer steps with the REC / OPMD losses.

    learner = Learner(cfg)                       # loads cfg.model, builds the DeepSpeed engine
    metrics = learner.step(groups)               # one optimizer step per batch by default
    arrays = learner.state_dict_for_sync()       # numpy arrays for the rollout engines

A plain class (Ray wraps it in cluster/). Per step: advantages per group (the preset's
settings), teacher-forced log-probs of the response tokens at the sampling temperature (the
same quantity the engines record, docs in staleflow.actors.engine), the preset's loss
normalised over the whole (mini-)batch even when it is split into micro-batches, then one
optimizer step. The model runs in eval mode: dropout would make its log-probs disagree with
the behaviour policy's; gradients flow all the same.

CPU uses gloo; the JIT builds DeepSpeed would start on CPU (fused Adam, the shared-memory comm
op) are avoided with a client torch AdamW and a no-op `build_shm_op` (docs/architecture.md,
"Facts about running on CPU").
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from staleflow.buffer.ports import free_port
from staleflow.buffer.records import Group
from staleflow.learner.batch import TrainBatch, build_batch
from staleflow.learner.device import role_device
from staleflow.learner.losses import LossInputs, aggregate, loss_denominator, loss_from_config
from staleflow.learner.lr import lr_factor
from staleflow.learner.sync_group import gloo_on_node_interface

logger = logging.getLogger(__name__)

# What makes a step's gradient norm inf or NaN once ratios are clamped (losses.py)
_NONFINITE_CAUSES = (
    "a reward or log-prob far out of range in the batch, or a RED-Weight weight_temperature "
    "so small exp(A / T) overflows"
)

__all__ = ["Learner", "ensure_distributed", "response_logprobs", "untied"]


def ensure_distributed(
    rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu"
) -> None:
    """Initialise torch.distributed through DeepSpeed once per process: NCCL when the learner
    runs on CUDA, gloo on the CPU. A CPU learner also gets DeepSpeed's CPU accelerator, so a
    machine's GPU never pulls the model onto it (DeepSpeed picks CUDA whenever it sees one)."""
    import deepspeed

    device = torch.device(device)
    if device.type == "cpu":
        from deepspeed.accelerator import get_accelerator, set_accelerator

        if get_accelerator().device_name() != "cpu":
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            set_accelerator(CPU_Accelerator())
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    if deepspeed.comm.is_initialized():
        return
    defaults = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        if world_size > 1:
            raise RuntimeError("MASTER_PORT must be set for more than one learner rank")
        os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR",
        str(os.path.join(os.path.expanduser("~"), ".cache", "staleflow", "torch_extensions")),
    )
    if device.type != "cuda":
        gloo_on_node_interface()  # peers on other nodes must be told a reachable address
    # DeepSpeed's CPU shared-memory comm op JIT-compiles for about a minute; gloo needs none.
    setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


class _PassClock:
    """Seconds of forward and backward passes. On CUDA the passes only launch kernels (the
    loss has no host syncs), so host clocks stopped early and the GPU's time went to
    whatever synchronised next: CUDA events time the passes themselves, read once at the
    end. On CPU, the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, Any, Any]] = []

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def add(self, key: str, start: Any, end: Any) -> None:
        self.spans.append((key, start, end))

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.cuda and self.spans:
            self.spans[-1][2].synchronize()  # the last pass is done, and so every one before
        for key, start, end in self.spans:
            seconds = start.elapsed_time(end) / 1000 if self.cuda else end - start
            out[key] = out.get(key, 0.0) + seconds
        return out


def response_logprobs(model: Any, batch: TrainBatch, temperature: float) -> Tensor:
    """[N, L - 1] log pi(target) at `temperature`, for every target position.

    Logits are computed only from the first response target on (HF `logits_to_keep`): with a
    large vocabulary the prompt's logits would cost as much as the rest of the model. Earlier
    positions are zeros; the response mask never selects them."""
    return _response_stats(model, batch, temperature, entropy=False)[0]


def response_logprobs_entropy(
    model: Any, batch: TrainBatch, temperature: float
) -> tuple[Tensor, Tensor]:
    """`response_logprobs` and, at the same positions, the policy's entropy at `temperature`
    over the whole vocabulary, H = -sum_v pi(v) log pi(v), with its gradient (the entropy
    bonus of docs/algorithms.md section 5). It costs one more [N, T, V] tensor (the softmax)."""
    logp, entropy = _response_stats(model, batch, temperature, entropy=True)
    assert entropy is not None
    return logp, entropy


def _response_stats(
    model: Any, batch: TrainBatch, temperature: float, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    n, length = batch.input_ids.shape
    columns = batch.response_mask.any(dim=0).nonzero()
    first = int(columns[0]) if len(columns) else length - 1
    keep = length - first  # logits at positions first..L-1; the last one predicts nothing
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep
    ).logits
    logits = logits[:, :-1].float() / temperature
    targets = batch.input_ids[:, first + 1 :]
    taken: Tensor = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    log_z = torch.logsumexp(logits, dim=-1)
    logp = taken - log_z
    ent = None
    if entropy:
        # H = -sum p (logit - log Z) = log Z - sum p * logit: no second [N, T, V] log-softmax.
        # A -inf logit (a masked token, or an overflow at low temperature) has p = 0 and adds
        # nothing, but 0 * -inf is NaN, in the value and in the gradient: count it as 0.
        finite = logits.masked_fill(torch.isneginf(logits), 0.0)
        ent = log_z - (torch.softmax(logits, dim=-1) * finite).sum(-1)
    if first == 0:
        return logp, ent
    pad = logp.new_zeros(n, first)
    return torch.cat([pad, logp], dim=1), None if ent is None else torch.cat([pad, ent], dim=1)


class Learner:
    """A DeepSpeed engine around the policy, stepping on batches of groups."""

    def __init__(
        self,
        cfg: Any,
        *,
        model: Any = None,
        tokenizer: Any = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        import deepspeed

        # The learner's own GPU share decides its device (staleflow.learner.device).
        self.device = role_device(cfg.learner.gpus_per_rank, "learner.gpus_per_rank")
        ensure_distributed(rank, world_size, self.device)
        if model is None:
            from staleflow.actors.models import load_model

            model, tokenizer = load_model(cfg.model)
        if tokenizer is None:
            raise ValueError("a learner given a model needs its tokenizer (for the pad id)")
        model = model.to(self.device)  # loaded or injected, the model lives on the learner's
        # A frozen copy of the initial policy for the optional KL penalty (loss.kl_coef), taken
        # before DeepSpeed wraps the model: at ZeRO 3 the wrapped module's parameters are
        # partitions, whose copy cannot run a forward pass. So it is a whole copy on every
        # rank (no gradients, no optimizer state), in the dtype DeepSpeed trains in.
        self.reference = None
        if cfg.learner.reference_model:
            import copy

            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            if cfg.model.dtype == "bfloat16":
                self.reference = self.reference.to(torch.bfloat16)
        self.cfg = cfg
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.loss_fn = loss_from_config(cfg.learner.loss)
        self.temperature = cfg.rollout.temperature
        opt = cfg.learner.optimizer
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=_ds_config(cfg)
        )
        self.engine.eval()  # no dropout (see the module docstring)
        if type(self.engine.optimizer).__name__ == "FP16_UnfusedOptimizer":
            _forget_deepspeeds_first_step(self.engine.optimizer)
        # The policy version is the number of batches trained (`step` calls): one counter for
        # the whole system. `mini_batches` and `epochs` act inside a step; the optimizer steps
        # they take are counted apart (docs/architecture.md, "One version counter").
        self.version = 0
        self.optimizer_steps = 0
        self.rank, self.world_size = rank, world_size
        # At ZeRO 0 one rank has nothing to all-reduce, yet DeepSpeed would flatten and copy
        # every gradient after each backward. (ZeRO 1-3 need that pass to fill partitions.)
        if cfg.learner.zero_stage == 0 and world_size == 1:
            self.engine.enable_backward_allreduce = False

    @property
    def model(self) -> Any:
        return self.engine.module

    # ------------------------------------------------------------------------- training

    def step(self, groups: Sequence[Group], learner_version: int | None = None) -> dict[str, float]:
        """Train on `groups`: `mini_batches` optimizer steps per epoch, `epochs` passes
        (one optimizer step by default); the policy version then goes up by one, whatever
        the number of optimizer steps. Returns the step's metrics as floats."""
        version = self.version if learner_version is None else learner_version
        start = time.perf_counter()
        groups = list(groups)  # read twice below: a generator trained, then failed
        batch = build_batch(
            groups,
            self.cfg.learner.loss.advantage,
            self.pad_id,
            seed=self.cfg.run.seed + self.version,
        ).to(self.device)
        sums: dict[str, float] = {}  # token-weighted sums of per-micro-batch means
        extrema: dict[str, float] = {}
        timing = {"forward_s": 0.0, "backward_s": 0.0, "step_s": 0.0}
        grad_norms, losses, skipped = [], [], 0
        lr = float(self.scheduler.get_last_lr()[0])  # what this step's first optimizer step uses
        for _ in range(self.cfg.learner.epochs):
            for mini in _split(batch.num_sequences, self.cfg.learner.mini_batches):
                loss, norm = self._optimizer_step(batch.rows(mini), sums, extrema, timing)
                skipped += not math.isfinite(norm)
                if self.world_size > 1:
                    loss = _all_reduce_sum(loss, self.device)  # each rank held its shard's share
                losses.append(loss)
                grad_norms.append(norm)
        if self.world_size > 1:  # each rank summed over its shard: the batch's are the totals
            sums, extrema = _all_reduce_metrics(sums, extrema, self.device)
        if self.device.type == "cuda":
            # The last optimizer step's kernels are still queued here: wait for them, so the
            # step's time (time_step_s) is the step's and a publish after it times only itself
            # (its own synchronize used to absorb them). A publish or the next step would wait
            # for them anyway.
            torch.cuda.synchronize(self.device)
        self.version += 1
        elapsed = time.perf_counter() - start
        tokens = int(batch.response_mask.sum())
        lags = [version - v for v in batch.policy_versions]
        counted = max(sums.pop("_tokens", 0.0), 1.0)
        metrics = {k: v / counted for k, v in sums.items()}
        metrics.update(extrema)
        metrics.update(
            loss=float(np.mean(losses)),
            grad_norm=float(np.mean(grad_norms)),
            lr=lr,
            lag_min=float(min(lags)),
            lag_mean=float(np.mean(lags)),
            lag_max=float(max(lags)),
            groups=float(len(groups)),
            tokens=float(tokens),
            tokens_per_s=tokens * self.cfg.learner.epochs / elapsed if elapsed > 0 else 0.0,
            step_time_s=elapsed,
            skipped_steps=float(skipped),
            **timing,
        )
        return metrics

    def _optimizer_step(
        self,
        batch: TrainBatch,
        sums: dict[str, float],
        extrema: dict[str, float],
        timing: dict[str, float],
    ) -> tuple[float, float]:
        """Forward/backward over micro-batches, then one optimizer step."""
        mode = self.cfg.learner.loss.loss_agg_mode
        # Every rank builds the same batch: the whole batch's denominator is known locally.
        denominator = loss_denominator(batch.response_mask, mode)
        scale = 1.0
        size = self.cfg.learner.micro_batch_size
        parts: list[slice | None]
        if self.world_size > 1:
            shards = _token_balanced_shards(batch, self.world_size)
            # Every rank must run as many forward/backward passes as the others: ZeRO 2
            # reduces gradients after each backward and ZeRO 3 gathers parameters in each
            # forward, so a rank with one micro-batch more would wait forever for the rest.
            # A rank short of sequences (or with none) runs a stand-in with zero loss.
            count = max(math.ceil(len(s) / size) if size else 1 for s in shards)
            own = shards[self.rank]
            stand_in = batch.rows(slice(0, 1))
            batch = batch.rows(torch.tensor(own, dtype=torch.long, device=batch.input_ids.device))
            parts = list(_split(len(own), count)) if own else []
            parts += [None] * (count - len(parts))
            scale = float(self.world_size)  # DeepSpeed averages gradients over ranks
        else:
            rows = batch.num_sequences
            parts = list(_split(rows, math.ceil(rows / size) if size else 1))
        total = 0.0
        clock = _PassClock(self.device)
        for i, part in enumerate(parts):
            micro = stand_in if part is None else batch.rows(part)
            t0 = clock.mark()
            logp, out = self._loss(micro, denominator)
            t1 = clock.mark()
            self.engine.set_gradient_accumulation_boundary(i == len(parts) - 1)
            # A stand-in's loss times zero: its passes (and their collectives) run, and its
            # gradient adds nothing.
            self.engine.backward(out.loss * (0.0 if part is None else scale))
            clock.add("forward_s", t0, t1)
            clock.add("backward_s", t1, clock.mark())
            if part is None:
                continue
            total += float(out.loss.detach())
            n = float(out.metrics["num_tokens"])
            sums["_tokens"] = sums.get("_tokens", 0.0) + n
            # The exact entropy when the loss has an entropy term; otherwise a cheap estimate:
            # -mean log pi of the (nearly on-policy) sampled tokens.
            entropy = out.metrics.get("entropy")
            if entropy is None:
                entropy = -aggregate(logp.detach(), micro.response_mask, "token-mean")
            sums["entropy"] = sums.get("entropy", 0.0) + float(entropy) * n
            for key in _TOKEN_AVERAGED:
                if key in out.metrics:
                    sums[key] = sums.get(key, 0.0) + float(out.metrics[key]) * n
            if n > 0:
                low, high = float(out.metrics["ratio_min"]), float(out.metrics["ratio_max"])
                extrema["ratio_min"] = min(extrema.get("ratio_min", low), low)
                extrema["ratio_max"] = max(extrema.get("ratio_max", high), high)
        for key, seconds in clock.totals().items():
            timing[key] += seconds
        t2 = time.perf_counter()
        # ZeRO 0 leaves full (already all-reduced) gradients on the parameters: clip them here,
        # which also yields the norm. ZeRO 1-3 partition them: DeepSpeed clips inside step()
        # and reports the global norm.
        norm = None
        if self.cfg.learner.zero_stage == 0:
            clip = self.cfg.learner.optimizer.grad_clip
            params = [p for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf")))
            if not math.isfinite(norm):  # (the same on every rank: the gradients are reduced)
                # applied, it would make the weights NaN, and Adam's moments with them for good
                for p in params:
                    p.grad = None
                timing["step_s"] += time.perf_counter() - t2
                logger.warning(
                    "learner step %d: the gradient norm is %s (loss %s): this optimizer step is "
                    "skipped, the weights and optimizer state are unchanged (metrics: "
                    "skipped_steps). Look for %s",
                    self.version + 1, norm, total, _NONFINITE_CAUSES,
                )  # fmt: skip
                return total, norm
        self.engine.step()
        if norm is None:
            reported = self.engine.get_global_grad_norm()
            norm = float(reported) if reported is not None else float("nan")
            if reported is not None and not math.isfinite(norm):  # already applied
                raise FloatingPointError(
                    f"learner step {self.version + 1}: the gradient norm is {norm} (loss "
                    f"{total}) and ZeRO stage {self.cfg.learner.zero_stage} applied it, so "
                    "the weights may hold NaN: resume from the last checkpoint, after "
                    f"removing the cause ({_NONFINITE_CAUSES}); at ZeRO 0 such a step is "
                    "skipped"
                )
        if self.device.type == "cuda":  # step() only launched the optimizer's kernels
            torch.cuda.synchronize(self.device)
        timing["step_s"] += time.perf_counter() - t2
        self.optimizer_steps += 1
        return total, norm

    def _loss(self, batch: TrainBatch, denominator: Tensor | None = None) -> tuple[Tensor, Any]:
        """The preset's loss on `batch` with the current weights: (logp, LossOutputs)."""
        with_entropy = self.loss_fn.config.entropy_coef > 0  # the loss's entropy term needs it
        logp, entropy = _response_stats(self.engine, batch, self.temperature, with_entropy)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = response_logprobs(self.reference, batch, self.temperature)
        out = self.loss_fn(
            LossInputs(
                logp=logp,
                behavior_logp=batch.behavior_logp,
                advantages=batch.advantages,
                mask=batch.response_mask,
                ref_logp=ref_logp,
                entropy=entropy,
                denominator=denominator,
            )
        )
        return logp, out

    # ------------------------------------------------------------------------- persistence

    def save(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """Checkpoint everything needed to resume exactly (see staleflow.learner.checkpoint)."""
        from staleflow.learner.checkpoint import save_checkpoint

        save_checkpoint(self, path, extra)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Resume from `save`; returns the `extra` data saved with it."""
        from staleflow.learner.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    # ------------------------------------------------------------------------- inspection

    @torch.no_grad()
    def evaluate_loss(self, groups: Sequence[Group]) -> float:
        """The loss on `groups` with the current weights, without training."""
        batch = build_batch(groups, self.cfg.learner.loss.advantage, self.pad_id, seed=0)
        batch = batch.to(self.device)
        return float(self._loss(batch)[1].loss)

    @contextlib.contextmanager
    def gathered_weights(self) -> Iterator[dict[str, Tensor]]:
        """The full weights as tensors on the learner's device, valid inside the block, each
        tensor once: a tied output layer (lm_head, the embedding's own tensor) is left out,
        as loading the embedding loads it (HF and vLLM tie it alike). Every update sent it a
        second time: 113 MB of SmolLM2's 651, and vLLM then skipped it.

        Under ZeRO-3 the partitioned parameters are gathered first (every rank must enter)."""
        import deepspeed

        gather: Any = contextlib.nullcontext()
        if self.cfg.learner.zero_stage == 3:
            gather = deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()))
        with gather:
            yield untied(self.engine.module.state_dict())

    def state_dict_for_sync(self) -> dict[str, np.ndarray]:
        """The full weights as numpy arrays of their own (bfloat16 as int16 views), for
        `load_weights` (every rank must call under ZeRO-3)."""
        from staleflow.learner.publish import host_arrays

        with self.gathered_weights() as tensors:
            return host_arrays(tensors, copy=True)


def untied(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`state` detached, without the names whose tensor an earlier name holds already (a
    tied output layer): what a run publishes."""
    out: dict[str, Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    for name, tensor in state.items():
        view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)  # fmt: skip
        if tensor.numel() and view in seen:
            continue
        seen.add(view)
        out[name] = tensor.detach()
    return out


def _token_balanced_shards(batch: TrainBatch, world_size: int) -> list[list[int]]:
    """Each rank's sequences: longest first, each to the rank with the fewest tokens so far
    (deterministic, so every rank computes the same assignment, and every rank's size)."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


# Loss metrics reported as token-weighted means over the batch (besides the entropy).
_TOKEN_AVERAGED = (
    "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl", "adv_mean", "regularizer", "kl_ref"
)  # fmt: skip


def _all_reduce_metrics(
    sums: dict[str, float], extrema: dict[str, float], device: torch.device
) -> tuple[dict[str, float], dict[str, float]]:
    """Every rank's token-weighted sums added up and the ratio's extremes over all ranks: the
    metrics of the whole batch, not of rank 0's shard. (A key no rank has stays absent: a
    rank that ran only stand-ins has none.)"""
    import deepspeed
    from deepspeed.comm import ReduceOp

    keys = ("_tokens", "entropy", *_TOKEN_AVERAGED)
    values = [sums.get(k, 0.0) for k in keys] + [float(k in sums) for k in keys]
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    deepspeed.comm.all_reduce(summed)
    totals = summed.tolist()
    out = {k: totals[i] for i, k in enumerate(keys) if totals[len(keys) + i] > 0}
    low, high = extrema.get("ratio_min", math.inf), extrema.get("ratio_max", -math.inf)
    bounds = torch.tensor([low, -high], dtype=torch.float64, device=device)
    deepspeed.comm.all_reduce(bounds, op=ReduceOp.MIN)
    low, high = bounds[0].item(), -bounds[1].item()
    return out, ({"ratio_min": low, "ratio_max": high} if math.isfinite(low) else {})


def _forget_deepspeeds_first_step(wrapped: Any) -> None:
    """DeepSpeed's optimizer for bf16 at ZeRO 0 (FP16_UnfusedOptimizer, DeepSpeed 0.19) makes
    its state by one optimizer step on zero gradients when built. AdamW's step count then
    started at 1, so every bias correction was one step late (the first update 0.744x of
    fp32's and ZeRO 1-3's at the default betas, the gap fading over ~10 steps), and weight
    decay shrank the fp32 master weights once before any training. The state is dropped
    (AdamW makes it at its first real step) and the master weights are copied again from the
    model's, as DeepSpeed made them."""
    wrapped.optimizer.state.clear()
    with torch.no_grad():
        for masters, params in zip(wrapped.fp32_groups, wrapped.fp16_groups, strict=True):
            for master, param in zip(masters, params, strict=True):
                master.copy_(param.float())


def _all_reduce_sum(value: float, device: torch.device) -> float:
    import deepspeed

    t = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL reduces CUDA tensors
    deepspeed.comm.all_reduce(t)
    return float(t[0])


def _split(n: int, parts: int) -> list[slice]:
    """`parts` contiguous, nearly equal slices of range(n) (fewer if n < parts)."""
    parts = max(1, min(parts, n))
    edges = np.linspace(0, n, parts + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def _ds_config(cfg: Any) -> dict[str, Any]:
    learner = cfg.learner
    return {
        "train_micro_batch_size_per_gpu": 1,  # batching is ours; DeepSpeed never splits
        "gradient_accumulation_steps": 1,  # and we mark the accumulation boundary ourselves
        # ZeRO 0: the learner clips (and reads the norm) itself; ZeRO 1-3: DeepSpeed does.
        "gradient_clipping": (learner.optimizer.grad_clip or 0.0) if learner.zero_stage else 0.0,
        "zero_optimization": {"stage": learner.zero_stage},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        # bf16 under ZeRO: micro-batches' gradients summed in fp32, not in bf16 (DeepSpeed's
        # default is the model's dtype; ZeRO 1 then uses its BF16_Optimizer). Without ZeRO,
        # DeepSpeed 0.19 has no such mode (it refuses the mix).
        **(
            {"data_types": {"grad_accum_dtype": "fp32"}}
            if cfg.model.dtype == "bfloat16" and learner.zero_stage
            else {}
        ),
        "steps_per_print": 2**31 - 1,
        "zero_allow_untested_optimizer": True,
    }
