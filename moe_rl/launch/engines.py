"""Inference deployment on a GPU cluster: vLLM engine groups (colocated, or prefill/decode disaggregated), wide
expert parallelism, KV connectors and the request router.

Terms (vLLM ``docs/serving/data_parallel_deployment.md``, ``vllm/engine/arg_utils.py``): one *replica* is one vLLM
data-parallel group of ``nodes_per_replica`` nodes; its ``data_parallel_size = nodes * gpus_per_node /
tensor_parallel_size`` DP ranks each run the attention for their own requests, and with
``--enable-expert-parallel`` the MoE layers are split over ``EP = DP x TP`` GPUs (*wide EP* when that spans 4+
nodes, EP >= 32). Each node runs one ``vllm serve`` process holding ``--data-parallel-size-local`` ranks; the head
node serves the API (``--data-parallel-address`` / ``--data-parallel-rpc-port`` are its coordinates), the others
run ``--headless`` with ``--data-parallel-start-rank``.

P/D disaggregation (prime-rl ``multi_node_rl.sbatch.j2``): prefill replicas use
DeepEP's high-throughput kernels (``--all2all-backend deepep_high_throughput``; long prompts, large token batches,
optionally dual-batch overlap ``--enable-dbo``), decode replicas its low-latency kernels (``deepep_low_latency``; a
few tokens per request per step, CUDA graphs). KV moves prefill -> decode over the KV connector (``NixlConnector``,
``kv_role`` ``kv_both`` on both sides as in vLLM ``docs/features/nixl_connector_usage.md``; or the Mooncake
Transfer Engine ``MooncakeConnector`` with ``kv_producer`` / ``kv_consumer``). With Mooncake KV offload on, the
engine's connector is a ``MultiConnector`` of the P/D connector (first: it answers the request's remote-prefill
blocks) and ``MooncakeStoreConnector`` (the shared DRAM/SSD tier); offload forces prefix caching on.

``--all2all-backend``, ``--enable-dbo``, ``--data-parallel-*``, ``--enable-expert-parallel``,
``--kv-transfer-config`` are ``vllm serve`` flags in vLLM 0.32 (``EngineArgs.add_cli_args``) and later;
``--headless`` belongs to ``vllm serve`` (``vllm/entrypoints/cli/serve.py``), so engines start with ``vllm serve``.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, field_validator, model_validator

from moe_rl.config import BaseConfig
from moe_rl.inference.vllm_server import logprobs_mode_in, owned_flags_in
from moe_rl.launch.mooncake import MooncakeOffloadConfig

__all__ = [
    "ENGINE_LOGPROBS_MODE",
    "EngineGroup",
    "InferenceDeployment",
    "MAMBA_SSM_CACHE_DTYPE_BYTES",
    "VllmRouterConfig",
    "WIDE_EP_MIN",
    "kv_transfer_config",
]

WIDE_EP_MIN = 32
"""Smallest expert-parallel size called *wide EP* here (4 nodes of 8 GPUs)."""

All2All = Literal["allgather_reducescatter", "naive", "deepep_high_throughput", "deepep_low_latency"]
Role = Literal["engine", "prefill", "decode"]

MAMBA_SSM_CACHE_DTYPE_BYTES: dict[str, float] = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}
"""Bytes per element of each ``--mamba-ssm-cache-dtype`` the plan may pass: the explicit choices of vLLM 0.32's
``MambaDType`` (``vllm/config/cache.py``: ``auto``, ``float32``, ``float16``, ``bfloat16``) less ``auto``, which lets
vLLM pick the dtype from the checkpoint (for Nemotron-H its ``config.json`` ``mamba_ssm_cache_dtype``, else
``float32``; for other Mamba models the model dtype), a value the memory plan could not know."""

_ROLE_ALL2ALL: dict[str, str | None] = {
    "prefill": "deepep_high_throughput",
    "decode": "deepep_low_latency",
    "engine": None,  # colocated: vLLM's default unless the recipe picks one
}


class EngineGroup(BaseConfig):
    """One kind of vLLM replica (prefill, decode, or a colocated engine doing both) and how many of them."""

    nodes_per_replica: int = Field(1, ge=1)
    """Nodes of one data-parallel group (one API endpoint)."""
    replicas: int = Field(1, ge=1)
    """Independent replicas of this group (each its own DP/EP group and endpoint)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """TP inside each DP rank (1 = attention data-parallel, the usual choice with wide EP)."""
    enable_expert_parallel: bool = True
    """Split the MoE layers over the replica's ``DP x TP`` GPUs (``--enable-expert-parallel``)."""
    wide_ep: bool = False
    """Require ``EP >= 32`` (validated): the point of a wide-EP decode or prefill group."""
    all2all_backend: All2All | None = None
    """``--all2all-backend``; None = the role's default: prefill ``deepep_high_throughput``, decode
    ``deepep_low_latency``, colocated vLLM's own default."""
    enable_dbo: bool = False
    """Dual-batch overlap of compute with the all-to-all (``--enable-dbo``), for prefill."""
    max_num_seqs: int = Field(256, ge=1)
    """Running requests per DP rank (``--max-num-seqs``)."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Tokens per engine step per DP rank (``--max-num-batched-tokens``); None = vLLM's default."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of each GPU vLLM may use for weights + KV cache (``--gpu-memory-utilization``)."""
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"] = "auto"
    """``--kv-cache-dtype`` (a subset of vLLM's ``CacheDType``, ``vllm/config/cache.py``; ``fp8_ds_mla`` is the
    DeepSeek-V3.2 / GLM-5 sparse-MLA FP8 layout)."""
    mamba_ssm_cache_dtype: str = "float32"
    """``--mamba-ssm-cache-dtype``: dtype of the Mamba-2 SSM state ``[heads, head_dim, state]`` each sequence holds in
    every Mamba-2 layer. Passed only when the model is hybrid (``nemotron_h``); the dry run's per-sequence state uses
    the same value (4 bytes per element for ``float32``, 2 for ``float16`` / ``bfloat16``). ``float32`` (the default) is NVIDIA's
    recommendation for Nemotron-H: the state is carried across the whole sequence, and rounding it to 16 bits at every
    step compounds. One of :data:`MAMBA_SSM_CACHE_DTYPE_BYTES`; ``auto`` is refused (see there)."""
    port: int = Field(8000, ge=1, le=65535)
    """HTTP port of the replica's API server (head node)."""
    dp_rpc_port: int = Field(13345, ge=1, le=65535)
    """``--data-parallel-rpc-port`` of the replica's head node."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment of every process of this group (e.g. ``UCX_NET_DEVICES``, ``VLLM_*`` knobs)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra ``vllm serve`` arguments appended verbatim."""

    @field_validator("mamba_ssm_cache_dtype", mode="before")
    @classmethod
    def _check_mamba_ssm_cache_dtype(cls, value: object) -> object:
        if not isinstance(value, str) or value not in MAMBA_SSM_CACHE_DTYPE_BYTES:
            why = (" ('auto' lets vLLM pick the dtype from the checkpoint, which the memory plan cannot know)"
                   if value == "auto" else "")
            raise ValueError(
                f"mamba_ssm_cache_dtype={value!r} is not a Mamba SSM cache dtype the launcher passes{why}: use one of "
                f"{sorted(MAMBA_SSM_CACHE_DTYPE_BYTES)} (vLLM's --mamba-ssm-cache-dtype; 'float32' is NVIDIA's "
                "recommendation for Nemotron-H)"
            )
        return value

    @property
    def mamba_ssm_cache_bytes(self) -> float:
        """Bytes per element of the Mamba-2 SSM state (:attr:`mamba_ssm_cache_dtype`)."""
        return MAMBA_SSM_CACHE_DTYPE_BYTES[self.mamba_ssm_cache_dtype]

    def resolved_all2all(self, role: Role) -> str | None:
        """The backend this role runs with (the field, or the role's default)."""
        return self.all2all_backend if self.all2all_backend is not None else _ROLE_ALL2ALL[role]

    @property
    def nodes(self) -> int:
        """Nodes of all replicas of this group."""
        return self.nodes_per_replica * self.replicas

    def dp_size(self, gpus_per_node: int) -> int:
        """DP ranks of one replica: ``nodes_per_replica * gpus_per_node / tensor_parallel_size``."""
        return self.nodes_per_replica * gpus_per_node // self.tensor_parallel_size

    def ep_size(self, gpus_per_node: int) -> int:
        """Expert-parallel size of one replica (``DP x TP`` = its GPUs; 1 without expert parallelism)."""
        return self.nodes_per_replica * gpus_per_node if self.enable_expert_parallel else 1

    def problems(self, name: str, role: Role, gpus_per_node: int, experts: int) -> list[str]:
        """Layout rules this group breaks on ``gpus_per_node``-GPU nodes with ``experts`` routed experts."""
        out = []
        if gpus_per_node % self.tensor_parallel_size:
            out.append(
                f"{name}.tensor_parallel_size={self.tensor_parallel_size} must divide gpus_per_node={gpus_per_node} "
                "(each node holds whole DP ranks)"
            )
            return out
        ep = self.ep_size(gpus_per_node)
        if self.enable_expert_parallel and experts % ep:
            out.append(
                f"{name}: expert-parallel size {ep} (= nodes_per_replica {self.nodes_per_replica} x {gpus_per_node} GPUs) "
                f"must divide the model's {experts} routed experts; change {name}.nodes_per_replica"
            )
        if self.wide_ep and ep < WIDE_EP_MIN:
            out.append(
                f"{name}.wide_ep=true needs EP >= {WIDE_EP_MIN}, but nodes_per_replica={self.nodes_per_replica} x "
                f"{gpus_per_node} GPUs gives EP={ep}; raise {name}.nodes_per_replica to "
                f"{-(-WIDE_EP_MIN // gpus_per_node)} or set wide_ep=false"
            )
        backend = self.resolved_all2all(role)
        if backend is not None and backend.startswith("deepep") and not self.enable_expert_parallel:
            out.append(f"{name}.all2all_backend={backend!r} needs enable_expert_parallel=true")
        owned = owned_flags_in(self.extra_args, ("--host", "--port", "--api-key", "--middleware", "--model"))
        if owned:
            out.append(
                f"{name}.extra_args sets {owned}, which the cluster plan sets itself (the node's cluster address, the "
                f"group's port, the control-plane middleware and token, the model): remove them (use {name}.port "
                "for the port)"
            )
        mamba = owned_flags_in(self.extra_args, ("--mamba-ssm-cache-dtype",))
        if mamba:
            out.append(
                f"{name}.extra_args sets {mamba}, which the cluster plan sets from {name}.mamba_ssm_cache_dtype (the "
                f"value its memory plan assumes): remove them and set {name}.mamba_ssm_cache_dtype instead"
            )
        mode = logprobs_mode_in(self.extra_args)
        if mode is not None and mode != ENGINE_LOGPROBS_MODE:
            out.append(
                f"{name}.extra_args sets --logprobs-mode {mode}, but the trainer recomputes log_softmax(logits / T) "
                f"over the full vocabulary, which is vLLM's {ENGINE_LOGPROBS_MODE!r} (the launcher's setting); "
                "mixing the two makes every train/inference ratio biased: remove the flag"
            )
        return out


