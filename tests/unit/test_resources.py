"""Placement before anything starts: what fits a cluster, and the refusals' messages."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from staleflow.cluster.resources import (
    ActorRequest,
    NodeCapacity,
    PlacementError,
    check_colocated,
    check_sync_method,
    fit,
    ipc_bundle,
    run_requests,
)
from staleflow.configs import load_config, parse_config

BASE = "model: {preset: tiny}\ntask: {name: digits, chat_template: false}\n"


def cfg(*overrides: str):
    return parse_config(BASE, list(overrides))


def test_requests_take_the_learners_share_from_its_own_setting():
    requests = run_requests(
        cfg("rollout.num_workers=2", "rollout.gpus_per_worker=0.25", "learner.gpus_per_rank=0.5")
    )
    assert [(r.role, r.cpus, r.gpus) for r in requests] == [
        ("learner rank 0", 1.0, 0.5),
        ("rollout worker 0", 1.0, 0.25),
        ("rollout worker 1", 1.0, 0.25),
    ]
    # a CPU learner stays at 0 GPU whatever the workers ask (it used to take a whole GPU)
    assert run_requests(cfg("rollout.gpus_per_worker=1"))[0].gpus == 0.0


def test_colocated_shares_fit_one_gpu():
    one_gpu = [NodeCapacity.of("127.0.0.1", cpus=16, gpus=1)]
    # 0.5 + 0.25 + 0.25 = 1 GPU: learner and both workers share it
    fit(run_requests(cfg("rollout.gpus_per_worker=0.25", "learner.gpus_per_rank=0.5")), one_gpu)


def test_the_one_gpu_hang_is_refused_with_what_was_asked_and_what_there_is():
    # the reported hang: workers at 0.5 GPU each plus a learner at 1 GPU on a 1-GPU machine
    one_gpu = [NodeCapacity.of("10.0.0.5", cpus=16, gpus=1)]
    run = cfg("rollout.num_workers=1", "rollout.gpus_per_worker=0.5", "learner.gpus_per_rank=1")
    with pytest.raises(PlacementError) as err:
        fit(run_requests(run), one_gpu)
    message = str(err.value)
    assert "rollout worker 0 (1 CPU, 0.5 GPU) fits on no node" in message
    assert "1 x learner rank (1 CPU, 1 GPU each); 1 x rollout worker (1 CPU, 0.5 GPU each)" in (
        message
    )
    assert "= 2 CPU, 1.5 GPU; the cluster has 10.0.0.5: 16 CPU, 1 GPU" in message
    assert "must add up to at most 1" in message


def test_fractions_never_span_two_gpus():
    # 0.6 + 0.6 on two GPUs: one each (0.4 free on each, not 0.8 anywhere)
    node = NodeCapacity.of("n", cpus=8, gpus=2)
    fit([ActorRequest("a", 1, 0.6), ActorRequest("b", 1, 0.6)], [node])
    with pytest.raises(PlacementError, match=r"c .* fits on no node"):
        fit([ActorRequest(r, 1, 0.6) for r in "abc"], [node])


def test_whole_gpus_and_cpus_are_counted_per_node():
    nodes = [NodeCapacity.of("a", cpus=2, gpus=2), NodeCapacity.of("b", cpus=2, gpus=2)]
    fit([ActorRequest("x", 1, 2), ActorRequest("y", 1, 2)], nodes)  # one node each
    with pytest.raises(PlacementError, match=r"z .3 CPU, 0 GPU. fits on no node"):
        fit([ActorRequest("z", 3, 0)], nodes)  # 4 CPUs in all, but 2 per node
    with pytest.raises(PlacementError, match=r"lower rollout\.num_workers"):
        fit([ActorRequest("z", 3, 0)], nodes)
    with pytest.raises(PlacementError, match="the cluster has no nodes"):
        fit([ActorRequest("z", 1, 0)], [])


def test_nccl_is_refused_where_it_cannot_work():
    gpus = ("learner.gpus_per_rank=1", "rollout.gpus_per_worker=1", "sync.method=nccl")
    check_sync_method(cfg(*gpus))  # separate whole GPUs: fine
    with pytest.raises(PlacementError, match="NCCL cannot join two ranks on one GPU"):
        check_sync_method(cfg("learner.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5",
                              "sync.method=nccl"))  # fmt: skip
    with pytest.raises(PlacementError, match=r"got 0 and 0\).*sync.method: gloo for CPU roles"):
        check_sync_method(cfg("sync.method=nccl"))
    with pytest.raises(PlacementError, match=r"sync\.offset=1 runs batches on versions older"):
        check_sync_method(cfg(*gpus, "sync.offset=1"))
    with pytest.raises(PlacementError, match=r"eval_every \(10\) must be a multiple of sync.int"):
        check_sync_method(cfg(*gpus, "sync.interval=4"))
    check_sync_method(cfg(*gpus, "sync.interval=5"))  # eval every 10 = every second sync
    check_sync_method(cfg(*gpus, "sync.interval=4", "sync.mode=async"))  # async: no schedule


def test_gloo_is_for_cpu_roles():
    check_sync_method(cfg("sync.method=gloo"))
    with pytest.raises(PlacementError, match="gloo broadcasts from CPU memory"):
        check_sync_method(cfg("sync.method=gloo", "rollout.gpus_per_worker=1"))


REPO = Path(__file__).resolve().parents[2]
RUN_CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "sweeps" not in p.parts)


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_shipped_config_passes_its_own_sync_check(path):
    check_sync_method(load_config(path))


def test_gpu_quickstart_fits_one_gpu_colocated_and_nothing_without_one():
    cfg = load_config(REPO / "configs" / "quickstart-gpu.yaml")
    assert cfg.rollout.engine == "vllm"
    assert cfg.rollout.vllm.multiprocessing  # vLLM's default mode
    fit(run_requests(cfg), [NodeCapacity.of("gpu-box", cpus=16, gpus=1)])
    with pytest.raises(PlacementError, match="the cluster has laptop: 8 CPU, 0 GPU"):
        fit(run_requests(cfg), [NodeCapacity.of("laptop", cpus=8, gpus=0)])


def test_ipc_needs_the_roles_on_the_learners_device():
    check_sync_method(cfg("sync.method=ipc"))  # CPU roles: files in /dev/shm
    share = ("learner.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.25", "sync.method=ipc")
    check_sync_method(cfg(*share))  # fractions of one GPU: CUDA IPC
    for learner, worker in ((1, 0.5), (0.5, 1), (0.5, 0), (0, 0.5)):
        shares = (f"learner.gpus_per_rank={learner}", f"rollout.gpus_per_worker={worker}")
        with pytest.raises(PlacementError, match=rf"fractions of one GPU .* got {learner:g} and"):
            check_sync_method(cfg(*shares, "sync.method=ipc"))
    # it keeps every version still needed, as ray does: no broadcast's schedule limits
    check_sync_method(cfg(*share, "sync.offset=1"))
    check_sync_method(cfg(*share, "sync.interval=4"))


def test_ipc_refuses_a_worker_off_the_learners_gpu_naming_where_each_is():
    learner = ("a" * 40, ["0"])
    check_colocated(learner, {"rollout worker 0": ("a" * 40, ["0"])})
    with pytest.raises(PlacementError) as err:
        check_colocated(learner, {"rollout worker 0": ("a" * 40, ["0"]),
                                  "rollout worker 1": ("a" * 40, ["1"]),
                                  "rollout worker 2": ("b" * 40, ["0"])})  # fmt: skip
    message = str(err.value)
    assert "learner rank 0's node and GPU (node aaaaaaaaaaaa, GPU ['0'])" in message
    assert "rollout worker 1 on node aaaaaaaaaaaa GPU ['1']" in message
    assert "rollout worker 2 on node bbbbbbbbbbbb GPU ['0']" in message
    assert "rollout worker 0" not in message
    assert "hide the others: CUDA_VISIBLE_DEVICES), or use sync.method: nccl or ray" in message
    # CPU roles: the node must match, and the fix is another
    with pytest.raises(PlacementError, match=r"GPU none.*Run on one node .*method: gloo or ray"):
        check_colocated(("a" * 40, []), {"rollout worker 0": ("b" * 40, [])})


def test_ipc_places_learner_rank_0_and_its_workers_as_one_request():
    run = cfg("sync.method=ipc", "rollout.num_workers=2", "learner.num_ranks=2")
    requests = run_requests(run)
    # rank 0's placement-group bundle holds its own CPU and each worker's: 1 + 2 x 1 = 3
    assert [(r.role, r.cpus, r.gpus) for r in requests] == [
        ("learner rank 0 with rollout workers 0-1", 3.0, 0.0),
        ("learner rank 1", 1.0, 0.0),
    ]
    # 4 CPUs in all, but no node has the 3 that rank 0's bundle needs
    two_nodes = [NodeCapacity.of("10.0.0.1", 2, 0), NodeCapacity.of("10.0.0.2", 2, 0)]
    with pytest.raises(PlacementError) as err:
        fit(requests, two_nodes)
    message = str(err.value)
    assert "learner rank 0 with rollout workers 0-1 (3 CPU, 0 GPU) fits on no node" in message
    assert "1 x learner rank 0 with its rollout workers (sync.method: ipc)" in message
    assert "in one placement group bundle, so they need one node: lower rollout" in message
    assert message.endswith("or use sync.method: ray.")
    fit(requests, [NodeCapacity.of("10.0.0.1", 4, 0)])  # 3 + 1 on one node of 4
    # any other method places each actor on its own
    assert len(run_requests(cfg("rollout.num_workers=2", "learner.num_ranks=2"))) == 4


def test_ipc_gpu_shares_must_add_up_to_one_gpu():
    ok = cfg(
        "sync.method=ipc", "learner.gpus_per_rank=0.5",
        "rollout.num_workers=2", "rollout.gpus_per_worker=0.25",
    )  # fmt: skip
    check_sync_method(ok)
    [bundle] = run_requests(ok)
    assert (bundle.cpus, bundle.gpus) == (3.0, 1.0)  # 1 + 2 x 1 CPU; 0.5 + 2 x 0.25 GPU
    fit([bundle], [NodeCapacity.of("gpu-node", 8, 1)])
    # 0.5 + 2 x 0.5 = 1.5: each share is below 1, the three together are not
    too_much = cfg(
        "sync.method=ipc", "learner.gpus_per_rank=0.5",
        "rollout.num_workers=2", "rollout.gpus_per_worker=0.5",
    )  # fmt: skip
    with pytest.raises(PlacementError, match=r"= 0.5 \+ 2 x 0.5 = 1.5 > 1\. Lower the shares"):
        check_sync_method(too_much)


def test_the_ipc_bundle_adds_every_workers_resources_to_rank_0s():
    run = cfg(
        "sync.method=ipc", "learner.gpus_per_rank=0.5", "rollout.num_workers=3",
        "rollout.cpus_per_worker=2", "rollout.gpus_per_worker=0.1", "rollout.resources={accel: 1}",
    )  # fmt: skip
    bundle = ipc_bundle({"CPU": 1.0, "GPU": 0.5}, run.rollout)
    # CPU 1 + 3 x 2 = 7; GPU 0.5 + 3 x 0.1 = 0.8; accel 3 x 1 = 3
    assert bundle == {"CPU": 7.0, "GPU": pytest.approx(0.8), "accel": 3.0}


def test_custom_resources_are_placed_node_by_node_and_ipc_needs_them_on_one():
    # the README's recipe: learner ranks on a node labelled "learner", workers on "rollout"
    labels = ['learner.resources={"learner": 1}', 'rollout.resources={"rollout": 1}']
    nodes = [
        NodeCapacity.of("10.0.0.1", 8, 0, {"learner": 1}),
        NodeCapacity.of("10.0.0.2", 8, 0, {"rollout": 2}),
    ]
    fit(run_requests(cfg(*labels, "rollout.num_workers=2")), nodes)  # each on its own node
    # a third worker finds no 'rollout' left (2 on the only node that has it)
    with pytest.raises(PlacementError, match=r"rollout worker 2 \(1 CPU, 0 GPU, 1 'rollout'\)"):
        fit(run_requests(cfg(*labels, "rollout.num_workers=3")), nodes)
    # ipc puts rank 0 and both workers in one bundle: 1 'learner' + 2 x 1 'rollout' on one
    # node, which neither has (Ray would wait for it forever)
    run = cfg(*labels, "rollout.num_workers=2", "sync.method=ipc")
    with pytest.raises(PlacementError) as err:
        fit(run_requests(run), nodes)
    message = str(err.value)
    assert "rollout workers 0-1 (3 CPU, 0 GPU, 1 'learner', 2 'rollout') fits on no node" in (
        message
    )
    assert "10.0.0.1: 8 CPU, 0 GPU, 1 'learner', 0 'rollout'" in message
    assert "with learner.resources and rollout.resources together" in message
    both = [NodeCapacity.of("10.0.0.3", 8, 0, {"learner": 1, "rollout": 2})]
    fit(run_requests(run), both)


def test_ipc_shares_that_add_up_to_one_gpu_fit_despite_rounding():
    # 0.2 + 16 x 0.05 is 1 GPU; summed one share at a time it came to 1.0000000000000002,
    # which fit() took for a request of two whole GPUs and refused
    run = cfg(
        "sync.method=ipc", "learner.gpus_per_rank=0.2",
        "rollout.num_workers=16", "rollout.gpus_per_worker=0.05", "rollout.cpus_per_worker=0.5",
    )  # fmt: skip
    check_sync_method(run)
    [bundle] = run_requests(run)
    assert bundle.role == "learner rank 0 with rollout workers 0-15"
    fit([bundle], [NodeCapacity.of("gpu-node", 16, 1)])
    one = cfg("sync.method=ipc", "learner.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5",
              "rollout.num_workers=1")  # fmt: skip
    assert run_requests(one)[0].role == "learner rank 0 with rollout worker 0"


@pytest.mark.parametrize(
    "error",
    [ConnectionError("Could not find any running Ray instance. Please specify the one to "
                     "connect to by setting `--address` flag or `RAY_ADDRESS` env var."),
     ValueError("Ray Client requires pip package `ray[client]`.")],
)  # fmt: skip
def test_an_address_ray_cannot_join_is_one_clear_error(monkeypatch, error):
    # ray.init's own error, injected (no cluster needs to be missing for real): it escaped
    # `staleflow train --address ...` as a traceback
    import ray

    from staleflow.cluster.failures import ClusterUnreachable
    from staleflow.cluster.placement import start_ray

    def refuse(**_kwargs):
        raise error

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with socket.create_server(("127.0.0.1", 0)) as listening:  # something is there
        address = f"ray://127.0.0.1:{listening.getsockname()[1]}"
        with pytest.raises(ClusterUnreachable) as raised:
            start_ray(address)
    message = str(raised.value)
    assert message.startswith(f"cannot join the Ray cluster at --address {address}: ")
    assert str(error).rstrip(".") in message
    assert "ray start --head" in message


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_an_address_where_nothing_listens_is_refused_before_ray_init(monkeypatch, scheme):
    # ray.init retries a GCS address with nothing behind it for minutes; the driver tries
    # one TCP connection first (to the port and, for a loopback host, this node's address,
    # which ray.init would use instead) and refuses at once
    import ray

    from staleflow.buffer.ports import free_port
    from staleflow.cluster.failures import ClusterUnreachable
    from staleflow.cluster.placement import start_ray

    called = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: called.append(kwargs))
    port = free_port("127.0.0.1")
    with pytest.raises(ClusterUnreachable) as raised:
        start_ray(f"{scheme}127.0.0.1:{port}")
    assert called == []
    message = str(raised.value)
    assert f"nothing accepts connections at 127.0.0.1:{port} (Connection refused)" in message
    assert "ray start --head" in message
    # with something listening, the address goes on to ray.init
    with socket.create_server(("127.0.0.1", 0)) as listening:
        start_ray(f"{scheme}127.0.0.1:{listening.getsockname()[1]}")
    assert len(called) == 1


def _serve_once(
    reply: bytes, host: str = "127.0.0.1", port: int = 0
) -> tuple[socket.socket, list[bytes]]:
    """A listening socket whose first connection gets `reply` after the client's first
    bytes arrive (what it received is recorded)."""
    import threading

    listening = socket.create_server((host, port))
    received: list[bytes] = []

    def answer() -> None:
        conn, _ = listening.accept()
        with conn:
            received.append(conn.recv(64))
            conn.sendall(reply)
            conn.recv(64)  # until the client closes

    threading.Thread(target=answer, daemon=True).start()
    return listening, received


@pytest.mark.parametrize(
    ("reply", "kind"),
    [(b"HTTP/1.0 400 Bad Request\r\nServer: Python\r\n\r\n", "an HTTP/1 server"),
     (b"-ERR unknown command 'PRI', with args beginning with: '*'\r\n", "a Redis server"),
     (b"<!DOCTYPE HTML>\n<html lang=en>\n", "an HTTP/1 server"),  # Python's http.server
     (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP/2 server")],
)  # fmt: skip
def test_an_address_that_answers_in_another_protocol_is_refused_before_ray_init(
    monkeypatch, reply, kind
):
    # e.g. the dashboard's port, or a Redis: ray.init would try it for minutes. The driver
    # opens HTTP/2 as gRPC does; a reply that is not HTTP/2 is refused at once, quoted
    import ray

    from staleflow.cluster.failures import ClusterUnreachable
    from staleflow.cluster.placement import start_ray

    called = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: called.append(kwargs))
    listening, received = _serve_once(reply)
    with listening:
        port = listening.getsockname()[1]
        with pytest.raises(ClusterUnreachable) as raised:
            start_ray(f"127.0.0.1:{port}")
    assert called == []
    assert received[0].startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    message = str(raised.value)
    first = reply.splitlines()[0].decode()
    assert f"127.0.0.1:{port} answers, but not as Ray: its reply begins {first!r}" in message
    assert kind in message
    assert "6379 by default" in message


def test_an_address_that_answers_in_http2_goes_on_to_ray_init(monkeypatch):
    # A gRPC server's first frame: SETTINGS (type 4) on stream 0, here with one setting
    import ray

    from staleflow.cluster.placement import start_ray

    called = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: called.append(kwargs))
    settings = bytes([0, 0, 6, 4, 0, 0, 0, 0, 0]) + bytes([0, 3, 0, 0, 0, 100])
    listening, _ = _serve_once(settings)
    with listening:
        start_ray(f"127.0.0.1:{listening.getsockname()[1]}")
    assert len(called) == 1


def test_a_loopback_address_passes_if_this_nodes_address_answers_as_ray(monkeypatch):
    # ray.init joins this node's address for 127.0.0.1: a Redis on 127.0.0.1 and Ray's GCS on
    # the node's address, both on one port, must not be refused
    import ray

    from staleflow.cluster.placement import start_ray

    node = ray.util.get_node_ip_address()
    if node.startswith("127."):
        pytest.skip("this machine's node address is a loopback one")
    called = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: called.append(kwargs))
    settings = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
    gcs, _ = _serve_once(settings, host=node)
    port = gcs.getsockname()[1]
    redis_like, _ = _serve_once(b"-ERR unknown command 'PRI'\r\n", port=port)
    with gcs, redis_like:
        start_ray(f"127.0.0.1:{port}")
    assert len(called) == 1


def test_spread_ranks_with_a_gpu_share_each_need_a_node_of_their_own():
    # Two ranks at 0.5 GPU each, spread: Ray's SPREAD is best effort and gives fractional
    # shares from the first GPU with room, so on one node both landed on GPU 0, and NCCL
    # refused the duplicate GPU after the model loaded. They now need two nodes.
    run = cfg("learner.num_ranks=2", "learner.gpus_per_rank=0.5", "learner.placement=spread")
    one_node = [NodeCapacity.of("10.0.0.5", cpus=16, gpus=2)]
    with pytest.raises(PlacementError) as err:
        fit(run_requests(run), one_node)
    assert "learner rank 1 (1 CPU, 0.5 GPU) fits on no node" in str(err.value)
    assert "puts each learner rank on a node of its own" in str(err.value)
    fit(run_requests(run), [NodeCapacity.of(f"10.0.0.{i}", cpus=16, gpus=1) for i in (5, 6)])
    # whole GPUs, or packed (refused by the config for shares), or one rank: no such rule
    whole = cfg("learner.num_ranks=2", "learner.gpus_per_rank=1", "learner.placement=spread")
    fit(run_requests(whole), one_node)
    assert {r.apart for r in run_requests(whole)} == {""}


def test_the_strict_spread_rule_holds_for_the_ipc_bundle_too():
    spread = ("learner.num_ranks=2", "learner.gpus_per_rank=0.5", "learner.placement=spread")
    run = cfg(*spread, "sync.method=ipc", "rollout.num_workers=1", "rollout.gpus_per_worker=0.5")
    requests = run_requests(run)
    assert [(r.role, r.gpus, r.apart) for r in requests] == [
        ("learner rank 0 with rollout worker 0", 1.0, "learner ranks"),
        ("learner rank 1", 0.5, "learner ranks"),
    ]
    with pytest.raises(PlacementError, match="on a node of its own"):
        fit(requests, [NodeCapacity.of("n", cpus=16, gpus=2)])
    fit(requests, [NodeCapacity.of(n, cpus=16, gpus=1) for n in "ab"])


def test_the_driver_and_the_learners_meeting_task_import_no_torch():
    # A run's driver process and the Ray task that finds where learner ranks meet used to
    # import torch (1.7 s) and, the driver, everything behind the learner rank's module: a
    # tiny run's driver took 4.5 CPU-s, 2.0 after (bench/run_cpu.py). Only the actors need it.
    import subprocess
    import sys

    heavy = ("torch", "transformers", "deepspeed")
    for modules in (
        ["staleflow.cluster.cli", "staleflow.cluster.driver", "staleflow.cluster.services",
         "staleflow.cluster.placement", "staleflow.cluster.learner_rank"],
        ["staleflow.buffer.ports"],  # what the meeting task's worker process imports
    ):  # fmt: skip
        code = f"import sys, {', '.join(modules)}; print([m for m in {heavy} if m in sys.modules])"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "[]", (modules, out.stdout)
