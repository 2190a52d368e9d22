"""What a run asks of the cluster, checked before anything starts.

A Ray actor whose resources no node can give waits forever; so the driver first packs every
actor the run needs (learner ranks, rollout workers) onto the cluster's nodes, the way Ray
places fractional GPUs (a share below 1 must fit on one GPU; the config allows no more than
1), and refuses with what was asked and what the cluster has. The weight-sync method is
checked against the placement too (`check_sync_method`): a method that cannot work there is
refused, never replaced by another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from staleflow.configs.loader import ConfigError

__all__ = [
    "ActorRequest",
    "NodeCapacity",
    "PlacementError",
    "check_colocated",
    "check_custom_resources",
    "check_ipc_shares",
    "check_sync_method",
    "cluster_nodes",
    "fit",
    "ipc_bundle",
    "ipc_scale_refusal",
    "run_requests",
    "strictly_spread",
]

_EPS = 1e-9


class PlacementError(ConfigError):
    """The run cannot be placed on this cluster (or its sync method cannot work there)."""


@dataclass(frozen=True)
class ActorRequest:
    role: str  # "learner rank 0", "rollout worker 1"
    cpus: float
    gpus: float
    kind: str = ""  # what refusals count it as; default: `role` less its index
    custom: Mapping[str, float] = field(default_factory=dict)  # learner/rollout.resources
    apart: str = ""  # requests with the same tag go on different nodes (Ray's STRICT_SPREAD)

    def counted_as(self) -> str:
        return self.kind or self.role.rsplit(" ", 1)[0]


@dataclass
class NodeCapacity:
    name: str
    cpus: float
    gpus: list[float] = field(default_factory=list)  # free share of each GPU
    custom: dict[str, float] = field(default_factory=dict)  # the node's custom resources

    @classmethod
    def of(
        cls, name: str, cpus: float, gpus: float, custom: Mapping[str, float] | None = None
    ) -> NodeCapacity:
        return cls(name, cpus, [1.0] * int(gpus + _EPS), dict(custom or {}))

    def take(self, request: ActorRequest) -> bool:
        """Reserve `request` here if it fits (first GPU with room for a fraction)."""
        if request.cpus > self.cpus + _EPS:
            return False
        if any(amount > self.custom.get(k, 0.0) + _EPS for k, amount in request.custom.items()):
            return False
        gpus = request.gpus
        if 0 < gpus <= 1 + _EPS:  # a sum of shares can round to just above 1
            fits = [i for i, free in enumerate(self.gpus) if free + _EPS >= gpus]
            if not fits:
                return False
            self.gpus[fits[0]] -= gpus
        elif gpus > 1:
            whole = [i for i, free in enumerate(self.gpus) if free >= 1 - _EPS]
            if len(whole) < gpus:
                return False
            for i in whole[: int(gpus)]:
                self.gpus[i] = 0.0
        self.cpus -= request.cpus
        for key, amount in request.custom.items():
            self.custom[key] -= amount
        return True


IPC_BUNDLE = "learner rank 0 with its rollout workers (sync.method: ipc)"


def ipc_bundle(rank0: Mapping[str, float], rollout: Any) -> dict[str, float]:
    """Learner rank 0's placement-group bundle under sync.method ipc: its own resources
    (`rank0`: CPU, GPU, custom) plus rollout.num_workers workers'. Ray keeps a bundle on one
    node, and a GPU share of at most 1 on one GPU, so every worker placed in it shares rank
    0's node and GPU. The GPU share adds up as `check_sync_method` checks it."""
    out = dict(rank0)
    n = rollout.num_workers
    worker = {"CPU": rollout.cpus_per_worker, "GPU": rollout.gpus_per_worker,
              **rollout.resources}  # fmt: skip
    for key, amount in worker.items():
        if amount:
            out[key] = out.get(key, 0.0) + n * amount
    return out


