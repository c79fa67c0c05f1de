"""verifiers (v1) environments through ``moe_rl.envs.verifiers_env``: the ``/inference/v1/generate`` format adapter,
episodes of the tiny offline environment ``vf_tiny_chain`` (tests/envs) against a scripted engine (salt, seeds,
prompt extension, one sample per episode, a re-rendering chat template that makes each turn a sample, refused
sampling parameters, engine failures), and a slow end-to-end run
of ``moe-rl rl`` on the real vLLM CPU server with router replay.

Needs the ``envs`` extra (``pip install 'moe_rl[envs]'``); the adapter tests skip without it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from _fake_engine import completion

from moe_rl.envs import CharTokenizer, run_group
from moe_rl.envs.verifiers_endpoint import (
    MAX_BODY_BYTES,
    GenerateApp,
    GenerateEndpoint,
    GenerateRequest,
    GenerateResult,
    parse_generate_body,
    render_generate_reply,
)
from moe_rl.rl.trajectory import interleave_calls

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOK = CharTokenizer()


# ---------------------------------------------------------------- the format adapter (no verifiers needed)
def test_generate_body_parses_and_the_reply_names_token_ids():
    body = {"model": "m", "token_ids": [1, 5, 6], "cache_salt": "s",
            "sampling_params": {"max_tokens": 3, "temperature": 0.7, "seed": 9, "stop_token_ids": [2], "logprobs": 1}}
    req = parse_generate_body(body, {"X-Session-ID": "abc"})
    assert (req.prompt_ids, req.max_tokens, req.temperature, req.seed, req.stop_token_ids, req.cache_salt) == (
        [1, 5, 6], 3, 0.7, 9, [2], "s")
    assert req.headers == {"x-session-id": "abc"}
    reply = render_generate_reply(req, GenerateResult([7, 2], [-0.25, -1.5], "stop", request_id="r1"))
    (choice,) = reply["choices"]
    assert choice["token_ids"] == [7, 2] and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"] == [{"token": "token_id:7", "logprob": -0.25},
                                             {"token": "token_id:2", "logprob": -1.5}]
    assert reply["prompt_token_ids"] == [1, 5, 6] and reply["request_id"] == "r1"
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@pytest.mark.parametrize("body, match", [
    ([1, 2], "JSON object"),
    ({"token_ids": []}, "empty"),
    ({"token_ids": [1, -2]}, "token_ids"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ({"token_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"token_ids": [1], "features": {}}, "multimodal"),
])
def test_generate_body_errors_name_the_field(body, match):
    with pytest.raises(ValueError, match=match):
        parse_generate_body(body)


def test_reply_refuses_mismatched_or_non_finite_logprobs():
    req = parse_generate_body({"token_ids": [1]})
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        render_generate_reply(req, GenerateResult([3, 4], [-1.0], "stop"))
    with pytest.raises(ValueError, match="non-finite"):
        render_generate_reply(req, GenerateResult([3], [float("nan")], "stop"))


async def _echo_or_fail(req):
    """A handler: prompt 9 -> ValueError, 8 -> RuntimeError, else the sampled ids [4, 2]."""
    if req.prompt_ids[0] == 9:
        raise ValueError("nine is refused")
    if req.prompt_ids[0] == 8:
        raise RuntimeError("engine down")
    return GenerateResult([4, 2], [-0.5, -0.1], "stop")


def test_app_routes_and_maps_errors_to_vllm_error_shape():
    """The ASGI app in process (httpx.ASGITransport, no socket): routes, status codes, vLLM's error shape."""
    seen: list[GenerateRequest] = []

    async def handler(req):
        seen.append(req)
        return await _echo_or_fail(req)

    app = GenerateApp(handler, model="pol", max_model_len=64)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            gen = "/inference/v1/generate"
            return {
                "models": await http.get("/v1/models"),
                "ok": await http.post(gen, json={"token_ids": [1, 5]}, headers={"X-Session-ID": "s1"}),
                "bad": await http.post(gen, json={"token_ids": [9]}),
                "down": await http.post(gen, json={"token_ids": [8]}),
                "garbage": await http.post(gen, content=b"{not json"),
                "field": await http.post(gen, json={"token_ids": [1], "sampling_params": {"seed": "x"}}),
                "huge": await http.post(gen, content=b" " * (MAX_BODY_BYTES + 1)),
                "get": await http.get(gen),
                "missing": await http.get("/nowhere"),
            }

    r = asyncio.run(main())
    assert r["models"].json()["data"] == [{"id": "pol", "object": "model", "owned_by": "moe_rl",
                                           "max_model_len": 64}]
    assert r["ok"].status_code == 200 and r["ok"].json()["choices"][0]["token_ids"] == [4, 2]
    assert r["ok"].json()["choices"][0]["logprobs"]["content"][1] == {"token": "token_id:2", "logprob": -0.1}
    assert r["bad"].status_code == 400 and r["bad"].json()["error"]["message"] == "ValueError: nine is refused"
    assert r["down"].status_code == 500 and r["down"].json()["error"]["message"] == "RuntimeError: engine down"
    assert r["garbage"].status_code == 400 and "bad /inference/v1/generate" in r["garbage"].json()["error"]["message"]
    assert r["field"].status_code == 400 and "sampling_params.seed" in r["field"].json()["error"]["message"]
    assert r["huge"].status_code == 413 and r["get"].status_code == 405 and r["missing"].status_code == 404
    assert [q.prompt_ids for q in seen] == [[1, 5], [9], [8]] and app.requests == 3  # bad bodies never reach it
    assert seen[0].headers["x-session-id"] == "s1"
    assert GenerateApp(handler, model="pol").max_model_len is None
    with pytest.raises(TypeError, match="handler"):
        GenerateApp("not a function", model="pol")