RouterPolicy = Literal["consistent_hash", "cache_aware", "kv_aware", "power_of_two", "round_robin", "random",
                       "sticky_least_loaded"]
"""``vllm-router`` 0.1.17's ``--policy`` choices (the launch tests compare this list with the binary's ``--help``):
``consistent_hash`` (hash ring over a session key: the ``X-Session-ID`` header first, the body's ``user`` field
among the fallbacks), ``cache_aware`` (approximate prefix tree per worker, load fallback), ``kv_aware`` (cost from
the workers' KV-cache events, ``--kv-event-source``), ``power_of_two``, ``round_robin``, ``random`` and
``sticky_least_loaded`` (session affinity, least-loaded placement)."""


class VllmRouterConfig(BaseConfig):
    """The request router in front of the engines (``vllm-router`` 0.1.17, the ``router`` extra: ``--host``,
    ``--port``, ``--worker-urls``, ``--policy``; P/D: ``--vllm-pd-disaggregation --kv-connector nixl|mooncake
    --prefill URL --decode URL``, ``--prefill-policy``, ``--decode-policy``; every flag the plan passes is checked
    against the installed binary's ``--help`` by the launch tests)."""

    executable: str = "vllm-router"
    port: int = Field(30000, ge=1, le=65535)
    policy: RouterPolicy = "consistent_hash"
    """Load-balancing policy; ``consistent_hash`` keeps a trajectory on one replica (prefix reuse; the orchestrator
    sends its id as the session key, prime-rl's choice)."""
    prefill_policy: RouterPolicy | None = None
    decode_policy: RouterPolicy | None = None


