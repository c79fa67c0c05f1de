"""Chained (multi-turn) addition: problems, env segments, per-turn targets and rewards, config rules."""

import random

import pytest

from moe_rl.envs import (
    AdditionTask,
    AdditionTaskConfig,
    ChainedAdditionTask,
    ChainedAdditionTaskConfig,
    ChainedProblem,
    CharTokenizer,
    make_task,
)


def _task(**kw) -> ChainedAdditionTask:
    return ChainedAdditionTask(ChainedAdditionTaskConfig(**kw), CharTokenizer())


def test_turn_targets_segments_and_rewards_by_hand():
    task = _task(num_turns=3)
    tok = task.tok
    p = ChainedProblem(12, 34, (5, 70))
    assert task.prompt_ids(p) == tok.encode("12+34=", bos=True)
    assert [p.turn_answer(k) for k in range(3)] == ["46", "51", "121"]
    assert task.turn_ids(p, 1) == tok.encode("+5=", bos=False)
    assert task.turn_ids(p, 2) == tok.encode("+70=", bos=False)
    ans = [tok.encode("46", bos=False) + [tok.eos_id], tok.encode("50", bos=False) + [tok.eos_id],
           tok.encode("121", bos=False) + [tok.eos_id]]
    # turn 2 "50" vs "51": one of two digits in place -> 0.25; the others exact
    assert task.turn_reward(p, 1, ans[1]) == 0.25
    assert task.reward_turns(p, ans) == pytest.approx((1.0 + 0.25 + 1.0) / 3)
    assert _task(num_turns=3, reward="final").reward_turns(p, ans) == 1.0
    # targets are the true running sums: a wrong turn 1 does not shift turn 2's target
    wrong1 = [tok.encode("47", bos=False) + [tok.eos_id], ans[1][:1] + tok.encode("1", bos=False), ans[2]]
    assert task.reward_turns(p, wrong1) == pytest.approx((0.25 + 1.0 + 1.0) / 3)
    # the single-turn interface describes turn 1 (the SFT warm-up uses it)
    assert task.reward(p, ans[0]) == 1.0 and task.target_ids(p) == ans[0]
    with pytest.raises(ValueError, match="one per turn"):
        task.reward_turns(p, ans[:2])
    with pytest.raises(ValueError, match=r"turn=3 must be in \[1, 3\)"):
        task.turn_ids(p, 3)
    with pytest.raises(ValueError, match=r"turn=0 must be in \[1, 3\)"):
        task.turn_ids(p, 0)


def test_sampling_keeps_the_addition_split_and_draws_one_operand_per_turn():
    task = _task(num_turns=4)
    base = AdditionTask(AdditionTaskConfig(), CharTokenizer())
    rng = random.Random(0)
    for heldout in (False, True):
        for _ in range(300):
            p = task.sample(rng, heldout=heldout)
            assert isinstance(p, ChainedProblem) and p.num_turns == 4 and len(p.rest) == 3
            assert base.is_heldout(p) == heldout  # the split is decided by the first pair, as in AdditionTask
            assert all(0 <= x < 100 for x in (p.a, p.b, *p.rest))


def test_max_sequence_len_bounds_the_longest_rollout():
    cfg = ChainedAdditionTaskConfig(num_turns=3)
    task = ChainedAdditionTask(cfg, CharTokenizer())
    p = ChainedProblem(99, 99, (99, 99))
    answer = [3] * cfg.max_new_tokens  # a full-budget answer each turn
    seq = task.prompt_ids(p) + answer + task.turn_ids(p, 1) + answer + task.turn_ids(p, 2) + answer
    assert len(seq) == cfg.max_sequence_len() == 7 + 3 * 4 + 2 * 4


def test_config_rules_and_make_task():
    with pytest.raises(ValueError, match=r"max_new_tokens >= 4"):
        ChainedAdditionTaskConfig(num_turns=2, max_new_tokens=3)  # 2 * 99 = 198: 3 digits + <eos>
    with pytest.raises(ValueError):
        ChainedAdditionTaskConfig(num_turns=0)
    with pytest.raises(TypeError, match="ChainedAdditionTaskConfig"):
        ChainedAdditionTask(AdditionTaskConfig(), CharTokenizer())
    assert type(make_task(AdditionTaskConfig(), CharTokenizer())) is AdditionTask
    assert type(make_task(ChainedAdditionTaskConfig(), CharTokenizer())) is ChainedAdditionTask
    assert ChainedAdditionTaskConfig().num_turns == 2


def test_chained_budget_holds_the_largest_running_sum():
    """The last turn's answer sums ``num_turns + 1`` operands (``a + b`` plus one per later turn); the budget check
    must admit exactly the configs whose ``max_new_tokens`` hold its digits plus ``<eos>`` (it used ``num_turns``
    operands: ``num_turns=1`` accepted ``max_new_tokens=2`` for ``9+9=18<eos>``)."""
    for num_turns in range(1, 9):
        for nd in (1, 2, 3):
            top = 10**nd - 1
            p = ChainedProblem(top, top, (top,) * (num_turns - 1))  # every operand at its largest
            need = len(p.turn_answer(num_turns - 1)) + 1  # digits + <eos>
            cfg = ChainedAdditionTaskConfig(num_turns=num_turns, num_digits=nd, max_new_tokens=need)
            assert cfg.max_new_tokens == need
            with pytest.raises(ValueError, match=f"max_new_tokens >= {need}"):
                ChainedAdditionTaskConfig(num_turns=num_turns, num_digits=nd, max_new_tokens=need - 1)
