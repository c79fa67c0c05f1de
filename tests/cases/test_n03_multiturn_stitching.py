"""N03: multi-turn stitching when the chat template is not append-only.

moe_rl builds multi-turn samples token-in/token-out (:class:`moe_rl.runtime.orchestrator.Orchestrator`, mode (a) of the
case): turn ``k``'s request is the previous request's tokens + the tokens the engine sampled + the environment's
tokens, never a re-render of the history, so a template that strips ``<think>`` from past assistant turns cannot
change what the trainer sees. There is no re-rendering harness in moe_rl (mode (b) does not exist here).

The toy template of the case, tokenized one character per token (a byte-level tokenizer):
``<|im_start|>{role}\\n{content}<|im_end|>`` joined with ``\\n``; the engine samples ``<think>p</think>A<|im_end|>``
then ``<think>q</think>B<|im_end|>``; the tool message is ``R``. Checked against the engine's recorded request log:

* one sample, whose tokens are exactly turn-1 prompt + ``<think>p</think>A<|im_end|>`` +
  ``\\n<|im_start|>tool\\nR<|im_end|>\\n<|im_start|>assistant\\n`` + ``<think>q</think>B<|im_end|>``;
* the loss mask is 1 on the two sampled spans only; "A" appears once; every ``<|im_end|>`` followed by another
  message is followed by ``\\n``;
* turn 2's engine context is byte-equal to the sample's prefix, and the training row
  (:func:`moe_rl.rl.batch.build_batch`) is byte-equal to the last engine context + its output, with the engine's
  logprobs at exactly the sampled positions.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import torch
from _fake_engine import FakeCompletion

from moe_rl.rl.batch import build_batch
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths

PROMPT = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
TURN1 = "<think>p</think>A<|im_end|>"
TOOL = "\n<|im_start|>tool\nR<|im_end|>\n<|im_start|>assistant\n"
TURN2 = "<think>q</think>B<|im_end|>"


def enc(s: str) -> list[int]:
    return [ord(c) for c in s]


def dec(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


@dataclass
class _Cfg:
    max_new_tokens: int = 64


class ToolTask:
    """Two turns: the user question, then one tool message (the environment's tokens, appended as they are)."""

    num_turns = 2
    cfg = _Cfg()

    def sample(self, rng: random.Random) -> str:
        return "Q"

    def prompt_ids(self, problem: Any) -> list[int]:
        return enc(PROMPT)

    def turn_ids(self, problem: Any, turn: int) -> list[int]:
        assert turn == 1
        return enc(TOOL)

    def reward_turns(self, problem: Any, answers: list[list[int]]) -> float:
        return float(dec(answers[-1]).endswith("B<|im_end|>"))


class LoggingEngine:
    def __init__(self) -> None:
        self.log: list[dict] = []

    def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        turn = len(self.log)
        out = enc(TURN1 if turn == 0 else TURN2)
        lps = [-(turn + 1) - j / 100 for j in range(len(out))]
        self.log.append({"prompt": list(prompt_ids), "out": out, "lps": lps})

        async def answer():
            return [FakeCompletion(out, lps, version_segments=[(0, 0)])], 0

        return answer()


def _run(tmp_path):
    engine = LoggingEngine()
    cfg = OrchestratorConfig(batch_size=1, group_size=1, max_off_policy_steps=1, engine_probe=False)
    orch = Orchestrator(cfg, ToolTask(), engine, RunPaths(tmp_path), max_steps=1, seed=0, run_id="n03")

    async def go():
        orch.buffer.start(0, 0, 1, prompt="Q")
        await orch._rollout(0, "Q", 0, 5)

    asyncio.run(go())
    (group,) = orch.buffer.take(1, consume_version=0)
    return engine, group


def test_n03_token_in_token_out_sample_is_exactly_what_the_engine_saw(tmp_path):
    engine, group = _run(tmp_path)
    (s,) = group.samples  # one sample for the whole conversation
    full = dec(s.prompt_ids + s.completion_ids)
    assert full == PROMPT + TURN1 + TOOL + TURN2
    assert full.count("A") == 1 and full.count("B") == 1
    ends = [i for i in range(len(full)) if full.startswith("<|im_end|>", i)]
    for i in ends[:-1]:  # every <|im_end|> followed by another message is followed by "\n"
        assert full[i + len("<|im_end|>")] == "\n"
    mask = "".join("1" if m else "0" for m in s.completion_mask)
    assert mask == "1" * len(TURN1) + "0" * len(TOOL) + "1" * len(TURN2)
    # the engine's contexts, byte for byte
    assert [dec(e["prompt"]) for e in engine.log] == [PROMPT, PROMPT + TURN1 + TOOL]
    assert engine.log[1]["prompt"] + engine.log[1]["out"] == s.prompt_ids + s.completion_ids


def test_n03_training_row_is_the_engine_context_with_its_logprobs(tmp_path):
    engine, group = _run(tmp_path)
    batch = build_batch([group], step=0, pad_id=0)
    last = engine.log[-1]
    row = batch.input_ids[0].tolist()
    assert row == last["prompt"] + last["out"]  # the trainer recomputes logprobs on exactly this context
    p = len(enc(PROMPT))
    predicted = batch.loss_mask[0].nonzero().flatten().tolist()
    spans = list(range(p - 1, p - 1 + len(TURN1))) + list(
        range(p - 1 + len(TURN1) + len(TOOL), p - 1 + len(TURN1) + len(TOOL) + len(TURN2)))
    assert predicted == spans
    lps = batch.inference_logprobs[0][batch.loss_mask[0]].tolist()
    want = torch.tensor(engine.log[0]["lps"] + engine.log[1]["lps"], dtype=torch.float32).tolist()
    assert lps == want  # the engine's values, stored in the batch's fp32
