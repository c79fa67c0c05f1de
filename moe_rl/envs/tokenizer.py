"""A character-level tokenizer built locally (no model hub), saved in the Hugging Face format so that
both transformers and vLLM load it from a checkpoint directory.

Token ids are fixed: ``<pad>=0, <bos>=1, <eos>=2``, then the alphabet in order. Encoding is one id per
character; there is no merging, so token boundaries never depend on context (a property the RL loop relies
on: the prompt ids the orchestrator sends are exactly the ids the trainer sees).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CharTokenizer", "DEFAULT_ALPHABET", "SPECIAL_TOKENS"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
DEFAULT_ALPHABET = "0123456789+-*/=<>()[]{}|,.:;?"  # 29 characters: vocabulary of 32


class CharTokenizer:
    """Map characters to ids and back.

    Args:
        alphabet: the characters, each becoming one token after the 3 special tokens.

    Raises:
        ValueError: the alphabet repeats a character or contains whitespace.
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet={alphabet!r} repeats a character; each character must appear once")
        if any(c.isspace() for c in alphabet):
            raise ValueError(f"alphabet={alphabet!r} contains whitespace; use visible characters only")
        self.alphabet = alphabet
        self.vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for c in alphabet:
            self.vocab[c] = len(self.vocab)
        self.inv = {i: t for t, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Encode ``text`` character by character (optionally prefixed by ``<bos>``).

        Raises:
            ValueError: a character is not in the alphabet.
        """
        try:
            ids = [self.vocab[c] for c in text]
        except KeyError as exc:
            raise ValueError(
                f"text={text!r} has character {exc.args[0]!r} outside the alphabet {self.alphabet!r}"
            ) from None
        return ([self.bos_id] if bos else []) + ids

    def decode(self, ids: list[int], stop_at_eos: bool = True) -> str:
        """Decode ids to text, dropping special tokens (and everything after ``<eos>`` if asked)."""
        out = []
        for i in ids:
            if i == self.eos_id and stop_at_eos:
                break
            if i < len(SPECIAL_TOKENS):
                continue
            out.append(self.inv.get(int(i), ""))
        return "".join(out)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ special tokens map) into ``out_dir``.

        Uses the ``tokenizers`` WordLevel model over single characters with a pre-tokenizer that splits
        every character, wrapped in transformers' ``PreTrainedTokenizerFast``.
        """
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab=dict(self.vocab), unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
        )
        fast.save_pretrained(str(out_dir))
