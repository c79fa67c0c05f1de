"""N12: token budgets of continued requests, loss-mask / logprob / token length agreement, no retry of
context-length rejections.

moe_rl has no partial-rollout abort/resume (an in-flight request is never aborted and re-sent with its generated
tokens). The nearest real behaviour is the multi-turn continuation in :class:`moe_rl.runtime.orchestrator.Orchestrator`:
turn ``k`` re-sends prompt + every earlier token and asks for new tokens, under whatever version the engine then
serves. The case's rules, applied to it:

* budget: every continued request asks for the task's per-turn budget ``max_new_tokens`` (never a budget computed
  from a *configured maximum* prompt), so ``len(request prompt) + max_tokens`` never exceeds the task's longest
  sequence (``ChainedAdditionTaskConfig.max_sequence_len``, which ``RLConfig`` checks against the engine's
  ``max_model_len``);
* the sample's loss mask, logprobs and per-token versions have exactly one entry per completion token, the
  versions ``[v1] * turn-1 tokens + [v2] * turn-2 tokens`` after a weight update between turns;
* after a retraction-like event the engine's answer is taken as a whole: a completion of N = 7 tokens carrying
  K + N = 12 logprobs is refused (:class:`moe_rl.inference.VllmClient` and :class:`moe_rl.rl.buffer.Sample`);
* a context-length rejection (HTTP 400) is not retried: the client sends the request once, and the orchestrator
  drops the group (reason ``"error"``) without re-queueing its prompt.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from _fake_engine import FakeCompletion

from moe_rl.envs import ChainedAdditionTask, ChainedAdditionTaskConfig, ChainedProblem, CharTokenizer
from moe_rl.envs.addition import AdditionTask, AdditionTaskConfig
from moe_rl.inference import VllmClient, VllmRequestError
from moe_rl.rl.buffer import Sample
from moe_rl.rl.token_versions import token_versions
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths


class RecordingEngine:
    """Answers every request with ``max_tokens - 1`` digits + ``<eos>`` (the whole budget) and logs each request;
    the weights go to version 2 after the first request (an update between turn 1 and turn 2)."""

    def __init__(self) -> None:
        self.version = 1
        self.log: list[dict] = []

    def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        self.log.append({"prompt_len": len(prompt_ids), "max_tokens": max_tokens, "version": self.version})
        v = self.version
        if len(self.log) == 1:
            self.version = 2

        async def answer():
            ids = [4] * (max_tokens - 1) + [2]
            return [FakeCompletion(ids, [-0.5] * len(ids), version_segments=[(v, 0)]) for _ in range(n)], 0

        return answer()

    async def weight_version(self):
        return self.version


def _orchestrator(tmp_path, task, engine, group_size=1):
    cfg = OrchestratorConfig(batch_size=group_size, group_size=group_size, max_off_policy_steps=2,
                             engine_probe=False)
    return Orchestrator(cfg, task, engine, RunPaths(tmp_path), max_steps=1, seed=0, run_id="n12")


def test_n12_continued_turn_budget_mask_and_versions(tmp_path):
    cfg = ChainedAdditionTaskConfig(num_turns=2, num_digits=1, max_new_tokens=5)
    task = ChainedAdditionTask(cfg, CharTokenizer())
    engine = RecordingEngine()
    orch = _orchestrator(tmp_path, task, engine)
    problem = ChainedProblem(3, 4, (5,))

    async def go():
        orch.buffer.start(0, 1, 1, prompt=problem)
        await orch._rollout(0, problem, 1, 7)

    asyncio.run(go())
    (group,) = orch.buffer.take(1, consume_version=2)
    (s,) = group.samples
    assert [e["max_tokens"] for e in engine.log] == [5, 5]  # each turn: its own budget, never more
    for e in engine.log:
        assert e["prompt_len"] + e["max_tokens"] <= cfg.max_sequence_len()
    env = task.turn_ids(problem, 1)
    n = len(s.completion_ids)
    assert n == 5 + len(env) + 5
    assert len(s.completion_mask) == len(s.completion_logprobs) == n
    assert s.completion_mask == [True] * 5 + [False] * len(env) + [True] * 5
    versions = token_versions(n, group.version_start, s.version_segments)
    model = [v for v, m in zip(versions, s.completion_mask, strict=True) if m]
    assert model == [1] * 5 + [2] * 5


def test_n12_logprobs_must_match_tokens_after_a_retraction():
    with pytest.raises(ValueError, match="7 tokens but completion_logprobs has 12"):
        Sample(prompt_ids=[1], completion_ids=[3] * 7, completion_logprobs=[-0.1] * 12)
    body = {"choices": [{"index": 0, "token_ids": [3] * 7, "finish_reason": "stop",
                         "logprobs": {"tokens": ["token_id:3"] * 7, "token_logprobs": [-0.1] * 12}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 7}}
    client = VllmClient("http://engine:8000", track_token_versions=False)
    client._http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, content=json.dumps(body).encode())),
        base_url="http://engine:8000")
    with pytest.raises(ValueError, match="7 token ids but logprobs"):
        asyncio.run(client.generate([1], n=1, max_tokens=7, temperature=1.0))


CONTEXT_400 = ("This model's maximum context length is 40960 tokens. However, you requested 43778 tokens "
               "(19202 in the messages, 24576 in the completion).")


def test_n12_client_sends_a_context_length_rejection_once():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(400, json={"error": {"message": CONTEXT_400, "code": 400}})

    client = VllmClient("http://engine:8000", track_token_versions=False)
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine:8000")
    with pytest.raises(VllmRequestError) as info:
        asyncio.run(client.generate([1] * 8, n=1, max_tokens=4, temperature=1.0))
    assert info.value.status == 400 and "maximum context length" in str(info.value)
    assert len(calls) == 1


def test_n12_orchestrator_does_not_retry_a_context_length_rejection(tmp_path):
    task = AdditionTask(AdditionTaskConfig(), CharTokenizer())
    sent = []

    class Rejecting:
        async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
            sent.append(list(prompt_ids))
            raise VllmRequestError("/v1/completions", 400, CONTEXT_400)

    orch = _orchestrator(tmp_path, task, Rejecting(), group_size=2)
    problem = task.sample(orch.rng)

    async def go():
        orch.buffer.start(0, 0, 2, prompt=problem)
        await orch._rollout(0, problem, 0, 1)

    asyncio.run(go())
    assert len(sent) == 1
    assert orch.buffer.counters.dropped_by_reason == {"error": 2}
    assert orch.buffer.num_retry_prompts == 0 and orch.buffer.next_retry() is None
    assert orch.state.errors == 1
