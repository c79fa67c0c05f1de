"""The training batch handed from the orchestrator to the trainer, and its on-disk transport.

Shape legend: ``B`` samples, ``L`` padded sequence length (prompt + completion), ``L-1`` predicted
positions (position t predicts token t+1).

On disk a batch is one safetensors file ``<dir>/step_<n>.safetensors`` written atomically (temp file,
fsync, rename), so the trainer never reads a partial batch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_rl.rl.advantage import episode_advantages
from moe_rl.rl.buffer import RolloutGroup

__all__ = ["TrainingBatch", "build_batch", "batch_path", "write_batch", "read_batch"]


@dataclass
class TrainingBatch:
    """Tensors of one trainer step.

    Attributes:
        input_ids: ``[B, L]`` int64, prompt + completion, right-padded with ``pad_id``.
        loss_mask: ``[B, L-1]`` bool, True at positions that predict a completion token.
        inference_logprobs: ``[B, L-1]`` float32, the engine's log-prob of the predicted token (0 off-mask).
        advantages: ``[B]`` float32.
        version_start: ``[B]`` int64, policy version each sample started under.
        rewards: ``[B]`` float32.
        step: the batch index (= trainer version that consumes it).
        token_versions: ``[B, L-1]`` int64, the policy version that sampled the predicted token (from the
            samples' ``version_segments``; ``version_start`` where those are unknown); -1 at prompt and padding
            positions.
        routed_experts: ``[B, L, M, K]`` uint8 (<= 256 experts) / int16: the engine's routed experts per token and
            MoE layer (router replay); None when no sample carries routing. Rows whose ``routed_experts_state``
            is not 0 hold 0 here.
        routed_experts_state: ``[B, L]`` int8 per token: 0 replay the ids, -1 pad/placeholder (fill), -2 no
            engine routing (the trainer routes it) (``moe_rl.replay.layout``).
        lengths: ``[B]`` int64 tokens of each sample (prompt + completion; the rest of the row is padding), or None
            (older batch files: the trainer derives them from the padding, :meth:`sample_lengths`).
        temperatures: ``[B]`` float32 sampling temperature of each sample (the trainer divides that sample's logits
            by it), or None (every sample has the trainer's configured temperature).
        sft: ``[B]`` bool, True for a supervised sample: its loss tokens are trained with cross-entropy
            (``-log p``) instead of the RL loss, under the same single normalizer (:mod:`moe_rl.rl.loss`); its
            ``inference_logprobs`` and ``advantages`` are 0 and unused. None: every sample is an RL sample.
        sampling_mask_ids: ``[B, L-1, W]`` int32: the engine's top-k / top-p kept (or dropped) token ids of the
            token predicted at each position, -1 padding (sampling-mask replay, :mod:`moe_rl.rl.sampling_mask`);
            None when no sample carries a record.
        sampling_mask_kind: ``[B, L-1]`` int8 per position: 0 the whole vocabulary, 1 the listed ids are the kept
            set, -1 the listed ids are dropped (``moe_rl.rl.sampling_mask.FULL`` / ``KEEP`` / ``DROP``); None with
            ``sampling_mask_ids``.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    version_start: torch.Tensor
    rewards: torch.Tensor
    step: int
    token_versions: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    routed_experts_state: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    temperatures: torch.Tensor | None = None
    sft: torch.Tensor | None = None
    sampling_mask_ids: torch.Tensor | None = None
    sampling_mask_kind: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    def sample_lengths(self, pad_id: int) -> torch.Tensor:
        """``[B]`` int64 tokens of each sample: :attr:`lengths` when stored, else one past the last token that is
        not ``pad_id`` or that a loss position predicts (``max(last non-pad + 1, last loss position + 2)``)."""
        if self.lengths is not None:
            return self.lengths.to(torch.int64)
        b, length = self.input_ids.shape
        col = torch.arange(length)
        non_pad = torch.where(self.input_ids != pad_id, col + 1, 0).amax(dim=1)
        loss = torch.where(self.loss_mask, col[:-1] + 2, 0).amax(dim=1) if length > 1 else torch.zeros(b, dtype=torch.int64)
        return torch.maximum(non_pad, loss).to(torch.int64)

    def shard(self, rank: int, world_size: int) -> TrainingBatch:
        """Contiguous shard of samples for data-parallel ``rank``.

        Raises:
            ValueError: the sample count is not divisible by ``world_size``.
        """
        b = self.num_samples
        if b % world_size:
            raise ValueError(f"batch of {b} samples cannot be split evenly over world_size={world_size}")
        per = b // world_size
        sl = slice(rank * per, (rank + 1) * per)
        return TrainingBatch(
            self.input_ids[sl], self.loss_mask[sl], self.inference_logprobs[sl], self.advantages[sl],
            self.version_start[sl], self.rewards[sl], self.step,
            token_versions=None if self.token_versions is None else self.token_versions[sl],
            routed_experts=None if self.routed_experts is None else self.routed_experts[sl],
            routed_experts_state=None if self.routed_experts_state is None else self.routed_experts_state[sl],
            lengths=None if self.lengths is None else self.lengths[sl],
            temperatures=None if self.temperatures is None else self.temperatures[sl],
            sft=None if self.sft is None else self.sft[sl],
            sampling_mask_ids=None if self.sampling_mask_ids is None else self.sampling_mask_ids[sl],
            sampling_mask_kind=None if self.sampling_mask_kind is None else self.sampling_mask_kind[sl],
        )

    def pad_rows(self, multiple: int, pad_id: int) -> TrainingBatch:
        """This batch with inert rows appended so that its row count is a multiple of ``multiple``.

        The orchestrator legitimately produces batches whose row count does not divide the trainer's
        data-parallel ranks (a group with a failed request keeps fewer than ``group_size`` samples; the
        ``"mask"`` staleness policy drops fully masked samples); the trainer pads them before
        :meth:`shard`. An appended row contributes exactly nothing to the loss, its gradient or any statistic
        of :func:`moe_rl.rl.loss.compute_loss` / :func:`~moe_rl.rl.loss.loss_normalizer`: ``input_ids`` all
        ``pad_id``, ``loss_mask`` all False (so it is neither a loss token nor a sequence with one),
        ``inference_logprobs`` 0, ``advantages`` 0, ``version_start`` 0, ``rewards`` 0, ``token_versions`` -1
        (the off-mask value), ``routed_experts`` 0 with ``routed_experts_state`` ``FILL_ROW`` (-1) on every token,
        the convention of pad tokens in :mod:`moe_rl.replay.layout` (the router fills them with spread in-range
        ids), ``lengths`` 0, ``temperatures`` 1, ``sft`` False, ``sampling_mask_kind`` 0 (whole vocabulary) with
        ``sampling_mask_ids`` -1. Rows never interact in the model (no capacity limit, no cross-row attention), so the real rows'
        log-probs are unchanged. Count tokens and statistics on the unpadded batch.

        Args:
            multiple: the row count must become a multiple of it (``dp_replicate * dp_shard``), >= 1.
            pad_id: token id of padding.

        Returns:
            ``self`` when no row is needed, else a new batch of ``ceil(B / multiple) * multiple`` rows (the
            first ``B`` are this batch's rows, in order).

        Raises:
            ValueError: ``multiple < 1`` or the batch has no rows (nothing to train on).
        """
        if multiple < 1:
            raise ValueError(f"multiple={multiple} must be >= 1 (the number of data-parallel ranks)")
        b = self.num_samples
        if b == 0:
            raise ValueError("the batch has 0 rows; the orchestrator must send at least one sample per step")
        extra = -b % multiple
        if extra == 0:
            return self

        def cat(t: torch.Tensor | None, fill: float | int) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)])

        from moe_rl.replay.layout import FILL_ROW

        return TrainingBatch(
            cat(self.input_ids, pad_id), cat(self.loss_mask, False), cat(self.inference_logprobs, 0.0),
            cat(self.advantages, 0.0), cat(self.version_start, 0), cat(self.rewards, 0.0), self.step,
            token_versions=cat(self.token_versions, -1), routed_experts=cat(self.routed_experts, 0),
            routed_experts_state=cat(self.routed_experts_state, FILL_ROW), lengths=cat(self.lengths, 0),
            temperatures=cat(self.temperatures, 1.0), sft=cat(self.sft, False),
            sampling_mask_ids=cat(self.sampling_mask_ids, -1), sampling_mask_kind=cat(self.sampling_mask_kind, 0),
        )


