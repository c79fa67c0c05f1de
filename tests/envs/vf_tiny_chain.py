"""A tiny offline ``verifiers`` (v1) environment for moe_rl's tests: chained addition over moe_rl's character
alphabet, played by an in-process chat harness (no program launch, no package download, no network).

Taskset and harness id: ``vf_tiny_chain`` (verifiers imports plugins by top-level module name, so this folder must
be on ``sys.path``). A task: ``prompt = "12+34="``, then ``steps`` follow-up user turns such as ``"+5="``; the
model answers each with the running sum. Reward (``correct``): the fraction of turns answered exactly; metric
``answered_turns``.
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

__all__ = ["ChainHarness", "ChainTaskset"]

NUM_TASKS = 64


class ChainData(vf.TaskData):
    steps: list[str] = []
    """The follow-up user turns (``"+5="``)."""
    answers: list[int] = []
    """The running sum after the prompt and after each step."""


class ChainTask(vf.Task[ChainData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.messages if m.role == "assistant"]
        hits = sum(r.strip() == str(a) for r, a in zip(replies, self.data.answers, strict=False))
        trace.record_metric("answered_turns", float(len(replies)))
        return hits / len(self.data.answers)


class ChainTaskset(vf.Taskset[ChainTask]):
    """``NUM_TASKS`` problems with one follow-up step each (2 model turns), reproducible (seed 0)."""

    def load(self):
        rng = random.Random(0)
        for i in range(NUM_TASKS):
            a, b, c = rng.randint(10, 49), rng.randint(10, 49), rng.randint(1, 9)
            yield ChainTask(ChainData(id=str(i), prompt=f"{a}+{b}=", steps=[f"+{c}="], answers=[a + b, a + b + c]),
                            self.config.task)


class ChainHarness(vf.Harness[vf.HarnessConfig]):
    """Plays the task's prompt and then each step as a user turn, through the interception endpoint, in process."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_unused) -> ProgramResult:
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            messages = [{"role": "user", "content": data.prompt}]
            for step in [*data.steps, None]:
                r = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
                if step is not None:
                    messages.append({"role": "user", "content": step})
        finally:
            await client.close()
        return ProgramResult(0, "", "")
