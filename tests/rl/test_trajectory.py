"""Trajectory interleaving by token prefix (``moe_rl.rl.trajectory.interleave_calls``).

Each case checks exact masks, log-probs, per-token versions and routed-expert rows. The fake engine's routing is a
causal function of the tokens: the row of position ``t`` depends only on ``tokens[: t + 1]`` (as a real forward
pass), so the expected record of any sample is that function over the sample's own tokens, whatever mix of engine
records and copied rows produced it; the last token's row is a placeholder.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_rl.replay import RoutedExperts
from moe_rl.rl.trajectory import ModelCall, TrajectorySample, interleave_calls

E, LAYERS, K = 8, 2, 2


def route(prefix: list[int]) -> list[list[int]]:
    """``[LAYERS, K]`` distinct expert ids of the token closing ``prefix`` (a function of the whole prefix)."""
    seed = sum((i + 1) * 31 * t for i, t in enumerate(prefix)) % 10007
    out = []
    for layer in range(LAYERS):
        a = (seed + layer) % E
        out.append([a, (a + 1 + seed % (E - 1)) % E])
    return out


def expected_rows(tokens: list[int]) -> np.ndarray:
    rows = [route(tokens[: t + 1]) for t in range(len(tokens) - 1)] + [[[-1] * K] * LAYERS]
    return np.array(rows, dtype=np.int64)


def call(prompt, completion, lps, version=0, *, start=0, segments=None, temperature=1.0, rows=True) -> ModelCall:
    """A model call whose engine record covers positions ``[start, n)`` (last row a placeholder)."""
    tokens = list(prompt) + list(completion)
    rec = None
    if rows:
        rec = RoutedExperts.from_array(expected_rows(tokens)[start:], E, start=start)
    return ModelCall(prompt, completion, lps, version, version_segments=segments, routed_experts=rec,
                     temperature=temperature, finish_reason="stop")


def check_rows(s: TrajectorySample) -> None:
    assert s.routing == "stitched"
    tokens = s.prompt_ids + s.completion_ids
    assert s.routed_experts.start == 0 and s.routed_experts.shape == (len(tokens), LAYERS, K)
    assert np.array_equal(s.routed_experts.to_numpy(np.int64), expected_rows(tokens))
    assert s.routed_experts.row_valid.tolist() == [True] * (len(tokens) - 1) + [False]


def test_extend_appends_env_tokens_masked_then_the_completion():
    calls = [call([1, 2, 3], [10, 11], [-0.1, -0.2], 0),
             call([1, 2, 3, 10, 11, 20, 21], [12], [-0.3], 1, start=4)]  # delta record from the last sampled token
    (s,) = interleave_calls(calls)
    assert s.prompt_ids == [1, 2, 3]
    assert s.completion_ids == [10, 11, 20, 21, 12]
    assert s.completion_mask == [True, True, False, False, True]
    assert s.completion_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert s.token_versions == [0, 0, -1, -1, 1]
    assert s.version_segments == [(0, 0), (1, 4)]
    assert s.calls == [0, 1] and s.branched_from is None
    check_rows(s)


def test_break_re_rendered_history_starts_a_new_sample():
    think, close, eos = 50, 52, 9
    first = call([1, 2], [think, 51, close, 60, eos], [-0.1, -0.2, -0.3, -0.4, -0.5], 0)
    # the template strips the past <think>...</think>: the prompt no longer extends the first sample
    second = call([1, 2, 60, eos, 70], [61, eos], [-0.6, -0.7], 1, start=2)  # engine cached [1, 2]
    s0, s1 = interleave_calls([first, second])
    assert s0.prompt_ids == [1, 2] and s0.completion_ids == [think, 51, close, 60, eos]
    assert s0.completion_mask == [True] * 5 and s0.completion_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert s0.token_versions == [0] * 5
    assert s1.prompt_ids == [1, 2, 60, eos, 70] and s1.completion_ids == [61, eos]
    assert s1.completion_mask == [True, True] and s1.completion_logprobs == [-0.6, -0.7]
    assert s1.token_versions == [1, 1] and s1.branched_from is None
    check_rows(s0)
    check_rows(s1)  # rows 0-1 copied from the first sample (shared prefix), the rest from the engine


def test_interleaved_agents_each_extend_their_own_sample():
    calls = [call([1, 2], [10], [-0.1], 0), call([5, 6], [20], [-0.2], 0),
             call([1, 2, 10, 3], [11], [-0.3], 1, start=2), call([5, 6, 20, 7], [21], [-0.4], 2, start=2)]
    a, b = interleave_calls(calls)
    assert (a.prompt_ids, a.completion_ids, a.completion_mask) == ([1, 2], [10, 3, 11], [True, False, True])
    assert a.completion_logprobs == [-0.1, 0.0, -0.3] and a.token_versions == [0, -1, 1]
    assert (b.prompt_ids, b.completion_ids, b.completion_mask) == ([5, 6], [20, 7, 21], [True, False, True])
    assert b.completion_logprobs == [-0.2, 0.0, -0.4] and b.token_versions == [0, -1, 2]
    assert a.calls == [0, 2] and b.calls == [1, 3]
    check_rows(a)
    check_rows(b)


def test_longest_matching_prefix_wins():
    calls = [call([1, 2], [10], [-0.1], 0),
             call([1, 2], [10, 11], [-0.2, -0.3], 0),  # a second sample of the same prompt, longer
             call([1, 2, 10, 11, 30], [12], [-0.4], 0, start=3),  # extends both: the longer one wins
             call([1, 2, 10, 40], [13], [-0.5], 0, start=2)]  # extends only the first
    s0, s1 = interleave_calls(calls)
    assert s1.completion_ids == [10, 11, 30, 12] and s1.completion_mask == [True, True, False, True]
    assert s1.completion_logprobs == [-0.2, -0.3, 0.0, -0.4] and s1.calls == [1, 2]
    assert s0.completion_ids == [10, 40, 13] and s0.completion_mask == [True, False, True]
    assert s0.completion_logprobs == [-0.1, 0.0, -0.5] and s0.calls == [0, 3]
    check_rows(s0)
    check_rows(s1)


@pytest.mark.parametrize("branch", ["train", "mask"])
def test_rollback_branches_with_the_prefix_rows_and_versions(branch):
    calls = [call([1, 2], [10, 11], [-0.1, -0.2], 0),
             call([1, 2, 10, 11, 30], [12, 13], [-0.3, -0.4], 1, start=3),
             # roll back to the state after the first call, with another env message; the engine cached 4 tokens
             call([1, 2, 10, 11, 31], [14], [-0.5], 2, start=4)]
    s0, s1 = interleave_calls(calls, branch=branch)
    assert s0.completion_ids == [10, 11, 30, 12, 13] and s0.token_versions == [0, 0, -1, 1, 1]
    assert s1.branched_from == 0
    if branch == "train":
        assert s1.prompt_ids == [1, 2] and s1.completion_ids == [10, 11, 31, 14]
        assert s1.completion_mask == [True, True, False, True]
        assert s1.completion_logprobs == [-0.1, -0.2, 0.0, -0.5]
        assert s1.token_versions == [0, 0, -1, 2] and s1.version_segments == [(0, 0), (2, 3)]
        assert s1.calls == [0, 2]
    else:
        assert s1.prompt_ids == [1, 2, 10, 11, 31] and s1.completion_ids == [14]
        assert s1.completion_mask == [True] and s1.completion_logprobs == [-0.5] and s1.token_versions == [2]
        assert s1.calls == [2]
    check_rows(s0)
    check_rows(s1)  # row 3 (token 11) was forwarded by the second call only: copied from sample 0


def test_errored_rollout_trains_nothing():
    calls = [call([1, 2], [10], [-0.1], 0), call([1, 2, 10, 3], [11], [-0.2], 0)]
    assert interleave_calls(calls, errored=True) == []


def test_no_trajectory_is_none_not_an_empty_list():
    assert interleave_calls([]) is None
    assert interleave_calls([call([1, 2], [], [], 0)]) == []  # a call that sampled nothing trains nothing


def test_other_temperature_starts_a_new_sample():
    calls = [call([1, 2], [10], [-0.1], 0, temperature=1.0),
             call([1, 2, 10, 3], [11], [-0.2], 0, start=2, temperature=0.7)]
    s0, s1 = interleave_calls(calls)
    assert s0.temperature == 1.0 and s1.temperature == 0.7
    assert s1.prompt_ids == [1, 2, 10, 3] and s1.completion_ids == [11] and s1.completion_mask == [True]
    check_rows(s1)


def test_routing_status_and_version_errors():
    calls = [call([1, 2], [10], [-0.1], 0), call([1, 2, 10, 3], [11], [-0.2], 0, rows=False)]
    (s,) = interleave_calls(calls)
    assert s.routing == "missing_call" and s.routed_experts is None
    (s,) = interleave_calls([call([1, 2], [10], [-0.1], 0, rows=False)])
    assert s.routing == "not_recorded"
    (s,) = interleave_calls([call([1, 2], [10], [-0.1], 0), call([1, 2, 10, 3], [11], [-0.2], 0, start=3)])
    assert s.routing == "incomplete" and s.routed_experts is None  # row 2 (token 10) was never forwarded
    with pytest.raises(ValueError, match="versions never go back"):
        interleave_calls([call([1, 2], [10], [-0.1], 3, segments=[(3, 0)]),
                          call([1, 2, 10, 3], [11], [-0.2], 2, start=2, segments=[(2, 0)])])
    with pytest.raises(ValueError, match="one log-prob per sampled token"):
        interleave_calls([call([1, 2], [10, 11], [-0.1], 0)])
    with pytest.raises(ValueError, match="prompt"):
        interleave_calls([ModelCall([], [1], [-0.1], 0)])
    with pytest.raises(TypeError, match="ModelCall"):
        interleave_calls([{"prompt_ids": [1]}])
    with pytest.raises(ValueError, match="branch"):
        interleave_calls([call([1, 2], [10], [-0.1], 0)], branch="copy")


@pytest.mark.parametrize("seed", range(40))
def test_random_trajectories_keep_every_call_exact(seed):
    """Random rollouts mixing extensions, rollbacks, re-rendered histories and new agents: in every sample, each
    call it holds is a prefix of its tokens, the loss mask is exactly the union of those calls' completions with
    their log-probs and versions, every call is held by some sample, and the routed rows are the causal function of
    the sample's tokens."""
    import random

    rng = random.Random(seed)
    states: list[list[int]] = []  # token sequences after each call (prompt + completion)
    cuts: list[list[int]] = []  # completion ends within each state's lineage
    calls = []
    for i in range(rng.randint(1, 12)):
        op = rng.random() if states else 0.0
        if op < 0.2:  # a new agent / prompt
            prompt, lineage = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))], []
        else:
            j = rng.randrange(len(states))
            base, lineage = list(states[j]), list(cuts[j])
            if op < 0.6:  # extend
                pass
            elif op < 0.8:  # rollback to an earlier completion end
                b = rng.choice(lineage)
                base, lineage = base[:b], [c for c in lineage if c <= b]
            else:  # re-render: change one earlier token
                k = rng.randrange(len(base))
                base[k] = base[k] + 100
                lineage = [c for c in lineage if c <= k]
            prompt = base + [rng.randint(1, 6) for _ in range(rng.randint(0, 3))]
        completion = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        lps = [-(i + 1) - j / 10 for j in range(len(completion))]
        calls.append(call(prompt, completion, lps, version=i))
        states.append(prompt + completion)
        cuts.append(lineage + [len(prompt) + len(completion)])
    samples = interleave_calls(calls)
    held = set()
    for s in samples:
        tokens = s.prompt_ids + s.completion_ids
        p = len(s.prompt_ids)
        want_mask = [False] * len(tokens)
        want_lp = [0.0] * len(tokens)
        want_v = [-1] * len(tokens)
        for k in s.calls:
            c = calls[k]
            n0, n1 = len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)
            assert tokens[:n1] == list(c.prompt_ids) + list(c.completion_ids), (seed, k)
            want_mask[n0:n1] = [True] * (n1 - n0)
            want_lp[n0:n1] = list(c.logprobs)
            want_v[n0:n1] = [c.version] * (n1 - n0)
            held.add(k)
        assert s.completion_mask == want_mask[p:] and s.completion_logprobs == want_lp[p:]
        assert s.token_versions == want_v[p:]
        assert not any(want_mask[:p]) and s.completion_mask[0]
        check_rows(s)
    assert held == set(range(len(calls)))
