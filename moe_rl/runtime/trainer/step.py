"""One RL trainer step on the library's parallelism (EP x CP x FSDP2): the functional core of
``moe_rl.runtime.trainer.rl_trainer`` (the torchrun process adds batch polling, publishing and the step report file).

Shape legend:
    B    rows (samples) of the global batch; Bd = ceil(B / dp) rows of this data rank, dp = dp_replicate * dp_shard
    Bm   rows of one micro-batch: settings.micro_batch (the last one of a rank may be shorter), or Bd
    L    tokens per row (prompt + completion, right-padded); L-1 predicted positions
    Lp   L padded at the end to a multiple of 2 * cp (zigzag) or cp (contiguous: ``model.cp_layout``) for context
         parallelism
    Sl   tokens of each row held by one CP rank, Lp = cp * Sl
    M    MoE layers, K experts per token, V vocabulary
    T    tokens of one packed row ``[1, T]`` (sequence packing: whole samples back to back, ``T <= seq_len``)
    n, W samples of one packed row and their longest length (their log-probs are laid out as ``[n, W-1]``)

Per step on every rank (``dims = trainer.parallel``; data rank ``d``, CP rank ``c``):

1. rows: ``batch.pad_rows(dp, pad_id).shard(d, dp)`` with ``dp = dp_replicate * dp_shard`` (the ``cp`` ranks of
   one data rank take the same rows): a batch whose row count ``dp`` does not divide (partial groups, masked
   samples dropped by the orchestrator) first gets inert rows (all pad, no loss token, advantage 0, fill routing)
   that count in no statistic; then the ``Bd`` rows run in micro-batches of ``settings.micro_batch`` rows (``None``:
   all at once), each through steps 2-4 (forward, loss, backward; gradients accumulate). Every data rank has the
   same ``Bd``, so all ranks run the same number of micro-batches, in the same order on the CP ranks of a data
   rank. Each backward reduce-scatters under FSDP2 (gradient sync is not deferred to the last micro-batch: that
   would hold every unsharded gradient until the end, the memory FSDP exists to save);
2. columns (cp > 1): ``input_ids``, the next-token labels ``input_ids[:, t+1]`` and the router-replay rows
   (``routed_experts``, ``routed_experts_state``) go through
   :func:`moe_rl.distributed.parallelize.shard_for_context_parallel` with one plan, so every local token keeps its own
   label and routing row (padding columns: label 0, state -1 = pad fill rows); the model runs on ``[Bm, Sl]`` with
   the absolute ``positions``;
3. log-probs: each CP rank computes its ``[Bm, Sl]`` token log-probs, then the CP group all-gathers them
   (:func:`gather_context_parallel`: backward returns each rank its own slice) and unshards them to ``[Bm, L-1]``;
   every CP rank thus evaluates the same loss on whole rows, so sequence-level kinds (``gspo``, sequence ``mis``)
   need no special case. The CP ranks' gradients flow only through their own columns: summed over the CP group,
   each row's loss gradient is counted once;
4. loss = ``loss_sum(rows of d) * world / loss_normalizer(global batch)``: FSDP2 (``parallelize_model``) sums each
   gradient over the ranks and divides by ``dims.dp_size = world`` (SUM then divide on gloo,
   ``force_sum_reduction``). The CP ranks of one data rank contribute disjoint columns of the same rows' loss, so
   the sum over ranks is ``world * sum_d dloss_sum_d / norm`` and the reduced gradient is that of the
   single-process loss (``tests/trainer/test_rl_trainer_parallel.py`` checks it against one process);
5. clip with :func:`moe_rl.distributed.parallelize.clip_grad_norm_` (the global norm over the dense and the
   ``(efsdp, ep)`` meshes), AdamW step, warm-up schedule step;
6. statistics: each field of ``LossOutput`` is a sum over rows for every loss kind (sequence-level terms are per
   row), so the micro-batches' sums are added (ratios concatenated), then all-reduced over the world with only CP
   rank 0 of each data rank contributing (the other CP ranks computed the same rows' loss).

Sequence packing (``settings.packing``, ``trainer.batch.packing``; with ``micro_batch = None`` and ``cp == 1``) replaces
steps 1-2: :func:`moe_rl.rl.packing.plan_packing` assigns the batch's samples (truncated to ``settings.seq_len``) to
packed rows ``[1, T]`` of at most ``seq_len`` tokens, the same number of rows on every data rank, balanced by
attention-aware cost; each row runs as one micro-batch (``cu_seqlens``: attention causal within each sample,
positions restarting at 0, the samples' routed-expert rows and temperatures concatenated), its token log-probs are
laid back out as the samples' rows ``[n, W-1]`` and steps 3-4 follow unchanged (the loss divided by the normaliser of
the global truncated batch). A rank with fewer rows runs 1-token pad rows with loss exactly 0 (FSDP's collectives stay
in lockstep). Per-sample temperatures (``TrainingBatch.temperatures``) and supervised rows (``TrainingBatch.sft``,
cross-entropy under the same normaliser) apply in both layouts.

One rank (``nproc_per_node = 1``) runs the plain model (no FSDP) in fp32, with the same code otherwise.

Mixed precision (``trainer.dtype = "bfloat16"``, :func:`apply_trainer_parallelism`): FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every group, so the parameters the optimizer
sees stay fp32 (master weights; AdamW's moments are fp32), forward and backward compute in bf16, and gradients are
cast to fp32 before their reduction. A single rank takes the same path on a 1-rank mesh (it needs the default
process group, which the trainer processes always initialise), so one process and many compute alike. Router
logits, the LM head's logits, the log-probs and the loss stay fp32 (cast explicitly in the models and here).

Routed experts run ``torch._grouped_mm`` (``trainer.experts_backend = "grouped_mm"``, the default; checked at start
by :func:`moe_rl.moe.experts.grouped_mm_problem`) or the per-expert loop.

FP8 (``trainer.fp8``): the model is converted before ``parallelize_model``; measured to run with the default layout
and with cp = 2 (FP8 linears and grouped experts are token-local). With ``ep > 1`` the FP8 experts become FP8 local
experts (``ExpertParallelMoE.from_full`` keeps ``fp8_backend``). :func:`moe_rl.moe.fp8_parameter_fraction` of the
parallelized model is printed at start and stored in :attr:`TrainerState.info`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh
    from moe_rl.rl.batch import TrainingBatch
    from moe_rl.rl.loss import LossConfig
    from moe_rl.runtime.config import RLConfig
    from moe_rl.runtime.trainer.config import OptimizerConfig

__all__ = [
    "StepSettings",
    "TrainerState",
    "apply_trainer_parallelism",
    "build_trainer",
    "resolve_experts_backend",
    "full_state_dict",
    "gather_context_parallel",
    "make_optimizer",
    "accumulate_gradients",
    "packing_linear_cost",
    "token_logprobs",
    "train_step",
    "uses_packing",
]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Log-probability of each next token.

    Args:
        logits: ``[B, L, V]`` float.
        input_ids: ``[B, L]`` int64.
        temperature: logits are divided by it (must match the sampler): a float, or a ``[B]`` float tensor (one
            temperature per row: per-sample temperatures).

    Returns:
        ``[B, L-1]`` float32: entry ``t`` is ``log p(input_ids[:, t+1] | input_ids[:, :t+1])``.
    """
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 1:
        temperature = temperature[:, None]
    return _label_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)