class InferenceDeployment(BaseConfig):
    """How the inference nodes are used.

    Raises (at construction):
        ValueError: ``mode`` and the groups given disagree (colocated needs ``engine``; disaggregated needs
            ``prefill`` and ``decode``).
    """

    mode: Literal["colocated", "disaggregated"]
    """``colocated``: each engine prefills and decodes its own requests; ``disaggregated``: prefill and decode run on
    separate replicas and the KV moves between them (P/D)."""
    max_model_len: int = Field(ge=1)
    """Longest request (prompt + completion) the engines accept (``--max-model-len``)."""
    engine: EngineGroup | None = None
    """Colocated mode: the engine group."""
    prefill: EngineGroup | None = None
    """Disaggregated mode: the prefill group."""
    decode: EngineGroup | None = None
    """Disaggregated mode: the decode group."""
    kv_connector: Literal["NixlConnector", "MooncakeConnector"] = "NixlConnector"
    """P/D KV transfer (disaggregated mode)."""
    kv_offload: MooncakeOffloadConfig | None = None
    """Tiered KV offload through Mooncake Store (None = off)."""
    router: VllmRouterConfig = VllmRouterConfig()
    served_model_name: str = Field("policy", min_length=1)
    """``--served-model-name`` of every engine: the ``model`` field the orchestrator's ``VllmClient`` sends (its
    default, and ``moe_rl.inference.VllmServerConfig``'s, is ``"policy"``) and the model id of Mooncake weight
    keys. Without it vLLM serves the checkpoint path as the name and a client asking for ``"policy"`` gets 404."""
    vllm_executable: str = "vllm"
    """The ``vllm`` console script of the GPU build (``vllm serve``)."""
    worker_extension_cls: str = "moe_rl.weights.engine.WeightSyncExtension"
    """``--worker-extension-cls``: the weight-reload methods the trainer's publications call."""
    trust_remote_code: bool = True

    @model_validator(mode="after")
    def _check(self) -> InferenceDeployment:
        if self.mode == "colocated":
            if self.engine is None or self.prefill is not None or self.decode is not None:
                raise ValueError("mode='colocated' takes [inference.engine] only (no prefill/decode groups)")
        elif self.prefill is None or self.decode is None or self.engine is not None:
            raise ValueError("mode='disaggregated' takes [inference.prefill] and [inference.decode] (no engine group)")
        else:
            # the KV (and a hybrid model's Mamba state) computed by prefill is what decode reads: one format. vLLM's
            # NIXL handshake refuses a KV dtype mismatch only at the first transfer and never checks the SSM state.
            for field in ("kv_cache_dtype", "mamba_ssm_cache_dtype"):
                p, d = getattr(self.prefill, field), getattr(self.decode, field)
                if p != d:
                    raise ValueError(
                        f"inference.prefill.{field}={p!r} but inference.decode.{field}={d!r}: in P/D mode decode "
                        f"reads the cache prefill wrote, so both must be equal; set the same value on both groups")
        return self

    def groups(self) -> list[tuple[Role, EngineGroup]]:
        """``[(role, group)]`` in node order: prefill then decode, or the colocated engine."""
        if self.mode == "colocated":
            return [("engine", self.engine)]  # type: ignore[list-item]
        return [("prefill", self.prefill), ("decode", self.decode)]  # type: ignore[list-item]

    @property
    def nodes(self) -> int:
        """Inference nodes in all."""
        return sum(g.nodes for _, g in self.groups())


