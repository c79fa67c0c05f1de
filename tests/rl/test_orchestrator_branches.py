"""Agentic episodes whose model calls form several trajectories by token prefix, through the orchestrator (no vLLM):
a chat template that re-renders history (strips past ``<think>`` blocks) and a rollback. Every trainable branch is
one sample with exact tokens, loss mask, engine log-probs, per-token versions and routed-expert rows; every branch
carries its episode's reward and the group baseline is over episodes; the rollout accounting stays exact.

The fake engine routes causally (a token's row depends only on the tokens up to it, as a real forward pass) and
returns rows only for the tokens its prefix cache did not hold, so a sample's rows are complete only if they are
stitched from its own calls and the prefix it shares with an earlier sample; the expected record of any sample is
the routing function over its own tokens (last row a placeholder). Rewards are dyadic: advantages compare with
``==``."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from _fake_engine import FakeCompletion, finish_step, publish_folder_version

from moe_rl.envs import CharTokenizer, Environment, EpisodeResult, ModelRequest, SamplingParams
from moe_rl.replay import RoutedExperts
from moe_rl.rl.batch import batch_path, build_batch, read_batch
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths

E, LAYERS, K = 8, 2, 2
THINK, END_THINK, ENV, ALT = 40, 41, 30, 31
PROMPT = (1, 5, 6, 7)


def route(prefix: list[int]) -> list[list[int]]:
    """``[LAYERS, K]`` distinct expert ids of the token closing ``prefix`` (a function of the whole prefix)."""
    seed = sum((i + 1) * 31 * t for i, t in enumerate(prefix)) % 10007
    return [[(seed + layer) % E, (seed + layer + 1 + seed % (E - 1)) % E] for layer in range(LAYERS)]


def expected_rows(tokens: list[int]) -> np.ndarray:
    rows = [route(tokens[: t + 1]) for t in range(len(tokens) - 1)] + [[[-1] * K] * LAYERS]
    return np.array(rows, dtype=np.int64)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class ThinkEngine:
    """Completions ``<think> x </think> y <eos>`` (``y`` distinct per request and choice), log-probs distinct per
    token, version segments of the version served when the request arrived, and routed rows for the positions its
    prefix cache (every earlier request's forwarded tokens) did not hold. ``bump_after``: request index -> version
    served once it has returned (a weight update between turns)."""

    def __init__(self, bump_after=None, on_version=None):
        self.version = 0
        self.bump_after = bump_after or {}
        self.on_version = on_version
        self.forwarded: list[list[int]] = []
        self.requests = 0
        self.return_routed_experts = True

    def _set_version(self, v):
        self.version = v
        if self.on_version is not None:
            self.on_version(v)

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        req, self.requests = self.requests, self.requests + 1
        prompt = list(prompt_ids)
        cached = min(max((common_prefix(prompt, f) for f in self.forwarded), default=0), len(prompt) - 1)
        comps = []
        for i in range(n):
            ids = [THINK, 50 + req % 20, END_THINK, 100 + 8 * req + i, 2][:max_tokens]
            lps = [-(req + 1) - (i + 1) / 8 - j / 64 for j in range(len(ids))]
            tokens = prompt + ids
            rows = RoutedExperts.from_array(expected_rows(tokens)[cached:], E, start=cached)
            comps.append(FakeCompletion(ids, lps, version_segments=[(self.version, 0)], routed_experts=rows))
            self.forwarded.append(tokens[:-1])
        await asyncio.sleep(0)
        if req in self.bump_after:
            self._set_version(self.bump_after[req])
        return comps, cached

    async def update_weights(self, path, version):
        self._set_version(version)
        return {"version": version}

    async def weight_version(self):
        return self.version


def strip(completion: list[int]) -> list[int]:
    """The completion as the template re-renders it in the history: its ``<think> ... </think>`` removed."""
    return completion[completion.index(END_THINK) + 1:] if THINK in completion else completion


class BranchEnv(Environment):
    """Episode ``i`` plays ``plans[i % len(plans)]`` after its first turn, one model call per mode: ``extend``
    (the whole history, thinking included: extends the sample), ``strip`` (history with past thinking removed: a
    re-rendered prompt, a new sample), ``rollback`` (back to the state after turn 1 with another env message: a
    branch that copies that state), ``fail`` (the tool crashes: the episode trains nothing). Records each call's
    prompt and response per episode (``log``)."""

    num_turns = 3

    def __init__(self, plans, rewards):
        self.tok = CharTokenizer()
        self.plans = plans
        self.rewards = rewards
        self.log: dict[int, list] = {}

    def sample(self, rng, heldout=False):
        return (rng.randrange(200, 10**6), *PROMPT[1:])  # distinct first tokens: no engine cache hit across groups

    async def episode(self, problem, ctx):
        sp = SamplingParams(max_tokens=5)
        calls = self.log.setdefault(ctx.index, [])
        calls.clear()
        r = await ctx.generate(ModelRequest(sp, prompt_ids=list(problem)))
        calls.append(r)
        outs = [r.token_ids]
        for k, mode in enumerate(self.plans[ctx.index % len(self.plans)]):
            if mode == "fail":
                raise RuntimeError("the tool crashed")
            if mode == "rollback":
                prompt = [*problem, *outs[0], ALT, k]
            else:
                prompt = list(problem)
                for j, o in enumerate(outs):
                    prompt += (strip(o) if mode == "strip" else o) + [ENV, j]
            r = await ctx.generate(ModelRequest(sp, prompt_ids=prompt))
            calls.append(r)
            outs.append(r.token_ids)
        return EpisodeResult(self.rewards[ctx.index % len(self.rewards)], "answered")


# which calls of an episode each of its samples holds (in order of creation), per plan
BRANCHES = {
    ("strip",): [[0], [1]],
    ("strip", "strip"): [[0], [1], [2]],
    ("extend", "strip"): [[0, 1], [2]],
    ("extend", "rollback"): [[0, 1], [0, 2]],
    ("extend",): [[0, 1]],
    ("fail",): [],
}


def expected_sample(calls, held: list[int]) -> dict:
    """Tokens, prompt length, mask, log-probs and versions of the sample holding ``held`` (each held call's
    prompt + completion is a prefix of the sample; its completion is trained with the engine's log-probs and the
    version that sampled it; every other token is off the loss)."""
    last = calls[held[-1]]
    tokens = list(last.prompt_ids) + list(last.token_ids)
    mask, lps, vers = [False] * len(tokens), [0.0] * len(tokens), [-1] * len(tokens)
    for k in held:
        c = calls[k]
        a, b = len(c.prompt_ids), len(c.prompt_ids) + len(c.token_ids)
        assert tokens[:b] == list(c.prompt_ids) + list(c.token_ids)
        mask[a:b] = [True] * (b - a)
        lps[a:b] = list(c.logprobs)
        vers[a:b] = [c.version_segments[0][0]] * (b - a)
    return {"tokens": tokens, "p": len(calls[held[0]].prompt_ids), "mask": mask, "lps": lps, "versions": vers}


def _orchestrator(tmp_path, env, engine, group_size):
    cfg = OrchestratorConfig(batch_size=group_size, group_size=group_size, max_off_policy_steps=2,
                             engine_probe=False)
    return Orchestrator(cfg, env, engine, RunPaths(tmp_path), max_steps=1, seed=0, run_id="br")


@pytest.mark.parametrize("plans, rewards", [
    ((("strip",),), (1.0, 0.25)),                                   # 2 branches per episode
    ((("strip", "strip"), ("extend",)), (1.0, 0.25)),               # 3 branches next to 1 sample
    ((("extend", "strip"), ("extend", "rollback"), ("fail",)), (0.5, 1.0, 0.0)),  # re-render, rollback, failure
])
def test_each_branch_trains_as_one_sample(tmp_path, plans, rewards):
    group_size = max(2, len(plans))
    env = BranchEnv(plans, rewards)
    holder = {}
    engine = ThinkEngine(bump_after={0: 1}, on_version=lambda v: setattr(holder["orch"].state, "engine_version", v))
    orch = _orchestrator(tmp_path, env, engine, group_size)
    holder["orch"] = orch

    async def go():
        orch.buffer.start(0, 0, group_size, prompt=PROMPT)
        orch._inflight.clear()
        await orch._rollout(0, PROMPT, 0, 123)
    asyncio.run(go())
    c = orch.buffer.counters
    c.check()
    want = {i: BRANCHES[plans[i % len(plans)]] for i in range(group_size)}
    n_samples = sum(len(b) for b in want.values())
    finished = [i for i in range(group_size) if want[i]]
    assert (c.started, c.queued, c.branches) == (group_size + n_samples - len(finished), n_samples,
                                                 n_samples - len(finished))
    assert c.dropped == group_size - len(finished)
    assert orch.state.turns["branches"] == n_samples - len(finished) > 0
    assert orch.state.episodes.get("errors_env", 0) == group_size - len(finished)

    (g,) = orch.buffer.take(1, consume_version=1)
    assert g.size == n_samples
    batch = build_batch([g], step=1, pad_id=env.tok.pad_id)
    baseline = sum(rewards[i % len(rewards)] for i in finished) / len(finished)  # over episodes, not samples
    row = 0
    for i in finished:
        samples = [s for s in g.samples if s.episode == i]
        assert len(samples) == len(want[i])
        for s, held in zip(samples, want[i], strict=True):
            r = expected_sample(env.log[i], held)
            tokens, p, n = r["tokens"], r["p"], len(r["tokens"])
            assert s.prompt_ids + s.completion_ids == tokens and len(s.prompt_ids) == p
            assert s.completion_mask == r["mask"][p:]
            assert s.completion_logprobs == r["lps"][p:]
            assert s.reward == rewards[i % len(rewards)]
            # the batch row: loss mask, engine log-probs, per-token versions, routed rows, the episode's advantage
            assert batch.input_ids[row, :n].tolist() == tokens
            assert batch.loss_mask[row, : n - 1].tolist() == r["mask"][1:]
            assert batch.inference_logprobs[row, : n - 1].tolist() == r["lps"][1:]  # dyadic: exact in float32
            assert batch.token_versions[row, : n - 1].tolist() == r["versions"][1:]
            assert s.routed_experts is not None and s.routed_experts.start == 0
            assert np.array_equal(s.routed_experts.to_numpy(np.int64), expected_rows(tokens))
            assert batch.routed_experts_state[row].tolist() == [0] * (n - 1) + [-1] * (batch.input_ids.shape[1] - n + 1)
            assert batch.routed_experts[row, : n - 1].tolist() == expected_rows(tokens)[: n - 1].tolist()
            assert float(batch.advantages[row]) == rewards[i % len(rewards)] - baseline
            row += 1
    assert row == batch.num_samples
    st = orch.state.turns
    assert st["samples"] == n_samples and st["routed_experts_stitched"] == n_samples
    assert st.get("routed_experts_incomplete", 0) == 0 and st.get("routed_experts_missing_turn", 0) == 0
    orch.buffer.mark_trained(g.size)
    orch.buffer.counters.check()
    assert c.trained == n_samples


def test_rollback_branch_copies_versions_of_the_state_it_extends(tmp_path):
    """The rollback branch trains turn 1 again with turn 1's version (0) and its own turn with version 1."""
    env = BranchEnv((("extend", "rollback"),), (1.0,))
    holder = {}
    engine = ThinkEngine(bump_after={0: 1}, on_version=lambda v: setattr(holder["orch"].state, "engine_version", v))
    orch = _orchestrator(tmp_path, env, engine, 2)
    holder["orch"] = orch

    async def go():
        orch.buffer.start(0, 0, 2, prompt=PROMPT)
        orch._inflight.clear()
        await orch._rollout(0, PROMPT, 0, 5)
    asyncio.run(go())
    (g,) = orch.buffer.take(1, consume_version=1)
    for i in (0, 1):
        main, branch = [s for s in g.samples if s.episode == i]
        n1 = len(env.log[i][0].token_ids)
        assert branch.prompt_ids == list(PROMPT) and branch.completion_ids[:n1] == env.log[i][0].token_ids
        assert branch.completion_ids[n1:n1 + 2] == [ALT, 1]
        assert branch.version_segments == main.version_segments == [(0, 0), (1, n1 + 2)]  # [ENV, 0] / [ALT, 1]
        assert branch.completion_mask == [True] * n1 + [False, False] + [True] * len(env.log[i][2].token_ids)


async def _fake_trainer(paths, max_steps, seen):
    for step in range(max_steps):
        while not batch_path(paths.batches, step).exists():
            await asyncio.sleep(0.001)
        b = read_batch(batch_path(paths.batches, step))
        seen["rows"] += b.num_samples
        finish_step(paths, step, int(b.input_ids.numel()))


def test_branching_run_keeps_the_accounting_exact(tmp_path):
    """A whole asynchronous run of branching episodes (3 + 2 samples and a failed episode per group): at every
    trainer step ``started == trained + dropped + withheld + in flight``; every trained row is counted once."""
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    env = BranchEnv((("strip", "strip"), ("extend", "rollback"), ("fail",)), (1.0, 0.5, 0.0))
    cfg = OrchestratorConfig(batch_size=6, group_size=3, max_inflight=4, max_off_policy_steps=1, engine_probe=False)
    steps = 5
    orch = Orchestrator(cfg, env, ThinkEngine(), paths, max_steps=steps, seed=1, run_id="brun")
    seen = {"rows": 0}

    async def main():
        trainer = asyncio.create_task(_fake_trainer(paths, steps, seen))
        summary = await asyncio.wait_for(orch.run(), timeout=120)
        await trainer
        return summary

    s = asyncio.run(main())
    records = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert len(records) == steps
    for r in records:
        assert r["rollouts_started"] == (r["rollouts_trained"] + r["rollouts_dropped"] + r["rollouts_withheld"]
                                         + r["rollouts_inflight"])
        assert r["multiturn_branches"] > 0
    # each group: 5 samples (3 branches) trained, 1 failed episode dropped
    assert s["rollouts_trained"] == seen["rows"] == steps * 2 * 5
    assert s["rollouts_started"] == (s["rollouts_trained"] + s["rollouts_dropped"] + s["rollouts_withheld"]
                                     + s["rollouts_inflight_at_exit"])
    mt = s["multiturn"]
    assert mt["branches"] == 3 * mt["samples"] // 5 and mt["samples"] % 5 == 0
    assert mt["routed_experts_stitched"] + mt.get("routed_experts_incomplete", 0) == mt["samples"]
    assert s["rollouts_dropped_by_reason"].get("error", 0) >= steps * 2
