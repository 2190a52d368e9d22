"""The servers and actors one run uses: started in order, stopped in reverse, safe to stop
after a partial start (the driver steers them; this module only brings them up and down)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from staleflow.configs.loader import redact, redact_url

__all__ = ["REDIS_URL_ENV", "Services", "redis_url_from_env"]

# A Redis URL with its password, kept out of config files and command lines (visible in `ps`).
REDIS_URL_ENV = "STALEFLOW_REDIS_URL"

logger = logging.getLogger(__name__)


@dataclass
class Services:
    cfg: Any
    rundir: Any  # RunDir
    address: str | None = None
    redis: Any = None  # the embedded RedisServer, if the run started one
    buffer: Any = None  # the driver's ReplayBuffer handle: stats, reconciliation, clear
    learner: Any = None  # placement.LearnerGroup
    pool: Any = None  # placement.WorkerPool
    sync: Any = None  # weights.WeightSync
    started_ray: bool = False
    placement: dict[str, Any] | None = None  # which node each actor runs on (summary.json)

    def start(
        self, resume: bool = False, check_buffer: Callable[[Any], None] | None = None
    ) -> None:
        """Redis (embedded unless buffer.redis_url), an empty buffer for this run (or, with
        `resume`, the one it left, whose stats are first handed to `check_buffer`, which raises
        to refuse it before any actor starts), Ray, the placement check, the learner ranks and the
        rollout workers, ready to run."""
        import ray

        from staleflow.buffer.ports import node_address
        from staleflow.buffer.replay import ReplayBuffer
        from staleflow.buffer.server import RedisServer, redis_dir
        from staleflow.cluster.placement import LearnerGroup, WorkerPool, start_ray, wait_started
        from staleflow.cluster.resources import (
            check_custom_resources,
            cluster_nodes,
            fit,
            run_requests,
        )
        from staleflow.cluster.weights import WeightSync

        cfg, run_id = self.cfg, self.rundir.key
        self.started_ray = not ray.is_initialized() and not self.address
        start_ray(self.address, cfg)
        # refuse now rather than wait forever: custom resources the cluster lacks in total
        # first (the clearer message), then each actor (and ipc's bundle) on some node
        check_custom_resources(cfg, ray.cluster_resources())
        fit(run_requests(cfg), cluster_nodes())
        url = cfg.buffer.redis_url or redis_url_from_env()
        if url is None:
            # On a cluster the workers and the learner may run on other nodes: the embedded
            # server listens on this node's address too (password-protected, as always).
            host = node_address() if self.address else "127.0.0.1"
            server = RedisServer(
                redis_dir(self.rundir.path), persistence=cfg.buffer.persistence, host=host
            )
            self.redis = server.start()
            url = self.redis.url
        else:
            _check_not_loopback(url)
        self.buffer = ReplayBuffer.from_config(cfg.buffer, url, run_id)
        logger.info("buffer: %s", redact(url))
        if resume:
            stats = self.buffer.stats()
            logger.info("resuming with the buffer as left: %d stored, %d pending, %d pushed",
                        stats.length, stats.pending, stats.pushed)  # fmt: skip
            if check_buffer is not None:
                check_buffer(stats)
        else:
            self.buffer.clear()  # a new run starts empty (its key is new: RunDir.key)
        publish_dir = self.publish_dir
        trajectories = self.rundir.trajectories if cfg.run.record_trajectories else None
        learner_dirs, worker_dirs = self._mark_shared_dirs()
        self.learner = LearnerGroup(
            cfg,
            publish_dir=publish_dir,
            redis_url=url,
            run_id=run_id,
            trajectories_dir=os.path.abspath(trajectories) if trajectories else None,
            shared=learner_dirs,
        )
        self.pool = WorkerPool(
            cfg, run_id, url, shared=worker_dirs, strategy=self.learner.worker_strategy()
        )
        timeout = cfg.run.start_timeout_s
        if cfg.rollout.engine == "vllm" and 0 < cfg.rollout.gpus_per_worker < 1:
            # vLLM sizes its KV cache by the GPU memory that frees or fills while it
            # profiles: a learner or another engine loading on the same GPU meanwhile is
            # counted as its own, and its start fails (no memory for the cache blocks, or
            # its profiling assertion; vllm-project/vllm#55827). Roles that may share a
            # GPU start one after another: the learner, then each engine.
            wait_started({"learner ranks": self.learner.ranks}, timeout)
            self.learner.started = True
            for _ in range(cfg.rollout.num_workers):
                wait_started({"rollout workers": [self.pool.add().handle]}, timeout)
        else:
            for _ in range(cfg.rollout.num_workers):
                self.pool.add()
            wait_started(
                {"learner ranks": self.learner.ranks,
                 "rollout workers": [slot.handle for slot in self.pool.slots]},
                timeout,
            )  # fmt: skip
            self.learner.started = True
        self.sync = WeightSync(cfg, self.learner, self.pool)
        self.placement = {
            "learner_nodes": _nodes_of(self.learner.ranks),
            # (a one-rank learner meets no one: rank 0 picks a loopback port of its own)
            "rendezvous": "{}:{}".format(*self.learner.master) if self.learner.master[1] else None,
            "worker_nodes": _nodes_of([slot.handle for slot in self.pool.slots]),
            "driver_node": ray.get_runtime_context().get_node_id(),
            "node_addresses": {
                n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]
            },
            "redis": redact(url).rsplit("@", 1)[-1].split("/", 1)[0],
        }
        logger.info("placement: %s", self.placement)
        logger.info(
            "ray: %d rollout worker(s), %d learner rank(s)",
            len(self.pool.slots),
            cfg.learner.num_ranks,
        )

    def _mark_shared_dirs(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Markers for the directories actors write or read on the driver's behalf (the run
        directory for the learner ranks; with sync.method checkpoint the publish directory
        for them and the workers too), which each checks at start (cluster/storage.py)."""
        from staleflow.buffer.ports import node_address
        from staleflow.cluster.storage import SharedDir

        writer = node_address()
        run = SharedDir.mark(self.rundir.path, "the run directory", writer)
        learner, workers = [run], []
        if self.cfg.sync.method == "checkpoint":
            published = run  # one marker per directory: a second would replace the first's
            if self.publish_dir != run.path:
                published = SharedDir.mark(
                    self.publish_dir, "the weights directory (sync.checkpoint_dir)", writer
                )
                learner.append(published)
            workers.append(published)
        return tuple(learner), tuple(workers)

    @property
    def publish_dir(self) -> str:
        """Where sync.method checkpoint publishes weights (absolute: actors on other nodes,
        or merely in another working directory, get the driver's path)."""
        return os.path.abspath(self.cfg.sync.checkpoint_dir or self.rundir.path / "weights")

    def revive_redis(self) -> bool:
        """Restart the embedded server if it died (same port and password, its append-only
        file replayed; clients reconnect by themselves). True if it was restarted. Without
        persistence there is nothing to replay: RedisServerError (the run cannot go on)."""
        from staleflow.buffer.server import RedisServerError

        server = self.redis
        if server is None or server.process is None or server.process.poll() is None:
            return False
        if not self.cfg.buffer.persistence:
            # Restarted empty, the server would have lost the groups, the counts and the
            # consumer group the run's tally stands on: a lock-step run stalled on it, an
            # async one waited for the lost groups forever.
            raise RedisServerError(
                f"the embedded Redis server died (exit code {server.process.returncode}) and "
                "buffer.persistence is off: the groups, counts and delivery state it held are "
                "lost, so the run cannot go on (buffer.persistence: true keeps them across a "
                "restart)"
            )
        logger.warning("the embedded Redis server died (exit code %s); restarting it from its "
                       "append-only file", server.process.returncode)  # fmt: skip
        server.start()  # a dead process is relaunched on its port
        return True

    def stop(self) -> None:
        """Everything that was started, in reverse; one failure does not stop the rest."""
        import ray

        for what, stop in (
            ("workers", lambda: self.pool and [self.pool.remove(s) for s in list(self.pool.slots)]),
            ("learner", lambda: self.learner and self.learner.kill()),
            ("buffer", lambda: self.buffer and self.buffer.close()),
            ("ray", lambda: ray.shutdown() if self.started_ray else None),
            ("redis", lambda: self.redis and self.redis.stop()),
        ):
            try:
                stop()
            except Exception:
                logger.exception("could not stop the %s", what)


