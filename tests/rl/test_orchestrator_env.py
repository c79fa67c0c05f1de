"""The orchestrator on the environment protocol: the calculator environment (real tool sandbox) against a
scripted noisy engine and a fake trainer. Every trained sample is one episode whose loss mask covers exactly the
model's turns (tool results off the mask), rewards are the environment's, stop reasons and tool faults are
counted, and the rollout accounting holds."""

import asyncio
import json
import random
from types import SimpleNamespace

from _fake_engine import finish_step

from moe_rl.envs import CharTokenizer
from moe_rl.envs.calculator import make_env
from moe_rl.rl.batch import batch_path, read_batch
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths

TOK = CharTokenizer()


class NoisyExpert:
    """Per completion: the expert's tool call or answer; a wrong answer with probability 0.3; on a problem's first
    request, the first completion bombs the tool (``[9**99]``: 95 digits, more than the 64-byte output cap).
    Random latency; version segments of the served version; ``fail_first``: the first request raises."""

    def __init__(self, rng, fail_first=False):
        self.rng = rng
        self.version = 0
        self.requests = 0
        self.fail_first = fail_first

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed, stop_token_ids=None):
        self.requests += 1
        req = self.requests
        assert cache_salt and stop_token_ids == [TOK.encode("]", bos=False)[0]]
        v0 = self.version
        await asyncio.sleep(self.rng.random() * 0.005)
        if self.fail_first and req == 1:
            raise ConnectionError("engine down")
        text = TOK.decode(list(prompt_ids), stop_at_eos=False)
        value, step = text[text.rfind("=") + 1:].split("|")
        out = []
        for i in range(n):
            if step == ".":
                ans = value if self.rng.random() > 0.3 else str(int(value) + 1)
                ids = TOK.encode(ans, bos=False) + [TOK.eos_id]
            elif i == 0 and n > 1:
                ids = TOK.encode("[9**99]", bos=False)
            else:
                ids = TOK.encode(f"[{value}{step[:-1]}]", bos=False)
            out.append(SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                                       version_segments=[(v0, 0)], routed_experts=None))
        return out, 0

    async def update_weights(self, path, version):
        self.version = version
        return {"version": version}

    async def weight_version(self):
        return self.version


def _run(tmp_path, engine, steps=3):
    env = make_env(TOK, max_ops=6, max_concurrent_tools=4, tool_output_bytes=64, tool_wall_s=30.0)
    cfg = OrchestratorConfig(batch_size=8, group_size=4, max_inflight=4, max_off_policy_steps=1,
                             engine_probe=False, partial_groups="survivors")
    paths = RunPaths(tmp_path)
    orch = Orchestrator(cfg, env, engine, paths, max_steps=steps, seed=0, run_id="env", max_model_len=512)
    batches = []

    async def trainer():
        for step in range(steps):
            while not batch_path(paths.batches, step).exists():
                await asyncio.sleep(0.005)
            b = read_batch(batch_path(paths.batches, step))
            batches.append(b)
            finish_step(paths, step, int(b.input_ids.numel()))

    async def main():
        t = asyncio.create_task(trainer())
        out = await asyncio.wait_for(orch.run(), timeout=240)
        await t
        return out

    return asyncio.run(main()), batches, paths


def test_calculator_episodes_train_as_one_masked_sample_each(tmp_path):
    summary, batches, paths = _run(tmp_path, NoisyExpert(random.Random(0)))
    ep = summary["episodes"]
    assert ep["stop_tool_error"] >= 1 and ep["env_tool_fault_output_too_large"] == ep["stop_tool_error"]
    assert ep["stop_answered"] >= 1 and sum(v for k, v in ep.items() if k.startswith("stop_")) == ep["episodes"]
    assert summary["rollouts_trained"] == 3 * 8 and summary["engine_errors"] == 0
    for b in batches:
        for row in range(b.input_ids.shape[0]):
            ids = b.input_ids[row].tolist()
            mask = b.loss_mask[row].tolist()
            n = int(b.attention_mask[row].sum()) if hasattr(b, "attention_mask") else len(ids)
            text = TOK.decode(ids[:n], stop_at_eos=False)
            # position j of the mask predicts token j + 1: the trained tokens are the model's turns
            trained = "".join(TOK.decode([ids[j + 1]], stop_at_eos=False) or "E" for j in range(len(mask)) if mask[j])
            calls = "".join(seg for seg in _model_turns(text))
            assert trained == calls, (text, trained, calls)
            assert float(b.rewards[row]) in (0.0, 1.0) or 0.0 < float(b.rewards[row]) < 1.0
    metrics = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert metrics[-1]["episodes_stop_answered"] == ep["stop_answered"]
    rollouts = [json.loads(x) for x in paths.rollouts.read_text().splitlines()]
    assert rollouts and all(len(r["episode_s"]) == 4 and min(r["episode_s"]) > 0 for r in rollouts)


def _model_turns(text):
    """The model's turns in a calculator transcript: each ``[...]`` call, and the final answer + EOS ('E')."""
    out = []
    i = 0
    while i < len(text):
        if text[i] == "[":
            j = text.index("]", i)
            out.append(text[i:j + 1])
            i = j + 1
        elif text[i] == "." and text[i - 1] == "|":
            out.append(text[i + 1:].split("<")[0] + "E")
            break
        else:
            i += 1
    return out


def test_a_failed_first_request_loses_its_group_as_one_engine_error(tmp_path):
    summary, batches, _ = _run(tmp_path, NoisyExpert(random.Random(1), fail_first=True), steps=1)
    assert summary["engine_errors"] == 1 and summary["rollouts_dropped_by_reason"].get("error") == 4
    assert summary["episodes"]["errors_engine"] == 4
