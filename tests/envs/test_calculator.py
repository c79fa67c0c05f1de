"""The calculator environment: the heavy-tailed step count, the split, the expert demonstration and its mask, the
episode logic against scripted policies (correct, malformed calls, tool faults, turn and token limits), and one
trainable sample per episode with exactly the model's tokens on the loss mask."""

import asyncio
import math
import random

import pytest
from _fake_engine import completion

from moe_rl.envs import CharTokenizer, run_group
from moe_rl.envs.calculator import CalcProblem, CalculatorEnv, CalculatorEnvConfig, make_env
from moe_rl.envs.sandbox import Sandbox, SandboxLimits
from moe_rl.rl.trajectory import interleave_calls

TOK = CharTokenizer()


class ScriptEngine:
    """A scripted policy: ``policy(prompt_text) -> (completion_text, finish_reason)``; EOS is appended to texts
    that are not tool calls. Logs the stop tokens it was asked for."""

    def __init__(self, policy):
        self.policy = policy
        self.stops = []

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed, stop_token_ids=None):
        self.stops.append(stop_token_ids)
        text, finish = self.policy(TOK.decode(prompt_ids, stop_at_eos=False))
        ids = TOK.encode(text, bos=False)[:max_tokens]
        if not text.startswith("[") and finish == "stop":
            ids = ids + [TOK.eos_id]
        return [completion(list(ids), finish) for _ in range(n)], 0


def oracle(text):
    """The expert: call the tool on the current value and step; answer when no step is left."""
    seg = text[text.rfind("=") + 1:]
    val, step = seg.split("|")
    return (val, "stop") if step == "." else (f"[{val}{step[:-1]}]", "stop")


def play(env, problem, policy, n=1):
    eng = ScriptEngine(policy)
    return asyncio.run(run_group(env, problem, n, eng)), eng


def test_step_count_has_the_configured_pareto_tail():
    env = make_env(TOK, max_ops=24, tail_alpha=1.2)
    rng = random.Random(0)
    n = 20_000
    draws = [env.draw_steps(rng) for _ in range(n)]
    assert min(draws) == 1 and max(draws) == 24
    for m in (2, 4, 8, 16, 24):
        p = m ** -1.2  # P(steps >= m); the cap keeps the mass of larger values at 24
        freq = sum(d >= m for d in draws) / n
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n), (m, freq, p)


def test_split_is_disjoint_and_problems_are_well_formed():
    env = make_env(TOK, operand_max=9)
    rng = random.Random(1)
    for heldout in (False, True):
        for _ in range(200):
            p = env.sample(rng, heldout=heldout)
            assert env.is_heldout(p) == heldout and 1 <= len(p.steps) <= env.cfg.max_ops
            assert all(op in "+-" and 0 <= x <= 9 for op, x in p.steps) and 0 <= p.start <= 9
    assert env.heldout_set(4, seed=2) == env.heldout_set(4, seed=2)


def test_demonstration_tokens_and_mask_by_hand():
    env = make_env(TOK)
    p = CalcProblem(7, (("+", 5), ("-", 3)))
    assert p.answer == 9
    d = env.demonstration(p)
    text = "=7|+5;" + "[7+5]" + "=12|-3;" + "[12-3]" + "=9|." + "9"
    assert list(d.token_ids) == TOK.encode(text, bos=True) + [TOK.eos_id]
    want = [False] * 7 + [True] * 5 + [False] * 7 + [True] * 6 + [False] * 4 + [True] * 2
    assert list(d.loss_mask) == want
    long = CalcProblem(1, (("+", 1),) * 5)
    assert env.cfg.demo_max_ops == 4 and env.demonstration(long) is None  # SFT draws another problem
    assert make_env(TOK, demo_max_ops=5).demonstration(long) is not None