def _label_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor,
                    mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[B, S]`` float32 ``log softmax(logits / temperature)[labels]`` for ``[B, S, V]`` logits; a tensor
    ``temperature`` broadcasts against ``[B, S]`` (per row ``[B, 1]`` or per token ``[B, S]``).

    ``mask = (ids [B, S, W], kind [B, S])``: the engine's kept sets (sampling-mask replay); the log-softmax is then
    renormalised over each position's kept set (:func:`moe_rl.rl.sampling_mask.masked_logprobs`)."""
    if mask is not None:
        from moe_rl.rl.sampling_mask import dense_keep, masked_logprobs

        return masked_logprobs(logits, labels, temperature, dense_keep(mask[0], mask[1], int(logits.shape[-1])))
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.float()[..., None]
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, labels[..., None]).squeeze(-1)


def _sampling_mask(cfg: StepSettings, batch: TrainingBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids [B, L, W], kind [B, L])`` of ``batch``'s kept sets in token columns (column ``t`` holds the set of the
    token predicted from token ``t``; the last column and every position off the loss mask are the whole
    vocabulary), or None when replay is off or the batch has no records.

    Raises:
        ValueError: replay is on with ``loss_chunk_tokens`` set (the chunked head takes no kept sets).
    """
    if not cfg.sampling_mask_replay or batch.sampling_mask_ids is None:
        return None
    if cfg.loss_chunk_tokens is not None:
        raise ValueError(f"sampling_mask_replay needs the full-logits head, but loss_chunk_tokens="
                         f"{cfg.loss_chunk_tokens}; set trainer.loss_chunk_tokens = None or turn sampling_mask_replay "
                         "off")
    ids, kind = batch.sampling_mask_ids, batch.sampling_mask_kind
    kind = torch.where(batch.loss_mask, kind, torch.zeros_like(kind))  # off the loss: whole vocabulary
    b = ids.shape[0]
    ids = torch.cat([ids, ids.new_full((b, 1, ids.shape[2]), -1)], dim=1)
    kind = torch.cat([kind, kind.new_zeros(b, 1)], dim=1)
    return ids, kind


class _GatherCP(torch.autograd.Function):
    """All-gather ``[B, Sl]`` along a new leading CP axis; backward returns this rank's slice of the gradient.

    Correct only when every rank of the group computes the *same* function of the gathered tensor (here: the loss
    of the same rows), so the gradient w.r.t. rank ``c``'s slice is the same on every rank and rank ``c`` owns it.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.rank = rank
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad[ctx.rank], None, None, None


def gather_context_parallel(local_BS: torch.Tensor, plan: Any, group: Any, cp_rank: int) -> torch.Tensor:
    """Whole rows from every CP rank's columns (a collective over ``group``).

    Args:
        local_BS: ``[B, Sl]`` this rank's columns (``plan.shard(x, cp_rank, dim=1)`` order).
        plan: the :class:`moe_rl.attention.layout.ShardPlan` the columns were cut with (``plan.total_len`` = S).
        group: the CP process group (``mesh["cp"].get_group()``).
        cp_rank: this rank's index in ``group``.

    Returns:
        ``[B, S]`` in stream order (padding dropped). Differentiable: the gradient w.r.t. ``local_BS`` is this rank's
        columns of the output's gradient (every CP rank must evaluate the same function of the output).
    """
    stacked = _GatherCP.apply(local_BS, group, cp_rank, plan.cp)  # [cp, B, Sl]
    return plan.unshard(stacked.transpose(0, 1), dim=1)