def strictly_spread(learner: Any) -> bool:
    """Whether the learner's ranks must each have a node of their own: spread, with a GPU
    share below 1. Ray gives fractional shares from the first GPU with room, so two ranks on
    one node would share a GPU, where NCCL refuses to join them (after the model loads); plain
    SPREAD is only best effort. Whole GPUs need no more than SPREAD: one GPU per rank."""
    return learner.placement == "spread" and learner.num_ranks > 1 and 0 < learner.gpus_per_rank < 1


def run_requests(cfg: Any) -> list[ActorRequest]:
    """Every actor the run starts, with the resources placement.py asks Ray for."""
    learner, rollout = cfg.learner, cfg.rollout
    apart = "learner ranks" if strictly_spread(learner) else ""
    ranks = [
        ActorRequest(
            f"learner rank {r}",
            1.0,
            learner.gpus_per_rank,
            custom=dict(learner.resources),
            apart=apart,
        )
        for r in range(learner.num_ranks)
    ]
    n = rollout.num_workers
    workers = [
        ActorRequest(
            f"rollout worker {i}",
            rollout.cpus_per_worker,
            rollout.gpus_per_worker,
            custom=dict(rollout.resources),
        )
        for i in range(n)
    ]
    if cfg.sync.method == "ipc" and workers:
        # one placement-group bundle holds rank 0 and every worker (placement.LearnerGroup),
        # so they need one node, and one GPU for GPU roles: they are placed as one
        rank0 = ranks[0]
        bundle = ipc_bundle({"CPU": rank0.cpus, "GPU": rank0.gpus, **rank0.custom}, rollout)
        with_workers = "rollout worker 0" if n == 1 else f"rollout workers 0-{n - 1}"
        ranks[0] = ActorRequest(
            f"learner rank 0 with {with_workers}",
            bundle.pop("CPU"),
            bundle.pop("GPU"),
            kind=IPC_BUNDLE,
            custom=bundle,
            apart=apart,
        )
        workers = []
    return ranks + workers


def check_custom_resources(cfg: Any, available: dict[str, float]) -> None:
    """Refuse a run whose custom resources (learner.resources, rollout.resources) the
    cluster does not have in total (`available`: ray.cluster_resources()), rather than let
    its actors wait for nodes that never come."""
    for key, amount_each, count in (
        ("learner.resources", cfg.learner.resources, cfg.learner.num_ranks),
        ("rollout.resources", cfg.rollout.resources, cfg.rollout.num_workers),
    ):
        for name, amount in amount_each.items():
            have = available.get(name, 0.0)
            if have + _EPS < amount * count:
                raise PlacementError(
                    f"{key} asks {amount:g} {name!r} for each of {count}, {amount * count:g} in "
                    f"all; the cluster has {have:g}. Start nodes with `ray start --resources "
                    f"'{{\"{name}\": N}}'`, or drop {key}"
                )


def fit(
    requests: Sequence[ActorRequest], nodes: Sequence[NodeCapacity], hint: str | None = None
) -> None:
    """Place `requests` (largest GPU share first) on `nodes`; raise PlacementError naming the
    first actor that does not fit, what the run asks and what the cluster has, and `hint`
    (default: which config keys to change)."""
    free = [NodeCapacity(n.name, n.cpus, list(n.gpus), dict(n.custom)) for n in nodes]
    order = sorted(requests, key=lambda r: (-r.gpus, -r.cpus))
    used: dict[str, set[int]] = {}  # an `apart` tag -> the nodes holding one of its requests
    for request in order:
        taken = used.setdefault(request.apart, set()) if request.apart else set()
        placed = next(
            (i for i, node in enumerate(free) if i not in taken and node.take(request)), None
        )
        if placed is None:
            raise PlacementError(_refusal(request, requests, nodes, hint))
        taken.add(placed)


