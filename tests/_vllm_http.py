"""Shared by the tests that drive a running vLLM server over HTTP (``tests/inference/test_vllm_server.py``,
``tests/inference/test_pause_broadcast_vllm.py``): the prompts, and the client plumbing."""

from __future__ import annotations

import asyncio

PROMPTS = [
    [1, 4, 5, 13, 6, 15],
    [1] + list(range(3, 16)) * 3,
    [1, 10, 10, 10, 14, 9, 15],
]
MAX_TOKENS = 12


def run_with_client(coro_fn, server):
    """``asyncio.run`` of ``coro_fn(client)`` with a ``VllmClient`` of ``server`` (closed afterwards)."""
    from moe_rl.inference import VllmClient

    async def main():
        async with VllmClient(server.base_url) as client:
            return await coro_fn(client)

    return asyncio.run(main())


async def greedy_over_http(client, salt: str) -> tuple[list[list[int]], list]:
    """Greedy completions (``MAX_TOKENS`` tokens, EOS ignored) of every prompt of ``PROMPTS`` under cache salt
    ``salt``, sent together: ``(token ids per prompt, log-probs per prompt)``."""
    outs = await asyncio.gather(
        *[client.generate(p, n=1, max_tokens=MAX_TOKENS, temperature=0.0, cache_salt=salt,
                          extra_body={"ignore_eos": True}) for p in PROMPTS]
    )  # fmt: skip
    return [c[0].token_ids for c, _ in outs], [c[0].logprobs for c, _ in outs]
