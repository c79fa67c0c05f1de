"""Seeded random rollout groups for the trainer tests (``tests/trainer/test_chunked_logprobs.py``,
``tests/trainer/test_rl_trainer_parallel.py``): fixed prompt/completion lengths, random token ids, sampler
log-probabilities and rewards, so that a batch built from them has a known padded length."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def random_groups(
    rng: np.random.Generator,
    lengths: Sequence[tuple[int, int]],
    vocab: int,
    *,
    group_size: int = 4,
    extra: Callable[[int, int, int, int], dict[str, Any]] | None = None,
) -> list:
    """``len(lengths) // group_size`` :class:`moe_rl.rl.buffer.RolloutGroup` s (ids 0, 1, ..., version 0, cache_salt
    ``"s"``) of ``group_size`` samples each; sample ``j`` of group ``gid`` has the ``(prompt, completion)`` lengths
    ``lengths[group_size * gid + j]``.

    Each sample draws, from ``rng`` in this order: the prompt (``[1]`` then ids in ``[3, vocab)``), the completion
    (ids in ``[3, vocab)``), whatever ``extra(gid, j, prompt_len, completion_len)`` draws (it returns more
    :class:`moe_rl.rl.buffer.Sample` keyword arguments, e.g. a ``routed_experts`` record), the completion's sampler
    log-probabilities (uniform in ``(-2, 0]``) and the reward (uniform in ``[0, 1)``).
    """
    from moe_rl.rl.buffer import RolloutGroup, Sample

    groups = []
    for gid in range(len(lengths) // group_size):
        samples = []
        for j in range(group_size):
            p, c = lengths[group_size * gid + j]
            prompt = [1] + rng.integers(3, vocab, size=p - 1).tolist()
            comp = rng.integers(3, vocab, size=c).tolist()
            kw = extra(gid, j, p, c) if extra is not None else {}
            samples.append(Sample(prompt, comp, (-rng.random(c) * 2.0).tolist(), reward=float(rng.random()), **kw))
        groups.append(RolloutGroup(gid, 0, "s", samples))
    return groups
