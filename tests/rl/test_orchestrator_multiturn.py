"""Multi-turn rollouts in the orchestrator against a simulated engine (no vLLM): the whole-history sample, its
loss mask (model tokens only), logprobs, per-token versions across weight updates between and within turns, and
routed experts stitched from the turns' engine records (``S-1`` rows each; case B13), all checked against a
reference rebuilt independently from the engine's request log."""

import asyncio
import json
import random

import numpy as np
import pytest
from _fake_engine import FakeCompletion, finish_step, publish_folder_version

from moe_rl.envs import ChainedAdditionTask, ChainedAdditionTaskConfig, ChainedProblem, CharTokenizer
from moe_rl.replay import RoutedExperts, complete_engine_rows
from moe_rl.rl.batch import batch_path, build_batch, read_batch
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths

E, LAYERS, K = 8, 2, 2


def engine_row(request: int, pos: int) -> list[list[int]]:
    """The routing request ``request`` computes at position ``pos``: distinct per request, so the test sees which
    turn's row the stitched record holds (a later turn recomputing a prefix row may route it differently)."""
    a = (request * 5 + pos) % E
    return [[(a + layer) % E, (a + layer + 3) % E] for layer in range(LAYERS)]


class TurnEngine:
    """Deterministic fake engine with a request log.

    ``bump_after``: request index -> version the engine serves once that request has returned (a weight update
    landing between turns). ``bump_within``: request index -> (token index, version): tokens from that index on
    are sampled by the new version (an update during the request). ``segments=False``: report no version
    segments (the orchestrator then uses the version served when the turn was sent)."""

    def __init__(self, rng, bump_after=None, bump_within=None, segments=True, max_latency=0.0, on_version=None):
        self.rng = rng
        self.version = 0
        self.bump_after = bump_after or {}
        self.bump_within = bump_within or {}
        self.segments = segments
        self.max_latency = max_latency
        self.on_version = on_version
        self.log: list[dict] = []
        self.return_routed_experts = True

    def _set_version(self, v):
        self.version = v
        if self.on_version is not None:
            self.on_version(v)

    def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        # the version served when the caller sends the request (the coroutine may start later, e.g. in wait_for)
        return self._generate(prompt_ids, n, max_tokens, cache_salt, self.version)

    async def _generate(self, prompt_ids, n, max_tokens, cache_salt, sent_version):
        req = len(self.log)
        entry = {"prompt": list(prompt_ids), "n": n, "salt": cache_salt, "version": sent_version, "out": []}
        self.log.append(entry)
        v0 = self.version
        if self.max_latency:
            await asyncio.sleep(self.rng.random() * self.max_latency)
        v_end = self.version
        comps = []
        for i in range(n):
            k = self.rng.randint(2, max_tokens)  # the first token tells the choices apart (the reference needs it)
            ids = [3 + i % 10] + [self.rng.randint(3, 12) for _ in range(k - 2)] + [2]
            lps = [-(req + 1) - (i + 1) / 10 - j / 100 for j in range(k)]
            if req in self.bump_within and self.bump_within[req][0] < k:
                at, v = self.bump_within[req]
                segs = [(v0, 0), (v, at)] if at > 0 else [(v, 0)]
            elif v_end != v0:  # an update landed while this request ran: its tokens from a random point on
                at = self.rng.randint(0, k - 1)
                segs = [(v0, 0), (v_end, at)] if at > 0 else [(v_end, 0)]
            else:
                segs = [(v0, 0)]
            n_tok = len(prompt_ids) + k
            rows = RoutedExperts.from_array(np.array([engine_row(req, p) for p in range(n_tok - 1)],
                                                     dtype=np.int64).reshape(n_tok - 1, LAYERS, K), E)
            comps.append(FakeCompletion(ids, lps, version_segments=segs if self.segments else None,
                                        routed_experts=complete_engine_rows(rows, n_tok)))
            entry["out"].append({"ids": ids, "lps": lps, "segs": segs})
        if req in self.bump_within:
            self._set_version(max(self.version, self.bump_within[req][1]))
        if req in self.bump_after:
            self._set_version(self.bump_after[req])
        return comps, 0

    async def update_weights(self, path, version):
        self._set_version(version)
        return {"version": version}

    async def weight_version(self):
        return self.version