@dataclass(frozen=True)
class StepSettings:
    """What :func:`train_step` reads besides the model and the batch (from ``RLConfig`` for the one-machine run,
    from ``ClusterConfig`` for a cluster run)."""

    loss: LossConfig
    """The off-policy loss (``moe_rl.rl.loss``)."""
    max_grad_norm: float
    """Global gradient-norm clip."""
    temperature: float
    """Sampling temperature of the engines (logits are divided by it before the log-softmax)."""
    pad_id: int
    """Token id of right padding in batches (CP pads columns with it too)."""
    router_replay: bool = False
    """Replay the batch's ``routed_experts`` (R3) when the batch has them."""
    loss_chunk_tokens: int | None = None
    """Run the LM head + log-softmax in chunks of this many tokens (``model.token_logprobs``,
    :mod:`moe_rl.models.common.head`: no ``[T, V]`` logits held); ``None``: full logits (``model(...)``)."""
    micro_batch: int | None = None
    """Rows per forward/backward on each data rank (gradient accumulation, ``trainer.micro_batch`` of a cluster
    run; the memory planner assumes it): this rank's ``Bd`` rows run in ``ceil(Bd / micro_batch)`` chunks, the last
    one possibly shorter. ``None``: all ``Bd`` rows at once (or sequence packing, see ``packing``)."""
    packing: bool = False
    """Sequence packing (:mod:`moe_rl.rl.packing`): when ``micro_batch`` is None and ``cp == 1``, each data rank's
    micro-batches are packed rows ``[1, T]`` of whole samples (``cu_seqlens``, positions restarting per sample, no
    padding), balanced over the data ranks by attention-aware cost, the same count on every rank. Rows otherwise."""
    seq_len: int | None = None
    """Packed row capacity in tokens (longer samples are truncated to it: tokens, loss mask, log-probs, versions and
    routed-expert rows cut at the same column). ``None``: ``max(longest sample, ceil(batch tokens / data ranks))``,
    so nothing is truncated and each rank gets about one micro-batch."""
    sft_weight: float = 1.0
    """Weight of the cross-entropy term of supervised rows (``TrainingBatch.sft``)."""
    sampling_mask_replay: bool = False
    """Renormalise the log-probs over the engine's top-k / top-p kept sets (``TrainingBatch.sampling_mask_ids``,
    :mod:`moe_rl.rl.sampling_mask`) when the batch has them; needs ``loss_chunk_tokens = None``."""

    def __post_init__(self) -> None:
        mb = self.micro_batch
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise ValueError(f"micro_batch={self.micro_batch!r} must be an int >= 1 (rows per forward/backward per "
                             "data rank) or None (all of the rank's rows at once)")
        sl = self.seq_len
        if sl is not None and (isinstance(sl, bool) or not isinstance(sl, int) or sl < 2):
            raise ValueError(f"seq_len={sl!r} must be an int >= 2 (tokens per packed row) or None (automatic)")

    @classmethod
    def from_rl_config(cls, cfg: RLConfig) -> StepSettings:
        """The settings of a ``moe-rl rl`` run."""
        t = cfg.trainer
        return cls(loss=t.loss, max_grad_norm=t.optim.max_grad_norm, temperature=cfg.orchestrator.temperature,
                   pad_id=cfg.pad_id, router_replay=t.router_replay, loss_chunk_tokens=t.loss_chunk_tokens,
                   packing=t.batch.packing, seq_len=t.batch.seq_len, sft_weight=t.batch.sft_weight,
                   sampling_mask_replay=t.sampling_mask_replay)


@dataclass
class TrainerState:
    """Everything one trainer rank holds between steps (built by :func:`build_trainer`)."""

    settings: StepSettings
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    dims: ParallelDims
    mesh: ParallelMesh | None
    """None when the job has one rank (plain model, no FSDP)."""
    rank: int
    world: int
    info: dict = dataclasses.field(default_factory=dict)
    """Start-up facts for the log and the first step report (``dtype``, ``experts_backend``,
    ``fp8_param_fraction``)."""

    @property
    def cp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.coordinate("cp")

    @property
    def data_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.data_rank

    @property
    def data_parallel_size(self) -> int:
        return self.dims.dp_replicate * self.dims.dp_shard


def build_trainer(cfg: RLConfig, init_dir: Path) -> TrainerState:
    """Build the policy from the version-0 HF checkpoint, convert to FP8 if enabled, apply
    :func:`moe_rl.distributed.parallelize.parallelize_model` with ``cfg.trainer.parallel`` and create AdamW + the
    warm-up schedule. A collective when the default process group has more than one rank (every rank calls it).

    Raises:
        ValueError: the process group's size is not ``cfg.trainer.nproc_per_node``, or the layout does not fit the
            model (``ep`` must divide ``n_routed_experts``; from ``parallelize_model``).
    """
    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.models.glm4_moe import load_hf_state_dict

    tcfg = cfg.trainer
    dims = tcfg.dims
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world != dims.world_size:
        raise ValueError(
            f"the trainer runs on {world} ranks but trainer.nproc_per_node={tcfg.nproc_per_node} ({dims!r}); "
            "launch it with torchrun --nproc-per-node equal to trainer.nproc_per_node"
        )
    backend = resolve_experts_backend(tcfg.experts_backend, cfg.model, tcfg.dtype, "cpu",
                                      field="trainer.experts_backend")
    model = GlmMoeForCausalLM(cfg.model, experts_backend=backend)
    model.load_state_dict(load_hf_state_dict(init_dir), strict=True)
    if tcfg.fp8.enabled:
        from moe_rl.moe.fp8_convert import convert_model_to_fp8

        print(f"fp8: {convert_model_to_fp8(model, tcfg.fp8)}", flush=True)
    par = tcfg.parallel
    mesh = apply_trainer_parallelism(model, dims, dtype=tcfg.dtype, device_type="cpu", cp_method=par.cp_method,
                                     activation_checkpointing=par.activation_checkpointing)
    model.train()
    opt, sched = make_optimizer(model, tcfg.optim)
    info = _start_info(model, tcfg.dtype, backend)
    return TrainerState(StepSettings.from_rl_config(cfg), model, opt, sched, dims, mesh, rank, world, info)


