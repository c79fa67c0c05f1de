"""``moe-rl cluster ... --dry-run``: check a cluster recipe against the code that would run it, and print every
process's command, the resolved config and the memory plans, without starting anything.

The first printed line is the verdict: ``OK (...)`` or ``FAIL: <first reason>`` (every reason is listed at the end).
Errors (:class:`DryRun`; exit 1):

- the recipe's model cannot be built by the trainer, or an entry point refuses a setting: the dry run calls the
  same checks the entry points call at start-up (``moe_rl.runtime.checks.check_trainer_supported``,
  ``moe_rl.runtime.checks.check_supported``);
- the trainer plan does not fit in GPU memory: the largest phase of :func:`phase_peaks` (printed as a table, one
  row per phase) plus ``trainer.reserve_gib`` exceeds the GPU; the message lists the complete sets of flags
  (:func:`suggest_layouts`) whose dry run fits -- or the host memory;
- an inference role's weights do not fit, or a decode / colocated engine's ``max_num_seqs`` full contexts of
  ``max_model_len`` tokens do not fit its KV budget.
- a server listens on a non-loopback address without a guard and is not a documented exception
  (:func:`moe_rl.launch.plan.listeners`; the ``## listening`` section prints every address and its guard). A
  documented exception is accepted on the cluster interface only; the listeners whose programs bind every interface
  (torch's ``TCPStore``, Mooncake's metadata server) are a warning.

Trainer memory: :func:`moe_rl.distributed.memory.trainer_plan_inputs` maps the resolved config to the planner's
inputs -- the ones the trainer executes: ``trainer.dtype``, the model's DSA kernel (``attn_backend``), activation
checkpointing, optimizer offload, FP8 linears and experts, the CP degree, the loss chunk -- and
:func:`moe_rl.distributed.memory.plan_memory` plans them against ``cluster.gpu_bytes`` with ``trainer.reserve_gib``
kept free. Architectures the trainer does not build (published figures only) get the parameter-state lower bound,
``(4 + 4 + 8) B`` per parameter over ``dp_shard * cp`` GPUs, for information.

Inference memory (:func:`inference_memory_plan`, modelled architectures): per GPU of each role, the weights of the
served checkpoint (FP8 with 128 x 128 block scales when ``weights.quantize_fp8``, else ``weights.dtype``: routed
experts split over the replica's EP, everything else replicated per DP rank and split by TP, plus the bf16 absorbed
MLA ``W_UK`` / ``W_UV`` copies; the MTP layer is not served), the KV cache per token (MLA: the latent and the rope
key, ``(kv_lora_rank + qk_rope_head_dim)`` values per layer in the cache dtype -- ``fp8_ds_mla``: 656 bytes --
plus the DSA indexer key cache, ``index_head_dim`` FP8 bytes and one fp32 scale per layer; hybrid ``nemotron_h``: K and
V of the attention layers only, plus a fixed Mamba-2 conv and SSM state per sequence), the KV budget
``gpu_memory_utilization * GPU - weights - activation reserve`` and how many full ``max_model_len`` contexts that
holds (each with its recurrent state, for a hybrid model).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.engines import kv_transfer_config
from moe_rl.launch.plan import CLUSTER_JSON, LaunchPlan, Process, build_plan, listeners

__all__ = ["DryRun", "InferenceRolePlan", "condense_processes", "dry_run", "inference_memory_plan", "phase_peaks",
           "suggest_layouts", "trainer_memory_plan", "trainer_plan_inputs_of", "with_overrides"]

GiB = 1024**3
NODE_SEARCH_FACTOR = 8
"""When no layout fits on the trainer's nodes, :func:`suggest_layouts` adds up to this many times
``cluster.num_nodes`` nodes (to both ``cluster.num_nodes`` and ``trainer.num_nodes``) with the current layout."""
INFERENCE_ACTIVATION_RESERVE_GIB = 8.0
"""Per inference GPU, inside vLLM's ``gpu_memory_utilization`` share: activations, DeepEP buffers and CUDA graphs
(not modelled; 6-8 GiB on an H200 for a wide-EP DeepSeek-style model)."""


@dataclass
class DryRun:
    """What ``--dry-run`` found."""

    plan: LaunchPlan
    text: str
    """Everything printed (verdict first, then the summary, processes, memory plans, resolved config)."""
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    memory_plan: object | None = None
    """The trainer's :class:`moe_rl.distributed.memory.MemoryPlan` (modelled architectures)."""
    plan_inputs: object | None = None
    """The :class:`moe_rl.distributed.memory.PlanInputs` it was planned from."""
    inference: list[InferenceRolePlan] = field(default_factory=list)
    """Per-role inference memory plans (modelled architectures)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Per-GPU bytes of each phase of the trainer plan (:func:`phase_peaks`; modelled architectures)."""
    state_lower_bound_bytes: float | None = None
    """Published-only architectures: parameter-state bytes per GPU."""

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def verdict(self) -> str:
        """The first printed line: ``OK (...)`` or ``FAIL: <first error>``."""
        if self.ok:
            return f"OK (0 errors, {len(self.warnings)} warnings)"
        more = f" (+{len(self.errors) - 1} more errors, listed at the end)" if len(self.errors) > 1 else ""
        return f"FAIL: {self.errors[0].splitlines()[0]}{more}"


