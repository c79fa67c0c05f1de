"""The environment protocol and its runner: request/result validation, the shared first call of a group, per-sample
seeds, the run's salt on every request, versions per call, failures counted per episode (engine, environment,
timeout), chat messages rendered by the environment, and the addition tasks as two implementations."""

import asyncio
import random

import pytest

from moe_rl.envs import (
    AdditionTask,
    AdditionTaskConfig,
    ChainedAdditionTask,
    ChainedAdditionTaskConfig,
    ChainedProblem,
    CharTokenizer,
    Environment,
    EnvMessage,
    EpisodeResult,
    ModelRequest,
    Problem,
    SamplingParams,
    run_group,
)
from moe_rl.envs.runner import derive_seed
from moe_rl.rl.trajectory import interleave_calls


class Comp:
    def __init__(self, ids, lps=None, finish="stop", segs=None):
        self.token_ids = ids
        self.logprobs = lps if lps is not None else [-0.25] * len(ids)
        self.finish_reason = finish
        self.version_segments = segs
        self.routed_experts = None


class LogEngine:
    """Answers every request with ``n`` completions ``[3 + request index, 2]`` (distinct per request); logs the
    arguments. ``fail``: request indices that raise. No ``stop_token_ids`` parameter unless ``stops``."""

    def __init__(self, fail=(), version=0, latency=0.0):
        self.log = []
        self.fail = set(fail)
        self.version = version
        self.latency = latency

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        req = len(self.log)
        self.log.append({"prompt": list(prompt_ids), "n": n, "max_tokens": max_tokens, "temperature": temperature,
                         "salt": cache_salt, "seed": seed})
        if self.latency:
            await asyncio.sleep(self.latency)
        if req in self.fail:
            raise ConnectionError(f"request {req} refused")
        return [Comp([3 + req % 20, 2]) for _ in range(n)], 0


class StopEngine(LogEngine):
    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed, stop_token_ids=None):
        out = await super().generate(prompt_ids, n, max_tokens, temperature, cache_salt, seed)
        self.log[-1]["stop"] = stop_token_ids
        return out


class Scripted(Environment):
    """Each episode makes ``turns[index]`` calls extending its history; behaviours per index: ``"raise"`` raises
    after the first call, ``"sleep"`` sleeps 10 s before its second call, ``"own_seed"`` sets seed 99 on call 1,
    ``"temp"`` samples its second call at temperature 0.5."""

    def __init__(self, turns, behaviour=None, first_prompt=None):
        self.tok = CharTokenizer()
        self.turns = turns
        self.behaviour = behaviour or {}
        self.first_prompt = first_prompt or (lambda i: [1, 4, 5])

    def sample(self, rng, heldout=False):
        return "p"

    async def episode(self, problem, ctx):
        b = self.behaviour.get(ctx.index)
        history = list(self.first_prompt(ctx.index))
        for t in range(self.turns[ctx.index]):
            if t == 1 and b == "raise":
                raise KeyError("env bug")
            if t == 1 and b == "sleep":
                await asyncio.sleep(10)
            sp = SamplingParams(max_tokens=3, seed=99 if (b == "own_seed" and t == 0) else None,
                                temperature=0.5 if (b == "temp" and t == 1) else None)
            r = await ctx.generate(ModelRequest(sp, prompt_ids=history))
            history += r.token_ids + [7]
            ctx.emit(EnvMessage("env", "7", (7,)))
        return EpisodeResult(float(ctx.index), "answered", metrics={"turns": self.turns[ctx.index]})


def run(coro):
    return asyncio.run(coro)


