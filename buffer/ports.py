"""Free ports for listeners that bind a moment after they are chosen: the run's Redis (and its
restart on the same port), the learners' rendezvous, a weight-sync group. Here, in the lowest
layer, because the buffer's server needs it and must not import torch."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]


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