def test_endpoint_serves_over_loopback_http_with_keep_alive():
    """The uvicorn-served endpoint: a real socket, one keep-alive connection for every request, a clean close."""
    pytest.importorskip("uvicorn", reason="the envs extra is not installed: pip install 'moe_rl[envs]'")
    ports: list[int] = []

    async def main():
        ep = GenerateEndpoint(_echo_or_fail, model="pol", max_model_len=64)
        with pytest.raises(RuntimeError, match="not started"):
            _ = ep.base_url
        async with ep, httpx.AsyncClient(timeout=10) as http:
            root = ep.base_url.removesuffix("/v1")
            assert ep.base_url == f"http://127.0.0.1:{ep.port}/v1" and ep.port > 0

            async def trace(name, info):  # httpcore's trace hook: note each new TCP connection's local port
                if name == "connection.connect_tcp.complete":
                    ports.append(info["return_value"].get_extra_info("client_addr")[1])

            async def post(ids):
                return await http.post(f"{root}/inference/v1/generate", json={"token_ids": ids},
                                       extensions={"trace": trace})

            models = (await http.get(f"{ep.base_url}/models", extensions={"trace": trace})).json()
            replies = [await post([1, 5]), await post([9]), await post([8]), await post([3])]
        with pytest.raises(RuntimeError, match="not started"):
            _ = ep.base_url
        return models, replies, ep.requests

    models, replies, n = asyncio.run(main())
    assert models["data"][0]["max_model_len"] == 64
    assert [r.status_code for r in replies] == [200, 400, 500, 200] and n == 4
    assert replies[3].json()["choices"][0]["token_ids"] == [4, 2]
    assert len(ports) == 1  # one TCP connection opened: keep-alive served all five requests


def test_endpoint_arguments_are_checked():
    with pytest.raises(ValueError, match="shutdown_timeout_s"):
        GenerateEndpoint(_echo_or_fail, model="pol", shutdown_timeout_s=0)
    with pytest.raises(TypeError, match="handler"):
        GenerateEndpoint(None, model="pol")


def test_missing_verifiers_names_the_extra(monkeypatch):
    from moe_rl.envs.verifiers_env import make_env

    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers.v1 -> ImportError
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ImportError, match=r"pip install 'moe_rl\[envs\]'"):
        make_env(TOK, env={"taskset": {"id": "vf_tiny_chain"}}, max_tokens=4)


# ---------------------------------------------------------------- the adapter (needs verifiers)
class ScriptEngine:
    """Answers every prompt with ``reply(prompt_text)`` + ``<eos>``; logs each request's arguments."""

    def __init__(self, reply=lambda text: "7", fail_after=None):
        self.reply = reply
        self.requests = []
        self.fail_after = fail_after

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt=None, seed=None, stop_token_ids=None):
        self.requests.append({"prompt": list(prompt_ids), "n": n, "max_tokens": max_tokens, "salt": cache_salt,
                              "seed": seed, "stop": stop_token_ids, "temperature": temperature})
        if self.fail_after is not None and len(self.requests) > self.fail_after:
            raise ConnectionError("engine unreachable")
        ids = (TOK.encode(self.reply(TOK.decode(prompt_ids, stop_at_eos=False)), bos=False) + [TOK.eos_id])
        return [completion(ids[:max_tokens], "stop" if len(ids) <= max_tokens else "length") for _ in range(n)], 0


@pytest.fixture(scope="module")
def loop():
    """One event loop for every episode of this module, as in a run (renderers keeps loop-bound module state)."""
    with asyncio.Runner() as runner:
        yield runner