def _refusal(
    failed: ActorRequest,
    requests: Sequence[ActorRequest],
    nodes: Sequence[NodeCapacity],
    hint: str | None = None,
) -> str:
    asked = {}
    for r in requests:
        role = r.counted_as()
        count, cpus, gpus = asked.get(role, (0, r.cpus, r.gpus))
        asked[role] = (count + 1, cpus, gpus)
    wants = "; ".join(
        f"{n} x {role} ({cpus:g} CPU, {gpus:g} GPU each)" for role, (n, cpus, gpus) in asked.items()
    )
    custom = "".join(f", {amount:g} {key!r}" for key, amount in failed.custom.items())
    total_cpu = sum(r.cpus for r in requests)
    total_gpu = sum(r.gpus for r in requests)
    keys = sorted({key for r in requests for key in r.custom})
    has = "; ".join(
        f"{n.name}: {n.cpus:g} CPU, {len(n.gpus)} GPU"
        + "".join(f", {n.custom.get(k, 0.0):g} {k!r}" for k in keys)
        for n in nodes
    )
    has = has or "no nodes"
    hint = hint if hint is not None else _config_hint(failed)
    return (
        f"the cluster cannot hold this run: {failed.role} ({failed.cpus:g} CPU, "
        f"{failed.gpus:g} GPU{custom}) fits on no node. The run asks for {wants} = "
        f"{total_cpu:g} CPU, {total_gpu:g} GPU; the cluster has {has}. {hint}."
    )


def _config_hint(failed: ActorRequest) -> str:
    """Which config keys to change when `failed` fits on no node."""
    if failed.apart:
        return (
            "learner.placement: spread with a GPU share below 1 (learner.gpus_per_rank) puts "
            "each learner rank on a node of its own: on one node two ranks would share a GPU, "
            "which NCCL refuses. Add nodes with a GPU, give each rank a whole GPU "
            "(learner.gpus_per_rank=1), or use one rank"
        )
    if failed.kind == IPC_BUNDLE:
        return (
            "sync.method: ipc keeps learner rank 0 and every rollout worker in one placement "
            "group bundle, so they need one node"
            + (" and one GPU (their shares must add up to at most 1)" if failed.gpus else "")
            + (", with learner.resources and rollout.resources together" if failed.custom else "")
            + ": lower rollout.num_workers, rollout.cpus_per_worker"
            + (" or the GPU shares" if failed.gpus else "")
            + ", or use sync.method: ray"
        )
    if failed.gpus > 0:
        return (
            "GPU shares placed on one GPU must add up to at most 1 (e.g. learner.gpus_per_rank="
            "0.5 with two workers at rollout.gpus_per_worker=0.25), or add GPUs"
        )
    return "lower rollout.num_workers or rollout.cpus_per_worker, or add nodes" + (
        " (with the custom resources asked)" if failed.custom else ""
    )


def cluster_nodes() -> list[NodeCapacity]:
    """The alive nodes of the connected Ray cluster and their total CPUs and GPUs."""
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        name = node.get("NodeManagerAddress", node.get("NodeID", "?"))
        nodes.append(NodeCapacity.of(str(name), res.get("CPU", 0.0), res.get("GPU", 0.0), res))
    return nodes


def scale_placement_refusal(cfg: Any, n: int) -> str | None:
    """Why the connected cluster cannot hold this run with `n` rollout workers (checked as
    at start: the whole run against the nodes' totals), or None. Ray would otherwise keep the
    new workers pending, and the first batch handed to one would stop the run after
    run.start_timeout_s (Rollouts.check_started)."""
    scaled = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"num_workers": n})})
    try:
        fit(run_requests(scaled), cluster_nodes(), hint="ask for fewer workers, or add nodes first")
    except PlacementError as exc:
        return str(exc)
    return None


