"""Configs owned by the trainer: the RL trainer (torchrun, FSDP2) and the SFT warm-up."""

from __future__ import annotations

from pydantic import Field

from moe_rl.config import BaseConfig
from moe_rl.fp8.config import Fp8Config
from moe_rl.rl.loss import LossConfig

__all__ = ["OptimizerConfig", "TrainerConfig", "SftConfig"]


class OptimizerConfig(BaseConfig):
    """AdamW with linear warm-up, then a constant learning rate."""

    lr: float = Field(3e-4, gt=0.0, le=1.0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay."""
    warmup_steps: int = Field(10, ge=0)
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Global gradient-norm clip."""


class TrainerConfig(BaseConfig):
    """The RL trainer: ``torchrun --nproc-per-node N`` on gloo (CPU) with FSDP2 over the N ranks."""

    nproc_per_node: int = Field(2, ge=1, le=64)
    """Data-parallel ranks (FSDP2 shards parameters, gradients and optimizer state over them)."""
    optim: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    fp8: Fp8Config = Fp8Config()
    """FP8 block-scaled training (``trainer.fp8 = true`` is shorthand for ``{enabled = true}``): linears and
    routed experts are converted before FSDP2 (``moe_rl.fp8.convert_model_to_fp8``)."""
    cpu_affinity: list[int] | None = None
    """Cores the trainer processes are pinned to; ``None`` lets the launcher decide (the last core when the
    machine has 2 or more, so vLLM and the trainer do not fight over one core)."""
    torch_threads: int = Field(1, ge=1, le=64)
    """``torch.set_num_threads`` in each rank."""
    batch_poll_s: float = Field(0.002, gt=0.0, le=1.0)
    """Interval at which a rank polls for the next batch file."""
    router_replay: bool = False
    """Router replay (R3, arXiv 2510.11370): the engine records every token's routed experts and the trainer's
    MoE layers replay them, with gate weights recomputed from the trainer's own scores
    (``docs/router_replay.md``). Also turns on the recording in the engine client."""


class SftConfig(BaseConfig):
    """Built-in supervised warm-up so RL starts from a model that sometimes succeeds.

    Stops at the first evaluation whose greedy pass rate on held-out prompts reaches ``pass_trigger``
    (``shared/notes/task-spike.md``: a time budget would overshoot; a trigger of 0.2-0.3 leaves RL room).
    The result is cached in ``<output_dir>/sft`` keyed by a hash of everything that affects it.
    """

    enabled: bool = True
    lr: float = Field(1e-3, gt=0.0, le=1.0)
    batch_size: int = Field(64, ge=1)
    warmup_steps: int = Field(50, ge=0)
    max_steps: int = Field(2000, ge=1)
    eval_every: int = Field(25, ge=1)
    eval_prompts: int = Field(200, ge=10)
    pass_trigger: float = Field(0.25, gt=0.0, le=1.0)
    """Stop once greedy exact-match on held-out prompts is at least this."""
    torch_threads: int = Field(2, ge=1, le=64)