ENGINE_LOGPROBS_MODE = "processed_logprobs"
"""``--logprobs-mode`` of every engine the launcher starts: the log-probabilities of the distribution the sampler
drew from, ``log_softmax(logits / temperature)``, which the trainer recomputes (``moe_rl.runtime.trainer.step``). vLLM's
default, ``raw_logprobs``, is taken before temperature: at ``T != 1`` each token's train/inference ratio would carry
the constant bias ``LSE(z)/T - LSE(z/T)``."""


def kv_transfer_config(deployment: InferenceDeployment, role: Role) -> dict | None:
    """The ``--kv-transfer-config`` value of one role (None when the engine needs no KV connector).

    - disaggregated, no offload: the P/D connector (``NixlConnector`` ``kv_both``; ``MooncakeConnector``
      ``kv_producer`` on prefill, ``kv_consumer`` on decode);
    - colocated with offload: ``MooncakeStoreConnector`` ``kv_both``;
    - disaggregated with offload: ``MultiConnector`` ``kv_both`` whose ``kv_connector_extra_config.connectors`` lists
      the P/D connector first, then ``MooncakeStoreConnector`` (vLLM ``v1/multi_connector.py``: loads from the first
      connector that has the blocks, saves to all).
    """
    offload = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    if deployment.mode == "colocated":
        return offload if deployment.kv_offload is not None else None
    if deployment.kv_connector == "NixlConnector":
        pd = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    else:
        pd = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}
    if deployment.kv_offload is None:
        return pd
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [pd, offload]}}


def kv_transfer_json(deployment: InferenceDeployment, role: Role) -> str | None:
    """:func:`kv_transfer_config` as the compact JSON string passed on the command line."""
    cfg = kv_transfer_config(deployment, role)
    return None if cfg is None else json.dumps(cfg, separators=(",", ":"))
