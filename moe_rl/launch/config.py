"""``ClusterConfig``: one async RL run on a Slurm GPU cluster (``moe-rl cluster @ recipes/glm5_1/rl.toml``).

Node order (fixed, so every process's host is known before the job starts)::

    nodes [0, T)                 trainer (torchrun, ``trainer.num_nodes`` = T); node 0 also runs the orchestrator
    nodes [T, T + P)             prefill replicas, ``nodes_per_replica`` consecutive nodes each   (disaggregated)
    nodes [T + P, T + P + D)     decode replicas                                                   (disaggregated)
    (or [T, T + E): the colocated engine replicas)
    node T (head inference node) also runs the router and, with KV offload, the Mooncake master

Validation (at construction; every message names the field, its value, the rule and the fix): the node counts add
up to ``cluster.num_nodes``; the trainer layout divides its GPUs (``ParallelDims``: ``ep`` divides ``dp_shard * cp``)
and ``cp`` divides ``seq_len``; EP divides the routed experts (trainer and each engine group); wide-EP groups have
EP >= 32; the engines' ``max_model_len`` fits the trainer's ``seq_len``; no two processes of one node listen on the same
port.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from moe_rl.config import BaseConfig
from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.envs.addition import AdditionTaskConfig
from moe_rl.envs.chained_addition import ChainedAdditionTaskConfig
from moe_rl.envs.tokenizer import DEFAULT_ALPHABET
from moe_rl.launch.engines import InferenceDeployment
from moe_rl.launch.model import ModelSpec
from moe_rl.rl.loss import LossConfig
from moe_rl.rl.salt import check_run_id
from moe_rl.runtime.orchestrator import OrchestratorConfig
from moe_rl.runtime.trainer.config import OptimizerConfig
from moe_rl.weights.delta_sync import DeltaConfig

__all__ = ["ClusterConfig", "ClusterSpec", "SlurmConfig", "TaskSpec", "TrainerLayout", "WeightTransportConfig"]

_TIME = re.compile(r"^(\d+-)?\d{1,3}:\d{2}:\d{2}$")


class ClusterSpec(BaseConfig):
    """The machines."""

    num_nodes: int = Field(ge=1)
    """Nodes of the allocation (``#SBATCH --nodes``)."""
    gpus_per_node: int = Field(8, ge=1, le=64)
    gpu_memory_gb: float = Field(141.0, gt=0)
    """GPU memory in GB (1e9 bytes), the datasheet figure (H200: 141); ignored when ``gpu_memory_gib`` is given."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Usable GPU memory in GiB (2**30 bytes) as the device reports it (an H200 shows 143,771 MiB = 140.4 GiB);
    when given, the memory plans are checked against it instead of ``gpu_memory_gb``."""
    host_memory_gb: float | None = Field(None, gt=0)
    """Host DRAM per node in GB; when given, optimizer offload + the Mooncake segment are checked against it."""
    gpu_name: str = "H200"

    @property
    def gpu_bytes(self) -> float:
        """GPU memory the plans are checked against: ``gpu_memory_gib * 2**30`` if given, else ``gpu_memory_gb * 1e9``."""
        return self.gpu_memory_gib * 2**30 if self.gpu_memory_gib is not None else self.gpu_memory_gb * 1e9


class SlurmConfig(BaseConfig):
    """``#SBATCH`` header and job-wide settings of the rendered script."""

    job_name: str = "moe-rl"
    partition: str | None = None
    account: str | None = None
    time_limit: str = "48:00:00"
    """``--time`` (``[D-]HH:MM:SS``)."""
    run_dir: str = "${SLURM_SUBMIT_DIR}/runs/${SLURM_JOB_ID}"
    """Run directory on a filesystem every node sees (configs, logs, weights)."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run first on the batch host (``module load``, ``source .venv/bin/activate``, NCCL/UCX exports)."""
    srun_args: list[str] = Field(default_factory=list)
    """Extra ``srun`` arguments of every step (e.g. ``--container-image=...``, ``--mpi=none``)."""
    gpu_gres: str = "gpu:{gpus_per_node}"
    """``--gres`` of a GPU step (``{gpus_per_node}`` is filled in)."""
    python: str = "python"
    """Python of the job's environment (runs ``-m torch.distributed.run`` and the moe_rl entry points)."""
    startup_timeout_s: int = Field(3600, ge=1)
    """Seconds to wait for each engine / router health endpoint before giving up."""

    @model_validator(mode="after")
    def _check(self) -> SlurmConfig:
        if not _TIME.match(self.time_limit):
            raise ValueError(f"time_limit={self.time_limit!r} must be [D-]HH:MM:SS, e.g. '48:00:00' or '2-00:00:00'")
        try:
            self.gpu_gres.format(gpus_per_node=8)
        except (KeyError, IndexError, ValueError):
            raise ValueError(
                f"gpu_gres={self.gpu_gres!r} may use only the placeholder {{gpus_per_node}}, e.g. 'gpu:h200:{{gpus_per_node}}'"
            ) from None
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.job_name):
            raise ValueError(f"job_name={self.job_name!r} may hold only letters, digits, '_', '.', '-'")
        return self