def trainer_plan_inputs_of(cfg: ClusterConfig, **changes):
    """The planner inputs of ``cfg``'s trainer (:func:`moe_rl.distributed.memory.trainer_plan_inputs`), or None for
    an architecture the trainer does not build. ``changes`` override ``TrainerLayout`` fields (e.g. ``cp=8``).

    Raises:
        ValueError: the changed layout is invalid (``ParallelDims`` rules).
    """
    from moe_rl.distributed.memory import trainer_plan_inputs

    model = cfg.model.model_config_obj()
    if model is None:
        return None
    t = cfg.trainer.model_copy(update=changes)
    return trainer_plan_inputs(model, t, gpus_per_node=cfg.cluster.gpus_per_node)


def trainer_memory_plan(cfg: ClusterConfig, **changes):
    """The planner's per-GPU plan of ``cfg``'s trainer (``changes`` override ``TrainerLayout`` fields), with
    ``trainer.reserve_gib`` as its reserve, or None for an architecture the planner does not model.

    Raises:
        ValueError: the changed layout is invalid (``ParallelDims`` / ``plan_memory`` rules).
    """
    inputs = trainer_plan_inputs_of(cfg, **changes)
    if inputs is None:
        return None
    plan = inputs.plan()
    plan.reserve_bytes = cfg.trainer.model_copy(update=changes).reserve_gib * GiB
    return plan


def phase_peaks(inputs, plan) -> dict[str, float]:
    """Per-GPU bytes of every phase the planner compares (``plan.peak_phase`` is the largest), in the planner's order.

    A training phase holds the parameter state, its activations and working set and the FSDP all-gather buffers; the
    optimizer step holds the state and AdamW's working set but no all-gather (``plan.details["fsdp_allgather_bytes"]``).

    Args:
        inputs: the :class:`moe_rl.distributed.memory.PlanInputs` ``plan`` was planned from.
        plan: its :class:`moe_rl.distributed.memory.MemoryPlan`.

    Returns:
        Phase name -> bytes per GPU (``reserve_bytes`` not included).
    """
    comp = plan.components
    state = comp["parameters"] + comp["gradients"] + comp["optimizer"]
    gather = plan.details["fsdp_allgather_bytes"]
    names = [k.removesuffix("_activation_bytes") for k in plan.details if k.endswith("_activation_bytes")]
    return {name: state + plan.details[f"{name}_bytes"] + (0.0 if name == "optimizer_step" else gather)
            for name in names}


def _flag(path: str, value) -> str:
    """``("trainer.optimizer_offload", True)`` -> ``"--trainer.optimizer-offload true"``."""
    shown = str(value).lower() if isinstance(value, bool) else str(value)
    return f"--{path.replace('_', '-')} {shown}"


def with_overrides(cfg: ClusterConfig, changes: dict[str, object]) -> ClusterConfig:
    """``cfg`` with dotted-path ``changes`` applied (``{"trainer.cp": 4}``), validated again like the CLI's flags.

    Raises:
        ValueError: the changed config breaks a rule (pydantic's ``ValidationError``).
    """
    tree = cfg.model_dump()
    for path, value in changes.items():
        node = tree
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return ClusterConfig.model_validate(tree)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _trainer_candidates(cfg: ClusterConfig) -> list[dict[str, object]]:
    """Every valid trainer layout on the trainer's nodes (each ``cp`` dividing the GPUs and ``seq_len``, each ``ep``
    dividing ``dp_shard * cp`` and the routed experts, optimizer offload off / on), plus ``dtype='bfloat16'`` and the
    memory-bounded DSA kernel (``attn_backend='torch'``) when the config has the other one; as override sets,
    cheapest first: fewest changed settings, then without optimizer offload, then the smallest CP, then the EP
    nearest the current one."""
    t, g = cfg.trainer, cfg.cluster.gpus_per_node
    flat = t.num_nodes * g // t.dp_replicate  # dp_shard * cp
    experts = cfg.model.experts
    cps = [c for c in _divisors(flat) if t.seq_len % c == 0 and (t.num_nodes * g) % (t.dp_replicate * c) == 0]
    eps = [e for e in _divisors(flat) if experts % e == 0]
    offloads = sorted({t.optimizer_offload, True})
    dtypes = sorted({t.dtype, "bfloat16"})
    model_cfg = cfg.model.model_config_obj()
    backend = getattr(model_cfg, "attn_backend", None)
    backends = [backend] + (["torch"] if backend == "dense" else [])
    out = []
    for cp in cps:
        for ep in eps:
            for off in offloads:
                for dt in dtypes:
                    for be in backends:
                        ch: dict[str, object] = {}
                        if cp != t.cp:
                            ch["trainer.cp"] = cp
                        if ep != t.ep:
                            ch["trainer.ep"] = ep
                        if off != t.optimizer_offload:
                            ch["trainer.optimizer_offload"] = off
                        if dt != t.dtype:
                            ch["trainer.dtype"] = dt
                        if be != backend:
                            ch["model.config.attn_backend"] = be
                        if ch:
                            out.append(ch)
    out.sort(key=lambda ch: (len(ch), bool(ch.get("trainer.optimizer_offload", t.optimizer_offload)),
                             ch.get("trainer.cp", t.cp), abs(int(ch.get("trainer.ep", t.ep)) - t.ep)))
    return out


