"""Ray placement: starting or joining a cluster, the rollout worker pool and the learner ranks
(the rank itself: cluster/learner_rank.py).

The roles stay plain classes (actors/, learner/); this module is the only place that wraps
them in `ray.remote` and decides how many CPUs / GPUs each gets. Remote calls go through the
typed handles returned here (`pool.run_batch(...)`, `learner.train(...)`), never by method-name
strings.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from staleflow.actors.tasks import Prompt
from staleflow.actors.worker import RolloutWorker
from staleflow.buffer.ports import meeting_point
from staleflow.cluster.failures import (
    ClusterUnreachable,
    LearnerFailed,
    RayStartError,
    rank_error,
    remote_cause,
)
from staleflow.cluster.learner_rank import LearnerRank
from staleflow.cluster.resources import ipc_bundle, strictly_spread
from staleflow.learner.device import hidden_gpus_env

__all__ = [
    "ActorStartError",
    "LearnerGroup",
    "StartTimeout",
    "WorkerPool",
    "check_reachable",
    "learner_threads",
    "object_store_bytes",
    "start_ray",
    "wait_started",
]

logger = logging.getLogger(__name__)

# A Ray this process starts prestarts one idle Python worker per CPU for its first driver.
# staleflow's actors carry a runtime_env (their thread counts), so none of them can use those
# workers: on a 2-core machine they cost about 2 CPU-s and 1 s before the first actor call
# answers (bench/ray_start.py). Off for every Ray staleflow starts (the tests' too); a cluster
# it joins keeps its own setting.
NO_PRESTART: dict[str, Any] = {"prestart_worker_first_driver": False}


def start_ray(
    address: str | None, cfg: Any = None, log_to_driver: bool = True, runs: int = 1
) -> None:
    """Join the cluster at `address` ('auto', 'ray://host:port', 'host:port') or start a local
    one on the loopback interface (actors' logs are echoed here unless `log_to_driver` is
    False). A local one gets the machine's CPUs, or what `runs` runs of `cfg` reserve if that
    is more, plus `SCALE_HEADROOM` so `staleflow scale` can add workers (Ray CPUs are a
    scheduling count: the OS shares the cores), and `runs` times the run's object store.
    `cfg` may be a list of configs (a sweep's cells, `runs` of them side by side): each need
    is then the largest of any cell's."""
    if ray.is_initialized():
        return
    with _keeping_sigterm_handler():
        _start_ray(address, cfg, log_to_driver, runs)


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Any:
    """ray.init replaces the process's SIGTERM handling (a Python handler that exits, then the
    core worker's, which aborts): a caller's own Python handler (the driver's clean stop) is
    put back once Ray is up. A process without one keeps Ray's."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


def _start_ray(address: str | None, cfg: Any, log_to_driver: bool, runs: int = 1) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = {"log_to_driver": log_to_driver, "include_dashboard": False}
    if address:
        check_reachable(address)
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, ValueError) as exc:  # none running there; ray:// w/o client
            raise ClusterUnreachable(
                f"cannot join the Ray cluster at --address {address}: {str(exc).rstrip('.')}. "
                "Start one (ray start --head) or give its address (auto on a node of it, "
                "HOST:6379, or ray://HOST:10001); without --address staleflow starts a Ray of "
                "its own"
            ) from None
        return
    cfgs = list(cfg) if isinstance(cfg, (list, tuple)) else [] if cfg is None else [cfg]
    needed = 1.0
    if cfgs:
        needed = runs * max(
            c.rollout.num_workers * c.rollout.cpus_per_worker + c.learner.num_ranks for c in cfgs
        )
    cpus = max(os.cpu_count() or 1, math.ceil(needed)) + SCALE_HEADROOM
    # "local": a Ray of this run's own even where `ray start` left a cluster on this machine
    # or $RAY_ADDRESS names one (ray.init's default joins those, and then refuses num_cpus
    # with a bare ValueError); the CLI turns $RAY_ADDRESS into --address before this
    kwargs["address"] = "local"
    logger.info(
        "starting a Ray of this run's own (%d CPUs); --address auto joins a running cluster "
        "instead", cpus,
    )  # fmt: skip
    stores = [b for b in map(object_store_bytes, cfgs) if b is not None]
    store = runs * max(stores) if stores else None  # (None: Ray's default size)
    if store is None:
        ray.init(num_cpus=cpus, _node_ip_address="127.0.0.1", _system_config=NO_PRESTART, **kwargs)
        return
    # Pages of a fresh object store fault in on first write: pre-faulted, putting 651 MB of
    # weights takes less than half the time (bench/sync.py). Only in shared memory: where
    # /dev/shm is too small Ray puts the store on disk, and pre-faulting that would be slow.
    prefault = _shm_free() >= store
    if not prefault:
        logger.warning(
            "/dev/shm has less free space than the %d MiB object store: Ray will keep it on "
            "disk (one over 10 GB it refuses), and weight publishes will be slower (give the "
            "container a larger /dev/shm, e.g. docker --shm-size)", store >> 20,
        )  # fmt: skip
    system: dict[str, Any] = {**NO_PRESTART, "preallocate_plasma_memory": prefault}
    if prefault:
        # The raylet connects to its store once the store is pre-faulted, and gives up after
        # 10 one-second attempts: faulting 2.7 GB in took 9.4 s on a 2-core machine, so a
        # run failed to start now and then. Allow 1 s per 100 MB on top.
        system["raylet_client_num_connect_attempts"] = 10 + math.ceil(store / 100e6)
    try:
        ray.init(
            num_cpus=cpus,
            _node_ip_address="127.0.0.1",
            object_store_memory=store,
            _system_config=system,
            **kwargs,
        )
    except ValueError as exc:  # Ray checks the store's size against memory and /dev/shm
        # (the GCS server it started before the check exits with this process)
        side_by_side = f" (here for {runs} runs side by side: a smaller --parallel needs less)"
        raise RayStartError(
            f"Ray did not start with a {store >> 20} MiB object store: {exc} Set "
            "sync.object_store_mb to what this machine holds (at least 75), or, with "
            "sync.method ray and no object_store_mb, choose another sync.method: the default "
            "store is 4 copies of the weights + 512 MiB" + (side_by_side if runs > 1 else "")
        ) from None


_ANSWERED: set[str] = set()  # addresses check_reachable found answering (this process)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once, naming the address, when nothing accepts a TCP connection at the
    HOST:PORT of `address`, or what does answers in another protocol than gRPC (a Redis, the
    dashboard): ray.init retries such an address for minutes (here, with nothing on a
    loopback port, still retrying after 6 min). 'auto' and anything without a port are left
    to ray.init, and so is a server that says nothing within 2 s."""
    if address in _ANSWERED:  # the CLI checks before the run directory, start_ray again
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    host = host.strip("[]")  # [IPv6]:port
    hosts = [host]
    if host in ("127.0.0.1", "localhost", "::1"):  # ray.init joins this node's address instead
        hosts.append(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    hosts = list(dict.fromkeys(hosts))  # the node's address may be the loopback one
    why, others = "", []
    for candidate in hosts:  # any one answering as gRPC (or not telling) will do
        try:
            sock = socket.create_connection((candidate, int(port)), timeout=timeout_s)
        except OSError as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
            continue
        with sock:
            other = _other_protocol(sock)
        if other is None:
            _ANSWERED.add(address)
            return
        others.append(f"{candidate}:{port} answers, but not as Ray: {other}")
    if others:
        raise ClusterUnreachable(
            f"cannot join the Ray cluster at --address {address}: {'; '.join(others)}. Give "
            "the head's GCS port (`ray start --head` prints it; 6379 by default) or "
            "ray://HOST:10001 for Ray Client; the dashboard's port (8265) is for `ray job "
            "submit`, not --address"
        )
    raise ClusterUnreachable(
        f"cannot join the Ray cluster at --address {address}: nothing accepts "
        f"connections at {host}:{port} ({why}). Check the host and port (the head's GCS "
        "port, 6379 by default, or ray://HOST:10001 for Ray Client), start one there "
        "(ray start --head), or use auto on a node of the cluster; without --address "
        "staleflow starts a Ray of its own"
    )


# The client's connection preface of HTTP/2 (RFC 9113 3.4), then an empty SETTINGS frame. Ray's
# GCS and Ray Client are gRPC servers: they answer with a SETTINGS frame of their own.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _other_protocol(sock: socket.socket, timeout_s: float = 2.0) -> str | None:
    """What answers on `sock`, if it plainly is not a gRPC server such as Ray's GCS: its
    reply's first line, and a guess at what it is (ray.init tries such an address for
    minutes). None if it answers in HTTP/2, or cannot be told: no reply in time, the
    connection closed, or a TLS alert (Ray's gRPC may use TLS)."""
    reply = b""
    try:
        sock.settimeout(timeout_s)
        sock.sendall(_H2_PREFACE)
        while len(reply) < 9:
            chunk = sock.recv(256)
            if not chunk:
                break
            reply += chunk
    except OSError:
        pass
    if len(reply) < 9 or reply[0] == 0x15:  # too little to tell, or a TLS alert record
        return None
    if reply[3] == 0x04 and reply[5:9] == bytes(4):  # an HTTP/2 SETTINGS frame on stream 0
        return None
    first = reply.splitlines()[0][:60].decode("ascii", "replace")
    if reply.startswith(b"HTTP/") or reply[:9].lower().startswith((b"<!doctype", b"<html")):
        kind = "an HTTP/1 server (Ray's dashboard, on 8265, is one)"
    elif reply[:1] in (b"-", b"+"):
        kind = "a Redis server"
    else:
        kind = "not an HTTP/2 server"
    return f"its reply begins {first!r}, {kind}"


def _shm_free() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def object_store_bytes(cfg: Any) -> int | None:
    """The object store a local Ray gets for this run: `sync.object_store_mb`, or with
    `sync.method: ray` room for four published copies of the weights plus 512 MiB (None:
    Ray's default, e.g. for the tiny model)."""
    if cfg.sync.object_store_mb is not None:
        return int(cfg.sync.object_store_mb) << 20
    if cfg.sync.method != "ray":
        return None
    from staleflow.actors.models import weights_bytes

    size = weights_bytes(cfg.model)
    return None if size is None else 4 * size + (512 << 20)


SCALE_HEADROOM = 4


def _actor_env(cpus: float, gpus: float) -> dict[str, Any]:
    """Ray sets OMP_NUM_THREADS=1 in actors; give torch the CPUs the actor reserved. An actor
    with no GPU share sees no GPU (Ray would leave the machine's GPUs visible to it)."""
    threads = str(max(1, int(cpus)))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **hidden_gpus_env(gpus)}
    return {"env_vars": env}


# --------------------------------------------------------------------------- rollout workers


@dataclass
class WorkerSlot:
    """One rollout worker actor and what the driver knows about it."""

    index: int
    handle: Any
    version: int = 0  # the version the actor will have loaded once its queued calls ran
    # Its calls in flight, rollout parts and evaluations, in the order the actor runs them
    # (max_concurrency=1): the first is running, the others wait behind it.
    queue: list[Any] = field(default_factory=list)
    head_since: float = field(default_factory=time.monotonic)  # when the first began running
    retiring: bool = False
    idle_since: float = field(default_factory=time.monotonic)
    ready: Any = None  # its constructor's ref until it is seen done (`Rollouts.check_started`)
    added: float = field(default_factory=time.monotonic)

    @property
    def busy(self) -> bool:
        """A call in flight: a rollout part or an evaluation."""
        return bool(self.queue)

    def call(self, ref: Any) -> Any:
        """`ref`, a call just made on the actor, runs after those already in flight."""
        if not self.queue:
            self.head_since = time.monotonic()
        self.queue.append(ref)
        return ref

    def running_for(self, ref: Any, now: float) -> float:
        """Seconds the call `ref` has been running at `now` (0 while it waits behind another
        call): what rollout.batch_timeout_s bounds, for a part or an evaluation."""
        return now - self.head_since if self.queue and self.queue[0] == ref else 0.0

    def overdue(self, ref: Any, limit: float, now: float) -> float | None:
        """The seconds the call `ref` has run, if over `limit` and it is not done (a call
        done but not handled yet is not hung); else None. `Rollouts.check_hung` and
        `Evaluations.check_hung` kill the worker of such a call."""
        ran = self.running_for(ref, now)
        if ran <= limit or ray.wait([ref], timeout=0)[0]:
            return None
        return ran


@dataclass
class WorkerPool:
    """Rollout worker actors; workers can be added and retired while a run goes on."""

    cfg: Any
    run_id: str
    redis_url: str
    shared: tuple[Any, ...] = ()  # storage.SharedDir each worker must see (checked at start)
    strategy: Any = None  # LearnerGroup.worker_strategy(): a placement group bundle, or None
    slots: list[WorkerSlot] = field(default_factory=list)
    _next_index: int = 0

    def __post_init__(self) -> None:
        rollout = self.cfg.rollout
        placed = {"scheduling_strategy": self.strategy} if self.strategy is not None else {}
        self._actor = ray.remote(RolloutWorker).options(  # type: ignore[attr-defined]
            num_cpus=rollout.cpus_per_worker,
            num_gpus=rollout.gpus_per_worker,
            resources=dict(rollout.resources) or None,
            runtime_env=_actor_env(rollout.cpus_per_worker, rollout.gpus_per_worker),
            max_concurrency=1,
            **placed,
        )

    @property
    def active(self) -> list[WorkerSlot]:
        return [s for s in self.slots if not s.retiring]

    def idle(self) -> list[WorkerSlot]:
        """Active workers with no call in flight (a batch given to one running an evaluation
        would wait behind it), longest idle first (so a newly added worker is not starved by
        a fast one that is always idle first)."""
        return sorted((s for s in self.active if not s.busy), key=lambda s: s.idle_since)

    def ended(self, slot: WorkerSlot, ref: Any) -> None:
        """The call `ref` on `slot` returned (or failed). A worker left with nothing in
        flight is idle from now, and one retiring is removed."""
        if ref in slot.queue:
            if slot.queue[0] == ref:  # the call behind it, if any, starts now
                slot.head_since = time.monotonic()
            slot.queue.remove(ref)
        if slot.busy:
            return
        slot.idle_since = time.monotonic()
        if slot.retiring and slot in self.slots:
            self.remove(slot)

    def add(self) -> WorkerSlot:
        """Start a worker; its first batch loads the weights it must use (`run_batch`)."""
        index, self._next_index = self._next_index, self._next_index + 1
        handle = self._actor.remote(
            self.cfg,
            run_id=self.run_id,
            worker_index=index,
            redis_url=self.redis_url,
            shared=self.shared,
        )
        slot = WorkerSlot(index, handle, ready=handle.__ray_ready__.remote())
        self.slots.append(slot)
        return slot

    def _weights_for(self, slot: WorkerSlot, weights: Any) -> Any:
        """`weights` if the worker must load them first (it loads them inside the call that
        needs them, so a failed load fails that call with its own error)."""
        if slot.version == weights.version:
            return None
        slot.version = weights.version
        return weights

    def version_unknown(self, slot: WorkerSlot) -> None:
        """A call on `slot` failed after it may have started loading weights: its next call
        loads the version it needs, whatever `slot.version` said."""
        slot.version = -1

    def run_batch(
        self,
        slot: WorkerSlot,
        weights: Any,
        prompts: Sequence[Prompt],
        ids: tuple[int, int] | None = None,
    ) -> Any:
        """Start a batch at `weights.version` (loaded first at this batch boundary if needed);
        `ids` = (batch number, first prompt's index in it) fixes the groups' ids."""
        load = self._weights_for(slot, weights)
        return slot.call(slot.handle.run_batch.remote(weights.version, list(prompts), load, ids))

    def evaluate(self, slot: WorkerSlot, weights: Any, n_prompts: int) -> Any:
        load = self._weights_for(slot, weights)
        return slot.call(slot.handle.evaluate.remote(n_prompts, None, load))

    def scale(self, n: int) -> None:
        """Make `n` workers active. Going up, workers still finishing their last batch before
        retiring stay instead (no engine to start; under ipc they still hold their room in
        learner rank 0's bundle), then new ones start. Going down, the newest retire: an idle
        one at once, a busy one when its last call in flight ends (`ended`)."""
        active = self.active
        if n > len(active):
            for slot in [s for s in self.slots if s.retiring][: n - len(active)]:
                slot.retiring = False
            for _ in range(n - len(self.active)):
                self.add()
        for slot in active[n:]:
            slot.retiring = True
            if not slot.busy:
                self.remove(slot)

    def remove(self, slot: WorkerSlot) -> None:
        ray.kill(slot.handle)
        self.slots.remove(slot)

    def drop(self, slot: WorkerSlot) -> None:
        """Forget a dead (or hung) worker, killing what is left of it."""
        with contextlib.suppress(Exception):
            ray.kill(slot.handle)
        if slot in self.slots:
            self.slots.remove(slot)

    def replace(self, slot: WorkerSlot) -> WorkerSlot:
        """A new worker in place of a dead (or hung) one, which is killed. It retires if that
        one was retiring (it takes over its calls, and goes when they end)."""
        self.drop(slot)
        new = self.add()
        new.retiring = slot.retiring
        return new


@dataclass
class LearnerGroup:
    """M learner ranks as actors; every call goes to all ranks (they step in lock step)."""

    cfg: Any
    ranks: list[Any] = field(default_factory=list)
    group: Any = None  # the ranks' placement group
    # where they rendezvous: rank 0's node and a free port; one rank: ("127.0.0.1", 0), rank
    # 0 picks a port of its own
    master: tuple[str, int] = ("", 0)

    publish_dir: str | None = None
    redis_url: str | None = None
    run_id: str | None = None
    trajectories_dir: str | None = None
    shared: tuple[Any, ...] = ()  # storage.SharedDir every rank must see (checked at start)
    # called about every second while the driver waits on the ranks outside a step (a
    # checkpoint, a publish): the driver restarts a dead Redis there, as it does between
    # steps, or a rank's commit would wait out its client's retries and fail the run
    while_waiting: Callable[[], None] = lambda: None
    # True once every rank's constructor has returned (Services.start): before, a call on a
    # rank queues behind a constructor that may wait out DeepSpeed's rendezvous for a peer
    # that failed (10 min)
    started: bool = False
    # The rank calls of an on_ranks that ended before all of them returned (one failed, the
    # limit passed, a second Ctrl-C): the ranks may still be in them, and a call made now
    # would queue behind them (see `idle`)
    abandoned: tuple[list[Any], str] | None = None

    def __post_init__(self) -> None:
        learner = self.cfg.learner
        # One CPU reserved per rank; its torch threads use this machine's cores (the learner is
        # the bottleneck of a CPU run, and the OS shares the cores with the workers). Its GPU
        # share is its own setting (learner.gpus_per_rank), whatever the workers take.
        threads = learner_threads(learner.num_ranks)
        # One bundle per rank in a placement group: packed on as few nodes as possible, or
        # spread when asked; rank r lives in bundle r, and all meet on bundle 0's node.
        bundle = {"CPU": 1.0, **({"GPU": learner.gpus_per_rank} if learner.gpus_per_rank else {})}
        bundle.update(learner.resources)  # custom resources pin the ranks to labelled nodes
        bundles = [dict(bundle) for _ in range(learner.num_ranks)]
        if self.cfg.sync.method == "ipc":  # the workers open rank 0's memory: its bundle
            bundles[0] = ipc_bundle(bundles[0], self.cfg.rollout)
        strategy = "STRICT_SPREAD" if strictly_spread(learner) else learner.placement.upper()
        self.group = placement_group(
            bundles,
            strategy=strategy,
            name=f"staleflow-learner-{self.run_id or os.getpid()}",
        )
        timeout = self.cfg.run.start_timeout_s
        try:
            self.master = self._meeting_point(timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise StartTimeout(
                f"the learner's {learner.num_ranks} rank(s) (bundles {bundles}) were not placed "
                f"within {timeout:g} s (run.start_timeout_s); {cluster_room()}"
                + (
                    " (sync.method ipc: bundle 0 holds rank 0 and every rollout worker, so it "
                    "needs one node with all of that)"
                    if self.cfg.sync.method == "ipc"
                    else ""
                )
            ) from None
        actor = ray.remote(LearnerRank)  # type: ignore[attr-defined]
        self.ranks = [
            actor.options(
                num_cpus=1,
                num_gpus=learner.gpus_per_rank,
                runtime_env=_actor_env(threads, learner.gpus_per_rank),
                scheduling_strategy=self._in_bundle(rank),
            ).remote(
                self.cfg,
                rank,
                learner.num_ranks,
                self.master,
                self.publish_dir,
                self.redis_url,
                self.run_id,
                self.trajectories_dir,
                self.shared,
            )
            for rank in range(learner.num_ranks)
        ]

    def _meeting_point(self, timeout: float) -> tuple[str, int]:
        """Once the group is placed (GetTimeoutError if not within `timeout`): where the ranks
        meet, bundle 0's node and a port free there, found by a task in that bundle. One rank
        meets no one: it takes a loopback port of its own (port 0 here), and no task runs."""
        if self.cfg.learner.num_ranks > 1:
            where = _meeting_point.options(scheduling_strategy=self._in_bundle(0)).remote()
            host, port = ray.get(where, timeout=timeout)
            return str(host), int(port)
        # (ready(): the GCS answers, no task runs; ray.get keeps Ctrl-C working meanwhile,
        # where PlacementGroup.wait blocks in C++ and truncates the timeout to whole seconds)
        ray.get(self.group.ready(), timeout=timeout)
        return "127.0.0.1", 0

    def _in_bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=index
        )

    def worker_strategy(self) -> PlacementGroupSchedulingStrategy | None:
        """Where rollout workers go: sync.method ipc, in rank 0's bundle (reserved for
        rollout.num_workers beside the rank); otherwise wherever Ray finds room (None)."""
        return self._in_bundle(0) if self.cfg.sync.method == "ipc" else None

    def train(self, wait_s: float, publish: bool) -> list[Any]:
        """Start `LearnerRank.train` on every rank; returns the refs, rank 0's (the report)
        first."""
        return [r.train.remote(wait_s, publish) for r in self.ranks]

    def publish(self) -> Any:
        return self.on_ranks([r.publish.remote() for r in self.ranks], "a publish")[0]

    def save_shared(self, versions: list[int], directory: str) -> None:
        ref = self.ranks[0].save_shared.remote(versions, os.path.abspath(directory))
        self.on_ranks([ref], "a checkpoint")

    def settle(self) -> tuple[int, int, int]:
        """No take in progress afterwards; what the last prefetch dropped (stale, invalid, of
        those the replays)."""
        return tuple(self.on_ranks([self.ranks[0].settle.remote()], "the stop")[0])  # type: ignore[return-value]

    def save(self, path: str, extra: dict[str, Any]) -> None:
        """Every rank checkpoints its part (the held groups are acked by `commit`). Paths
        are made absolute here: a rank's working directory is not the driver's."""
        path = os.path.abspath(path)
        self.on_ranks([r.save.remote(path, extra) for r in self.ranks], "a checkpoint")

    def commit(self) -> int:
        """Once LATEST names the checkpoint: rank 0 acks the groups it named; how many."""
        return int(self.on_ranks([self.ranks[0].commit.remote()], "a checkpoint")[0])

    def load(self, path: str | None, step: int) -> int:
        path = os.path.abspath(path) if path is not None else None
        return int(self.on_ranks([r.load.remote(path, step) for r in self.ranks], "the resume")[0])

    def on_ranks(
        self, refs: Sequence[Any], during: str, workers: Sequence[tuple[Any, Any]] = ()
    ) -> list[Any]:
        """The results of calls on learner ranks (`refs`), then of the rollout workers' calls
        taking part with them (`workers`: (slot, ref) pairs, e.g. a weight broadcast),
        calling `while_waiting` about every second meanwhile. A rank that died or raised
        during them (a publish, a checkpoint, ...) is a LearnerFailed, as in a step, so the
        run stops the same clean way whatever the ranks were doing; a worker's failure
        names the worker. So is a call still out after learner.step_timeout_s (a broadcast:
        after sync.broadcast_timeout_s, if that is longer), naming what has not returned."""
        slot_of = {ref: slot for slot, ref in workers}
        every = [*refs, *slot_of]
        pending = list(every)
        limit, setting = self.cfg.learner.step_timeout_s, "learner.step_timeout_s"
        if workers and self.cfg.sync.broadcast_timeout_s + 60 > limit:
            # the ranks give up on a broadcast themselves after its own timeout
            limit, setting = self.cfg.sync.broadcast_timeout_s + 60, "sync.broadcast_timeout_s"
        deadline = time.monotonic() + limit
        self.abandoned = (list(refs), during)  # until every one of them has returned
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            # a call that failed stops the wait at once: the others may be waiting for it
            # in a collective, which only the process group's timeout would end
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    if ref in slot_of:
                        cause = remote_cause(exc)
                        # Its process may live on (an engine error, a CUDA OOM): the ranks
                        # would then wait in the collective for it until the process
                        # group's timeout (sync.broadcast_timeout_s). Killed, its
                        # connections close and their calls fail at once.
                        with contextlib.suppress(Exception):
                            ray.kill(slot_of[ref].handle)
                        raise RuntimeError(
                            f"rollout worker {slot_of[ref].index} failed during {during}: "
                            f"{type(cause).__name__}: {cause}"
                        ) from exc
                    failure = rank_error(exc)
                    raise LearnerFailed(
                        f"a learner rank failed during {during}: {failure}"
                    ) from exc
            if pending and time.monotonic() > deadline:
                late = [f"learner rank {i}" for i, ref in enumerate(refs) if ref in pending]
                late += [
                    f"rollout worker {slot_of[ref].index}" for ref in pending if ref in slot_of
                ]
                raise LearnerFailed(
                    f"{', '.join(late)} did not return from {during} within {limit:g} s "
                    f"({setting}; a hung GPU, a stalled filesystem or a peer that never joined)"
                )
            if pending:
                self.while_waiting()
        self.abandoned = None
        return list(ray.get(every))

    def idle(self, timeout_s: float) -> str | None:
        """None if the ranks can take a call now: they have started, and any call an
        on_ranks gave up on has returned (waiting up to `timeout_s` for it); else what they
        are still doing, for the summary (a checkpoint or a settle would wait behind it)."""
        if not self.started:
            return "the learner ranks had not all started"
        if self.abandoned is None:
            return None
        refs, during = self.abandoned
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            return f"the learner ranks were still in {during} at the stop"
        self.abandoned = None
        return None

    def kill(self) -> None:
        """Close every rank (its prefetch, trajectory record and shared weights), waiting up
        to 30 s for all of them together, then kill them. A rank that died or fails to
        close is logged: the others still close before the kill (a single ray.get of them
        all raised at the first dead one and cut the rest short)."""
        try:
            refs = [r.close.remote() for r in self.ranks]
            done, late = ray.wait(refs, num_returns=len(refs), timeout=30)
            for rank, ref in enumerate(refs):
                if ref not in done:
                    continue
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    cause = remote_cause(exc)
                    logger.warning("learner rank %d did not close: %s: %s", rank,
                                   type(cause).__name__, str(cause).split("\n")[0])  # fmt: skip
            if late:  # killed below all the same
                logger.warning("%d learner rank(s) did not close in 30 s (still in a step, "
                               "waiting for a rank that failed?): killed", len(late))  # fmt: skip
        finally:
            for r in self.ranks:
                ray.kill(r)
            if self.group is not None:
                remove_placement_group(self.group)


# a Ray task in rank 0's bundle; its worker process imports staleflow.buffer.ports alone
_meeting_point = ray.remote(num_cpus=0)(meeting_point)


class ActorStartError(RuntimeError):
    """A worker's or learner rank's constructor raised; the message is its error's last line
    (the whole traceback goes to the driver's log)."""


class StartTimeout(ActorStartError, TimeoutError):
    """Actors were not placed, or did not finish starting, within run.start_timeout_s; the
    message says what the cluster has free."""


def _last_error(exc: Exception) -> str:
    """'SomeError: message' of the exception a remote constructor raised (Ray hands it on
    only as traceback text), else the text's last line."""
    lines = str(exc).strip().splitlines()
    for line in reversed(lines):
        name, sep, message = line.partition(": ")
        if sep and re.fullmatch(r"[A-Za-z_][\w.]*(Error|Exception)", name):
            return f"{name.rsplit('.', 1)[-1]}: {message}"
    return lines[-1] if lines else type(exc).__name__


def cluster_room() -> str:
    """What the connected Ray cluster has free, for the error of an actor it cannot place."""
    return f"the cluster has {ray.available_resources()} free of {ray.cluster_resources()}"


def learner_threads(num_ranks: int) -> int:
    """Torch threads of each learner rank: this machine's cores shared over the ranks."""
    return max(1, min(8, (os.cpu_count() or 1) // num_ranks))


def wait_started(roles: dict[str, Sequence[Any]], timeout_s: float) -> None:
    """Wait for actors' constructors ({"learner ranks": handles, ...}); an actor Ray cannot
    place (or that hangs while starting) ends the wait after `timeout_s` with what the cluster
    has left, instead of a hang. The first constructor to fail, of any role, ends it at once
    with its error: its peers may be blocked on it (learner ranks wait in their rendezvous
    for a rank that died), and the other roles need not finish loading first."""
    role_of = {h.__ray_ready__.remote(): what for what, handles in roles.items() for h in handles}
    pending = list(role_of)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        try:
            ray.get(done)
        except ray.exceptions.RayActorError as exc:
            if not exc.actor_init_failed:
                raise
            what = role_of[done[0]]
            logger.error("one of the %s failed to start: %s", what, exc)  # with its traceback
            message = f"one of the {what} failed to start: {_last_error(exc)}"
            raise ActorStartError(message) from None
    if pending:
        late = Counter(role_of[ref] for ref in pending)
        total = Counter(role_of.values())
        which = ", ".join(f"{n} of {total[what]} {what}" for what, n in late.items())
        raise StartTimeout(
            f"{which} did not start within {timeout_s:g} s "
            f"(run.start_timeout_s); {cluster_room()}: an actor that fits on no node waits for "
            "resources, and one still loading its model needs a longer run.start_timeout_s"
        )