@pytest.fixture(scope="module")
def vf_env(loop):
    pytest.importorskip("verifiers", reason="the envs extra is not installed: pip install 'moe_rl[envs]'")
    sys.path.insert(0, str(HERE))  # verifiers imports the taskset/harness plugin `vf_tiny_chain` by module name
    try:
        from moe_rl.envs.verifiers_env import make_env

        env = make_env(TOK, env={"taskset": {"id": "vf_tiny_chain"}}, max_tokens=4)
        yield env
        loop.run(env.aclose())
    finally:
        sys.path.remove(str(HERE))


def _play(loop, env, engine, n=4, seed=3, **kw):
    return loop.run(run_group(env, env.train_tasks[0], n, engine, seed=seed, cache_salt="salt-v0", **kw))


def oracle(text):
    """The right answer to the last turn of the decoded conversation (``a+b=`` or ``a+b=<sum>+c=``; the decoder
    drops <bos>/<eos>): the sum of the last ``x+y`` before ``=``."""
    return str(sum(int(x) for x in text.split("=")[-2].split("+")))


def test_episode_carries_salt_and_distinct_seeds_and_forms_one_sample(vf_env, loop):
    eng = ScriptEngine(oracle)
    eps = _play(loop, vf_env, eng, n=4)
    task = vf_env.train_tasks[0]
    assert all(e.error is None for e in eps), [e.error for e in eps]
    for e in eps:
        assert e.result.reward == 1.0 and e.result.stop_reason == "answered"
        assert e.result.rewards == {"correct": 1.0} and e.result.metrics["vf_model_calls"] == 2.0
        (first, second) = e.calls
        assert TOK.decode(first.prompt_ids) == task.data.prompt
        # turn 2's prompt extends turn 1 (prompt + completion + the step), so the episode is one sample
        assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids)
        (sample,) = interleave_calls(e.calls)
        assert sample.completion_mask.count(True) == len(first.completion_ids) + len(second.completion_ids)
    assert {r["salt"] for r in eng.requests} == {"salt-v0"}
    assert eng.requests[0]["n"] == 4  # the identical first requests go out as one request for the group
    later = [r["seed"] for r in eng.requests[1:]]
    assert len(later) == 4 and len(set(later)) == 4  # a distinct seed per sample
    assert all(r["stop"] == [TOK.eos_id] and r["max_tokens"] == 4 for r in eng.requests)


def test_sampled_special_tokens_keep_the_episode_one_sample(vf_env, loop):
    """<pad>/<bos> sampled inside an answer stay in verifiers' text, so turn 2's prompt still extends turn 1."""
    answer = TOK.encode("4", bos=False) + [TOK.pad_id, TOK.bos_id, TOK.eos_id]

    class Specials(ScriptEngine):
        async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt=None, seed=None,
                           stop_token_ids=None):
            await super().generate(prompt_ids, n, max_tokens, temperature, cache_salt, seed, stop_token_ids)
            return [completion(list(answer)) for _ in range(n)], 0

    eps = _play(loop, vf_env, Specials(), n=2)
    for e in eps:
        assert e.error is None, e.error
        first, second = e.calls
        assert first.completion_ids == answer
        assert second.prompt_ids[:len(first.prompt_ids) + len(answer)] == first.prompt_ids + answer
        assert len(interleave_calls(e.calls)) == 1


# a template that re-renders history: a past answer "<work>=<answer>" keeps only "<answer>" (as a template that
# strips past <think> blocks), so turn 2's prompt no longer extends turn 1's tokens
STRIP_TEMPLATE = ("<bos>{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'].split('=')[-1] }}"
                  "{{ eos_token }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")


def test_a_re_rendering_template_makes_each_turn_a_sample(loop):
    pytest.importorskip("verifiers", reason="the envs extra is not installed: pip install 'moe_rl[envs]'")
    sys.path.insert(0, str(HERE))
    try:
        from moe_rl.envs.verifiers_env import make_env

        env = make_env(TOK, env={"taskset": {"id": "vf_tiny_chain"}}, max_tokens=8, chat_template=STRIP_TEMPLATE)
        eng = ScriptEngine(lambda text: "9=" + oracle(text))  # the history holds no "9=": it was stripped
        eps = _play(loop, env, eng, n=2)
        loop.run(env.aclose())
    finally:
        sys.path.remove(str(HERE))
    for e in eps:
        assert e.error is None, e.error
        first, second = e.calls
        answer1 = TOK.decode(first.completion_ids).split("=")[-1]
        # turn 2's prompt holds turn 1's answer without its work: not an extension of turn 1's tokens
        assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
        assert second.prompt_ids[len(first.prompt_ids):][: len(answer1) + 1] == TOK.encode(answer1, bos=False) + [
            TOK.eos_id]
        s1, s2 = interleave_calls(e.calls)  # two trajectories: each trains as one sample
        assert s1.prompt_ids == first.prompt_ids and s1.completion_ids == first.completion_ids
        assert s2.prompt_ids == second.prompt_ids and s2.completion_ids == second.completion_ids
        assert s1.completion_mask == [True] * len(first.completion_ids)
        assert s2.completion_mask == [True] * len(second.completion_ids)
        assert s2.completion_logprobs == second.logprobs and s2.branched_from is None