def reference(log: list[dict], prompt: list[int], num_turns: int, tok_of_turn, segments: bool = True):
    """Rebuild every sample from the engine log alone: follow each turn-1 completion through the requests whose
    prompt extends it. Returns per sample: ids, loss mask, logprobs, token versions (-1 off the model tokens;
    without engine segments: the version served when the turn's request arrived) and the expected routed rows
    (each position's row from the first request that forwarded it; the last token a placeholder)."""
    out = []
    for first in log[0]["out"]:
        chain = [(0, first)]
        seq = prompt + first["ids"]
        for turn in range(1, num_turns):
            seq = seq + tok_of_turn(turn)
            (req, o), = [(r, e["out"][0]) for r, e in enumerate(log) if r > 0 and e["prompt"] == seq]
            chain.append((req, o))
            seq = seq + o["ids"]
        mask, lps, vers = [], [], []
        cur = list(prompt)
        ends = []
        for turn, (req, o) in enumerate(chain):
            if turn:
                env = tok_of_turn(turn)
                cur += env
                mask += [False] * len(env)
                lps += [0.0] * len(env)
                vers += [-1] * len(env)
            if segments:
                tv = [max(v for v, a in o["segs"] if a <= j) for j in range(len(o["ids"]))]
            else:
                tv = [log[req]["version"]] * len(o["ids"])
            cur += o["ids"]
            ends.append(len(cur))
            mask += [True] * len(o["ids"])
            lps += o["lps"]
            vers += tv
        assert cur == seq
        rows = []
        for p in range(len(seq)):
            owner = next((req for (req, _), end in zip(chain, ends, strict=True) if p < end - 1), None)
            rows.append(engine_row(owner, p) if owner is not None else [[-1] * K] * LAYERS)
        out.append({"ids": seq, "mask": mask, "lps": lps, "versions": vers, "rows": np.array(rows)})
    return out


def _orchestrator(tmp_path, task, engine, group_size=2, policy="drop", max_off=1):
    cfg = OrchestratorConfig(batch_size=group_size, group_size=group_size, max_off_policy_steps=max_off,
                             off_policy_policy=policy, engine_probe=False)
    return Orchestrator(cfg, task, engine, RunPaths(tmp_path), max_steps=1, seed=0, run_id="mt")


def _run_one_group(orch, problem, consume_version, seed=123):
    async def go():
        orch.buffer.start(0, 0, orch.cfg.group_size, prompt=problem)
        orch._inflight.clear()
        await orch._rollout(0, problem, 0, seed)
    asyncio.run(go())
    return orch.buffer.take(1, consume_version=consume_version)


