"""``HfTokenizer`` against ``CharTokenizer`` (the reference) on tokenizers built locally with the ``tokenizers``
library (no model hub): a char-level WordLevel with the same ids, a BPE without pad/bos, one without eos."""

from __future__ import annotations

import sys

import pytest

from moe_rl.envs import AdditionTask, AdditionTaskConfig, CharTokenizer, HfTokenizer


def _save(tok, out, **special):
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(str(out))
    return out


@pytest.fixture
def char_dir(tmp_path):
    out = tmp_path / "char"
    CharTokenizer().save_pretrained(out)
    return out


def _bpe(tmp_path, name, **special):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>"] + [v for v in special.values()]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"{a}+{b}={a + b}" for a in range(100) for b in range(0, 100, 7)], trainer)
    return _save(tok, tmp_path / name, unk_token="<unk>", **special)


def test_matches_char_tokenizer(char_dir):
    ref = CharTokenizer()
    hf = HfTokenizer(char_dir)
    assert (hf.pad_id, hf.bos_id, hf.eos_id, hf.vocab_size) == (ref.pad_id, ref.bos_id, ref.eos_id, ref.vocab_size)
    assert sorted(hf.alphabet) == sorted(ref.alphabet)
    for text in ["12+34=", "0", "(1+2)*3=9", ""]:
        assert hf.encode(text) == ref.encode(text)
        assert hf.encode(text, bos=False) == ref.encode(text, bos=False)
    for ids in ([1, 4, 5, 13, 6], [4, 5, 2, 7, 7], [0, 0, 3, 2], [2]):
        assert hf.decode(ids) == ref.decode(ids), ids
        assert hf.decode(ids, stop_at_eos=False) == ref.decode(ids, stop_at_eos=False), ids
    # the addition task built on either tokenizer asks and scores the same
    import random

    t_ref, t_hf = AdditionTask(AdditionTaskConfig(), ref), AdditionTask(AdditionTaskConfig(), hf)
    rng = random.Random(0)
    for _ in range(20):
        p = t_ref.sample(rng)
        assert t_hf.prompt_ids(p) == t_ref.prompt_ids(p)
        answer = t_ref.tok.encode(p.answer, bos=False) + [2]
        assert t_hf.reward(p, answer) == t_ref.reward(p, answer) == 1.0
        assert t_hf.reward(p, answer[::-1]) == t_ref.reward(p, answer[::-1])


def test_bpe_without_pad_or_bos(tmp_path):
    hf = HfTokenizer(_bpe(tmp_path, "bpe", eos_token="</s>"))
    assert hf.bos_id is None and hf.pad_id == hf.eos_id  # documented fallback
    ids = hf.encode("12+34=46", bos=True)  # no BOS prefix: the tokenizer has none
    assert hf.eos_id not in ids and hf.decode(ids) == "12+34=46"
    assert len(ids) < len("12+34=46")  # BPE merged something: not a per-character tokenizer
    assert hf.decode(ids + [hf.eos_id] + hf.encode("99", bos=False)) == "12+34=46"
    assert hf.decode(ids + [hf.eos_id] + hf.encode("99", bos=False), stop_at_eos=False) == "12+34=4699"
    assert hf.vocab_size == len(hf._tok) and max(ids) < hf.vocab_size
    assert set("0123456789+=") <= set(hf.alphabet)  # byte-level BPE: every printable character round-trips
    AdditionTask(AdditionTaskConfig(), hf)  # accepted


def test_bpe_with_bos_and_pad(tmp_path):
    hf = HfTokenizer(_bpe(tmp_path, "bpe2", bos_token="<s>", eos_token="</s>", pad_token="<pad>"))
    assert len({hf.bos_id, hf.eos_id, hf.pad_id}) == 3
    ids = hf.encode("7+8=15")
    assert ids[0] == hf.bos_id and hf.decode(ids) == "7+8=15"


def test_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="has no eos_token"):
        HfTokenizer(_bpe(tmp_path, "noeos"))
    with pytest.raises(ValueError, match=r"no tokenizer could be loaded from path=.*missing"):
        HfTokenizer(tmp_path / "missing")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install .*transformers.*task.tokenizer='char'"):
        HfTokenizer(tmp_path / "char")