def test_scripted_expert_solves_every_problem_and_each_episode_is_one_sample():
    env = make_env(TOK)
    p = CalcProblem(7, (("+", 5), ("-", 3), ("-", 9)))
    (ep,), eng = play(env, p, oracle)
    r = ep.result
    assert (r.reward, r.stop_reason, r.rewards) == (1.0, "answered", {"correct": 1.0})
    assert r.metrics["tool_calls"] == 3 and r.metrics["turns"] == 4 and r.metrics["tool_faults"] == 0
    assert r.metrics["steps"] == 3 and r.metrics["tool_s"] > 0
    assert eng.stops == [[TOK.encode("]", bos=False)[0]]] * 4
    (s,) = interleave_calls(ep.calls)
    full = s.prompt_ids + s.completion_ids
    d = env.demonstration(p)
    assert full == list(d.token_ids)  # the expert's episode is the demonstration, token for token
    assert [False] * (len(s.prompt_ids) - 1) + s.completion_mask == list(d.loss_mask)[1:]
    assert [m.content for m in ep.messages] == ["=12|-3;", "=9|-9;", "=0|."]


def test_malformed_calls_repeat_the_step_and_wrong_answers_get_partial_credit():
    env = make_env(TOK)
    p = CalcProblem(7, (("+", 5),))
    seen = []

    def policy(text):
        seen.append(text)
        k = len(seen)
        if k == 1:
            return "[7+", "length"  # cut off before ']'
        if k == 2:
            return "[7/2]", "stop"  # not an integer
        if k == 3:
            return "[7+5]", "stop"
        return "13", "stop"

    (ep,), _ = play(env, p, policy)
    assert seen[1].endswith("[7+=?|+5;") and seen[2].endswith("[7/2]=?|+5;") and seen[3].endswith("[7+5]=12|.")
    r = ep.result
    assert r.stop_reason == "answered" and r.metrics["tool_call_errors"] == 2 and r.metrics["correct"] == 0
    assert r.reward == 0.25  # "13" vs "12": one of two digits in place, half credit


def test_a_tool_fault_costs_the_episode_only():
    sb = Sandbox(SandboxLimits(wall_s=20.0, cpu_s=1, memory_bytes=128 << 20, output_bytes=16))
    env = CalculatorEnv(CalculatorEnvConfig(), TOK, sandbox=sb)
    p = CalcProblem(1, (("+", 1),))

    def policy(text):  # sample 0 bombs the tool (a huge power: output cap or CPU limit), the others are experts
        return ("[9**99]", "stop") if text.endswith("=1|+1;") and policy.first.pop() else oracle(text)

    policy.first = [False, False, True]  # popped from the end: only the first request's first completion bombs
    eng = ScriptEngine(lambda t: oracle(t))
    eps = asyncio.run(run_group(env, p, 3, eng, share_first_call=False))
    assert all(e.result.reward == 1.0 for e in eps)
    eng.policy = policy
    eps = asyncio.run(run_group(env, p, 3, eng, share_first_call=False))
    stops = sorted(e.result.stop_reason for e in eps)
    assert stops == ["answered", "answered", "tool_error"]
    (bad,) = [e for e in eps if e.result.stop_reason == "tool_error"]
    assert bad.result.reward == 0.0 and bad.result.metrics["tool_faults"] == 1
    assert bad.result.metrics["tool_fault_output_too_large"] == 1
    assert bad.error is None  # the episode ended normally: it trains (the model wrote the call)


def test_turn_and_token_limits():
    p = CalcProblem(1, (("+", 1),))
    (ep,), _ = play(make_env(TOK, max_turns=3), p, lambda t: ("[1+]", "stop"))
    assert ep.result.stop_reason == "max_turns" and ep.result.metrics["tool_call_errors"] == 3
    assert ep.result.reward == 0.0
    (ep,), _ = play(make_env(TOK, max_episode_tokens=40, max_call_tokens=12), p, lambda t: ("[1+]", "stop"))
    assert ep.result.stop_reason == "token_budget" and ep.result.reward == 0.0
    assert all(len(c.prompt_ids) + 12 <= 40 for c in ep.calls)


def test_config_and_alphabet_errors():
    with pytest.raises(ValueError, match="ops='/'"):
        CalculatorEnvConfig(ops="/")
    with pytest.raises(ValueError, match="lacks"):
        make_env(CharTokenizer("0123456789+-="))
    with pytest.raises(ValueError, match="max_ops"):
        make_env(TOK, max_ops=0)
