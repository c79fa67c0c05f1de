"""Configs owned by the trainer: the RL trainer (torchrun; EP x CP x FSDP2 through
``moe_rl.distributed.parallelize``) and the SFT warm-up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.fp8.config import Fp8Config
from moe_rl.rl.loss import LossConfig
from moe_rl.weights.broadcast import BroadcastTransportConfig
from moe_rl.weights.delta_sync import DeltaConfig
from moe_rl.weights.filesystem import FilesystemTransportConfig
from moe_rl.weights.mooncake import MooncakeTransportConfig
from moe_rl.weights.p2p import P2PTransportConfig

if TYPE_CHECKING:
    from moe_rl.distributed.parallel_dims import ParallelDims

__all__ = ["OptimizerConfig", "TrainerParallelConfig", "TrainerBatchConfig", "TrainerConfig", "SftConfig"]


class OptimizerConfig(BaseConfig):
    """AdamW with linear warm-up, then a constant learning rate."""

    lr: float = Field(3e-4, gt=0.0, le=1.0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay."""
    eps: float = Field(1e-8, gt=0.0, le=1.0)
    """AdamW's epsilon (added to the root of the second moment)."""
    warmup_steps: int = Field(10, ge=0)
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Global gradient-norm clip."""


class TrainerParallelConfig(BaseConfig):
    """The trainer's parallel layout, mapped to :class:`moe_rl.distributed.parallel_dims.ParallelDims` and applied by
    :func:`moe_rl.distributed.parallelize.parallelize_model` (torchtitan's convention: the ranks are
    ``dp_replicate x dp_shard x cp``; non-expert parameters are FSDP2-sharded over ``dp_shard x cp`` and replicated
    over ``dp_replicate``; expert parallelism borrows its ``ep`` ranks from ``dp_shard x cp``).

    Each step's batch rows are split over the ``dp_replicate * dp_shard`` data ranks; the ``cp`` ranks of one data
    rank hold the same rows and split their tokens (zigzag, padded at the end to a multiple of ``2 * cp``). The
    default (every field unset) is plain FSDP2 over all ``nproc_per_node`` ranks.
    """

    dp_replicate: int = Field(1, ge=1)
    """HSDP replicas (gradients all-reduced across them)."""
    dp_shard: int | None = Field(None, ge=1)
    """FSDP2 shard degree; ``None`` = ``nproc_per_node / (dp_replicate * cp)``."""
    cp: int = Field(1, ge=1)
    """Context-parallel degree (each sequence's tokens split over this many ranks)."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree; must divide ``dp_shard * cp`` and ``model.n_routed_experts``."""
    cp_method: Literal["ring", "ulysses"] = "ring"
    """Attention under CP (glm4_moe): ring attention or Ulysses all-to-all (any head counts: when ``cp`` does not
    divide the key/value heads they are replicated or zero-padded, ``moe_rl.attention.ulysses.ulysses_head_plan``)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (``checkpoint_wrapper``, full recompute)."""

    def dims(self, nproc_per_node: int) -> ParallelDims:
        """The :class:`ParallelDims` of this layout on ``nproc_per_node`` ranks (``dp_shard`` resolved).

        Raises:
            ValueError: ``dp_replicate * cp`` does not divide ``nproc_per_node`` (unset ``dp_shard``), the product
                of the degrees is not ``nproc_per_node``, or ``ep`` does not divide ``dp_shard * cp``.
        """
        from moe_rl.distributed.parallel_dims import ParallelDims

        outer = self.dp_replicate * self.cp
        dp_shard = self.dp_shard
        if dp_shard is None:
            if nproc_per_node % outer:
                raise ValueError(
                    f"trainer.parallel: dp_replicate*cp = {self.dp_replicate}*{self.cp} = {outer} does not divide "
                    f"trainer.nproc_per_node={nproc_per_node}, so dp_shard cannot be derived; change cp, "
                    "dp_replicate or nproc_per_node"
                )
            dp_shard = nproc_per_node // outer
        if self.dp_replicate * dp_shard * self.cp != nproc_per_node:
            raise ValueError(
                f"trainer.parallel: dp_replicate*dp_shard*cp = {self.dp_replicate}*{dp_shard}*{self.cp} = "
                f"{self.dp_replicate * dp_shard * self.cp} must equal trainer.nproc_per_node={nproc_per_node} "
                "(every rank is one FSDP/CP/EP coordinate); change the degrees or nproc_per_node"
            )
        if self.dp_replicate > 1 and dp_shard * self.cp == 1:
            raise ValueError(
                f"trainer.parallel: dp_replicate={self.dp_replicate} with dp_shard*cp = 1 (pure replication) is not "
                "supported: parallelize_model's gradient reduction is verified for shard groups of 2+ ranks only; "
                "use dp_shard instead of dp_replicate"
            )
        from pydantic import ValidationError

        try:
            return ParallelDims(dp_replicate=self.dp_replicate, dp_shard=dp_shard, cp=self.cp, ep=self.ep)
        except ValidationError as e:  # re-raise ParallelDims' rule under this config's field path
            msgs = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
            raise ValueError(f"trainer.parallel: {msgs}") from None


class TrainerBatchConfig(BaseConfig):
    """How the trainer lays out a step's samples (``moe_rl.runtime.trainer.step``)."""

    packing: bool = True
    """Sequence packing (``moe_rl.rl.packing``): each data rank's micro-batches are rows of whole samples back to
    back (``cu_seqlens``: attention causal within each sample, positions restarting at 0), no padding computed,
    balanced over the data ranks by attention-aware cost with the same micro-batch count on every rank. Equal to the
    padded rows up to rounding. Applies with ``parallel.cp = 1`` (context-parallel attention takes no sequence
    boundaries: padded rows then) and no row micro-batching."""
    seq_len: int | None = Field(None, ge=2)
    """Tokens per packed row; a longer sample is truncated to it (its tokens, loss mask, log-probs, versions and
    routed-expert rows cut at the same column; truncated tokens count as no loss token). ``None``: the longer of the
    longest sample and the batch's tokens per data rank (nothing truncated, about one micro-batch per rank)."""
    sft_weight: float = Field(1.0, ge=0.0)
    """Weight of the cross-entropy term of supervised samples (``Sample.sft``) beside the RL samples (one loss
    normalization per step over both)."""


class TrainerConfig(BaseConfig):
    """The RL trainer: ``torchrun --nproc-per-node N`` on gloo (CPU), parallelized by ``parallel`` (default: FSDP2
    over the N ranks)."""

    nproc_per_node: int = Field(2, ge=1, le=64)
    """Trainer ranks; ``parallel``'s degrees multiply to it (default layout: FSDP2 shards parameters, gradients
    and optimizer state over all of them)."""
    parallel: TrainerParallelConfig = TrainerParallelConfig()
    """EP x CP x FSDP2 layout of the ``nproc_per_node`` ranks."""
    optim: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    batch: TrainerBatchConfig = TrainerBatchConfig()
    """Sequence packing, truncation and the weight of supervised samples."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and activation dtype of the trainer's forward/backward. ``bfloat16``: FSDP2
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` with fp32 master weights and optimizer
    state; router logits, the loss and log-probs stay fp32. ``float32`` (default here): matches the CPU recipe's
    fp32 vLLM engine."""
    experts_backend: Literal["grouped_mm", "loop"] = "grouped_mm"
    """Routed-expert compute (``moe_rl.moe.experts``): ``grouped_mm`` (``torch._grouped_mm`` over expert-sorted
    rows, no host sync; CPU fp32/bf16; the hidden and expert intermediate sizes must be multiples of 16 bytes per
    row, i.e. of 4 in fp32 and 8 in bf16, else the trainer refuses it at start) or ``loop`` (one matmul pair per
    expert, the reference). Ignored for experts converted to FP8 (``fp8.experts``)."""
    fp8: Fp8Config = Fp8Config()
    """FP8 block-scaled training (``trainer.fp8 = true`` is shorthand for ``{enabled = true}``): linears and
    routed experts are converted before FSDP2 (``moe_rl.moe.convert_model_to_fp8``); under expert parallelism the
    FP8 experts become FP8 local experts (``LocalExperts.fp8_backend``). The trainer prints the fraction of
    parameters that run in FP8 at start and records it in the first step report (``fp8_param_fraction``)."""
    cpu_affinity: list[int] | None = None
    """Cores the trainer processes are pinned to; ``None`` lets the launcher decide (the last core when the
    machine has 2 or more, so vLLM and the trainer do not fight over one core)."""
    torch_threads: int = Field(1, ge=1, le=64)
    """``torch.set_num_threads`` in each rank."""
    batch_poll_s: float = Field(0.002, gt=0.0, le=1.0)
    """Interval at which a rank polls for the next batch file."""
    weight_transport: Literal["filesystem", "broadcast", "mooncake", "p2p"] = "filesystem"
    """How every trainer rank publishes its pieces of each version to the engines (``moe_rl.weights.publisher``):
    ``filesystem``: one sharded folder per version (every rank writes its own shards, ``STABLE`` marker);
    ``broadcast``: one torch.distributed group per trainer rank with the engine workers (gloo here); ``mooncake``:
    the run's Mooncake store (the launcher starts a loopback master), one shard per rank, falling back to the folder
    when the store fails, every fallback counted; ``p2p``: every rank snapshots its pieces and serves them, the engine
    workers pull what they need from the owning ranks (gloo point-to-point here). Each transport's settings are in
    the field of its name."""
    filesystem: FilesystemTransportConfig = FilesystemTransportConfig()
    """The sharded folder transport (also the fallback and the final checkpoint of the other two)."""
    broadcast: BroadcastTransportConfig = BroadcastTransportConfig()
    """The broadcast transport (used when ``weight_transport = "broadcast"``)."""
    mooncake: MooncakeTransportConfig = MooncakeTransportConfig()
    """The run's Mooncake store (used when ``weight_transport = "mooncake"``)."""
    p2p: P2PTransportConfig = P2PTransportConfig()
    """The pull transport (used when ``weight_transport = "p2p"``)."""
    weight_delta: DeltaConfig = DeltaConfig()
    """Delta encoding of each version (``moe_rl.weights.delta_sync``): every rank writes only the elements of its
    pieces whose bits changed since its previous version (exact, checksummed), with a full version every
    ``full_every`` updates; the engine keeps a host copy of the published tensors and loads the changed layers.
    ``weight_transport = "filesystem"``, ``"broadcast"`` or ``"p2p"``."""
    router_replay: bool = False
    """Router replay (R3, arXiv 2510.11370): the engine records every token's routed experts and the trainer's
    MoE layers replay them, with gate weights recomputed from the trainer's own scores
    (``docs/router_replay.md``). Also turns on the recording in the engine client. Under CP the routed experts
    are sharded exactly like ``input_ids``."""
    sampling_mask_replay: bool = False
    """Sampling-mask replay (the sampler counterpart of router replay; ``moe_rl.rl.sampling_mask``): the engine
    records the top-k / top-p kept set of every sampled token and the trainer computes its log-probs over the same
    truncated distribution (``log_softmax(logits / T)`` renormalised over the kept set), as the engine's
    ``processed_logprobs`` are. Needed for matching log-probs when ``orchestrator.top_p < 1`` or
    ``orchestrator.top_k > 0``. Also turns on the recording in the engine client. Needs ``loss_chunk_tokens =
    None``; single-turn samples only (a multi-call episode's sample trains over the whole vocabulary)."""
    checkpoint_every: int = Field(50, ge=0)
    """Write a resumable checkpoint (``<output_dir>/checkpoints/step_<n>/``: sharded model and optimizer state through
    ``torch.distributed.checkpoint``, scheduler and RNG states, the engines' weights of version ``n``, the
    orchestrator's accounting and data-stream position; ``moe_rl.runtime.checkpoint``) after every
    ``checkpoint_every`` trainer steps and after the last step; 0 = no checkpoints. ``moe-rl rl --resume`` continues
    from the newest complete one."""
    keep_checkpoints: int = Field(2, ge=1)
    """Complete checkpoints kept on disk (the newest ones; older ones are deleted once a newer one is complete)."""
    loss_chunk_tokens: int | None = Field(None, ge=1)
    """Compute the LM head and the token log-probs in chunks of this many tokens per rank, forward and backward
    (``moe_rl.models.common.head``; the idea of prime-rl's ``fused_lm_head_token_chunk_size``): the
    ``[tokens, V]`` fp32 logits, log-softmax and their gradients are never held, only ``[chunk, V]`` blocks, at the
    cost of recomputing the head matmul in backward. ``None`` (default): full logits. Results equal the full path
    to rounding."""

    @model_validator(mode="after")
    def _check_weight_delta(self) -> TrainerConfig:
        if self.weight_delta.enabled and self.weight_transport == "mooncake":
            raise ValueError("trainer.weight_delta.enabled = true with trainer.weight_transport = 'mooncake': delta "
                             "encoding is implemented for the filesystem, broadcast and p2p transports; set "
                             "trainer.weight_transport to one of them or trainer.weight_delta.enabled = false")
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> TrainerConfig:
        self.parallel.dims(self.nproc_per_node)  # raises ValueError naming the fields
        return self

    @property
    def dims(self) -> ParallelDims:
        """The resolved :class:`ParallelDims` of ``parallel`` on ``nproc_per_node`` ranks."""
        return self.parallel.dims(self.nproc_per_node)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that take distinct batch rows: ``dp_replicate * dp_shard`` (the ``cp`` ranks of one share rows)."""
        dims = self.dims
        return dims.dp_replicate * dims.dp_shard


class SftConfig(BaseConfig):
    """Built-in supervised warm-up so RL starts from a model that sometimes succeeds.

    Stops at the first evaluation whose greedy pass rate on held-out prompts reaches ``pass_trigger``
    (a time budget would overshoot on a fast machine; a trigger of 0.2-0.3 leaves the RL phase room to improve).
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
