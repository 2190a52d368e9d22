"""The Hugging Face engine on the tiny model: log-prob agreement, sampling, weight loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from staleflow.actors.engine import SamplingParams
from staleflow.actors.hf_engine import HFEngine
from staleflow.actors.models import tiny_model


@pytest.fixture
def engine() -> HFEngine:
    model, tokenizer = tiny_model(seed=0)
    return HFEngine(model, tokenizer)


def prompts(engine: HFEngine, n: int = 3) -> list[list[int]]:
    texts = ["user: What is 3 + 4?\nassistant:", "user: What is 1 + 1?", "user: What is 9 * 9?\nas"]
    return [engine.tokenizer(t).input_ids for t in texts[:n]]


def teacher_forced_logprobs(engine, prompt, tokens, temperature, top_k=0, top_p=1.0):
    """log mu(token) recomputed from one forward pass over prompt + tokens."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    ids = torch.tensor([list(prompt) + tokens.tolist()])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        logits = TopKLogitsWarper(top_k)(None, logits)
    if top_p < 1.0:
        logits = TopPLogitsWarper(top_p)(None, logits)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.as_tensor(tokens, dtype=torch.long)[:, None]).squeeze(1).numpy()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 1.0), (0.9, 0, 0.8)]
)
def test_behaviour_logprobs_equal_a_teacher_forced_pass(engine, temperature, top_k, top_p):
    params = SamplingParams(temperature, top_p, top_k, max_new_tokens=16, seed=1)
    batch = prompts(engine)
    out = engine.generate(batch, 4, params)
    checked = 0
    for prompt, samples in zip(batch, out, strict=True):
        for c in samples:
            expected = teacher_forced_logprobs(
                engine, prompt, c.token_ids, temperature, top_k, top_p
            )
            np.testing.assert_allclose(c.logprobs, expected, atol=1e-4)
            checked += len(c.token_ids)
    assert checked > 50


def test_left_padding_does_not_change_logprobs(engine):
    # the short prompt alone and batched with a long one give identical greedy continuations
    short, long = prompts(engine, 2)[1], prompts(engine, 1)[0] * 2
    alone = engine.generate([short], 1, SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    padded = engine.generate([long, short], 1, SamplingParams(temperature=0, max_new_tokens=10))
    np.testing.assert_array_equal(alone.token_ids, padded[1][0].token_ids)
    np.testing.assert_allclose(alone.logprobs, padded[1][0].logprobs, atol=1e-4)


def test_k_samples_per_prompt_in_order(engine):
    ps = prompts(engine)
    out = engine.generate(ps, 5, SamplingParams(max_new_tokens=8, seed=0))
    assert [len(samples) for samples in out] == [5, 5, 5]
    distinct = {tuple(c.token_ids) for c in out[0]}
    assert len(distinct) > 1  # sampling at temperature 1 varies
    # row i was sampled from prompt i: its log-probs are the model's given that prompt, and
    # not given another one (the three prompts' texts differ)
    for i, samples in enumerate(out):
        for c in samples:
            for j, prompt in enumerate(ps):
                recomputed = teacher_forced_logprobs(engine, prompt, c.token_ids, 1.0)
                assert np.allclose(c.logprobs, recomputed, atol=1e-4) == (i == j), (i, j)


def test_greedy_is_deterministic(engine):
    params = SamplingParams(temperature=0, max_new_tokens=12)
    first = engine.generate(prompts(engine), 3, params)
    second = engine.generate(prompts(engine), 3, params)
    for a, b in zip(first, second, strict=True):
        assert len({tuple(c.token_ids) for c in a}) == 1
        np.testing.assert_array_equal(a[0].token_ids, b[0].token_ids)


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_new_tokens=10, seed=42)
    a = engine.generate(prompts(engine), 2, params)
    b = engine.generate(prompts(engine), 2, params)
    assert [c.token_ids.tolist() for row in a for c in row] == [
        c.token_ids.tolist() for row in b for c in row
    ]


def test_max_new_tokens_is_honoured(engine):
    out = engine.generate(prompts(engine), 3, SamplingParams(max_new_tokens=5, seed=0))
    for c in (c for row in out for c in row):
        assert len(c.token_ids) <= 5
        assert len(c.logprobs) == len(c.token_ids)
        assert c.finish_reason in ("stop", "length")
        assert c.finish_reason == "stop" or len(c.token_ids) == 5


def test_eos_ends_a_completion_and_is_kept(engine):
    # make eos overwhelmingly likely: the first sampled token is eos, nothing follows it
    with torch.no_grad():
        engine.model.lm_head.weight.zero_()
        engine.model.lm_head.weight[engine.eos_id] = 1.0
        engine.model.transformer.ln_f.bias.fill_(10.0)
    (row,) = engine.generate(prompts(engine, 1), 3, SamplingParams(max_new_tokens=8, seed=0))
    for c in row:
        assert c.token_ids.tolist() == [engine.eos_id]
        assert c.finish_reason == "stop"
        assert c.logprobs[0] > -1e-3  # p(eos) ~ 1


