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

from moe_rl.rl.advantage import group_advantages
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
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    version_start: torch.Tensor
    rewards: torch.Tensor
    step: int

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

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
        )


def build_batch(groups: list[RolloutGroup], step: int, pad_id: int) -> TrainingBatch:
    """Pack groups into a right-padded batch with group-baseline advantages (reward - group mean).

    Raises:
        ValueError: a group is empty or a sample has no completion tokens.
    """
    rows, masks, lps, advs, vstart, rewards = [], [], [], [], [], []
    for g in groups:
        if not g.samples:
            raise ValueError(f"group {g.group_id} has no samples")
        adv = group_advantages([s.reward for s in g.samples])
        for s, a in zip(g.samples, adv, strict=True):
            if not s.completion_ids:
                raise ValueError(f"group {g.group_id}: a sample has an empty completion")
            ids = list(s.prompt_ids) + list(s.completion_ids)
            p = len(s.prompt_ids)
            mask = [False] * (p - 1) + [True] * len(s.completion_ids)
            lp = [0.0] * (p - 1) + list(s.completion_logprobs)
            rows.append(ids)
            masks.append(mask)
            lps.append(lp)
            advs.append(a)
            vstart.append(g.version_start)
            rewards.append(s.reward)
    length = max(len(r) for r in rows)
    b = len(rows)
    input_ids = torch.full((b, length), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((b, length - 1), dtype=torch.bool)
    inf_lp = torch.zeros((b, length - 1), dtype=torch.float32)
    for i, (ids, m, lp) in enumerate(zip(rows, masks, lps, strict=True)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        loss_mask[i, : len(m)] = torch.tensor(m)
        inf_lp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return TrainingBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        inference_logprobs=inf_lp,
        advantages=torch.tensor(advs, dtype=torch.float32),
        version_start=torch.tensor(vstart, dtype=torch.int64),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        step=step,
    )


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
    )