def _start_info(model: torch.nn.Module, dtype: str, experts_backend: str) -> dict:
    from moe_rl.moe.fp8_convert import fp8_parameter_fraction

    return {"dtype": dtype, "experts_backend": experts_backend, "fp8_param_fraction": fp8_parameter_fraction(model)}


def resolve_experts_backend(requested: str, model_cfg: Any, dtype: str, device_type: str, *,
                            field: str = "experts_backend") -> str:
    """The routed-expert backend a trainer builds its model with.

    Args:
        requested: ``"grouped_mm"`` or ``"loop"``.
        model_cfg: the model config (``hidden_size``, ``moe_intermediate_size``).
        dtype: the compute dtype, ``"float32"`` or ``"bfloat16"`` (``trainer.dtype``).
        device_type: ``"cpu"`` or ``"cuda"``. On CUDA ``torch._grouped_mm`` runs bf16 only (sm90+), so an fp32
            CUDA trainer gets ``"loop"`` (said in the start-up log, not silent); CPU runs fp32 and bf16.
        field: the config field named in errors.

    Returns:
        ``"grouped_mm"`` or ``"loop"``.

    Raises:
        ValueError: an unknown backend, a ``dtype`` other than ``"float32"`` / ``"bfloat16"``, a ``device_type``
            other than ``"cpu"`` / ``"cuda"``, or ``"grouped_mm"`` for sizes it cannot run (16-byte row strides).
    """
    from moe_rl.moe.experts import grouped_mm_problem

    if requested not in ("grouped_mm", "loop"):
        raise ValueError(f"{field}={requested!r} is not supported; use 'grouped_mm' or 'loop'")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} is not a trainer dtype; use 'float32' or 'bfloat16' (trainer.dtype, a "
                         "string)")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r} is not supported; use 'cpu' or 'cuda' (torch.device.type)")
    if requested == "loop":
        return "loop"
    if device_type == "cuda" and dtype != "bfloat16":
        return "loop"
    problem = grouped_mm_problem(model_cfg.hidden_size, model_cfg.moe_intermediate_size, getattr(torch, dtype))
    if problem is not None:
        raise ValueError(f"{field}='grouped_mm': {problem}; set {field} = 'loop' or change the model sizes")
    return "grouped_mm"


def apply_trainer_parallelism(model: torch.nn.Module, dims: ParallelDims, *, dtype: str, device_type: str,
                              cp_method: str | None, activation_checkpointing: bool) -> ParallelMesh | None:
    """Parallelize ``model`` for a trainer of ``dims`` ranks in ``dtype`` (a collective when it builds a mesh).

    ``world > 1``, or ``dtype = "bfloat16"`` on one rank: builds ``dims.build_mesh(device_type)`` and applies
    :func:`moe_rl.distributed.parallelize.parallelize_model` with
    :func:`moe_rl.distributed.parallelize.mixed_precision_policy` of ``dtype``. One rank in ``"float32"``: the plain
    model (no mesh). The single-rank bf16 path is FSDP2 on a 1-rank mesh: fp32 master parameters, bf16 compute,
    fp32 gradients, the same code and numerics as the parallel path.

    Args:
        model: the full model (real or meta device), already FP8-converted if wanted.
        dims: the layout; its world size must be the default group's (or 1 with no group for ``"float32"``).
        dtype: ``"float32"`` or ``"bfloat16"`` (``trainer.dtype``).
        device_type: ``"cpu"`` (gloo) or ``"cuda"``.
        cp_method: attention under CP (``None``: the model family's default).
        activation_checkpointing: recompute each decoder layer in backward.

    Returns:
        The mesh, or ``None`` for the plain single-rank fp32 model.

    Raises:
        ValueError: an unknown ``dtype``, or ``"bfloat16"`` on one rank without an initialised default process group.
    """
    from moe_rl.distributed.parallelize import mixed_precision_policy, parallelize_model

    mp = mixed_precision_policy(dtype)
    if dims.world_size == 1 and mp is None:
        return None
    if not dist.is_initialized():
        raise ValueError(f"trainer dtype={dtype!r} on one rank runs FSDP2 mixed precision on a 1-rank mesh, which "
                         "needs the default process group: call torch.distributed.init_process_group('gloo') first "
                         "(the trainer processes do), or use dtype='float32'")
    mesh = dims.build_mesh(device_type)
    parallelize_model(model, dims, mesh, cp_method=cp_method, activation_checkpointing=activation_checkpointing,
                      mp_policy=mp)
    return mesh