class TrainerLayout(BaseConfig):
    """The trainer's nodes and parallelism (``dp_shard`` is what the GPUs leave: ``world / (dp_replicate * cp)``)."""

    num_nodes: int = Field(ge=1)
    dp_replicate: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    """Context-parallel degree (each sequence's tokens over ``cp`` GPUs)."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree (borrowed from ``dp_shard * cp``)."""
    seq_len: int = Field(ge=1)
    """Tokens per packed training sequence."""
    micro_batch: int = Field(1, ge=1)
    """Sequences per micro-batch per data rank."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter and activation dtype (``bfloat16``: FSDP2 mixed precision with fp32 gradient reduction, fp32 master
    weights and optimizer state; ``float32``: everything fp32). The memory plan uses the same value."""
    fp8: bool = False
    """Block-scaled FP8 linears and grouped experts (``moe_rl.fp8``). The memory plan adds the e4m3 copies (and block
    scales) of one unsharded layer's FP8 weights, saved for its backward."""
    activation_checkpointing: Literal["none", "full"] = "full"
    optimizer_offload: bool = False
    """AdamW state on the host (prime-rl ``optim_cpu_offload``)."""
    loss_chunk_tokens: int | None = Field(4096, ge=1)
    """Head + loss in chunks of this many tokens (None: all at once)."""
    dist_timeout_s: int = Field(7200, ge=60)
    """Timeout of the trainer's collectives (``init_process_group(timeout=...)``): ranks wait in them while rank 0
    writes a version (prime-rl uses 7200 s for GLM-5)."""
    rdzv_port: int = Field(29500, ge=1, le=65535)
    """torchrun c10d rendezvous port on trainer node 0."""
    reserve_gib: float = Field(3.0, ge=0)
    """GPU memory kept free for the CUDA context, NCCL buffers and fragmentation when checking the plan."""
    env: dict[str, str] = Field(default_factory=lambda: {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    """Extra environment of every trainer process."""
    optim: OptimizerConfig = OptimizerConfig(lr=1e-6, weight_decay=0.0, warmup_steps=0)
    """AdamW (default: prime-rl's GLM-5.1 example, lr 1e-6, no weight decay, no warm-up)."""
    loss: LossConfig = LossConfig()
    """The off-policy loss (``moe_rl.rl.loss``)."""
    router_replay: bool = False
    """Router replay (R3): the engines record routed experts, the trainer replays them."""

    def parallel_dims(self, gpus_per_node: int) -> ParallelDims:
        """The :class:`ParallelDims` on ``num_nodes * gpus_per_node`` GPUs.

        Raises:
            ValueError: the GPUs do not divide into ``dp_replicate * cp``, or ``ep`` does not divide ``dp_shard * cp``.
        """
        world = self.num_nodes * gpus_per_node
        if world % (self.dp_replicate * self.cp):
            raise ValueError(
                f"trainer: {world} GPUs ({self.num_nodes} nodes x {gpus_per_node}) are not divisible by dp_replicate*cp "
                f"= {self.dp_replicate}*{self.cp}; change trainer.cp, trainer.dp_replicate or trainer.num_nodes"
            )
        return ParallelDims(dp_replicate=self.dp_replicate, dp_shard=world // (self.dp_replicate * self.cp),
                            cp=self.cp, ep=self.ep)


class WeightTransportConfig(BaseConfig):
    """How a new policy reaches the engines."""

    kind: Literal["filesystem", "broadcast", "p2p"] = "filesystem"
    """``filesystem``: every trainer rank writes its own shards under ``run_dir/weights/step_<v>`` (a sharded folder;
    with ``quantize_fp8`` rank 0 streams an FP8 Hugging Face folder instead, one tensor gathered at a time), then a
    load RPC per engine; ``broadcast``: one torch.distributed group per trainer rank with every engine worker (NCCL
    on GPUs, gloo on CPU; each rank listens on a free port it announces in ``weights/announce/``), every rank sends
    its own pieces (``moe_rl.weights``); ``p2p``: every trainer rank snapshots its pieces and serves them from a
    thread (gloo point-to-point) or lets the engines read them over NIXL (``p2p_backend``), the
    engine workers pull what they need from the owning ranks (``moe_rl.weights.p2p``)."""
    broadcast_timeout_s: float = Field(600.0, gt=0.0)
    """``broadcast`` / ``p2p``: bound on joining the groups and on every collective / request of a transfer
    (seconds)."""
    keep_versions: int = Field(2, ge=1)
    """``p2p``: versions each trainer rank holds for the engines to pull (one host copy of its pieces each)."""
    bucket_bytes: int = Field(256 << 20, ge=1)
    """``broadcast`` / ``p2p``: bound on one packed bucket (the extra memory per group during a transfer)."""
    p2p_backend: Literal["gloo", "nixl"] = "gloo"
    """``p2p``: how the pieces move (``trainer.p2p.backend``): ``gloo`` (TCP, served by the trainer's thread) or
    ``nixl`` (the engines READ the trainer ranks' registered host snapshots; ``pip install 'moe_rl[nixl]'``)."""
    quantize_fp8: bool = True
    """Send FP8 block-quantized weights to an FP8 engine (half the bytes): the DeepSeek-V3 checkpoint format
    (``moe_rl.weights.fp8``). Set false for an engine serving a bf16 checkpoint."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the published tensors that are not FP8-quantized (the engines' ``--dtype``)."""
    delta: DeltaConfig = DeltaConfig()
    """Delta encoding (``moe_rl.weights.delta_sync``): every trainer rank writes only the elements of its pieces
    whose bits changed since its previous version, exact and checksummed, with a full version every
    ``full_every``; the engines keep a host copy of the published tensors. Every ``kind``, with
    ``quantize_fp8 = false`` (an FP8 folder is streamed whole by rank 0)."""

    @model_validator(mode="after")
    def _check_backend(self) -> WeightTransportConfig:
        if self.p2p_backend == "nixl" and self.kind != "p2p":
            raise ValueError(f"weights.p2p_backend='nixl' is used only by weights.kind='p2p', not {self.kind!r}; set "
                             "weights.kind='p2p' or drop the backend")
        return self


class TaskSpec(BaseConfig):
    """The environment the orchestrator samples prompts from and scores completions with.

    ``env = "package.module:factory"`` plugs in a user environment (:func:`moe_rl.envs.load_env`): called as
    ``factory(tokenizer, **env_args)``, it returns an :class:`moe_rl.envs.Environment` (or an object with the task
    interface of :class:`moe_rl.envs.AdditionTask`, which is adapted). A table selects a built-in task instead.
    """

    env: str | AdditionTaskConfig | ChainedAdditionTaskConfig = Field(AdditionTaskConfig(),
                                                                      union_mode="left_to_right")
    """``"package.module:factory"`` (a user environment), or a built-in task's table (single-turn addition, or
    chained multi-turn addition when ``num_turns`` is given)."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the ``env`` factory."""
    factory: str | None = None
    """Older spelling of ``env = "package.module:factory"`` (called the same way); set one of the two."""
    tokenizer: Literal["checkpoint", "char"] = "checkpoint"
    """``checkpoint``: the Hugging Face tokenizer of ``model.inference_checkpoint`` (``transformers``);
    ``char``: the library's character tokenizer over ``alphabet`` (CPU smoke runs on checkpoints it wrote)."""
    alphabet: str = DEFAULT_ALPHABET
    """Characters of the ``char`` tokenizer (after <pad>, <bos>, <eos>)."""

    @property
    def env_spec(self) -> tuple[str, str] | None:
        """``(option name, "module:factory")`` of a user environment, or None for a built-in task."""
        if self.factory is not None:
            return "task.factory", self.factory
        return ("task.env", self.env) if isinstance(self.env, str) else None

    @model_validator(mode="after")
    def _check(self) -> TaskSpec:
        from moe_rl.envs.loader import check_env_spec

        if self.factory is not None and isinstance(self.env, str):
            raise ValueError(f"task.factory={self.factory!r} and task.env={self.env!r} both name a factory; keep "
                             "task.env (task.factory is its older spelling)")
        spec = self.env_spec
        if spec is not None:
            check_env_spec(spec[1], spec[0])
        elif self.env_args:
            raise ValueError(f"task.env_args={self.env_args!r} is set but task.env is a built-in task; name a factory "
                             "with task.env = 'package.module:factory' or drop task.env_args")
        return self


class ClusterConfig(BaseConfig):
    """Everything ``moe-rl cluster`` needs for one run; sections are owned by their components."""

    name: str = "run"
    """The run's id, mixed into every ``cache_salt``: at most 86 characters without ``'@'``, ``'/'``, ``'\\'`` or
    NUL (``moe_rl.rl.salt.check_run_id``)."""
    max_steps: int = Field(1000, ge=1)
    """Trainer (optimizer) steps; the orchestrator ends the run after the last one."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of prompt sampling and request seeds (orchestrator) and of the trainer ranks."""
    task: TaskSpec = TaskSpec()
    cluster: ClusterSpec
    slurm: SlurmConfig = SlurmConfig()
    model: ModelSpec
    trainer: TrainerLayout
    inference: InferenceDeployment
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    weights: WeightTransportConfig = WeightTransportConfig()

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        problems: list[str] = []
        g = self.cluster.gpus_per_node
        used = self.trainer.num_nodes + self.inference.nodes
        if used != self.cluster.num_nodes:
            parts = " + ".join(
                [f"trainer.num_nodes {self.trainer.num_nodes}"]
                + [f"inference.{r} {grp.nodes_per_replica} x {grp.replicas} replicas" for r, grp in self.inference.groups()]
            )
            problems.append(
                f"cluster.num_nodes={self.cluster.num_nodes} but the roles use {parts} = {used} nodes; make them add up"
            )
        experts = self.model.experts
        try:
            dims = self.trainer.parallel_dims(g)
        except ValidationError as exc:  # ParallelDims' own rule (ep divides dp_shard * cp)
            problems += ["trainer: " + e["msg"].removeprefix("Value error, ") for e in exc.errors()]
            dims = None
        except ValueError as exc:
            problems.append(str(exc))
            dims = None
        if dims is not None and experts % self.trainer.ep:
            problems.append(f"trainer.ep={self.trainer.ep} must divide the model's {experts} routed experts")
        if self.trainer.seq_len % self.trainer.cp:
            problems.append(
                f"trainer.seq_len={self.trainer.seq_len} must be divisible by trainer.cp={self.trainer.cp} (each CP "
                "rank holds seq_len / cp tokens)"
            )
        for role, grp in self.inference.groups():
            problems += grp.problems(f"inference.{role}", role, g, experts)
        if self.inference.max_model_len > self.trainer.seq_len:
            problems.append(
                f"inference.max_model_len={self.inference.max_model_len} exceeds trainer.seq_len={self.trainer.seq_len}: "
                "a rollout longer than a training sequence cannot be trained; lower it"
            )
        problems += self._port_clashes()
        try:  # the run id mixed into every cache_salt
            check_run_id(self.name, name="name")
        except ValueError as exc:
            problems.append(str(exc))
        o = self.orchestrator
        if o.max_inflight * o.group_size < o.batch_size:  # max_inflight counts groups, batch_size samples
            problems.append(
                f"orchestrator.max_inflight={o.max_inflight} groups x group_size={o.group_size} < batch_size="
                f"{o.batch_size} samples: a step could never fill; raise max_inflight to at least "
                f"{-(-o.batch_size // o.group_size)}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _port_clashes(self) -> list[str]:
        """Two processes of one node listening on the same TCP port (the job would die at startup)."""
        inf = self.inference
        by_node: list[tuple[str, dict[str, int]]] = []
        head: dict[str, int] = {}
        for i, (role, grp) in enumerate(inf.groups()):
            ports = {f"inference.{role}.port": grp.port, f"inference.{role}.dp_rpc_port": grp.dp_rpc_port}
            if i == 0:
                head.update(ports)  # the first group's first replica starts on the head inference node
            by_node.append((f"the {role} nodes", ports))
        if inf.kv_offload is not None:
            off = inf.kv_offload
            head.update({"inference.kv_offload.master_port": off.master_port,
                         "inference.kv_offload.metadata_port": off.metadata_port,
                         "inference.kv_offload.metrics_port": off.metrics_port,
                         "inference.kv_offload.client_port": off.client_port})  # fmt: skip
            for _, ports in by_node:
                ports["inference.kv_offload.client_port"] = off.client_port
        by_node.insert(0, ("the head inference node", head))
        # trainer node 0 also runs the router (on its loopback) beside torchrun's rendezvous store
        by_node.insert(0, ("trainer node 0", {"trainer.rdzv_port": self.trainer.rdzv_port,
                                              "inference.router.port": inf.router.port}))
        out = []
        for where, ports in by_node:
            seen: dict[int, str] = {}
            for field_name, port in ports.items():
                if port in seen:
                    out.append(f"{field_name}={port} and {seen[port]}={port} are both listened on by {where}; "
                               f"give one of them another port")
                else:
                    seen[port] = field_name
        return out

    @property
    def inference_head(self) -> int:
        """Index of the first inference node (the first replica's head, the Mooncake master)."""
        return self.trainer.num_nodes
