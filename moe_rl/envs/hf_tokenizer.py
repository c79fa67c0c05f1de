"""``HfTokenizer``: a Hugging Face tokenizer behind the task-tokenizer interface of :class:`CharTokenizer`.

The tasks (``moe_rl.envs.AdditionTask``, ``ChainedAdditionTask``, a ``task.factory`` environment), the orchestrator
(probe prompt) and batch building use only ``encode(text, bos=True) -> list[int]``, ``decode(ids) -> str``,
``pad_id``, ``bos_id``, ``eos_id``, ``vocab_size`` and ``alphabet`` (the built-in tasks check that it holds the
characters they write); this adapter gives those over
``transformers.AutoTokenizer`` so a cluster run (``task.tokenizer = "checkpoint"``) scores completions with the
tokenizer the engines serve.

Special ids: ``bos_id`` / ``eos_id`` are the tokenizer's; a tokenizer without a pad token pads with ``eos_id``
(the padded positions are masked out of the loss, so any valid id works; the same fallback as prime-rl and TRL). A
tokenizer without a BOS token (e.g. GLM's) encodes ``bos=True`` with no BOS prefix (``bos_id`` is then None).
"""

from __future__ import annotations

import string
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["HfTokenizer"]


class HfTokenizer:
    """Task tokenizer over ``transformers.AutoTokenizer.from_pretrained(path)``.

    Args:
        path: a checkpoint folder (or Hub id, resolved by transformers) holding the tokenizer files.
        trust_remote_code: passed to ``AutoTokenizer.from_pretrained``.

    Raises:
        ImportError: ``transformers`` is not installed (the message says how to install it).
        ValueError: the tokenizer has no EOS token (completions could never end) or no tokenizer is found at
            ``path``.
    """

    def __init__(self, path: str | Path, trust_remote_code: bool = True) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                "task.tokenizer='checkpoint' needs the 'transformers' package to read the checkpoint's tokenizer; "
                "install it (pip install 'transformers>=4.56') or use task.tokenizer='char'"
            ) from exc
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ValueError(f"HfTokenizer: no tokenizer could be loaded from path={str(path)!r}: {exc}") from exc
        self.path = str(path)
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(
                f"HfTokenizer: the tokenizer at {self.path!r} has no eos_token; a completion could never end. Set "
                "eos_token in its tokenizer_config.json"
            )
        self.eos_id: int = int(eos)
        bos = self._tok.bos_token_id
        self.bos_id: int | None = None if bos is None else int(bos)
        pad = self._tok.pad_token_id
        self.pad_id: int = self.eos_id if pad is None else int(pad)
        """The tokenizer's pad id, or ``eos_id`` when it has none (padding is masked out of the loss)."""
        self._special = set(int(i) for i in self._tok.all_special_ids)

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce (``len(tokenizer)``: base vocabulary plus added tokens)."""
        return len(self._tok)

    @cached_property
    def alphabet(self) -> str:
        """The printable ASCII characters (letters, digits, punctuation; no whitespace) that encode without the
        unknown token and decode back to themselves, in ``string`` order (computed once)."""
        unk = self._tok.unk_token_id
        out = []
        for c in string.ascii_letters + string.digits + string.punctuation:
            ids = self._tok.encode(c, add_special_tokens=False)
            if ids and unk not in ids and self._tok.decode(ids) == c:
                out.append(c)
        return "".join(out)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """``text`` to ids without the tokenizer's own special tokens; ``bos=True`` prefixes ``bos_id`` (when the
        tokenizer has one)."""
        ids = [int(i) for i in self._tok.encode(text, add_special_tokens=False)]
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int], stop_at_eos: bool = True) -> str:
        """Ids to text without special tokens; with ``stop_at_eos`` everything from the first ``eos_id`` on is
        dropped (as :meth:`CharTokenizer.decode`)."""
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode([i for i in ids if i not in self._special], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HfTokenizer({self.path!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, " \
               f"pad={self.pad_id})"
