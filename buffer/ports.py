"""Free ports for listeners that bind a moment after they are chosen: the run's Redis (and its
restart on the same port), the learners' rendezvous, a weight-sync group; and this node's
address. Here, in the lowest layer, because the buffer's server needs them and must not import
torch (nor may the Ray task that finds where learner ranks meet: its worker process imports
this module only)."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "meeting_point", "node_address"]


def node_address() -> str:
    """This node's address as Ray knows it (what other nodes reach), else the hostname's."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return socket.gethostbyname(socket.gethostname())


def meeting_point() -> tuple[str, int]:
    """Where learner ranks meet, run as a Ray task in rank 0's bundle: the address of the node
    it runs on and a port free there."""
    return node_address(), free_port()


def free_port(host: str = "") -> int:
    """A port free on this machine now, for a listener that binds it a moment later (Redis, the
    learners' rendezvous, a sync group). Taken below the kernel's ephemeral range when it can
    be: a port from that range can go, in that moment, to any outgoing connection (the
    kernel picks their local ports there), and two full `make test` runs saw rank 0's
    rendezvous fail with EADDRINUSE that way. Above Ray's default worker ports (10002-19999);
    the kernel's choice only if no port there is free."""
    low = _ephemeral_low()
    candidates = list(range(20000, low))
    random.SystemRandom().shuffle(candidates)  # not the global generator a run may seed
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