def test_max_tokens_is_clamped_to_the_engine_context(vf_env, loop):
    eng = ScriptEngine(oracle)
    eps = _play(loop, vf_env, eng, n=1, max_model_len=15)
    assert eps[0].error is None, eps[0].error
    # turn 2's prompt is 7 + 3 + 3 tokens: 2 of the 4 tokens the environment asks for fit
    assert [len(r["prompt"]) + r["max_tokens"] for r in eng.requests] == [11, 15]


def test_engine_failure_fails_the_episode_as_an_engine_error(vf_env, loop):
    eps = _play(loop, vf_env, ScriptEngine(oracle, fail_after=1), n=2)
    assert [e.error_kind for e in eps] == ["engine", "engine"], [e.error for e in eps]
    assert all(e.result is None for e in eps)


def test_distribution_changing_sampling_parameters_are_refused(vf_env, loop):
    from moe_rl.envs.verifiers_env import VerifiersEnv

    env = VerifiersEnv(TOK, env={"taskset": {"id": "vf_tiny_chain"}, "agent": {"sampling": {"top_p": 0.5}}},
                       max_tokens=4)
    eng = ScriptEngine(oracle)
    (ep,) = _play(loop, env, eng, n=1)
    loop.run(env.aclose())
    assert ep.error_kind == "env" and "top_p=0.5" in ep.error and not eng.requests


def test_bad_arguments_are_named(vf_env, loop):
    from moe_rl.envs.verifiers_env import VerifiersEnv

    with pytest.raises(ValueError, match="taskset"):
        VerifiersEnv(TOK, env={}, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        VerifiersEnv(TOK, env={"taskset": {"id": "vf_tiny_chain"}}, max_tokens=0)
    with pytest.raises(ValueError, match="heldout_percent"):
        VerifiersEnv(TOK, env={"taskset": {"id": "vf_tiny_chain"}}, max_tokens=4, heldout_percent=90)


# ---------------------------------------------------------------- end to end: moe-rl rl on the real vLLM CPU server
STEPS = 3


@pytest.mark.slow
@pytest.mark.vllm
def test_verifiers_env_trains_with_router_replay_on_vllm(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("verifiers", reason="the envs extra is not installed: pip install 'moe_rl[envs]'")
    from moe_rl.rl.batch import read_batch

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_rl.cli", "rl", "@", "recipes/debug_cpu/rl.toml", "--output-dir", str(out),
           "--max-steps", str(STEPS), "--env", "moe_rl.envs.verifiers_env:make_env",
           "--env-args", json.dumps({"env": {"taskset": {"id": "vf_tiny_chain"}}, "max_tokens": 4}),
           "--trainer.router-replay", "true", "--sft.enabled", "false", "--orchestrator.batch-size", "16",
           "--orchestrator.group-size", "4", "--orchestrator.max-inflight", "4",
           "--orchestrator.partial-groups", "drop_group"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert r["rollouts_started"] == (r["rollouts_trained"] + r["rollouts_dropped"] + r["rollouts_withheld"]
                                         + r["rollouts_inflight"])
        # every trained sample: both turns of the verifiers episode, one complete stitched routing record
        assert r["multiturn_turns"] == 2 * r["multiturn_samples"] > 0
        assert r["multiturn_routed_experts_stitched"] == r["multiturn_samples"]
        assert r["multiturn_routed_experts_missing_turn"] == r["multiturn_routed_experts_incomplete"] == 0
        assert r["multiturn_branches"] == 0  # verifiers' re-rendered turn 2 extends turn 1: one sample per episode
        assert r["episodes_env_vf_model_calls"] == 2 * (r["episodes_episodes"] - r.get("episodes_errors_env", 0)
                                                        - r.get("episodes_errors_engine", 0))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollouts_trained"] == STEPS * 16 and summary["engine_errors"] == 0
    for step in range(STEPS):
        b = read_batch(out / "batches" / f"step_{step}.safetensors")
        for i in range(b.num_samples):
            model = (b.token_versions[i] >= 0).tolist()  # predicted positions of model tokens
            n = max(j for j, m in enumerate(model) if m) + 2
            lm = b.loss_mask[i, : n - 1].tolist()
            runs = [lm[0]] + [lm[j] for j in range(1, n - 1) if lm[j] != lm[j - 1]]
            assert runs == [False, True, False, True], runs  # prompt, turn 1, the env's step, turn 2
            assert b.routed_experts_state[i, : n - 1].eq(0).all()  # complete routing on every forwarded token
            assert b.routed_experts_state[i, n - 1:].eq(-1).all()