@pytest.mark.parametrize("num_turns, bump_after, bump_within, segments", [
    (2, {0: 1}, {}, True),                   # weight update between turn 1 and turn 2
    (3, {0: 1}, {2: (1, 2)}, True),          # ... and another one inside sample 1's turn 2 (request 2)
    (3, {1: 2}, {}, False),                  # no engine segments: the version served when each turn was sent
])
def test_multiturn_sample_matches_reference(tmp_path, num_turns, bump_after, bump_within, segments):
    task = ChainedAdditionTask(ChainedAdditionTaskConfig(num_turns=num_turns), CharTokenizer())
    problem = ChainedProblem(12, 34, tuple(range(5, 5 + num_turns - 1)))
    holder = {}
    engine = TurnEngine(random.Random(num_turns), bump_after, bump_within, segments,
                        on_version=lambda v: setattr(holder["orch"].state, "engine_version", v))
    orch = _orchestrator(tmp_path, task, engine, max_off=2)
    holder["orch"] = orch
    groups = _run_one_group(orch, problem, consume_version=2)
    (g,) = groups
    assert g.size == 2 and orch.buffer.counters.dropped == 0
    # one shared turn-1 request (n = group size), then one request per sample and later turn, all with the
    # rollout's start salt
    assert [e["n"] for e in engine.log] == [2] + [1] * (2 * (num_turns - 1))
    assert {e["salt"] for e in engine.log} == {g.cache_salt} and g.cache_salt.endswith("-v0-float32")
    ref = reference(engine.log, task.prompt_ids(problem), num_turns, lambda t: task.turn_ids(problem, t), segments)
    if not segments:  # some turn was sent after the update: the fallback must give it the newer version
        assert any(v == 2 for r in ref for v in r["versions"])
    p = len(task.prompt_ids(problem))
    batch = build_batch(groups, step=2, pad_id=0)
    for i, (s, r) in enumerate(zip(g.samples, ref, strict=True)):
        assert s.prompt_ids + s.completion_ids == r["ids"]
        assert s.completion_mask == r["mask"]
        n = len(r["ids"])
        assert batch.input_ids[i, :n].tolist() == r["ids"]
        assert batch.loss_mask[i, : n - 1].tolist() == [False] * (p - 1) + r["mask"]
        assert not batch.loss_mask[i, n - 1:].any()
        assert batch.inference_logprobs[i, : n - 1].tolist() == pytest.approx([0.0] * (p - 1) + r["lps"])
        assert batch.token_versions[i, : n - 1].tolist() == [-1] * (p - 1) + r["versions"]
        # routed experts: one record for the whole sequence, rows from the turn that first forwarded them
        assert s.routed_experts.start == 0 and s.routed_experts.shape == (n, LAYERS, K)
        assert np.array_equal(s.routed_experts.to_numpy(np.int64), r["rows"])
        state = batch.routed_experts_state[i].tolist()
        assert state == [0] * (n - 1) + [-1] * (batch.input_ids.shape[1] - n + 1)
        assert batch.routed_experts[i, : n - 1].tolist() == r["rows"][: n - 1].tolist()
        assert s.reward == task.reward_turns(problem, _turn_answers(s))
    # B13: the row of turn 1's last token is turn 2's (request > 0), never a placeholder or turn 1's
    s0 = g.samples[0]
    last1 = p + s0.completion_mask.index(False) - 1
    assert s0.routed_experts.row_valid[last1]
    assert s0.routed_experts.to_numpy(np.int64)[last1].tolist() != engine_row(0, last1)
    st = orch.state.turns
    assert st["samples"] == 2 and st["turns"] == 2 * num_turns and st["routed_experts_stitched"] == 2
    assert st["env_tokens"] == sum(m.count(False) for m in (s.completion_mask for s in g.samples))
    assert orch.state.completion_tokens == sum(sum(s.completion_mask) for s in g.samples)


def _turn_answers(s):
    """Split a sample's completion into its model turns by the completion mask."""
    out, cur, prev = [], [], True
    for t, m in zip(s.completion_ids, s.completion_mask, strict=True):
        if m and not prev:
            out.append(cur)
            cur = []
        if m:
            cur.append(t)
        prev = m
    return [*out, cur]


def test_mask_policy_masks_only_model_tokens(tmp_path):
    """``mask`` with max_off_policy_steps=0 at consume version 1: turn-1 tokens (version 0) are masked and
    counted, env tokens are neither trained nor counted, turn-2 tokens (version 1) are trained."""
    task = ChainedAdditionTask(ChainedAdditionTaskConfig(num_turns=2), CharTokenizer())
    problem = ChainedProblem(3, 4, (5,))
    engine = TurnEngine(random.Random(7), bump_after={0: 1})
    orch = _orchestrator(tmp_path, task, engine, policy="mask", max_off=1)
    orch.buffer.max_off_policy_steps = 0
    (g,) = _run_one_group(orch, problem, consume_version=1)
    batch = build_batch([g], step=1, pad_id=0)
    p = len(task.prompt_ids(problem))
    turn1 = 0
    for i, s in enumerate(g.samples):
        m = s.completion_mask
        t1 = m.index(False)
        turn1 += t1
        n_env = m[t1:].index(True)
        expect = [False] * (p - 1 + t1 + n_env) + [True] * (len(m) - t1 - n_env)
        assert batch.loss_mask[i, : p - 1 + len(m)].tolist() == expect
    assert orch.buffer.counters.masked_tokens == turn1
    assert orch.buffer.counters.masked_samples == 2