def test_request_and_result_validation_name_the_field():
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature=0"):
        SamplingParams(max_tokens=1, temperature=0)
    with pytest.raises(ValueError, match="seed=-1"):
        SamplingParams(max_tokens=1, seed=-1)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(max_tokens=1, stop_token_ids=(1.5,))
    with pytest.raises(ValueError, match="exactly one of prompt_ids"):
        ModelRequest(SamplingParams(1))
    with pytest.raises(ValueError, match="exactly one of prompt_ids"):
        ModelRequest(SamplingParams(1), prompt_ids=[1], messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        ModelRequest(SamplingParams(1), prompt_ids=[])
    with pytest.raises(TypeError, match="SamplingParams"):
        ModelRequest({"max_tokens": 1}, prompt_ids=[1])
    with pytest.raises(ValueError, match="stop_reason='done'"):
        EpisodeResult(1.0, "done")
    with pytest.raises(ValueError, match="reward=nan"):
        EpisodeResult(float("nan"), "answered")
    with pytest.raises(ValueError, match=r"metrics\['x'\]"):
        EpisodeResult(0.0, "answered", metrics={"x": "many"})


def test_identical_first_calls_share_one_request_then_each_sample_continues_with_its_own_seed():
    eng = LogEngine()
    env = Scripted([3, 3, 3, 3])
    eps = run(run_group(env, "p", 4, eng, temperature=0.7, seed=1234, cache_salt="salt-v0", version=lambda: 5))
    assert eng.log[0] == {"prompt": [1, 4, 5], "n": 4, "max_tokens": 3, "temperature": 0.7, "salt": "salt-v0",
                          "seed": 1234}
    assert len(eng.log) == 1 + 4 * 2 and all(e["n"] == 1 and e["salt"] == "salt-v0" for e in eng.log[1:])
    later = sorted(e["seed"] for e in eng.log[1:])
    assert later == sorted(derive_seed(derive_seed(1234, i), j) for i in range(4) for j in (1, 2))
    assert len(set(later)) == 8
    for i, ep in enumerate(eps):
        assert ep.error is None and ep.result.reward == float(i) and len(ep.calls) == 3
        assert [c.version for c in ep.calls] == [5, 5, 5] and all(c.temperature == 0.7 for c in ep.calls)
        # every call's prompt extends the previous call's tokens: one trainable sample per episode
        (s,) = interleave_calls(ep.calls)
        assert s.completion_mask == [True, True, False] * 2 + [True, True]
        assert len(ep.messages) == 3


class SlowStart(Scripted):
    """Waits ``delay`` seconds before the first call (a group start racing a weight update)."""

    def __init__(self, turns, delay):
        super().__init__(turns)
        self.delay = delay

    async def episode(self, problem, ctx):
        await asyncio.sleep(self.delay)
        return await super().episode(problem, ctx)


def test_a_callable_salt_is_taken_once_when_the_first_request_is_sent():
    served = {"v": 3}
    asked = []

    def salt():
        asked.append(served["v"])
        return f"salt-v{served['v']}"

    async def main():
        # the group starts at version 3; the engine serves 4 before the first request goes out, 5 after it
        task = asyncio.ensure_future(run_group(SlowStart([2, 2], 0.05), "p", 2, eng, cache_salt=salt,
                                               version=lambda: served["v"]))
        await asyncio.sleep(0.01)
        served["v"] = 4
        while not eng.log:
            await asyncio.sleep(0.005)
        served["v"] = 5
        return await task

    eng = LogEngine(latency=0.01)
    eps = run(main())
    assert asked == [4]
    assert [e["salt"] for e in eng.log] == ["salt-v4"] * 3  # the shared first call, then one later call each
    assert [[c.version for c in ep.calls] for ep in eps] == [[4, 5], [4, 5]]


def test_a_bad_salt_is_an_environment_error_not_an_engine_error():
    def raising():
        raise KeyError("no version yet")

    for salt, err in ((raising, "KeyError"), (lambda: 42, "TypeError: cache_salt() returned int 42")):
        eng = LogEngine()
        eps = run(run_group(Scripted([1, 1]), "p", 2, eng, cache_salt=salt))
        assert eng.log == [] and all(ep.error_kind == "env" and err in ep.error for ep in eps), [e.error for e in eps]
    with pytest.raises(TypeError, match="cache_salt=42 must be a str, None or a callable"):
        run(run_group(Scripted([1]), "p", 1, LogEngine(), cache_salt=42))


def test_a_salt_vllm_would_reject_is_refused_before_any_request():
    # vLLM 0.32 refuses an empty salt, one over 128 characters or one holding '@', '/', '\' or NUL (HTTP 400)
    for salt, problem in (("", "is empty"), ("run/1-v0", "contains '/'"), ("s" * 129, "is 129 characters long")):
        with pytest.raises(ValueError, match=rf"cache_salt='.*' {problem}; vLLM accepts a cache_salt that is a "
                                             r"non-empty str.*Pass None for no salt"):
            run(run_group(Scripted([1]), "p", 1, LogEngine(), cache_salt=salt))
        eng = LogEngine()
        eps = run(run_group(Scripted([1, 1]), "p", 2, eng, cache_salt=lambda s=salt: s))
        assert eng.log == [] and all(ep.error_kind == "env" and "ValueError: cache_salt() result='" in ep.error
                                     and problem in ep.error for ep in eps), [e.error for e in eps]
    # None (also from the callable) is "no salt"; 128 characters is fine
    for salt, sent in ((None, None), (lambda: None, None), ("s" * 128, "s" * 128)):
        eng = LogEngine()
        eps = run(run_group(Scripted([1]), "p", 1, eng, cache_salt=salt))
        assert eps[0].error is None and [e["salt"] for e in eng.log] == [sent]


def test_distinct_first_prompts_own_seeds_and_temperatures():
    eng = LogEngine()
    env = Scripted([2, 2, 2, 2], behaviour={3: "own_seed", 1: "temp"},
                   first_prompt=lambda i: [1, 4, 5] if i < 2 else [1, 6])
    eps = run(run_group(env, "p", 4, eng, temperature=1.0, seed=7))
    firsts = [e for e in eng.log if e["prompt"] in ([1, 4, 5], [1, 6])]
    assert sorted((e["prompt"], e["n"], e["seed"]) for e in firsts) == sorted(
        [([1, 4, 5], 2, 7), ([1, 6], 1, derive_seed(7, 10_001)), ([1, 6], 1, 99)])
    assert eps[1].calls[1].temperature == 0.5 and eps[1].calls[0].temperature == 1.0
    assert all(e.error is None for e in eps)


def test_failures_cost_their_episode_only_and_are_classified():
    env = Scripted([3, 3, 3, 3], behaviour={1: "raise", 2: "sleep"})
    eng = LogEngine(fail={3})  # request 3: the second call of one of the samples
    eps = run(run_group(env, "p", 4, eng, episode_timeout_s=0.5))
    kinds = sorted(str(e.error_kind) for e in eps)
    assert kinds == ["None", "engine", "env", "timeout"]
    (to,) = [e for e in eps if e.error_kind == "timeout"]
    assert to.result.stop_reason == "timeout" and to.wall_s < 5
    (bug,) = [e for e in eps if e.error_kind == "env"]
    assert "KeyError" in bug.error and bug.result is None
    (eng_err,) = [e for e in eps if e.error_kind == "engine"]
    assert "ConnectionError" in eng_err.error


def test_a_failed_shared_first_call_fails_every_episode_as_an_engine_error():
    eps = run(run_group(Scripted([2, 2, 2]), "p", 3, LogEngine(fail={0})))
    assert [e.error_kind for e in eps] == ["engine"] * 3 and all(not e.calls for e in eps)


def test_context_limit_and_stop_tokens():
    class Long(Scripted):
        async def episode(self, problem, ctx):
            await ctx.generate(ModelRequest(SamplingParams(max_tokens=8, stop_token_ids=(9,)), prompt_ids=[1] * 5))
            return EpisodeResult(0.0, "answered")

    eps = run(run_group(Long([1]), "p", 1, StopEngine(), max_model_len=12))
    assert eps[0].error_kind == "env" and "max_model_len=12" in eps[0].error
    eng = StopEngine()
    eps = run(run_group(Long([1]), "p", 2, eng, max_model_len=13))
    assert eps[0].error is None and eng.log[0]["stop"] == [9] and eng.log[0]["n"] == 2


def test_messages_are_rendered_by_the_environment():
    class ChatTok(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and tokenize
            return [1] + [3 + len(m["content"]) for m in messages]

    class Chat(Scripted):
        async def episode(self, problem, ctx):
            r = await ctx.generate(ModelRequest(SamplingParams(2), messages=[{"role": "user", "content": "abc"}]))
            assert r.prompt_ids == ([1, 6] if isinstance(self.tok, ChatTok) else None)
            return EpisodeResult(1.0, "answered")

    env = Chat([1])
    env.tok = ChatTok()
    eng = LogEngine()
    eps = run(run_group(env, "p", 2, eng))
    assert eng.log[0]["prompt"] == [1, 6] and all(e.error is None for e in eps)
    eps = run(run_group(Chat([1]), "p", 1, LogEngine()))  # a char tokenizer has no chat template
    assert eps[0].error_kind == "env" and "no chat template" in eps[0].error


def test_run_group_argument_errors():
    with pytest.raises(TypeError, match="as_environment"):
        run(run_group(object(), "p", 1, LogEngine()))
    with pytest.raises(ValueError, match="n=0"):
        run(run_group(Scripted([1]), "p", 0, LogEngine()))
    with pytest.raises(ValueError, match="episode_timeout_s=0"):
        run(run_group(Scripted([1]), "p", 1, LogEngine(), episode_timeout_s=0))


class AnswerEngine(LogEngine):
    """Answers with the given texts in order (one per completion), ending in EOS."""

    def __init__(self, tok, texts):
        super().__init__()
        self.tok, self.texts = tok, list(texts)

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        await super().generate(prompt_ids, n, max_tokens, temperature, cache_salt, seed)
        return [Comp(self.tok.encode(self.texts.pop(0), bos=False) + [self.tok.eos_id]) for _ in range(n)], 0


def test_addition_tasks_are_environments_with_their_rewards():
    tok = CharTokenizer()
    task = AdditionTask(AdditionTaskConfig(), tok)
    assert isinstance(task, Environment) and task.max_sequence_len() == 1 + 4 + 2 + 4
    eng = AnswerEngine(tok, ["46", "47"])
    eps = run(run_group(task, Problem(12, 34), 2, eng, seed=3))
    assert eng.log[0]["n"] == 2 and eng.log[0]["prompt"] == task.prompt_ids(Problem(12, 34))
    assert [e.result.reward for e in eps] == [1.0, task.reward(Problem(12, 34), tok.encode("47", bos=False))]
    assert {e.result.stop_reason for e in eps} == {"answered"}

    chained = ChainedAdditionTask(ChainedAdditionTaskConfig(num_turns=3), tok)
    p = ChainedProblem(12, 34, (5, 70))
    eng = AnswerEngine(tok, ["46", "51", "121"])
    (ep,) = run(run_group(chained, p, 1, eng))
    eos = [tok.eos_id]
    want = [task.prompt_ids(Problem(12, 34)), *(
        task.prompt_ids(Problem(12, 34)) + tok.encode("46", bos=False) + eos + tok.encode("+5=", bos=False)
        + tail for tail in ([], tok.encode("51", bos=False) + eos + tok.encode("+70=", bos=False)))]
    assert [e["prompt"] for e in eng.log] == want
    assert ep.result.reward == 1.0 and ep.result.stop_reason == "answered"
    assert [m.content for m in ep.messages] == ["+5=", "+70="]
    assert chained.max_sequence_len() == chained.cfg.max_sequence_len()


def test_heldout_set_is_reproducible():
    task = AdditionTask(AdditionTaskConfig(), CharTokenizer())
    assert task.heldout_set(5, seed=3) == task.heldout_set(5, seed=3)
    assert all(task.is_heldout(p) for p in task.heldout_set(20))
    assert task.sample(random.Random(0)) == task.sample(random.Random(0))


class SessionEngine(LogEngine):
    """A ``LogEngine`` whose ``generate`` takes ``**options`` (as moe_rl's clients do): logs ``session_id``."""

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt=None, seed=None, **options):
        out = await super().generate(prompt_ids, n, max_tokens, temperature, cache_salt, seed)
        self.log[-1]["session"] = options.get("session_id")
        return out


def test_session_ids_keep_each_episode_on_its_session():
    """The shared first call carries the group's session id, every later call of episode i ``<group id>/<i>`` (a
    sticky router keeps the episode on one engine); an engine whose ``generate`` takes no ``session_id`` gets none."""
    eng = SessionEngine()
    eps = run(run_group(Scripted([3, 2, 1]), "p", 3, eng, seed=5, cache_salt="s"))
    assert [len(e.calls) for e in eps] == [3, 2, 1]
    first, *later = eng.log
    group = first["session"]
    assert first["n"] == 3 and group.startswith("g-")
    assert sorted(r["session"] for r in later) == [f"{group}/0", f"{group}/0", f"{group}/1"]
    eng2 = SessionEngine()
    run(run_group(Scripted([2, 2]), "p", 2, eng2, seed=5, cache_salt="s"))
    assert eng2.log[0]["session"] != group  # a new id per group
    plain = LogEngine()  # the documented minimal signature: no session_id keyword
    eps = run(run_group(Scripted([2, 2]), "p", 2, plain, seed=5, cache_salt="s"))
    assert all(e.error is None for e in eps) and "session" not in str(plain.log)
