"""A process group of its own for weight broadcasts: learner rank 0 and the rollout engines.

The learner ranks already form torch.distributed's default group (DeepSpeed), and the engines
are separate processes that are not in it, so the broadcast group is built directly from a
TCPStore on rank 0's node address and a backend's process group class, outside the default
group: NCCL between GPUs, gloo on CPUs. Rank 0 (the sender) hosts the store; receivers are
ranks 1..N. Every member must open the group at the same time (the driver calls them together),
and a member that never comes fails the others after `timeout_s`, instead of a hang.

    group = SyncGroup.open("nccl", host, port, rank, world_size)
    group.broadcast(tensor)          # in-place on receivers; same shape and dtype everywhere
    group.close()
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from staleflow.buffer.ports import node_address

if TYPE_CHECKING:  # torch is imported where it is used: a driver imports this without it
    import torch

__all__ = [
    "SyncGroup",
    "gloo_on_node_interface",
    "interface_of",
    "ray_place",
]

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0
"""How long closing a group waits for the backend (SyncGroup.close)."""


@dataclass
class SyncGroup:
    backend: str
    rank: int
    world_size: int
    store: Any
    group: Any

    @classmethod
    def open(
        cls,
        backend: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
    ) -> SyncGroup:
        import torch.distributed as dist

        if backend not in ("nccl", "gloo"):
            raise ValueError(f"broadcast backend must be nccl or gloo, got {backend!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True
        )
        if backend == "gloo":
            gloo_on_node_interface()
            group: Any = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        return cls(backend, rank, world_size, store, group)

    @classmethod
    def reopen(
        cls,
        previous: SyncGroup | None,
        backend: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
    ) -> SyncGroup:
        """Close `previous` (a member's old group, when the members changed) and open anew.

        The members changed, often because one was lost: the old group is aborted (`close`),
        which does not wait for the others (every member still there reopens too)."""
        if previous is not None:  # the new group's members wait timeout_s for this one
            previous.close(abort=True, wait_s=min(CLOSE_WAIT_S, timeout_s / 2))
        return cls.open(backend, host, port, rank, world_size, timeout_s)

    @property
    def device(self) -> torch.device:
        """Where broadcast tensors must live for this backend."""
        import torch

        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else (torch.device("cpu"))
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self.group.broadcast([tensor], options).wait()

    def close(self, *, abort: bool = False, wait_s: float = CLOSE_WAIT_S) -> None:
        """Release the group's connections. `abort`: a member is gone, so pending work is
        abandoned (the backend's abort) instead of shut down, which under NCCL waits for every
        member to shut down too and never returns once one has died. Either runs in a thread
        waited for at most `wait_s`; past it the group is left behind with a warning (a leaked
        communicator, not a member stuck forever)."""
        group, self.group, self.store = self.group, None, None
        release = getattr(group, "abort" if abort else "shutdown", None)
        if release is None:
            return

        def run() -> None:
            with contextlib.suppress(RuntimeError):  # already torn down by a failed peer
                release()

        thread = threading.Thread(target=run, name=f"close-{self.backend}-group", daemon=True)
        thread.start()
        thread.join(wait_s)
        if thread.is_alive():
            logger.warning(
                "the old %s broadcast group's %s did not return in %g s; left behind (its "
                "connections are freed when this process ends)",
                self.backend,
                "abort" if abort else "shutdown",
                wait_s,
            )


def ray_place() -> tuple[str, list[str]]:
    """Where Ray put this actor: its node id and the GPU ids it was given ([] for none)."""
    import ray

    context = ray.get_runtime_context()
    gpus = context.get_accelerator_ids().get("GPU", [])
    return str(context.get_node_id()), sorted(str(g) for g in gpus)


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this machine (None if none does)."""
    import psutil

    interfaces = psutil.net_if_addrs()
    for name, addresses in interfaces.items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address == address
               for a in addresses):  # fmt: skip
            return str(name)
    if ipaddress.ip_address(address).is_loopback and "lo" in interfaces:
        return "lo"  # 127.0.1.1 and the like: held by no interface, routed through lo
    return None


def gloo_on_node_interface(address: str | None = None) -> str | None:
    """Make gloo connect through the interface of this node's address (Ray's), unless
    $GLOO_SOCKET_IFNAME already names one; returns the interface used.

    Left alone, gloo advertises the address the machine's hostname resolves to, and many
    hosts map their own name to 127.0.0.1 or 127.0.1.1 (Debian's /etc/hosts): ranks on one
    machine meet anyway, but a peer on another node is told to connect to its own loopback
    and the group never forms (seen on a simulated cluster with one address per node)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    try:
        address = address or node_address()
    except OSError:  # the hostname does not resolve
        return None
    name = interface_of(address)
    if name is None:
        logger.warning(
            "no network interface holds this node's address %s: gloo picks one itself (set "
            "GLOO_SOCKET_IFNAME if its peers cannot connect)", address,
        )  # fmt: skip
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return name