def suggest_layouts(cfg: ClusterConfig, errors: list[str], limit: int = 5) -> list[str]:
    """Complete sets of CLI flags that make ``cfg``'s trainer fit, each checked by a dry run of the changed config.

    First every valid layout on the trainer's nodes (:func:`_trainer_candidates` order, at most ``limit``); when none
    fits, the fewest nodes (up to ``NODE_SEARCH_FACTOR * cluster.num_nodes``) added to both ``cluster.num_nodes`` and
    ``trainer.num_nodes``, with the current layout or else the smallest ``trainer.cp`` that fits there. A suggestion is printed
    only if the changed config validates and its dry run has no error outside ``errors`` (the errors of ``cfg``
    that the trainer layout does not cause), so with no other errors, applying it gives ``OK``.

    Returns:
        Lines ``"--trainer.cp 4 --trainer.ep 16: peak <GiB>, margin <GiB>"`` (the largest phase, :func:`phase_peaks`).
    """
    gpu_bytes = cfg.cluster.gpu_bytes
    allowed = set(errors)
    out: list[str] = []

    def check(changes: dict[str, object]) -> str | None:
        try:
            new = with_overrides(cfg, changes)
            plan = trainer_memory_plan(new)
        except ValueError:
            return None
        if plan is None or not plan.fits(gpu_bytes):  # cheap filter: no phase is below plan_memory's peak
            return None
        res = dry_run(new, suggest=False)
        if not res.phases or not set(res.errors) <= allowed:
            return None
        peak = max(res.phases.values())
        margin = gpu_bytes - peak - plan.reserve_bytes
        flags = " ".join(_flag(k, v) for k, v in changes.items())
        return f"{flags}: peak {peak / GiB:.2f} GiB, margin {margin / GiB:+.2f} GiB"

    for changes in _trainer_candidates(cfg):
        line = check(changes)
        if line is not None:
            out.append(line)
            if len(out) >= limit:
                return out
    if out:
        return out
    c, t = cfg.cluster, cfg.trainer
    for extra in range(1, NODE_SEARCH_FACTOR * c.num_nodes + 1):
        nodes = {"cluster.num_nodes": c.num_nodes + extra, "trainer.num_nodes": t.num_nodes + extra}
        # the current layout first, then the other CP degrees (smallest first) the larger trainer allows
        flat = (t.num_nodes + extra) * c.gpus_per_node // t.dp_replicate
        cps = [cp for cp in _divisors(flat) if cp != t.cp and t.seq_len % cp == 0 and flat % cp == 0]
        for more in [{}] + [{"trainer.cp": cp} for cp in cps]:
            line = check({**nodes, **more})
            if line is not None:
                return [f"{line} ({extra} more trainer node{'s' if extra > 1 else ''})"]
    return out


def _missing_entry_points(plan: LaunchPlan) -> list[str]:
    missing = []
    for p in plan.processes:
        argv = list(p.argv)
        for i, tok in enumerate(argv[:-1]):
            if tok == "-m" and argv[i + 1].startswith("moe_rl"):
                mod = argv[i + 1]
                if importlib.util.find_spec(mod) is None and mod not in missing:
                    missing.append(mod)
    return missing


# --------------------------------------------------------------------------------------------- inference plan

@dataclass
class InferenceRolePlan:
    """Memory of one inference GPU of a role (bytes)."""

    role: str
    ep: int
    tp: int
    weights_bytes: float
    """Served weights per GPU: routed experts / EP plus the replicated rest / TP plus the absorbed MLA copies."""
    kv_bytes_per_token: float
    """KV cache bytes per token over all layers (MLA latent + rope key, DSA indexer key)."""
    kv_budget_bytes: float
    """``gpu_memory_utilization * GPU - weights - activation reserve``."""
    max_model_len: int
    max_num_seqs: int
    state_bytes_per_seq: float = 0.0
    """Fixed-size recurrent state per sequence (``nemotron_h``: every Mamba-2 layer's conv and SSM state,
    :func:`_state_bytes_per_seq`); 0 for attention-only models."""

    @property
    def tokens_per_gpu(self) -> float:
        """Tokens of KV cache one GPU holds (MLA's single latent head is not split by TP: each TP rank holds it);
        the recurrent state of the sequences is not subtracted (see :attr:`contexts_per_gpu`)."""
        return max(0.0, self.kv_budget_bytes) / self.kv_bytes_per_token

    @property
    def contexts_per_gpu(self) -> float:
        """Full ``max_model_len`` contexts the KV budget holds (per GPU, so per DP rank), each with its KV cache and
        its recurrent state: ``budget / (max_model_len * kv_bytes_per_token + state_bytes_per_seq)``."""
        per_seq = self.max_model_len * self.kv_bytes_per_token + self.state_bytes_per_seq
        return max(0.0, self.kv_budget_bytes) / per_seq


