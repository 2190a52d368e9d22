"""vLLM's request outputs as the engine's completions (actors.vllm_engine.completions_of).

The outputs are stand-ins shaped as vLLM 0.25's RequestOutput / CompletionOutput (vLLM is
not in this environment; tests/vllm_cpu runs the real engine): `outputs`, and per response
`token_ids`, `logprobs` (one {token id: Logprob} per step, the sampled token among them),
`finish_reason` and `text`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from staleflow.actors.vllm_engine import completions_of


def response(tokens, logprobs, reason, text="x"):
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)]
    return SimpleNamespace(token_ids=tokens, logprobs=steps, finish_reason=reason, text=text)


def test_responses_keep_their_tokens_log_probs_and_reasons_in_order():
    outputs = [
        SimpleNamespace(outputs=[response([5, 6], [-0.5, -1.25], "stop"),
                                 response([7], [-2.0], "length")]),
        SimpleNamespace(outputs=[response([8, 9, 2], [-0.25, -0.5, -4.0], "repetition"),
                                 response([], [], "abort")]),
    ]  # fmt: skip
    rows = completions_of(outputs)
    assert [[c.finish_reason for c in row] for row in rows] == [
        ["stop", "length"],
        ["stop", "abort"],  # vLLM's repetition detector ended it: a stop of its own
    ]
    assert rows[0][0].token_ids.tolist() == [5, 6]
    assert rows[0][0].logprobs.tolist() == [-0.5, -1.25]
    assert rows[1][0].logprobs.tolist() == [-0.25, -0.5, -4.0]
    assert len(rows[1][1].token_ids) == 0


@pytest.mark.parametrize("reason", ["error", "something_new", None])
def test_a_response_vllm_ended_with_an_error_fails_the_batch(reason):
    # "error" was taken as "stop": a request vLLM failed internally was scored and trained
    # on as a response that ended by itself.
    outputs = [
        SimpleNamespace(outputs=[response([5], [-0.5], "stop")]),
        SimpleNamespace(outputs=[response([5], [-0.5], "stop"), response([6], [-1.0], reason)]),
    ]
    with pytest.raises(RuntimeError, match=rf"response 1 of prompt 1 of the batch with finish "
                       rf"reason {reason!r}.*not trained on"):  # fmt: skip
        completions_of(outputs)