def _nodes_of(handles: list[Any]) -> list[str]:
    """The Ray node id each actor runs on."""
    import ray

    return list(ray.get([h.__ray_call__.remote(_node_id) for h in handles]))


def _node_id(_actor: Any) -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _check_not_loopback(url: str) -> None:
    """Refuse a Redis URL only this machine reaches (a loopback address, a name resolving to
    one here, a unix socket) when the cluster has nodes at other addresses: the workers and
    learner there would each look on their own machine, not at the server."""
    import ray

    from staleflow.buffer.ports import node_address
    from staleflow.configs.loader import ConfigError

    where = _machine_local(url)
    if where is None:
        return
    here = node_address()
    others = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} - {here})
    if others:
        host = f"[{here}]" if ":" in here else here
        raise ConfigError(
            f"the buffer's Redis URL points at {where}, but this cluster has nodes at "
            f"{', '.join(others)} besides the driver's ({here}): workers and learner ranks "
            "there would look for Redis on their own machine. Give buffer.redis_url (or "
            "$STALEFLOW_REDIS_URL) an address every node reaches, e.g. "
            f"redis://:PASSWORD@{host}:PORT, or leave it unset for the embedded server"
        )


def _machine_local(url: str) -> str | None:
    """How `url` names a server only this machine reaches, or None."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"a unix socket ({parts.path})"
    host = parts.hostname or ""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return f"{host}, a loopback address"
        return None
    except ValueError:  # a name: as this machine resolves it
        pass
    try:
        addresses = {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
    except OSError:
        return None  # unresolvable here; each node resolves it itself
    if addresses and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return f"{host}, which resolves to a loopback address here"
    return None


def redis_url_from_env() -> str | None:
    """$STALEFLOW_REDIS_URL when buffer.redis_url is not set; checked like the config key."""
    import os

    from staleflow.configs.schema import redis_url_problem

    # (a value read from a file, a Kubernetes secret's, may end in a newline)
    url = os.environ.get(REDIS_URL_ENV, "").strip() or None
    problem = redis_url_problem(url) if url is not None else None
    if url is not None and problem:
        raise ValueError(
            f"${REDIS_URL_ENV} {problem} (got {redact_url(url)!r}); fix it, or unset it to use "
            "the embedded server"
        )
    return url