def build_batch(groups: list[RolloutGroup], step: int, pad_id: int, temperature: float | None = None) -> TrainingBatch:
    """Pack groups into a right-padded batch with group-baseline advantages (reward - group mean).

    The baseline is the mean reward over the group's RL *episodes* (:func:`moe_rl.rl.advantage.episode_advantages`):
    samples with the same ``Sample.episode`` are branches of one episode (one row each, each with the episode's
    reward and advantage) and count once in the mean; a sample with ``episode`` None is an episode of its own.
    Each branch is a row of its own for the loss normalizer (its loss tokens, or one sequence for ``gspo``), as
    any sample. Supervised samples (``Sample.sft``) get advantage 0,
    ``inference_logprobs`` 0 and ``sft`` True (their loss tokens are trained with cross-entropy). ``lengths`` holds
    each sample's token count; ``temperatures`` each sample's ``Sample.temperature``, ``temperature`` where that is
    None (the field is None when neither is given).
    ``sampling_mask_ids`` / ``sampling_mask_kind`` hold each RL sample's ``Sample.sampling_mask`` at the positions
    that predict its completion tokens (whole vocabulary elsewhere; both None when no sample has a record).

    A sample's ``train_mask`` (set by ``AsyncRolloutBuffer.take`` under the ``"mask"`` staleness policy) is
    ANDed into ``loss_mask``: completion token ``j`` of a sample with ``p`` prompt tokens is predicted at
    position ``p - 1 + j``, and is trained only where ``train_mask[j]`` is True. A multi-turn sample's
    ``completion_mask`` is ANDed in too: tokens the environment inserted between turns get ``loss_mask``
    False, ``token_versions`` -1 and ``inference_logprobs`` 0.

    Raises:
        ValueError: ``groups`` is empty (there is no batch to build), a group is empty, a sample has an empty
            prompt (position ``p - 1`` predicts the first completion token, so ``p >= 1``) or no completion
            tokens, an engine log-prob at a trained position is NaN or infinite, a sample's ``train_mask`` or
            ``completion_mask`` does not have one bool per completion token, or its ``version_segments`` are
            not canonical; two samples of one episode carry different rewards; some samples carry a temperature and others none while ``temperature`` is None, or a
            temperature is not a finite number > 0.
    """
    import math

    from moe_rl.rl.sampling_mask import batch_mask_tensors
    from moe_rl.rl.token_versions import token_versions_from_segments

    if not groups:
        raise ValueError(
            f"build_batch: groups={groups!r} is empty; a batch needs at least one RolloutGroup (wait until the "
            "buffer's take() returns groups before building a batch)"
        )
    rows, masks, lps, advs, vstart, rewards, versions = [], [], [], [], [], [], []
    routing: list = []
    sampling_masks: list = []
    mask_starts: list[int] = []
    temps: list[float | None] = []
    sft: list[bool] = []
    for g in groups:
        if not g.samples:
            raise ValueError(f"group {g.group_id} has no samples")
        rl = [s for s in g.samples if not s.sft]
        rl_adv = iter(episode_advantages([s.reward for s in rl], [s.episode for s in rl]) if rl else [])
        adv = [0.0 if s.sft else next(rl_adv) for s in g.samples]
        for s, a in zip(g.samples, adv, strict=True):
            if not s.completion_ids:
                raise ValueError(f"group {g.group_id}: a sample has an empty completion")
            if not s.prompt_ids:
                raise ValueError(
                    f"group {g.group_id}: a sample has prompt_ids=[] (empty); the first completion token is "
                    "predicted from the last prompt token, so a prompt needs at least one token (e.g. BOS)"
                )
            ids = list(s.prompt_ids) + list(s.completion_ids)
            p = len(s.prompt_ids)
            if s.train_mask is not None and len(s.train_mask) != len(s.completion_ids):
                raise ValueError(
                    f"group {g.group_id}: a sample's train_mask has {len(s.train_mask)} entries but its completion "
                    f"has {len(s.completion_ids)} tokens; train_mask needs one bool per completion token (or None)"
                )
            train = [True] * len(s.completion_ids) if s.train_mask is None else [bool(k) for k in s.train_mask]
            segments = s.version_segments or [(g.version_start, 0)]
            tv = token_versions_from_segments(segments, len(s.completion_ids))
            lp = [0.0] * (p - 1) + list(s.completion_logprobs)
            if s.completion_mask is not None:  # multi-turn: env tokens carry no loss and no version
                if len(s.completion_mask) != len(s.completion_ids):
                    raise ValueError(
                        f"group {g.group_id}: a sample's completion_mask has {len(s.completion_mask)} entries but "
                        f"its completion has {len(s.completion_ids)} tokens; pass one bool per completion token"
                    )
                train = [t and bool(m) for t, m in zip(train, s.completion_mask, strict=True)]
                tv = [v if m else -1 for v, m in zip(tv, s.completion_mask, strict=True)]
                lp = [x if m else 0.0 for x, m in zip(lp, [True] * (p - 1) + list(s.completion_mask), strict=True)]
            if s.sft:  # supervised: no behaviour log-probs, no policy version
                lp = [0.0] * len(lp)
                tv = [-1] * len(tv)
            bad = [j for j, (t, x) in enumerate(zip(train, s.completion_logprobs, strict=True))
                   if t and not s.sft and not math.isfinite(x)]
            if bad:
                j = bad[0]
                raise ValueError(
                    f"group {g.group_id}: completion_logprobs[{j}] = {s.completion_logprobs[j]!r} is not finite at a "
                    f"trained position ({len(bad)} such token(s)); the engine's log-prob of a sampled token must be "
                    "finite -- fix the engine output, or take the token off the loss with train_mask / completion_mask"
                )
            mask = [False] * (p - 1) + train
            versions.append([-1] * (p - 1) + tv)
            rows.append(ids)
            masks.append(mask)
            lps.append(lp)
            advs.append(a)
            vstart.append(g.version_start)
            rewards.append(s.reward)
            routing.append(s.routed_experts)
            sampling_masks.append(None if s.sft else s.sampling_mask)
            mask_starts.append(p - 1)
            temps.append(s.temperature if s.temperature is not None else temperature)
            sft.append(bool(s.sft))
    length = max(len(r) for r in rows)
    b = len(rows)
    extra: dict[str, torch.Tensor] = {}
    if any(t is not None for t in temps):
        if any(t is None for t in temps):
            raise ValueError(
                "build_batch: some samples carry a temperature and others none, and temperature=None; pass the "
                "run's sampling temperature as temperature= (used for samples without one)"
            )
        for t in temps:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise ValueError(f"build_batch: sample temperature {t!r} must be a finite number > 0")
        extra["temperatures"] = torch.tensor(temps, dtype=torch.float32)
    if any(sft):
        extra["sft"] = torch.tensor(sft, dtype=torch.bool)
    input_ids = torch.full((b, length), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((b, length - 1), dtype=torch.bool)
    inf_lp = torch.zeros((b, length - 1), dtype=torch.float32)
    tok_v = torch.full((b, length - 1), -1, dtype=torch.int64)
    for i, (ids, m, lp, tv) in enumerate(zip(rows, masks, lps, versions, strict=True)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        loss_mask[i, : len(m)] = torch.tensor(m)
        inf_lp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        tok_v[i, : len(tv)] = torch.tensor(tv, dtype=torch.int64)
    return TrainingBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        inference_logprobs=inf_lp,
        advantages=torch.tensor(advs, dtype=torch.float32),
        version_start=torch.tensor(vstart, dtype=torch.int64),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        step=step,
        token_versions=tok_v,
        **_routed_experts_tensors(routing, [len(r) for r in rows], length),
        lengths=torch.tensor([len(r) for r in rows], dtype=torch.int64),
        **batch_mask_tensors(sampling_masks, mask_starts, length),
        **extra,
    )


def _routed_experts_tensors(records: list, lengths: list[int], length: int) -> dict[str, torch.Tensor]:
    """``routed_experts`` / ``routed_experts_state`` batch fields (empty when no sample has routing)."""
    from moe_rl.replay.layout import batch_transport

    out = batch_transport(records, lengths, length)
    if out is None:
        return {}
    ids, state, _ = out
    return {"routed_experts": torch.from_numpy(ids), "routed_experts_state": torch.from_numpy(state)}


def batch_path(batch_dir: str | Path, step: int) -> Path:
    return Path(batch_dir) / f"step_{step}.safetensors"


def write_batch(batch: TrainingBatch, batch_dir: str | Path) -> Path:
    """Write ``batch`` atomically to ``batch_dir/step_<n>.safetensors`` and return the path."""
    from safetensors.torch import save_file

    path = batch_path(batch_dir, batch.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tensors = {
        "input_ids": batch.input_ids.contiguous(),
        "loss_mask": batch.loss_mask.to(torch.uint8).contiguous(),
        "inference_logprobs": batch.inference_logprobs.contiguous(),
        "advantages": batch.advantages.contiguous(),
        "version_start": batch.version_start.contiguous(),
        "rewards": batch.rewards.contiguous(),
    }
    if batch.token_versions is not None:
        tensors["token_versions"] = batch.token_versions.contiguous()
    if batch.routed_experts is not None:
        tensors["routed_experts"] = batch.routed_experts.contiguous()
        tensors["routed_experts_state"] = batch.routed_experts_state.contiguous()
    for name in ("lengths", "temperatures", "sampling_mask_ids", "sampling_mask_kind"):
        if getattr(batch, name) is not None:
            tensors[name] = getattr(batch, name).contiguous()
    if batch.sft is not None:
        tensors["sft"] = batch.sft.to(torch.uint8).contiguous()
    save_file(tensors, str(tmp), metadata={"step": json.dumps(batch.step)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_batch(path: str | Path) -> TrainingBatch:
    """Read a batch written by ``write_batch``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return TrainingBatch(
        input_ids=t["input_ids"],
        loss_mask=t["loss_mask"].to(torch.bool),
        inference_logprobs=t["inference_logprobs"],
        advantages=t["advantages"],
        version_start=t["version_start"],
        rewards=t["rewards"],
        step=int(json.loads(meta.get("step", "-1"))),
        token_versions=t.get("token_versions"),
        routed_experts=t.get("routed_experts"),
        routed_experts_state=t.get("routed_experts_state"),
        lengths=t.get("lengths"),
        temperatures=t.get("temperatures"),
        sft=None if "sft" not in t else t["sft"].to(torch.bool),
        sampling_mask_ids=t.get("sampling_mask_ids"),
        sampling_mask_kind=t.get("sampling_mask_kind"),
    )
