"""Addition task, reward and the local tokenizer (loaded back through transformers, as vLLM does)."""

import random

import pytest

from moe_rl.envs import AdditionTask, AdditionTaskConfig, CharTokenizer, addition_reward


def test_reward_exact_and_partial():
    assert addition_reward("46", "46") == 1.0
    assert addition_reward("45", "46") == 0.25          # one of two digits in place
    assert addition_reward("146", "46") == 0.0         # shifted: nothing in place
    assert addition_reward("4", "46") == 0.25
    assert addition_reward("", "46") == 0.0


def test_heldout_split_is_disjoint_and_deterministic():
    task = AdditionTask(AdditionTaskConfig(heldout_percent=5), CharTokenizer())
    rng = random.Random(0)
    train = {(p.a, p.b) for p in (task.sample(rng) for _ in range(2000))}
    held = {(p.a, p.b) for p in task.heldout_set(200)}
    assert not train & held
    assert task.heldout_set(50) == task.heldout_set(50)
    frac = sum(task.is_heldout(type(task.sample(rng))(a, b)) for a in range(100) for b in range(100)) / 1e4
    assert 0.03 < frac < 0.07


def test_tokenizer_roundtrip_through_transformers(tmp_path):
    tok = CharTokenizer()
    assert tok.vocab_size == 32
    ids = tok.encode("12+34=")
    assert ids[0] == tok.bos_id and len(ids) == 7
    assert tok.decode(ids[1:] + [tok.eos_id, 5]) == "12+34="
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.convert_tokens_to_ids(list("12+34=")) == ids[1:]
    assert hf.eos_token_id == 2 and hf.pad_token_id == 0 and hf.bos_token_id == 1
    assert hf.decode(ids[1:]) == "12+34="
    with pytest.raises(ValueError, match="outside the alphabet"):
        tok.encode("1 2")