def test_a_failed_later_turn_drops_only_that_sample(tmp_path):
    task = ChainedAdditionTask(ChainedAdditionTaskConfig(num_turns=2), CharTokenizer())
    problem = ChainedProblem(3, 4, (5,))
    engine = TurnEngine(random.Random(3))
    real = engine.generate

    async def flaky(prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        if n == 1 and prompt_ids[5] == 4:  # sample 1's turn 2 (its answer starts with 4)
            raise RuntimeError("engine down")
        return await real(prompt_ids, n, max_tokens, temperature, cache_salt, seed)

    engine.generate = flaky
    orch = _orchestrator(tmp_path, task, engine)
    (g,) = _run_one_group(orch, problem, consume_version=0)
    assert g.size == 1
    c = orch.buffer.counters
    assert c.dropped_by_reason == {"error": 1} and orch.state.errors == 1
    assert "engine down" in next(iter(orch.state.error_messages))


def test_single_turn_task_keeps_single_turn_samples(tmp_path):
    """num_turns=1 takes the single-turn path: one request per group, no completion mask, routing passed on."""
    task = ChainedAdditionTask(ChainedAdditionTaskConfig(num_turns=1), CharTokenizer())
    problem = ChainedProblem(3, 4, ())
    engine = TurnEngine(random.Random(5))
    orch = _orchestrator(tmp_path, task, engine)
    (g,) = _run_one_group(orch, problem, consume_version=0)
    assert len(engine.log) == 1 and g.size == 2
    for s, o in zip(g.samples, engine.log[0]["out"], strict=True):
        assert s.completion_mask is None and s.completion_ids == o["ids"] and s.completion_logprobs == o["lps"]
        assert s.routed_experts.row_valid.tolist() == [True] * (len(s.prompt_ids) + len(o["ids"]) - 1) + [False]
    assert orch.state.turns == {}


async def _fake_trainer(paths, max_steps, task, seen):
    for step in range(max_steps):
        while not batch_path(paths.batches, step).exists():
            await asyncio.sleep(0.001)
        b = read_batch(batch_path(paths.batches, step))
        for i in range(b.num_samples):
            ids = b.input_ids[i].tolist()
            n = len(ids) - ids[::-1].index(next(t for t in ids[::-1] if t != 0)) if any(ids) else 0
            # every sample holds all turns: one <eos> per model turn, each env segment right after an <eos>
            seen["eos"].add(ids[:n].count(task.tok.eos_id))
            tv = b.token_versions[i][b.loss_mask[i]]
            assert bool((tv >= int(b.version_start[i])).all()) and bool((tv <= step).all())
            seen["newer_tokens"] += int((tv > int(b.version_start[i])).sum())
            env = (~b.loss_mask[i, : n - 1]) & (b.token_versions[i, : n - 1] == -1)
            seen["env_positions"] += int(env.sum())
            assert b.routed_experts_state[i, : n - 1].eq(0).all(), "every forwarded token has an engine row"
            assert b.routed_experts_state[i, n - 1:].eq(-1).all()
        finish_step(paths, step, int(b.input_ids.numel()))


def test_multiturn_run_simulated(tmp_path):
    """A whole asynchronous run (3-turn rollouts, random latencies, weight updates during rollouts)."""
    rng = random.Random(11)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    task = ChainedAdditionTask(ChainedAdditionTaskConfig(num_turns=3), CharTokenizer())
    cfg = OrchestratorConfig(batch_size=8, group_size=2, max_inflight=8, max_off_policy_steps=1, engine_probe=True)
    engine = TurnEngine(rng, max_latency=0.01)
    steps = 15
    orch = Orchestrator(cfg, task, engine, paths, max_steps=steps, seed=1, run_id="sim")
    seen = {"eos": set(), "env_positions": 0, "newer_tokens": 0}

    async def main():
        trainer = asyncio.create_task(_fake_trainer(paths, steps, task, seen))
        summary = await asyncio.wait_for(orch.run(), timeout=120)
        await trainer
        return summary

    s = asyncio.run(main())
    assert seen["eos"] == {3}
    assert s["rollouts_trained"] == steps * 8
    mt = s["multiturn"]
    assert mt["routed_experts_stitched"] == mt["samples"] >= steps * 8 and mt["turns"] == 3 * mt["samples"]
    assert mt.get("routed_experts_incomplete", 0) == 0 and mt.get("routed_experts_missing_turn", 0) == 0
    records = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert records[-1]["multiturn_samples"] == mt["samples"]
    assert seen["env_positions"] > 0
    assert seen["newer_tokens"] > 0, "some trained tokens come from a version newer than their rollout's start"
