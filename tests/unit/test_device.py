"""Which device a role runs on follows its GPU share, never what the machine has."""

from __future__ import annotations

import pytest
import torch

from staleflow.configs import ConfigError, parse_config
from staleflow.learner.batch import build_batch
from staleflow.learner.device import DeviceError, hidden_gpus_env, role_device

BASE = "model: {preset: tiny}\ntask: {name: digits, chat_template: false}\n"


def test_no_share_means_cpu_and_no_visible_gpu():
    assert role_device(0.0, "learner.gpus_per_rank") == torch.device("cpu")
    assert hidden_gpus_env(0.0) == {"CUDA_VISIBLE_DEVICES": ""}
    assert hidden_gpus_env(0.5) == {}  # Ray sets it to the GPU it assigned


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine w/o GPU")
def test_a_share_without_a_visible_gpu_is_refused_not_run_on_the_cpu():
    with pytest.raises(DeviceError, match=r"rollout.gpus_per_worker=0.5 asks for a GPU.*"
                       r"set rollout.gpus_per_worker=0 to run this role on the CPU"):  # fmt: skip
        role_device(0.5, "rollout.gpus_per_worker")


def test_a_gpu_share_is_at_most_one_gpu_and_ranks_do_not_share_one():
    # a rank or an engine runs on cuda:0 of what Ray gives it: a share of 2 held a GPU idle
    cfg = parse_config(BASE, ["learner.gpus_per_rank=1", "rollout.gpus_per_worker=0.25"])
    assert (cfg.learner.gpus_per_rank, cfg.rollout.gpus_per_worker) == (1.0, 0.25)
    for key, share in (("learner.gpus_per_rank", "2"), ("rollout.gpus_per_worker", "1.5")):
        with pytest.raises(ConfigError, match=rf"{key}={share}: a learner rank or a rollout "
                           "engine runs on one GPU"):  # fmt: skip
            parse_config(BASE, [f"{key}={share}"])
    # two ranks on halves of one GPU: NCCL refused them only once the models had loaded
    with pytest.raises(ConfigError, match=r"2 ranks with a share of 0\.5 GPU each, packed"):
        parse_config(BASE, ["learner.num_ranks=2", "learner.gpus_per_rank=0.5"])
    for ok in (["learner.gpus_per_rank=1"], ["learner.gpus_per_rank=0.5",
                                              "learner.placement=spread"]):  # fmt: skip
        cfg = parse_config(BASE, ["learner.num_ranks=2", *ok])  # a GPU each (spread: a node)
        assert cfg.learner.num_ranks == 2


def test_vllm_engine_arguments_are_checked():
    cfg = parse_config(BASE, ["rollout.vllm.gpu_memory_utilization=0.3",
                              "rollout.vllm.enforce_eager=true"])  # fmt: skip
    assert cfg.rollout.vllm.gpu_memory_utilization == 0.3
    assert cfg.rollout.vllm.enforce_eager
    assert cfg.rollout.vllm.multiprocessing  # vLLM's default mode is the default here too
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        parse_config(BASE, ["rollout.vllm.gpu_memory_utilization=1.5"])


def test_a_batch_moves_every_tensor_to_the_models_device():
    import numpy as np

    from staleflow.buffer.records import Group, Response

    responses = [
        Response(np.array([5, 6], np.int32), np.array([-0.1, -0.2], np.float32), r, "stop", {})
        for r in (0.0, 1.0)
    ]
    group = Group.new(run_id="r", prompt_id="p", task="t", prompt_token_ids=[1, 2, 3],
                      responses=responses, policy_version=0, worker_id="w")  # fmt: skip
    from staleflow.configs.losses import AdvantageConfig

    batch = build_batch([group], AdvantageConfig(), pad_id=0)
    moved = batch.to("meta")  # a device other than the CPU that every machine has
    for name in ("input_ids", "attention_mask", "response_mask", "behavior_logp", "advantages",
                 "group_index"):  # fmt: skip
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).shape == getattr(batch, name).shape
    assert moved.policy_versions == batch.policy_versions == [0]
