"""Data parallelism: two learner ranks (real processes, gloo) make the same update as one."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch.multiprocessing as mp

from staleflow.buffer.ports import free_port
from staleflow.buffer.records import Group, Response
from staleflow.configs import parse_config

from .test_learner import new_learner, sampled_groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CFG = (
    "model: {preset: tiny}\nrollout: {temperature: 0.9}\n"
    "learner: {optimizer: {lr: 1.0e-2, eps: 1.0, grad_clip: 1.0}, "
    "loss: {name: rec-oneside-is}, micro_batch_size: 3}\n"
)


def _leave() -> None:
    """Leave the process group together, then exit: exiting with gloo's threads still
    running can abort the process ('terminate called without an active exception', exit
    -6), which a full `make test` once hit."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    # That was not enough: a full make test at stage 3 aborted the same way after both
    # ranks had written their results. The rank's work is done and on disk, so skip the
    # C++ teardown of whatever library thread is left (the test checks the results, not
    # how a library exits).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _as_rank(rank: int, port: int) -> None:
    """This process as rank `rank` of two (gloo, rank 0 listening on `port`)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip


def _rank(rank: int, port: int, groups: list, out_dir: str) -> None:
    _as_rank(rank, port)
    from staleflow.actors.models import tiny_model
    from staleflow.learner.learner import Learner

    model, tokenizer = tiny_model(0)
    learner = Learner(parse_config(CFG), model=model, tokenizer=tokenizer, rank=rank, world_size=2)
    metrics = learner.step(groups)
    arrays = learner.state_dict_for_sync()
    if rank == 0:
        np.savez(f"{out_dir}/weights.npz", **arrays)
        with open(f"{out_dir}/metrics.json", "w") as f:
            json.dump(metrics, f)
    _leave()


# The ranks' processes are forked from a fork server that imported torch, GPT-2's
# transformers classes and this module once; spawned, each of them spent about 5 CPU-seconds
# on those imports, most of this module's CPU on a 2-core machine. The server is a process of
# its own, started clean (not a fork of pytest, run from the repository's root as pytest is),
# and each rank is still a fresh process with its own gloo group and DeepSpeed engine.
# DeepSpeed is left to each rank: its import detects the accelerator, which on a CUDA build of
# torch would start CUDA in the server before it forks.
_RANKS = mp.get_context("forkserver")
_RANKS.set_forkserver_preload(
    ["torch", "transformers.models.gpt2.modeling_gpt2", "tokenizers",
     "tests.integration.test_learner_ranks"]
)  # fmt: skip


def _run_ranks(target, args: tuple, timeout_s: float = 300) -> list[int | None]:
    """Run `target(rank, port, *args)` as ranks 0 and 1 (processes of their own); their exit
    codes (None: still running at the timeout, e.g. waiting in a collective; then killed)."""
    port = free_port("127.0.0.1")  # below the ephemeral range (see free_port)
    procs = [_RANKS.Process(target=target, args=(r, port, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    return codes


def test_two_ranks_make_the_same_update_as_one(tmp_path):
    groups = sampled_groups(behaviour_seed=2)  # 16 sequences of different lengths
    single = new_learner(parse_config(CFG))
    expected = single.step(groups)
    assert _run_ranks(_rank, (groups, str(tmp_path))) == [0, 0]
    got = json.loads((tmp_path / "metrics.json").read_text())
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    weights = np.load(tmp_path / "weights.npz")
    for name, array in single.state_dict_for_sync().items():
        np.testing.assert_allclose(weights[name], array, rtol=1e-5, atol=1e-7, err_msg=name)


def _sharded_rank(rank: int, port: int, stage: int, data: list, out_dir: str) -> None:
    """Two steps, a checkpoint (every rank writes its optimizer partition), two more steps;
    then a learner built from other weights loads the checkpoint and takes the same two."""

    _as_rank(rank, port)
    from staleflow.actors.models import tiny_model
    from staleflow.learner.learner import Learner

    cfg = parse_config(CFG.replace("learner: {", f"learner: {{zero_stage: {stage}, "))

    def learner(seed: int) -> Learner:
        model, tokenizer = tiny_model(seed)
        return Learner(cfg, model=model, tokenizer=tokenizer, rank=rank, world_size=2)

    first = learner(0)
    for groups in data[:2]:
        first.step(groups)
    first.save(f"{out_dir}/ckpt")
    straight = [first.step(groups)["loss"] for groups in data[2:]]
    resumed = learner(7)  # other initial weights: everything must come from the checkpoint
    resumed.load(f"{out_dir}/ckpt")
    version = resumed.version
    again = [resumed.step(groups)["loss"] for groups in data[2:]]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"straight": straight, "resumed": again, "version": version}, f)
    _leave()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_zero_checkpoint_over_two_ranks_resumes_exactly(tmp_path, stage):
    data = [sampled_groups(behaviour_seed=s, n=2) for s in (1, 2, 3, 4)]
    assert _run_ranks(_sharded_rank, (stage, data, str(tmp_path))) == [0, 0]
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "optimizer-rank0.safetensors" in files
    assert "optimizer-rank1.safetensors" in files
    trainer = json.loads((tmp_path / "ckpt/trainer.json").read_text())
    assert trainer["world_size"] == 2
    assert trainer["sharded"] is True
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["version"] == 2
        assert got["resumed"] == pytest.approx(got["straight"], rel=1e-6, abs=1e-9)


def _save_fails(rank: int, port: int, data: list, out_dir: str, failing: int) -> None:
    _as_rank(rank, port)
    import safetensors.torch

    from staleflow.actors.models import tiny_model
    from staleflow.learner.learner import Learner

    model, tokenizer = tiny_model(0)
    cfg = parse_config(CFG.replace("learner: {", "learner: {zero_stage: 1, "))
    learner = Learner(cfg, model=model, tokenizer=tokenizer, rank=rank, world_size=2)
    learner.step(data[0])
    learner.save(f"{out_dir}/step-000001")  # a complete checkpoint first
    learner.step(data[1])
    if rank == failing == 0:  # no memory for rank 0's copy of the weights

        def no_memory(*args, **kwargs):
            raise MemoryError("no room for a copy of the weights")

        learner.model.state_dict = no_memory
    elif rank == failing:  # its disk fills up as it writes its optimizer partition
        real = safetensors.torch.save_file

        def full_disk(tensors, filename, *args, **kwargs):
            if "optimizer-rank1" in str(filename):
                raise OSError(28, "No space left on device")
            return real(tensors, filename, *args, **kwargs)

        safetensors.torch.save_file = full_disk
    try:
        learner.save(f"{out_dir}/step-000002")
        outcome = "saved"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(f"{out_dir}/rank{rank}.txt", "w") as f:
        f.write(outcome)
    _leave()


@pytest.mark.parametrize("failing", [1, 0])
def test_a_checkpoint_a_rank_fails_to_write_is_not_made(tmp_path, failing):
    # Rank 1 failed writing its optimizer shard; its barrier (in the save's cleanup) met rank
    # 0's after the shard writes, so rank 0 wrote the rest and renamed step-000002 into place
    # without optimizer-rank1, then waited at its own last barrier for rank 1, gone: a damaged
    # checkpoint on disk and a hung rank 0. Now the ranks count failures instead, and a rank
    # failing before the count (rank 0 copying the weights) still reaches it: the first fix
    # left that out, and both ranks waited for ever, one in the count, one in the cleanup.
    data = [sampled_groups(behaviour_seed=s, n=2) for s in (1, 2)]
    args = (data, str(tmp_path), failing)
    assert _run_ranks(_save_fails, args, timeout_s=240) == [0, 0]
    own = (tmp_path / f"rank{failing}.txt").read_text()
    assert own == ("OSError: [Errno 28] No space left on device" if failing else
                   "MemoryError: no room for a copy of the weights")  # fmt: skip
    other = (tmp_path / f"rank{1 - failing}.txt").read_text()
    assert other.startswith("CheckpointError: 1 of 2 learner ranks could not write their part")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-000001"]
    assert "optimizer-rank1.safetensors" in {p.name for p in (tmp_path / "step-000001").iterdir()}


def _group(name: str, prompt_len: int, response_lens: list[int]) -> Group:
    """A group with chosen lengths (token ids and behaviour log-probs made up, rewards
    1, 0, 1, ...), to control how sequences fall on the ranks."""
    rng = np.random.default_rng(len(name) + prompt_len)
    return Group.new(
        run_id="t", prompt_id=name, task="t", worker_id="w", policy_version=0,
        prompt_token_ids=rng.integers(3, 300, prompt_len).tolist(),
        responses=[
            Response(rng.integers(3, 300, n).tolist(), [-2.0] * n, float(j % 2 == 0), "stop")
            for j, n in enumerate(response_lens)
        ],
    )  # fmt: skip


# Token balancing puts the 100-token sequence alone on rank 0 and the five 11-token ones on
# rank 1: at one sequence per micro-batch, 1 pass against 5.
UNEVEN = [_group("long", 10, [90, 1]), _group("a", 10, [1, 1]), _group("b", 10, [1, 1])]
# One sequence for two ranks: rank 1 has none. A lone response has advantage 0, so only the
# entropy term moves the weights (with a gradient over the clip, to check both ranks clip).
LONE = [_group("lone", 6, [5])]


def _uneven_rank(rank: int, port: int, cfg_text: str, groups: list, out_dir: str) -> None:
    _as_rank(rank, port)
    from staleflow.actors.models import tiny_model
    from staleflow.learner.learner import Learner

    model, tokenizer = tiny_model(0)
    learner = Learner(
        parse_config(cfg_text), model=model, tokenizer=tokenizer, rank=rank, world_size=2
    )
    metrics = learner.step(groups)
    np.savez(f"{out_dir}/weights{rank}.npz", **learner.state_dict_for_sync())  # gathers at ZeRO 3
    with open(f"{out_dir}/metrics{rank}.json", "w") as f:
        json.dump(metrics, f)
    _leave()


@pytest.mark.parametrize(
    ("stage", "case"), [(0, "lone"), (2, "uneven"), (3, "uneven"), (3, "lone")]
)
def test_ranks_with_unequal_shards_make_the_same_update_as_one(tmp_path, stage, case):
    groups, extra = (UNEVEN, "") if case == "uneven" else (LONE, "entropy_coef: 0.5, ")
    cfg_text = (
        CFG.replace("micro_batch_size: 3", "micro_batch_size: 1")
        .replace("grad_clip: 1.0", "grad_clip: 1.0e-3")
        .replace("loss: {", "loss: {" + extra)
    )
    single = new_learner(parse_config(cfg_text))
    expected = single.step(groups)
    assert expected["grad_norm"] > 1.0e-3  # clipping changes the update
    sharded = cfg_text.replace("learner: {", f"learner: {{zero_stage: {stage}, ")
    # (a rank waiting in a collective for its peer would hang: None after 120 s)
    assert _run_ranks(_uneven_rank, (sharded, groups, str(tmp_path)), 120) == [0, 0]
    reference = single.state_dict_for_sync()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"metrics{rank}.json").read_text())
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-9)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
        # the batch's metrics, every rank's shard in them (not rank 0's shard alone)
        for key in ("entropy", "clip_frac", "ratio_mean", "approx_kl", "ratio_min", "ratio_max"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-9), key
        weights = np.load(tmp_path / f"weights{rank}.npz")
        for name, array in reference.items():
            np.testing.assert_allclose(
                weights[name], array, rtol=1e-5, atol=1e-7, err_msg=f"rank {rank}: {name}"
            )