def _kv_bytes_per_token(model, kv_cache_dtype: str) -> float:
    """KV cache bytes per token over the served layers (the MTP layer is not served).

    MLA (``glm_moe_dsa``, ``deepseek_v3``), per layer: the latent and the rope key, ``(kv_lora_rank +
    qk_rope_head_dim) * 2`` in bf16 (``auto`` / ``bfloat16``), ``* 1`` in an FP8 dtype, ``kv_lora_rank + 4 *
    kv_lora_rank / 128 + 2 * qk_rope_head_dim`` bytes for ``fp8_ds_mla`` (FP8 latent, fp32 scale per 128 values, bf16
    rope key: 656 B for kv_lora_rank 512, rope 64); DSA (``glm_moe_dsa``) adds its indexer key cache,
    ``index_head_dim`` FP8 bytes and an fp32 scale per 128 (132 B for GLM-5). GLM-5.1 in bf16: 1,284 B x 78 layers =
    97.8 KiB per token; Kimi-K2 (plain MLA) in bf16: 1,152 B x 61 layers = 68.6 KiB per token. GQA (``glm4_moe``):
    K and V per KV head. Hybrid (``nemotron_h``): K and V per KV head of the attention layers only (Nemotron-3-Ultra:
    2 x 2 x 128 x 2 B x 12 layers = 12 KiB per token in bf16); its Mamba-2 layers hold a fixed-size state per
    sequence instead (:func:`_state_bytes_per_seq`).
    """
    if hasattr(model, "kv_lora_rank"):  # MLA: one latent + rope key per token and layer
        kvl, dr = model.kv_lora_rank, model.qk_rope_head_dim
        if kv_cache_dtype == "fp8_ds_mla":
            latent = kvl + 4.0 * -(-kvl // 128) + 2.0 * dr
        else:
            latent = (kvl + dr) * (2.0 if kv_cache_dtype in ("auto", "bfloat16") else 1.0)
        indexer = model.index_head_dim + 4.0 * -(-model.index_head_dim // 128) if hasattr(model, "index_topk") else 0.0
        return (latent + indexer) * model.num_hidden_layers
    # GQA (glm4_moe; the attention layers of nemotron_h): K and V per KV head
    per = 2.0 * model.num_key_value_heads * model.head_dim * (2.0 if kv_cache_dtype in ("auto", "bfloat16") else 1.0)
    if hasattr(model, "layer_kind"):  # hybrid: attention layers only
        return per * sum(model.layer_kind(i) == "attention" for i in range(model.num_hidden_layers))
    return per * model.num_hidden_layers


def _state_bytes_per_seq(model, ssm_bytes: float) -> float:
    """Recurrent state bytes per sequence of a hybrid model (0 without Mamba-2 layers): per Mamba-2 layer the conv
    state, the last ``conv_kernel - 1`` inputs of the ``I + 2 G N`` conv channels in bf16 (the model dtype), and the
    SSM state ``[H, P, N]`` of ``ssm_bytes`` bytes per element: the engine group's ``mamba_ssm_cache_dtype``, the
    value its ``--mamba-ssm-cache-dtype`` gets (fp32 = 4 by default, NVIDIA's recommendation for Nemotron-H; fp16
    or bf16 halves it). Nemotron-3-Ultra in fp32: ``3 x 18432 x 2 + 256 x 64 x 128 x 4`` = 8.1 MiB x 48 layers = 389 MiB
    per sequence."""
    if not hasattr(model, "layer_kind"):
        return 0.0
    inner = model.mamba_num_heads * model.mamba_head_dim
    conv = (model.conv_kernel - 1) * (inner + 2 * model.n_groups * model.ssm_state_size) * 2.0
    ssm = inner * model.ssm_state_size * ssm_bytes
    return (conv + ssm) * sum(model.layer_kind(i) == "mamba" for i in range(model.num_hidden_layers))


def _served_weight_bytes(model, fp8: bool, dtype_bytes: float, ep: int, tp: int) -> float:
    """Per-GPU bytes of the served checkpoint (decoder layers, embedding, head; no MTP layer)."""
    from moe_rl.distributed.memory import arch_spec

    arch = arch_spec(model)
    layers = [layer for layer in arch.layers if not layer.mtp]
    d, e = model.hidden_size, model.n_routed_experts
    wbytes = (1.0 + 4.0 / 128**2) if fp8 else dtype_bytes  # FP8 e4m3 + fp32 scale per 128 x 128 block
    experts = sum(layer.expert_params for layer in layers)
    routers = sum(e * d for layer in layers if layer.expert_params)
    rest = sum(layer.dense_params for layer in layers) - routers  # linears (quantized) + small norms
    high = arch.embed_params + routers  # embedding, head and routers stay bf16
    absorbed = 0.0
    if hasattr(model, "kv_lora_rank"):  # MLA serving keeps bf16 W_UK / W_UV split out of kv_b_proj
        h = model.num_attention_heads
        absorbed = 2.0 * model.kv_lora_rank * h * (model.qk_nope_head_dim + model.v_head_dim) * len(layers)
    return experts * wbytes / ep + (rest * wbytes + high * 2.0 + absorbed) / tp


def inference_memory_plan(cfg: ClusterConfig) -> list[InferenceRolePlan]:
    """Per-role inference memory per GPU (see the module docstring); empty for a published-only architecture."""
    model = cfg.model.model_config_obj()
    if model is None:
        return []
    inf, g = cfg.inference, cfg.cluster.gpus_per_node
    fp8 = cfg.weights.quantize_fp8
    dtype_bytes = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}[cfg.weights.dtype]
    out = []
    for role, grp in inf.groups():
        ep = grp.ep_size(g) if grp.enable_expert_parallel else 1
        tp = grp.tensor_parallel_size
        weights = _served_weight_bytes(model, fp8, dtype_bytes, ep, tp)
        budget = grp.gpu_memory_utilization * cfg.cluster.gpu_bytes - weights - INFERENCE_ACTIVATION_RESERVE_GIB * GiB
        out.append(InferenceRolePlan(role, ep, tp, weights, _kv_bytes_per_token(model, grp.kv_cache_dtype), budget,
                                     inf.max_model_len, grp.max_num_seqs,
                                     _state_bytes_per_seq(model, grp.mamba_ssm_cache_bytes)))
    return out


# --------------------------------------------------------------------------------------------- process listing

_NUM = re.compile(r"\d+")


def _shape(p: Process) -> tuple:
    """What must be equal for two processes to be printed as one line (numbers may differ)."""
    env = tuple(sorted((k, _NUM.sub("#", v)) for k, v in p.env.items()))
    return (p.role, p.stage, p.gpus, bool(p.health_url), tuple(_NUM.sub("#", a) for a in p.argv), env)


def _merge(values: list[str]) -> str:
    """``["a16", "a17", "a18"]`` -> ``"a{16..18}"``: one token whose numbers vary across a group."""
    if len(set(values)) == 1:
        return values[0]
    parts = [_NUM.split(v) for v in values]
    nums = [_NUM.findall(v) for v in values]
    out = parts[0][0]
    for j in range(len(nums[0])):
        col = [int(n[j]) for n in nums]
        if len(set(col)) == 1:
            out += str(col[0])
        else:
            step = col[1] - col[0]
            arith = step > 0 and all(b - a == step for a, b in zip(col, col[1:], strict=False))
            out += (f"{{{col[0]}..{col[-1]}}}" if step == 1 else f"{{{col[0]}..{col[-1]} step {step}}}") if arith \
                else "{" + ",".join(map(str, col)) + "}"
        out += parts[0][j + 1]
    return out


def condense_processes(processes: list[Process]) -> list[str]:
    """Print lines of ``processes``: consecutive processes that differ only in numbers (node, host, start rank)
    become one ``N x <role>`` entry whose varying numbers read ``{first..last}``."""
    groups: list[list[Process]] = []
    for p in processes:
        if groups and _shape(groups[-1][0]) == _shape(p):
            groups[-1].append(p)
        else:
            groups.append([p])
    lines = []
    for grp in groups:
        first = grp[0]
        nodes = _merge([str(p.node) for p in grp])
        ready = f"  ready: {_merge([p.health_url for p in grp])}" if first.health_url else ""
        head = f"[stage {first.stage}] " + (f"{len(grp)} x {first.role}" if len(grp) > 1 else first.name)
        lines.append(f"{head}  node {nodes}  gpus {first.gpus}{ready}")
        if first.env:
            keys = sorted(first.env)
            lines.append("  env: " + " ".join(f"{k}={shlex.quote(_merge([p.env[k] for p in grp]))}" for k in keys))
        argv = [_merge([p.argv[i] for p in grp]) for i in range(len(first.argv))]
        lines.append("  $ " + shlex.join(argv))
    return lines


# --------------------------------------------------------------------------------------------- the dry run

def dry_run(cfg: ClusterConfig, out_dir: str | Path | None = None, *, suggest: bool = True) -> DryRun:
    """Build the plan of ``cfg``, check it, and describe it.

    Args:
        cfg: a validated :class:`ClusterConfig`.
        out_dir: when given and the verdict is OK, writes ``job.sbatch`` (rendered), ``plan.json`` (every process:
            node, role, argv, env), ``dry_run.txt`` (the printed text) and the plan's files (``configs/*.json``)
            there; on FAIL nothing is written.
        suggest: when the trainer does not fit, list the layouts that do (:func:`suggest_layouts`).

    Returns:
        A :class:`DryRun`; ``ok`` is False when anything in the module docstring's error list holds.
    """
    plan = build_plan(cfg)
    res = DryRun(plan, "")
    lines: list[str] = []
    c, t, inf = cfg.cluster, cfg.trainer, cfg.inference
    dims = t.parallel_dims(c.gpus_per_node)
    gpu_bytes = c.gpu_bytes
    gpu_label = f"{gpu_bytes / GiB:.1f} GiB per {c.gpu_name}"

    # what the entry points refuse at start-up: the same functions they call
    from moe_rl.runtime.checks import check_supported, check_trainer_supported

    try:
        check_trainer_supported(cfg)
    except ValueError as exc:
        res.errors.append(f"the cluster trainer refuses this config: {exc}")
    try:
        check_supported(cfg)
    except ValueError as exc:
        res.errors.append(f"the cluster entry points refuse this config: {exc}")

    lines.append(f"# moe-rl cluster dry run: {cfg.name}")
    spec = cfg.task.env_spec
    task = (f"{spec[0]} {spec[1]!r}" if spec is not None
            else f"built-in task {type(cfg.task.env).__name__} (max_new_tokens {cfg.task.env.max_new_tokens})")
    lines.append(f"trains on: {task}")
    lines.append(
        f"nodes: {c.num_nodes} x {c.gpus_per_node} {c.gpu_name} = trainer {t.num_nodes} + inference {inf.nodes} "
        f"({' + '.join(f'{r} {g.nodes_per_replica}x{g.replicas}' for r, g in inf.groups())})"
    )
    lines.append(f"processes: {len(plan.processes)} ("
                 + ", ".join(f"{r} {len(plan.by_role(r))}" for r in dict.fromkeys(p.role for p in plan.processes)) + ")")
    lines.append(f"trainer: dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} cp={dims.cp} ep={dims.ep} "
                 f"(world {dims.world_size}), seq_len {t.seq_len}, dtype {t.dtype}, fp8={str(t.fp8).lower()}, "
                 f"AC {t.activation_checkpointing}, optimizer_offload={str(t.optimizer_offload).lower()}")
    for role, g in inf.groups():
        kv = kv_transfer_config(inf, role)
        lines.append(
            f"inference.{role}: {g.replicas} replica(s) x {g.nodes_per_replica} nodes, DP={g.dp_size(c.gpus_per_node)} "
            f"TP={g.tensor_parallel_size} EP={g.ep_size(c.gpus_per_node)}, all2all={g.resolved_all2all(role)}, "
            f"max_num_seqs={g.max_num_seqs}, gpu_memory_utilization={g.gpu_memory_utilization:g}, "
            f"kv_cache_dtype={g.kv_cache_dtype}, "
            f"kv_transfer={json.dumps(kv, separators=(',', ':')) if kv else 'none'}"
        )
    lines.append("node roles: " + plan.node_summary())
    lines.append("")
    lines.append("## processes (hosts are ${HOST_<node>} = line <node> of `scontrol show hostnames`; "
                 "{a..b} = one process per value)")
    lines += condense_processes(list(plan.processes))
    lines.append("")
    lines.append("## listening (${ADDR_<node>} = the node's cluster-interface IPv4, resolved by the job; the control "
                 "token is $MOE_RL_CONTROL_TOKEN / ${RUN_DIR}/control_token)")
    groups: list[list] = []
    for lst in listeners(plan):  # consecutive listeners that differ only in numbers print as one line
        key = (lst.what, lst.guard, lst.guarded, lst.exception, _NUM.sub("#", lst.address), _NUM.sub("#", lst.process))
        if groups and groups[-1][0] == key:
            groups[-1][1].append(lst)
        else:
            groups.append([key, [lst]])
    for _, grp in groups:
        lst = grp[0]
        mark = ("guarded" if lst.guarded else "UNGUARDED, EVERY INTERFACE (firewall it)" if lst.wildcard
                else "UNGUARDED (documented exception)" if lst.exception else "UNGUARDED")
        lines.append(f"{_merge([x.address for x in grp])}  {_merge([x.process for x in grp])}: {lst.what}  "
                     f"[{mark}: {lst.guard}]")
    wide: dict[str, list[str]] = {}
    for lst in listeners(plan):
        if lst.guarded or lst.loopback:
            continue
        if lst.exception and lst.wildcard:  # the program binds every interface whatever it is told
            wide.setdefault(lst.what, []).append(lst.process)
        elif not lst.exception:
            res.errors.append(f"{lst.process} listens on {lst.address} ({lst.what}) without a guard; every control "
                              "endpoint on a non-loopback address must require the run's control token")
    if wide:
        res.warnings.append(
            f"{len(wide)} kinds of listener bind every interface without authentication, and their programs offer no "
            "way to bind one address: " + "; ".join(f"{what} ({_merge(procs) if len(procs) < 4 else f'{len(procs)} processes'})"
                                                  for what, procs in wide.items())
            + ". Allow only the job's nodes to reach them (a private fabric or a firewall; docs/blocks/launch.md, "
            "'Exceptions')")
    lines.append("")
    for path, content in plan.files.items():
        if path == CLUSTER_JSON:  # the resolved config, printed once at the end
            continue
        lines.append(f"## file ${{RUN_DIR}}/{path}")
        lines.append(content.rstrip("\n"))
        lines.append("")

    lines.append("## trainer memory (per GPU)")
    if cfg.model.modelled:
        inputs = trainer_plan_inputs_of(cfg)
        mplan = trainer_memory_plan(cfg)
        res.memory_plan, res.plan_inputs = mplan, inputs
        lines.append(f"plan_memory({cfg.model.architecture}: {inputs.describe()}); peak in {mplan.peak_phase}")
        lines.append(mplan.report(gpu_bytes))
        res.phases = phase_peaks(inputs, mplan)
        lines.append("")
        largest = max(res.phases, key=res.phases.__getitem__)
        lines.append("phases (margin = GPU - phase - reserve; a training phase includes the FSDP all-gather buffers):")
        lines.append("| phase | GiB per GPU | margin GiB |")
        lines.append("|---|---:|---:|")
        for name, value in res.phases.items():
            marks = (["largest"] if name == largest and largest != mplan.peak_phase else []) + (
                ["plan_memory's peak"] if name == mplan.peak_phase else [])
            mark = f" ({', '.join(marks)})" if marks else ""
            lines.append(f"| {name}{mark} | {value / GiB:.2f} | {(gpu_bytes - value - mplan.reserve_bytes) / GiB:+.2f} |")
        peak = res.phases[largest]
        margin = gpu_bytes - peak - mplan.reserve_bytes
        if largest != mplan.peak_phase:
            lines.append(f"the {largest} phase ({peak / GiB:.2f} GiB) is larger than plan_memory's peak "
                         f"({mplan.peak_phase}), whose comparison leaves out the FSDP all-gather buffers: the fit is "
                         f"checked against {largest} (margin {margin / GiB:+.2f} GiB)")
        if margin < 0:
            alts = suggest_layouts(cfg, list(res.errors)) if suggest else []
            res.errors.append(
                f"the trainer layout does not fit: peak {peak / GiB:.2f} GiB ({largest}) + reserve "
                f"{mplan.reserve_bytes / GiB:.2f} GiB > {gpu_label} (margin {margin / GiB:+.2f} GiB). "
                + ("Layouts that fit (flags to add, cheapest first): " + "; ".join(alts) if alts
                   else f"No layout on these {t.num_nodes} trainer nodes fits, nor this layout on up to "
                   f"{NODE_SEARCH_FACTOR * c.num_nodes} more nodes; add nodes and change trainer.cp / trainer.ep.")
            )
        optim_per_gpu = 4.0 * 2 * mplan.details["trained_params"] / dims.fsdp_size
    else:
        total = float(cfg.model.total_params)  # type: ignore[arg-type]
        state = (8.0 + (0.0 if t.optimizer_offload else 8.0)) * total / dims.fsdp_size
        res.state_lower_bound_bytes = state
        lines.append(
            f"NOT MODELLED: no trainer model and no block model for architecture {cfg.model.architecture!r}. "
            f"For information, the parameter state: {total / 1e9:.0f}B parameters (published: {cfg.model.source}) x "
            f"{8 + (0 if t.optimizer_offload else 8)} B / {dims.fsdp_size} GPUs = {state / GiB:.2f} GiB per GPU "
            f"(+ reserve {t.reserve_gib:.1f} GiB) of {gpu_bytes / GiB:.1f} GiB; activations and FSDP buffers NOT counted"
        )
        if state + t.reserve_gib * GiB > gpu_bytes:
            res.errors.append(
                f"even the parameter state ({state / GiB:.2f} GiB per GPU) + reserve does not fit in "
                f"{gpu_bytes / GiB:.1f} GiB; add trainer nodes or turn on trainer.optimizer_offload"
            )
        optim_per_gpu = 8.0 * total / dims.fsdp_size
    if c.host_memory_gb is not None:
        host = c.host_memory_gb * 1e9
        if t.optimizer_offload:
            need = optim_per_gpu * c.gpus_per_node
            lines.append(f"trainer host memory: AdamW state {need / GiB:.1f} GiB per node of {host / GiB:.1f} GiB")
            if need > host:
                res.errors.append(f"optimizer offload needs {need / GiB:.1f} GiB of host memory per trainer node, more "
                                  f"than cluster.host_memory_gb={c.host_memory_gb}")
        if inf.kv_offload is not None:
            need = inf.kv_offload.segment_gib_per_node * GiB
            lines.append(f"inference host memory: Mooncake segment {need / GiB:.1f} GiB per node of {host / GiB:.1f} GiB")
            if need > host:
                res.errors.append(f"inference.kv_offload.segment_gib_per_node={inf.kv_offload.segment_gib_per_node} "
                                  f"exceeds cluster.host_memory_gb={c.host_memory_gb}")
    lines.append("")

    lines.append("## inference memory (per GPU)")
    res.inference = inference_memory_plan(cfg)
    if not res.inference:
        lines.append(f"NOT MODELLED: no served-weight or KV model for architecture {cfg.model.architecture!r}")
    else:
        lines.append(f"weights: {'FP8 (128x128 block scales)' if cfg.weights.quantize_fp8 else cfg.weights.dtype}; "
                     f"activation reserve {INFERENCE_ACTIVATION_RESERVE_GIB:.1f} GiB per GPU; contexts of "
                     f"max_model_len {inf.max_model_len} tokens")
        lines.append("| role | EP | TP | weights GiB/GPU | KV bytes/token | KV budget GiB/GPU | tokens/GPU | "
                     "full contexts/GPU | max_num_seqs |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in res.inference:
            lines.append(f"| {r.role} | {r.ep} | {r.tp} | {r.weights_bytes / GiB:.2f} | {r.kv_bytes_per_token:,.0f} "
                         f"({r.kv_bytes_per_token / 1024:.1f} KiB) | {r.kv_budget_bytes / GiB:.2f} | "
                         f"{r.tokens_per_gpu / 1e6:.2f}M | {r.contexts_per_gpu:.2f} | {r.max_num_seqs} |")
        # every role has the same state: colocated has one group, P/D requires one mamba_ssm_cache_dtype
        hybrid = next((r for r in res.inference if r.state_bytes_per_seq), None)
        if hybrid is not None:
            ssm = getattr(inf, hybrid.role).mamba_ssm_cache_dtype
            lines.append(f"Mamba-2 state per sequence: {hybrid.state_bytes_per_seq / 2**20:.1f} MiB (conv bf16 + SSM "
                         f"{ssm}, --mamba-ssm-cache-dtype {ssm}), held beside each context's KV cache (full "
                         "contexts/GPU count both)")
        for r in res.inference:
            grp = getattr(inf, r.role)
            if r.kv_budget_bytes <= 0:
                res.errors.append(
                    f"inference.{r.role}: weights {r.weights_bytes / GiB:.2f} GiB + activation reserve "
                    f"{INFERENCE_ACTIVATION_RESERVE_GIB:.1f} GiB exceed gpu_memory_utilization "
                    f"{grp.gpu_memory_utilization:g} x {gpu_label}: no KV cache left; raise "
                    f"inference.{r.role}.nodes_per_replica (more EP) or gpu_memory_utilization")
            elif r.max_num_seqs > int(r.contexts_per_gpu):
                msg = (f"inference.{r.role}.max_num_seqs={r.max_num_seqs} but one DP rank's KV budget "
                       f"({r.kv_budget_bytes / GiB:.2f} GiB, {r.kv_bytes_per_token / 1024:.1f} KiB per token"
                       + (f" + {r.state_bytes_per_seq / 2**20:.1f} MiB Mamba-2 state per sequence"
                          if r.state_bytes_per_seq else "") + ", "
                       f"kv_cache_dtype={grp.kv_cache_dtype}) holds {r.contexts_per_gpu:.2f} full contexts of "
                       f"max_model_len={inf.max_model_len}; set max_num_seqs <= {int(r.contexts_per_gpu)}"
                       + (" or kv_cache_dtype='fp8_ds_mla'" if grp.kv_cache_dtype != "fp8_ds_mla"
                          and hasattr(cfg.model.model_config_obj(), "index_topk") else ""))
                if r.role == "prefill":  # prefill holds a request's KV only until the decode side pulls it
                    res.warnings.append(msg)
                else:
                    res.errors.append(msg)
        dec = [r for r in res.inference if r.role in ("decode", "engine")]
        for r in dec:
            grp = getattr(inf, r.role)
            ranks = grp.dp_size(c.gpus_per_node) * grp.replicas
            lines.append(f"{r.role}: {ranks} DP ranks x max_num_seqs {r.max_num_seqs} = {ranks * r.max_num_seqs} "
                         f"sequences in flight; KV for {ranks * r.contexts_per_gpu:.0f} full contexts")
        slots = sum(getattr(inf, r.role).dp_size(c.gpus_per_node) * getattr(inf, r.role).replicas * r.max_num_seqs
                    for r in dec)
        o = cfg.orchestrator
        if dec and o.max_inflight * o.group_size > slots:
            res.warnings.append(
                f"orchestrator.max_inflight={o.max_inflight} groups x group_size={o.group_size} = "
                f"{o.max_inflight * o.group_size} rollouts admitted, but the engines run {slots} sequences at once: "
                f"the rest wait in the engines' queues, and their policy version ages while they wait (staleness); "
                f"lower max_inflight to about {max(1, slots // o.group_size)} unless the queue is intended")
    lines.append("")

    for mod in _missing_entry_points(plan):
        res.warnings.append(f"entry point {mod} is not in this checkout: the plan is checked, but the job cannot run "
                            "until it exists")
    lines.append("## resolved config")
    lines.append(cfg.model_dump_json(indent=2))
    lines.append("")
    for w in res.warnings:
        lines.append(f"WARNING: {w}")
    for e in res.errors:
        lines.append(f"ERROR: {e}")
    lines.append(f"verdict: {res.verdict}")
    res.text = res.verdict + "\n" + "\n".join(lines) + "\n"

    if out_dir is not None and res.ok:
        from moe_rl.launch.slurm import render_sbatch

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.sbatch").write_text(render_sbatch(plan))
        (out / "dry_run.txt").write_text(res.text)
        (out / "plan.json").write_text(json.dumps(
            [{"name": p.name, "role": p.role, "node": p.node, "stage": p.stage, "gpus": p.gpus, "argv": list(p.argv),
              "env": p.env, "health_url": p.health_url} for p in plan.processes], indent=2) + "\n")
        for rel, content in plan.files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(content)
    return res