def test_stop_strings_end_generation(engine):
    free = engine.generate(prompts(engine), 4, SamplingParams(max_new_tokens=24, seed=3))
    texts = [c.text for row in free for c in row]
    # pick a character the model actually produces mid-way, and stop on it
    stop = next(t[len(t) // 2] for t in texts if len(t) > 4 and not t[len(t) // 2].isspace())
    stopped = engine.generate(
        prompts(engine), 4, SamplingParams(max_new_tokens=24, seed=3, stop=(stop,))
    )
    hits = 0
    for row in stopped:
        for c in row:
            if stop in c.text:
                hits += 1
                assert c.finish_reason == "stop"
                # nothing after the token that completed the stop string
                shorter = engine.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
                assert stop not in shorter
    assert hits > 0


def test_a_stop_string_is_looked_for_in_the_response_only(engine):
    # The tiny model answers "......" greedily to a prompt ending in "." (token 15). The
    # stop string ".." is first whole in the response at its second token. transformers' own
    # stop strings also matched the prompt's last "." with the first token: the row ended
    # there, and its padding (id 1) was returned as 5 generated tokens, reason "length".
    from staleflow.actors.models import prompt_ids

    (prompt,) = prompt_ids(engine.tokenizer, ["What is 3 + 4? Answer with just the number."],
                           False)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    ((free,),) = engine.generate([prompt], 1, greedy)
    assert free.token_ids.tolist() == [15] * 6  # "......"
    ((c,),) = engine.generate([prompt], 1, SamplingParams(0, max_new_tokens=6, stop=("..",)))
    assert c.token_ids.tolist() == [15, 15]
    assert c.text == ".."
    assert c.finish_reason == "stop"
    np.testing.assert_array_equal(c.logprobs, free.logprobs[:2])


def test_every_end_of_turn_id_of_the_generation_config_ends_a_row():
    # Llama 3 Instruct's turns end with <|eot_id|>, one of the eos ids its generation config
    # lists, not its tokenizer's eos: the engine generated past it to max_new_tokens. Here
    # the tiny model's "." (15) is made an end id: the greedy "......" ends at the first.
    from staleflow.actors.models import prompt_ids

    model, tokenizer = tiny_model(seed=0)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 15]
    engine = HFEngine(model, tokenizer)
    (prompt,) = prompt_ids(tokenizer, ["What is 3 + 4? Answer with just the number."], False)
    ((c,),) = engine.generate([prompt], 1, SamplingParams(temperature=0, max_new_tokens=6))
    assert c.token_ids.tolist() == [15]  # kept, as an eos is
    assert c.finish_reason == "stop"


def test_a_stop_string_that_is_a_special_token_stops_at_that_token(engine):
    # "<|pad|>" (id 1 here; "<|im_end|>" for a chat model) never appears in the text, which
    # is decoded without special tokens, so as a stop string it never stopped anything
    with torch.no_grad():  # make id 1 overwhelmingly likely, as the eos test does
        engine.model.lm_head.weight.zero_()
        engine.model.lm_head.weight[1] = 1.0
        engine.model.transformer.ln_f.bias.fill_(10.0)
    sampling = SamplingParams(max_new_tokens=6, seed=0, stop=("<|pad|>",))
    (row,) = engine.generate(prompts(engine, 1), 2, sampling)
    for c in row:
        assert c.token_ids.tolist() == [1]  # kept, as an eos is
        assert c.finish_reason == "stop"
        assert c.text == ""


def test_stop_strings_are_looked_for_only_after_a_token_that_can_end_one(engine):
    # the plan: text stop strings, token ids, and the ids whose own text holds a stop
    # string's last character (or part of one): the steps in between decode nothing
    texts, ids, candidates = engine._stop_plan(("ab", "<|pad|>"))
    assert (texts, ids) == (("ab",), [1])
    pieces = {
        i: engine.tokenizer.decode([i], skip_special_tokens=True)
        for i in range(len(engine.tokenizer))
    }
    assert candidates == {i for i, p in pieces.items() if "b" in p or "\ufffd" in p}
    assert engine._stop_plan(("ab", "<|pad|>"))[2] is candidates  # made once


def test_load_weights_changes_outputs_and_version(engine):
    # (a random tiny GPT-2 decodes greedily by repeating its last input token whatever its
    # weights, so compare the sampled tokens and their log-probs)
    params = SamplingParams(max_new_tokens=8, seed=5)

    def run(e: HFEngine) -> list[tuple[list[int], list[float]]]:
        out = e.generate(prompts(engine), 2, params)
        return [(c.token_ids.tolist(), np.round(c.logprobs, 4).tolist()) for r in out for c in r]

    before = run(engine)
    other, _ = tiny_model(seed=1)
    arrays = {name: t.detach().numpy() for name, t in other.state_dict().items()}
    engine.load_weights(arrays, version=3)
    after = run(engine)
    assert engine.version == 3
    assert before != after
    assert after == run(HFEngine(other, engine.tokenizer))


def test_bfloat16_arrives_as_int16_views(engine):
    name = "transformer.wte.weight"
    target = engine.model.state_dict()[name]
    new = torch.randn_like(target).to(torch.bfloat16)
    engine.load_weights({name: new.view(torch.int16).numpy()}, version=1)
    torch.testing.assert_close(engine.model.state_dict()[name], new.float())


def test_load_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(KeyError, match="unknown parameter 'nope'"):
        engine.load_weights({"nope": np.zeros(3, np.float32)}, version=1)
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        engine.load_weights({"transformer.wte.weight": np.zeros(3, np.float32)}, version=1)
    assert engine.version == 0


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