def make_optimizer(model: torch.nn.Module, optim: OptimizerConfig) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over ``model``'s parameters (DTensors included) and its linear warm-up schedule
    (``LambdaLR``: ``lr * min(1, (s + 1) / max(1, warmup_steps))`` at scheduler step ``s``)."""
    o = optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    warm = max(1, o.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return opt, sched


def _local_logprobs(st: TrainerState, batch: TrainingBatch) -> torch.Tensor:
    """``[Bm, L-1]`` float32 token log-probs of one micro-batch of this data rank's rows (forward on this CP rank's
    columns).

    With ``settings.loss_chunk_tokens`` set, the head and log-softmax run through ``model.token_logprobs`` in
    chunks of that many tokens (:mod:`moe_rl.models.common.head`); otherwise through the full logits."""
    cfg, model = st.settings, st.model
    temperature: float | torch.Tensor = cfg.temperature
    if batch.temperatures is not None:  # per-sample temperatures: [Bm, 1], per token [Bm, L] for the chunked head
        temperature = batch.temperatures.float()[:, None]
    chunk = cfg.loss_chunk_tokens
    replay_re, replay_state = None, None
    if cfg.router_replay and batch.routed_experts is not None:
        replay_re, replay_state = batch.routed_experts, batch.routed_experts_state
    moe_layers = [layer.is_moe for layer in model.layers]
    cp = st.dims.cp
    smask = _sampling_mask(cfg, batch)  # [Bm, L, W], [Bm, L] or None
    if cp == 1:
        replay = None
        if replay_re is not None:
            from moe_rl.replay import model_replay_ids

            replay = model_replay_ids(replay_re, replay_state, moe_layers)
        if chunk is None:
            if smask is None:
                return token_logprobs(model(batch.input_ids, replay_ids=replay), batch.input_ids, temperature)
            logits = model(batch.input_ids, replay_ids=replay)
            return _label_logprobs(logits[:, :-1], batch.input_ids[:, 1:], temperature,
                                   (smask[0][:, :-1], smask[1][:, :-1]))
        ids = batch.input_ids
        labels = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)  # [Bm, L]: last column unused
        temp = temperature.expand(ids.shape) if isinstance(temperature, torch.Tensor) else temperature
        lp = model.token_logprobs(ids, labels, temperature=temp, chunk_tokens=chunk, replay_ids=replay)
        return lp[:, :-1]

    from moe_rl.attention.layout import make_shard_plan
    from moe_rl.distributed.parallelize import shard_for_context_parallel

    ids = batch.input_ids
    length = int(ids.shape[1])
    c = st.cp_rank
    # the model's CP layout: zigzag (balanced causal attention), or contiguous where a recurrence (Nemotron-H's
    # Mamba-2 state) runs across the CP ranks in sequence order
    layout = getattr(model, "cp_layout", "zigzag")
    labels = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)  # [Bm, L]: column t predicts t+1
    sid = shard_for_context_parallel(ids, cp, c, layout=layout, pad_value=cfg.pad_id)
    slab = shard_for_context_parallel(labels, cp, c, layout=layout, pad_value=0)
    replay = None
    if replay_re is not None:
        from moe_rl.replay import FILL_ROW, model_replay_ids

        sre = shard_for_context_parallel(replay_re, cp, c, layout=layout, pad_value=0)
        # padding: pad fill rows
        sstate = shard_for_context_parallel(replay_state, cp, c, layout=layout, pad_value=FILL_ROW)
        replay = model_replay_ids(sre.local, sstate.local, moe_layers)
    local_mask = None
    if smask is not None:  # the kept sets travel with their label columns (padding: the whole vocabulary)
        local_mask = (shard_for_context_parallel(smask[0], cp, c, layout=layout, pad_value=-1).local,
                      shard_for_context_parallel(smask[1], cp, c, layout=layout, pad_value=0).local)
    if chunk is None:
        logits = model(sid.local, positions=sid.positions, replay_ids=replay)  # [Bm, Sl, V]
        local_lp = _label_logprobs(logits, slab.local, temperature, local_mask)  # [Bm, Sl]
    else:
        temp = temperature.expand(slab.local.shape) if isinstance(temperature, torch.Tensor) else temperature
        local_lp = model.token_logprobs(sid.local, slab.local, temperature=temp, chunk_tokens=chunk,
                                        positions=sid.positions, replay_ids=replay)  # [Bm, Sl]
    plan = make_shard_plan(length, cp, layout)  # the plan shard_for_context_parallel used
    full = gather_context_parallel(local_lp, plan, st.mesh["cp"].get_group(), c)  # [Bm, L]
    return full[:, :-1]


def _reduce_loss_stats(out, global_tokens: int, world: int, contributes: bool) -> tuple[torch.Tensor, dict]:
    """All-reduce a shard's loss sums (a collective: every rank calls it) and gather the ratios for quantiles.

    Args:
        out: this rank's ``LossOutput``.
        global_tokens: loss tokens of the whole batch.
        world: ranks.
        contributes: False on CP ranks other than 0 (they computed the same rows' loss as CP rank 0).

    Returns:
        ``(stats, metrics)``: ``stats = [loss_sum, mismatch_kl_sum, masked_tokens]`` summed over the data ranks, and
        the step's loss metrics as fractions of the global loss tokens (``masked_frac_low``, ``masked_frac_high``,
        ``clipped_frac``, ``masked_seq_frac``, ``age_masked_frac``), means (``age_mean``, ``age_weight_mean``) and
        ratio quantiles ``ratio_p01/p50/p99``.
    """
    from moe_rl.rl.loss import METRIC_KEYS, ratio_quantiles

    vec = torch.stack([out.loss_sum.detach(), out.mismatch_kl_sum, *[out.metrics[k] for k in METRIC_KEYS]])
    vec = vec.double() * float(contributes)
    ratios = out.ratios.float() if contributes else out.ratios.new_zeros(0).float()
    if world > 1:
        dist.all_reduce(vec)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, ratios)
        ratios = torch.cat(gathered)
    m = dict(zip(METRIC_KEYS, vec[2:].tolist(), strict=True))
    n = max(1, global_tokens)
    metrics = {
        "masked_frac_low": m["masked_low"] / n,
        "masked_frac_high": m["masked_high"] / n,
        "clipped_frac": m["clipped_tokens"] / n,
        "masked_seq_frac": m["masked_sequences_tokens"] / n,
        "age_masked_frac": m["age_masked_tokens"] / n,
        "age_mean": m["age_sum"] / n,
        "age_weight_mean": m["age_weight_sum"] / n,
        "sft_frac": m["sft_tokens"] / n,
        "sft_nll": m["sft_nll_sum"] / max(1.0, m["sft_tokens"]),
        **ratio_quantiles(ratios),
    }
    stats = torch.stack([vec[0], vec[1], torch.tensor(m["masked_tokens"], dtype=torch.float64)])
    return stats, metrics


def _rows(batch: TrainingBatch, start: int, stop: int) -> TrainingBatch:
    """Rows ``start:stop`` of ``batch`` (every tensor field has the rows on dim 0; views, no copy)."""
    from dataclasses import fields, replace

    return replace(batch, **{f.name: getattr(batch, f.name)[start:stop] for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def _merge_loss_outputs(outs: list) -> Any:
    """One detached ``LossOutput`` of this rank's rows from its micro-batches' outputs (in row order).

    Every field of :class:`moe_rl.rl.loss.LossOutput` is a sum over rows for every loss kind (each row's terms
    depend on that row only: token sums, and for ``gspo`` / sequence ``mis`` one per-row term), so the sums add
    and ``ratios`` concatenate. A single output is returned as it is (``micro_batch=None``: today's values bit for
    bit)."""
    from moe_rl.rl.loss import LossOutput

    if len(outs) == 1:
        return outs[0]
    def total(get) -> torch.Tensor:
        return torch.stack([get(o) for o in outs]).sum()

    return LossOutput(
        loss_sum=total(lambda o: o.loss_sum.detach()),
        num_tokens=sum(o.num_tokens for o in outs),
        mismatch_kl_sum=total(lambda o: o.mismatch_kl_sum),
        masked_sum=total(lambda o: o.masked_sum),
        num_sequences=sum(o.num_sequences for o in outs),
        normalizer=outs[0].normalizer,
        metrics={k: total(lambda o, k=k: o.metrics[k]) for k in outs[0].metrics},
        ratios=torch.cat([o.ratios for o in outs]),
    )


def uses_packing(st: TrainerState) -> bool:
    """Whether :func:`train_step` packs sequences: ``settings.packing``, no row ``micro_batch`` and ``cp == 1``
    (context-parallel attention takes no sequence boundaries)."""
    return st.settings.packing and st.settings.micro_batch is None and st.dims.cp == 1


def accumulate_gradients(st: TrainerState, full: TrainingBatch, step: int) -> tuple[Any, int, int]:
    """Forward and backward of this rank's share of ``full`` into ``.grad`` (no optimizer step; a collective).

    Rows (:func:`train_step`'s steps 1-4) or, with :func:`uses_packing`, packed micro-batches of
    :func:`moe_rl.rl.packing.plan_packing` over the data ranks. Either way the loss of each micro-batch is its
    ``loss_sum`` divided by the one normaliser of the *global* (truncated) batch, so the accumulated gradient does not
    depend on the split into micro-batches or ranks.

    Returns:
        ``(out, norm, loss_tokens)``: this rank's merged detached ``LossOutput``, the normaliser, and the global batch's
        loss tokens (after truncation).
    """
    from dataclasses import replace

    from moe_rl.rl.loss import compute_loss, loss_normalizer

    cfg = st.settings
    dp = st.data_parallel_size
    if uses_packing(st):
        return _accumulate_packed(st, full, step)
    batch = full.pad_rows(dp, cfg.pad_id).shard(st.data_rank, dp)
    global_tokens = int(full.loss_mask.sum())
    norm = loss_normalizer(cfg.loss, full.loss_mask)  # padding rows hold no loss token: real rows only
    rows = batch.num_samples
    mb = rows if cfg.micro_batch is None else cfg.micro_batch
    outs = []
    for start in range(0, rows, mb):  # same count on every rank: rows = Bd everywhere
        part = batch if mb >= rows else _rows(batch, start, start + mb)
        logprobs = _local_logprobs(st, part)
        out = compute_loss(cfg.loss, logprobs, part.inference_logprobs, part.advantages, part.loss_mask,
                           token_versions=part.token_versions, trainer_version=step, sft=part.sft,
                           sft_weight=cfg.sft_weight)
        # Normalised over the *global* batch (loss tokens; sequences for GSPO). parallelize_model's FSDP2 divides
        # each gradient by dims.dp_size (= world) after summing over ranks; the CP ranks of one data rank own
        # disjoint columns of the same rows' loss (gather_context_parallel), so scaling by the world size gives the
        # gradient of sum_d loss_sum_d / norm, the single-process loss. Micro-batches add their rows' terms into
        # .grad (each backward reduce-scatters under FSDP2; the reduction is linear).
        (out.loss_sum * st.world / norm).backward()
        outs.append(replace(out, loss_sum=out.loss_sum.detach()))  # keep no graph across micro-batches
        del logprobs, out
    return _merge_loss_outputs(outs), norm, global_tokens


def packing_linear_cost(model_cfg: Any) -> float:
    """The ``linear`` coefficient of :func:`moe_rl.rl.packing.row_cost` for a GLM MoE config: per-token work of the
    projections, the active experts and the LM head, in units of causal attention's per-token-pair work.

    Per layer, attention scores and values cost ``2 l^2 H Dh`` flops for a causal sequence of ``l`` tokens
    (``l^2 / 2`` pairs, ``2 Dh`` flops each for ``q.k`` and for ``p v``, ``H`` heads); a token's matmuls cost ``2 P``
    flops for ``P`` active weights. So ``cost = l^2 + linear * l`` with ``linear = P_token / (layers H Dh)``.
    """
    c = model_cfg
    need = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
            "intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts", "n_routed_experts",
            "vocab_size", "is_moe_layer")
    if not all(hasattr(c, n) for n in need):
        return 0.0  # another family: balance on attention cost alone
    d, h, hkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attn = d * dh * (2 * h + 2 * hkv)
    active = 0
    for i in range(c.num_hidden_layers):
        if c.is_moe_layer(i):
            active += attn + 3 * d * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts)
            active += d * c.n_routed_experts  # router
        else:
            active += attn + 3 * d * c.intermediate_size
    active += c.vocab_size * d  # LM head
    return active / (c.num_hidden_layers * h * dh)


def _empty_loss_output(cfg: Any) -> Any:
    from moe_rl.rl.loss import METRIC_KEYS, LossOutput

    zero = torch.zeros(())
    return LossOutput(loss_sum=zero, num_tokens=0, mismatch_kl_sum=zero, masked_sum=zero, num_sequences=0,
                      normalizer="sequences" if cfg.kind == "gspo" else "tokens",
                      metrics=dict.fromkeys(METRIC_KEYS, zero), ratios=torch.zeros(0))


def _truncated_mask(full: TrainingBatch, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]`` loss mask with the positions at or beyond each sample's (truncated) ``length - 1`` removed."""
    col = torch.arange(full.loss_mask.shape[1])
    return full.loss_mask & (col[None, :] < (lengths - 1)[:, None])


def _take(full: TrainingBatch, idx: list[int], lengths: list[int]) -> TrainingBatch:
    """Rows ``idx`` of ``full`` cut to ``W = max(lengths)`` columns (``W - 1`` predicted positions), each row's loss
    mask, log-probs and versions cut at its own ``length - 1`` (truncation); routed rows are cut with the tokens."""
    from dataclasses import replace

    w = max(lengths)
    rows = torch.tensor(idx)
    keep = torch.arange(w - 1)[None, :] < (torch.tensor(lengths) - 1)[:, None]  # [n, W-1]

    def pick(t: torch.Tensor | None, cols: int | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t[rows]
        return t if cols is None else t[:, :cols]

    return replace(
        full, input_ids=pick(full.input_ids, w), loss_mask=pick(full.loss_mask, w - 1) & keep,
        inference_logprobs=torch.where(keep, pick(full.inference_logprobs, w - 1), 0.0),
        advantages=pick(full.advantages, None), version_start=pick(full.version_start, None),
        rewards=pick(full.rewards, None),
        token_versions=None if full.token_versions is None else torch.where(keep, pick(full.token_versions, w - 1), -1),
        routed_experts=pick(full.routed_experts, w), routed_experts_state=pick(full.routed_experts_state, w),
        lengths=torch.tensor(lengths, dtype=torch.int64), temperatures=pick(full.temperatures, None),
        sft=pick(full.sft, None), sampling_mask_ids=pick(full.sampling_mask_ids, w - 1),
        sampling_mask_kind=pick(full.sampling_mask_kind, w - 1))


def _packed_logprobs(st: TrainerState, part: TrainingBatch, lengths: list[int]) -> torch.Tensor:
    """``[n, W-1]`` float32 token log-probs of the ``n`` rows of ``part`` computed as ONE packed row ``[1, T]``
    (``T = sum(lengths)``; ``cu_seqlens``, positions restarting per sample), laid out as the rows' predicted positions
    (0 beyond each row's ``length - 1``)."""
    cfg, model = st.settings, st.model
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    ids = torch.cat([part.input_ids[i, :n] for i, n in enumerate(lengths)])[None]  # [1, T]
    labels = torch.cat([torch.cat([part.input_ids[i, 1:n], part.input_ids.new_zeros(1)])
                        for i, n in enumerate(lengths)])[None]  # [1, T]: a sample's last column predicts nothing
    temperature: float | torch.Tensor = cfg.temperature
    if part.temperatures is not None:
        temperature = torch.cat([part.temperatures[i].float().expand(n) for i, n in enumerate(lengths)])[None]
    replay = None
    if cfg.router_replay and part.routed_experts is not None:
        from moe_rl.replay import model_replay_ids

        re_ = torch.cat([part.routed_experts[i, :n] for i, n in enumerate(lengths)])[None]  # [1, T, M, K]
        state = torch.cat([part.routed_experts_state[i, :n] for i, n in enumerate(lengths)])[None]  # [1, T]
        replay = model_replay_ids(re_, state, [layer.is_moe for layer in model.layers])
    smask = _sampling_mask(cfg, part)  # [n, W, Wm], [n, W]: each sample's last column the whole vocabulary
    packed_mask = None
    if smask is not None:
        packed_mask = (torch.cat([smask[0][i, :n] for i, n in enumerate(lengths)])[None],  # [1, T, Wm]
                       torch.cat([smask[1][i, :n] for i, n in enumerate(lengths)])[None])  # [1, T]
    if cfg.loss_chunk_tokens is None:
        lp = _label_logprobs(model(ids, replay_ids=replay, cu_seqlens=cu), labels, temperature, packed_mask)  # [1, T]
    else:
        lp = model.token_logprobs(ids, labels, temperature=temperature, chunk_tokens=cfg.loss_chunk_tokens,
                                  replay_ids=replay, cu_seqlens=cu)
    w = max(lengths)
    return torch.stack([F.pad(lp[0, a:a + n - 1], (0, w - n)) for a, n in zip(cu[:-1], lengths, strict=True)])


def _accumulate_packed(st: TrainerState, full: TrainingBatch, step: int) -> tuple[Any, int, int]:
    """:func:`accumulate_gradients` with sequence packing (see :attr:`StepSettings.packing`)."""
    from dataclasses import replace

    from moe_rl.rl.loss import compute_loss, loss_normalizer
    from moe_rl.rl.packing import plan_packing

    cfg = st.settings
    dp = st.data_parallel_size
    lengths = full.sample_lengths(cfg.pad_id)
    seq_len = cfg.seq_len
    if seq_len is None:
        seq_len = max(int(lengths.max()), -(-int(lengths.sum()) // dp))
    linear = packing_linear_cost(getattr(st.model, "config", None))
    plan = plan_packing([int(x) for x in lengths], seq_len, dp, linear=linear)
    cut = torch.tensor(plan.lengths, dtype=torch.int64)
    global_mask = _truncated_mask(full, cut)  # truncated tokens are no loss tokens anywhere
    global_tokens = int(global_mask.sum())
    norm = loss_normalizer(cfg.loss, global_mask)
    outs = []
    for mb in plan.ranks[st.data_rank]:  # the same count on every rank
        if mb.is_filler:  # no sample: a 1-token pad row keeps FSDP's collectives in lockstep, zero loss
            ids = torch.full((1, 1), cfg.pad_id, dtype=torch.int64)
            if cfg.loss_chunk_tokens is None:
                lp = st.model(ids, cu_seqlens=[0, 1])
            else:
                lp = st.model.token_logprobs(ids, torch.zeros_like(ids), chunk_tokens=cfg.loss_chunk_tokens,
                                             cu_seqlens=[0, 1])
            (lp.sum() * 0.0).backward()
            del lp
            continue
        part = _take(full, list(mb.samples), list(mb.lengths))
        logprobs = _packed_logprobs(st, part, list(mb.lengths))
        out = compute_loss(cfg.loss, logprobs, part.inference_logprobs, part.advantages, part.loss_mask,
                           token_versions=part.token_versions, trainer_version=step, sft=part.sft,
                           sft_weight=cfg.sft_weight)
        (out.loss_sum * st.world / norm).backward()  # one global normaliser: as the row path
        outs.append(replace(out, loss_sum=out.loss_sum.detach()))
        del logprobs, out
    return (_merge_loss_outputs(outs) if outs else _empty_loss_output(cfg.loss)), norm, global_tokens


def train_step(st: TrainerState, full: TrainingBatch, step: int) -> dict:
    """One optimizer step on the global batch ``full`` (a collective: every rank passes the same batch).

    The batch is padded with inert rows (:meth:`moe_rl.rl.batch.TrainingBatch.pad_rows`) to a multiple of the
    data-parallel ranks, then each data rank runs its ``Bd`` rows in micro-batches of ``settings.micro_batch`` rows
    (one forward + backward each, the gradients accumulate; ``None``: one pass). Every data rank has the same
    ``Bd``, hence the same number of micro-batches (FSDP's collectives stay in lockstep). With sequence packing
    (:func:`uses_packing`) the micro-batches are packed rows instead (:func:`accumulate_gradients`).

    Args:
        st: this rank's :class:`TrainerState`.
        full: the step's whole batch (every rank reads the same file and takes its rows / columns here); any
            number of rows >= 1.
        step: the trainer version that trains it (= the batch index).

    Returns:
        The step report's statistics (equal on every rank): ``step``, ``loss`` (global loss / normaliser),
        ``mismatch_kl`` and ``masked_frac`` (per global loss token), ``loss_kind``, ``loss_metrics``, ``grad_norm``
        (before clipping), ``lr`` (of this step), ``tokens`` (non-pad), ``loss_tokens`` (after truncation); padding
        rows count in none.

    Raises:
        ValueError: the batch has no rows.
    """
    cfg = st.settings
    out, norm, global_tokens = accumulate_gradients(st, full, step)
    if st.mesh is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(st.model.parameters(), cfg.max_grad_norm)
    else:
        from moe_rl.distributed.parallelize import clip_grad_norm_

        grad_norm = clip_grad_norm_(st.model.parameters(), cfg.max_grad_norm, st.dims)
    lr = st.sched.get_last_lr()[0]
    st.opt.step()
    st.sched.step()
    st.opt.zero_grad(set_to_none=True)
    stats, loss_metrics = _reduce_loss_stats(out, global_tokens, st.world, contributes=st.cp_rank == 0)
    n_tok = max(1, global_tokens)
    return {
        "step": step,
        "loss": float(stats[0]) / norm,
        "mismatch_kl": float(stats[1]) / n_tok,
        "masked_frac": float(stats[2]) / n_tok,
        "loss_kind": cfg.loss.kind,
        "loss_metrics": loss_metrics,
        "grad_norm": float(grad_norm),
        "lr": lr,
        "tokens": int((full.input_ids != cfg.pad_id).sum()),
        "loss_tokens": global_tokens,
    }


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and buffers under the unsharded model's names (a collective when the model is
    sharded: every rank must call it). DTensors (FSDP2 shards, EP expert shards ``[E/ep, ...]`` of the global
    ``[E, ...]``) are gathered with ``full_tensor``; ``checkpoint_wrapper``'s prefix is removed."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[k.replace("_checkpoint_wrapped_module.", "")] = v.full_tensor() if isinstance(v, DTensor) else v
    return out