def check_sync_method(cfg: Any) -> None:
    """Refuse a weight-sync method that cannot work with this placement and schedule."""
    sync, learner, rollout = cfg.sync, cfg.learner, cfg.rollout
    if sync.method == "nccl" and (learner.gpus_per_rank < 1 or rollout.gpus_per_worker < 1):
        raise PlacementError(
            f"sync.method: nccl needs the learner and every worker on GPUs of their own "
            f"(learner.gpus_per_rank >= 1 and rollout.gpus_per_worker >= 1; got "
            f"{learner.gpus_per_rank:g} and {rollout.gpus_per_worker:g}): NCCL cannot join two "
            "ranks on one GPU, and CPU roles have none. Use sync.method: ipc (or ray) for "
            "colocated runs, or sync.method: gloo for CPU roles"
        )
    if sync.method == "gloo" and (learner.gpus_per_rank > 0 or rollout.gpus_per_worker > 0):
        raise PlacementError(
            "sync.method: gloo broadcasts from CPU memory and is meant for CPU roles "
            "(learner.gpus_per_rank=0, rollout.gpus_per_worker=0); with GPUs use sync.method: "
            "nccl (separate GPUs), ipc (one shared GPU) or ray"
        )
    if sync.method == "ipc":
        check_ipc_shares(learner.gpus_per_rank, rollout.gpus_per_worker)
        shares = learner.gpus_per_rank + rollout.num_workers * rollout.gpus_per_worker
        if shares > 1 + _EPS:
            raise PlacementError(
                "sync.method: ipc puts learner rank 0 and every rollout worker on one GPU, but "
                f"learner.gpus_per_rank + rollout.num_workers x rollout.gpus_per_worker = "
                f"{learner.gpus_per_rank:g} + {rollout.num_workers} x "
                f"{rollout.gpus_per_worker:g} = {shares:g} > 1. Lower the shares (e.g. "
                "0.5 + 2 x 0.25) or rollout.num_workers, or use sync.method: ray"
            )
    broadcast = sync.method in sync.PUSH_METHODS
    if broadcast and sync.mode == "lockstep":
        if sync.offset > 0:
            raise PlacementError(
                f"sync.method: {sync.method} loads weights into the engines as they are "
                f"broadcast, but lockstep with sync.offset={sync.offset} runs batches on "
                "versions older than the newest; use sync.method: ray (it keeps them)"
            )
        every = cfg.run.eval_every
        if every and every % sync.interval:
            raise PlacementError(
                f"sync.method: {sync.method} with lockstep evaluates only published versions: "
                f"run.eval_every ({every}) must be a multiple of sync.interval ({sync.interval})"
            )


def check_ipc_shares(learner_gpus: float, worker_gpus: float) -> None:
    """sync.method ipc: the engines read learner rank 0's memory, so both roles must be where
    that memory is: shares of one GPU, or CPU roles (on one node, checked once placed)."""
    if (learner_gpus > 0) != (worker_gpus > 0) or learner_gpus >= 1 or worker_gpus >= 1:
        raise PlacementError(
            "sync.method: ipc shares learner rank 0's memory with the engines in place, so "
            "they must share its device: fractions of one GPU (0 < learner.gpus_per_rank < 1 "
            "and 0 < rollout.gpus_per_worker < 1) or CPU roles (both 0); got "
            f"{learner_gpus:g} and {worker_gpus:g}. Use sync.method: nccl for roles on GPUs "
            "of their own, or ray"
        )


def ipc_scale_refusal(method: str, reserved: int, n: int) -> str | None:
    """Why a run cannot scale to `n` rollout workers (None if it can): under sync.method ipc
    the workers live in learner rank 0's bundle, sized for `reserved` (rollout.num_workers)."""
    if method != "ipc" or n <= reserved:
        return None
    return (
        f"sync.method: ipc reserves room for rollout.num_workers ({reserved}) rollout workers "
        "in learner rank 0's placement group bundle at the start, and a worker anywhere else "
        f"could not open its weights. Scale between 1 and {reserved}, or restart the run "
        "(train --resume) with a larger rollout.num_workers"
    )


def check_colocated(learner: Any, workers: dict[str, Any]) -> None:
    """sync.method ipc, once placed: every worker on learner rank 0's node and GPU (places as
    staleflow.learner.ipc.Place; the rule and message are `colocation_problem`'s)."""
    from staleflow.learner.ipc import colocation_problem

    problem = colocation_problem(learner, workers)
    if problem:
        raise PlacementError(problem)
