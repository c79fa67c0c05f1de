"""``build_plan``: every process of a cluster run, with its node, argv and environment (a :class:`LaunchPlan`).

Hosts are not known until Slurm allocates the nodes, so argv and env refer to them as ``${HOST_<i>}`` (node ``i`` of
the allocation, in ``scontrol show hostnames`` order), to the run directory as ``${RUN_DIR}`` and to the job id as
``${SLURM_JOB_ID}``; the sbatch script defines these (:mod:`moe_rl.launch.slurm`). Nothing else in an argv is a shell
expansion.

Start order (``stage``; each stage's ``health_url`` endpoints answer before the next stage starts)::

    0 mooncake_master   (KV offload only)   head inference node
    1 mooncake_client   (KV offload only)   every inference node
    2 vLLM engines      one ``vllm serve`` per node of every replica (head: API server; others: --headless)
    3 router            head inference node
    4 trainer           one torchrun per trainer node (c10d rendezvous on trainer node 0)
    5 orchestrator      trainer node 0 (the job ends when it exits)

Per replica of ``N`` nodes with ``L = gpus_per_node / TP`` local DP ranks, node ``k`` runs ranks
``[k L, (k + 1) L)`` (``--data-parallel-start-rank k L``), so the replica's ranks cover ``0 .. DP - 1`` once each
(vLLM ``docs/serving/data_parallel_deployment.md``, multi-node internal load balancing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from moe_rl.inference.vllm_server import logprobs_mode_in
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.engines import ENGINE_LOGPROBS_MODE, EngineGroup, Role, kv_transfer_json

__all__ = ["Process", "LaunchPlan", "Listener", "build_plan", "host", "addr", "listeners", "TRAINER_MODULE",
           "ORCHESTRATOR_MODULE"]

TRAINER_MODULE = "moe_rl.entrypoints.cluster_trainer"
"""Module torchrun runs on every trainer GPU (``--config configs/cluster.json --run-dir ${RUN_DIR}``)."""
ORCHESTRATOR_MODULE = "moe_rl.entrypoints.cluster_orchestrator"
"""Module of the orchestrator process (``--config``, ``--run-dir``, ``--inference-url`` = the router, one
``--engine-url ROLE=URL`` per engine replica's API server)."""

MOONCAKE_JSON = "configs/mooncake_store.json"
CLUSTER_JSON = "configs/cluster.json"


def host(node: int) -> str:
    """The shell reference to node ``node``'s hostname in the rendered script."""
    return f"${{HOST_{node}}}"


def addr(node: int) -> str:
    """The shell reference to node ``node``'s cluster-interface IPv4 address (what its servers bind): the job script
    resolves ``${HOST_<node>}`` with ``getent ahostsv4`` and refuses loopback answers."""
    return f"${{ADDR_{node}}}"


CONTROL_MIDDLEWARE = "moe_rl.inference.control_plane.ControlTokenMiddleware"
"""vLLM ``--middleware`` of every engine API server: the run's control token on every path but ``/health``."""


@dataclass(frozen=True)
class Process:
    """One process of the run."""

    name: str
    """Unique name, also the log file's (``logs/<name>.log``)."""
    role: str
    """``trainer``, ``prefill``, ``decode``, ``engine``, ``mooncake_master``, ``mooncake_client``, ``router`` or
    ``orchestrator``."""
    node: int
    """Node index in the allocation."""
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    gpus: int = 0
    """GPUs the process uses on its node (0 for CPU-only processes)."""
    stage: int = 0
    """Start order (lower first)."""
    health_url: str | None = None
    """Endpoint that answers HTTP 200 once the process is ready (waited for before the next stage)."""
    replica: int | None = None
    dp_start_rank: int | None = None
    dp_local: int | None = None


@dataclass
class LaunchPlan:
    """Every process of a run plus the files it needs under the run directory."""

    config: ClusterConfig
    processes: list[Process]
    files: dict[str, str]
    """Relative path under ``${RUN_DIR}`` -> content (written by the job before anything starts)."""
    expand: frozenset[str] = frozenset()
    """Files whose ``${HOST_i}`` references the job fills in (the others are written literally)."""

    def by_role(self, role: str) -> list[Process]:
        return [p for p in self.processes if p.role == role]

    def by_node(self, node: int) -> list[Process]:
        return [p for p in self.processes if p.node == node]

    def node_roles(self) -> list[str]:
        """Per node, the roles of its processes (``"trainer"``, ``"prefill+mooncake_client"``, ...)."""
        out = []
        for n in range(self.config.cluster.num_nodes):
            roles = []
            for p in self.by_node(n):
                if p.role not in roles:
                    roles.append(p.role)
            out.append("+".join(roles))
        return out

    def node_summary(self) -> str:
        """:meth:`node_roles` with runs of equal nodes merged: ``"0: trainer+orchestrator; 1-15: trainer; ..."``."""
        roles = self.node_roles()
        runs, start = [], 0
        for i in range(1, len(roles) + 1):
            if i == len(roles) or roles[i] != roles[start]:
                runs.append(f"{start if i - 1 == start else f'{start}-{i - 1}'}: {roles[start]}")
                start = i
        return "; ".join(runs)


@dataclass(frozen=True)
class Listener:
    """One socket a process of the plan listens on, and what guards it (printed by the dry run)."""

    process: str
    address: str
    """``${ADDR_<node>}:<port>`` (the node's cluster interface), or ``${HOST_<node>}:<port>`` where the program binds
    what the name resolves to."""
    what: str
    guard: str
    """How requests are authenticated, or why they are not."""
    guarded: bool
    exception: bool = False
    """Unguarded, and documented as such (a program that has no authentication to turn on)."""


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def listeners(plan: LaunchPlan) -> list[Listener]:
    """Every listening socket of ``plan``'s processes that the plan chooses (address and port), with its guard.

    vLLM API servers are guarded by the run's control token (``--middleware``
    ``moe_rl.inference.control_plane.ControlTokenMiddleware``: every path but ``/health``; ``VLLM_API_KEY`` on
    ``/v1``). Mooncake's master and clients, vLLM's data-parallel RPC, torch's c10d rendezvous and the router's own
    routes have no authentication to turn on: they are listed as exceptions (``exception=True``), bound to the
    cluster interface where the program lets us choose.
    """
    out: list[Listener] = []
    for p in plan.processes:
        a = p.argv
        if p.role in ("engine", "prefill", "decode"):
            h, port = _flag(a, "--host"), _flag(a, "--port")
            if h is not None and port is not None:
                guarded = _flag(a, "--middleware") == CONTROL_MIDDLEWARE
                out.append(Listener(p.name, f"{h}:{port}", "vLLM API server (OpenAI + control routes)",
                                    "control token on every path but /health" if guarded else "none", guarded))
                rpc = _flag(a, "--data-parallel-rpc-port")
                if rpc is not None:
                    out.append(Listener(p.name, f"{_flag(a, '--data-parallel-address')}:{rpc}",
                                        "vLLM data-parallel RPC (ZMQ)", "none: vLLM has no authentication here",
                                        False, True))
        elif p.role == "router":
            out.append(Listener(p.name, f"{_flag(a, '--host')}:{_flag(a, '--port')}", "vllm-router",
                                "generation is checked by the engines (the client's token is forwarded); the "
                                "router's own routes are not guarded", False, True))
        elif p.role == "mooncake_master":
            h = _flag(a, "-rpc_address")
            for flag, what in (("-rpc_port", "Mooncake master RPC"),
                               ("-http_metadata_server_port", "Mooncake metadata server (0.3.13: every interface)"),
                               ("-metrics_port", "Mooncake master metrics/health")):
                out.append(Listener(p.name, f"{h}:{_flag(a, flag)}", what, "none: Mooncake has no authentication",
                                    False, True))
        elif p.role == "mooncake_client":
            out.append(Listener(p.name, f"{_flag(a, '-host')}:{_flag(a, '-port')}", "Mooncake client (RPC/RDMA)",
                                "none: Mooncake has no authentication", False, True))
        elif p.role == "trainer" and p.node == 0:
            ep = next((x.split("=", 1)[1] for x in a if x.startswith("--rdzv-endpoint=")), None)
            if ep is not None:
                out.append(Listener(p.name, ep, "torch c10d rendezvous", "none: torch has no authentication", False,
                                    True))
    return out


def _vllm_argv(cfg: ClusterConfig, role: Role, grp: EngineGroup, head: int, k: int) -> tuple[list[str], int, int]:
    inf, g = cfg.inference, cfg.cluster.gpus_per_node
    local = g // grp.tensor_parallel_size
    dp = grp.dp_size(g)
    start = k * local
    argv = [inf.vllm_executable, "serve", cfg.model.inference_checkpoint, "--served-model-name", inf.served_model_name]
    if k == 0:  # the API server: the node's cluster interface, the run's control token on every path but /health
        argv += ["--host", addr(head), "--port", str(grp.port), "--middleware", CONTROL_MIDDLEWARE]
    if inf.trust_remote_code:
        argv.append("--trust-remote-code")
    if grp.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(grp.tensor_parallel_size)]
    argv += ["--data-parallel-size", str(dp), "--data-parallel-size-local", str(local),
             "--data-parallel-address", host(head), "--data-parallel-rpc-port", str(grp.dp_rpc_port)]
    if k > 0:
        argv += ["--data-parallel-start-rank", str(start), "--headless"]
    if grp.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    backend = grp.resolved_all2all(role)
    if backend is not None:
        argv += ["--all2all-backend", backend]
    if grp.enable_dbo:
        argv.append("--enable-dbo")
    argv += ["--max-model-len", str(inf.max_model_len), "--max-num-seqs", str(grp.max_num_seqs)]
    if grp.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(grp.max_num_batched_tokens)]
    argv += ["--gpu-memory-utilization", f"{grp.gpu_memory_utilization:g}", "--kv-cache-dtype", grp.kv_cache_dtype]
    if inf.kv_offload is not None:
        argv.append("--enable-prefix-caching")  # offload keys blocks by prefix hash
    kv = kv_transfer_json(inf, role)
    if kv is not None:
        argv += ["--kv-transfer-config", kv]
    argv += ["--worker-extension-cls", inf.worker_extension_cls]
    if logprobs_mode_in(grp.extra_args) is None:
        argv += ["--logprobs-mode", ENGINE_LOGPROBS_MODE]  # the trainer's log_softmax(logits / T)
    argv += list(grp.extra_args)
    return argv, start, local


def build_plan(cfg: ClusterConfig) -> LaunchPlan:
    """Every process of ``cfg``'s run (see the module docstring for the node order and start stages).

    Returns:
        A :class:`LaunchPlan`; ``files`` holds ``configs/cluster.json`` (the resolved config) and, with KV offload,
        ``configs/mooncake_store.json`` (the engines' ``MOONCAKE_CONFIG_PATH``).
    """
    inf, g = cfg.inference, cfg.cluster.gpus_per_node
    head = cfg.inference_head
    procs: list[Process] = []
    files = {CLUSTER_JSON: cfg.model_dump_json(indent=2) + "\n"}
    inference_nodes = range(head, head + inf.nodes)
    off = inf.kv_offload
    if off is not None:
        files[MOONCAKE_JSON] = json.dumps(off.store_json(host(head)), indent=2) + "\n"
        procs.append(Process("mooncake_master", "mooncake_master", head, tuple(off.master_argv(addr(head))),
                             health_url=off.master_health_url(host(head))))  # clients need a serving master
        for n in inference_nodes:
            procs.append(Process(f"mooncake_client.n{n}", "mooncake_client", n,
                                 tuple(off.client_argv(host(n), host(head))), off.client_env(), stage=1))
    # engines
    node = head
    endpoints: dict[str, list[str]] = {}
    for role, grp in inf.groups():
        for r in range(grp.replicas):
            replica_head = node
            url = f"http://{host(replica_head)}:{grp.port}"
            endpoints.setdefault(role, []).append(url)
            for k in range(grp.nodes_per_replica):
                argv, start, local = _vllm_argv(cfg, role, grp, replica_head, k)
                # the worker extension's RPCs (weight updates, version probes, token versions) go through
                # /collective_rpc, which vLLM serves only in dev mode
                # (guarded by the control token the job exports: MOE_RL_CONTROL_TOKEN, VLLM_API_KEY); weight paths
                # sent to the engine must lie under the run's weights folder
                env = {"VLLM_SERVER_DEV_MODE": "1", "MOE_RL_WEIGHTS_ROOT": "${RUN_DIR}/weights", **grp.env}
                if inf.mode == "disaggregated" and inf.kv_connector == "NixlConnector":
                    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host(node)
                if off is not None:
                    env["MOONCAKE_CONFIG_PATH"] = "${RUN_DIR}/" + MOONCAKE_JSON
                    env["PYTHONHASHSEED"] = str(off.python_hash_seed)
                procs.append(Process(
                    f"{role}.r{r}.n{k}", role, node, tuple(argv), env, gpus=g, stage=2,
                    health_url=f"{url}/health" if k == 0 else None, replica=r, dp_start_rank=start, dp_local=local,
                ))
                node += 1
    # router
    rt = inf.router
    argv = [rt.executable, "--host", addr(head), "--port", str(rt.port)]
    if inf.mode == "disaggregated":
        argv.append("--pd-disaggregation")
        for url in endpoints["prefill"]:
            argv += ["--prefill", url]
        for url in endpoints["decode"]:
            argv += ["--decode", url]
        argv += ["--prefill-policy", rt.prefill_policy or rt.policy, "--decode-policy", rt.decode_policy or rt.policy]
    else:
        argv += ["--worker-urls", *endpoints["engine"], "--policy", rt.policy]
    router_url = f"http://{host(head)}:{rt.port}"
    procs.append(Process("router", "router", head, tuple(argv), stage=3, health_url=f"{router_url}/health"))
    # trainer
    t = cfg.trainer
    py = cfg.slurm.python
    for n in range(t.num_nodes):
        argv = [py, "-m", "torch.distributed.run", f"--nnodes={t.num_nodes}", f"--nproc-per-node={g}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={host(0)}:{t.rdzv_port}", "--rdzv-id=${SLURM_JOB_ID}",
                "-m", TRAINER_MODULE, "--config", "${RUN_DIR}/" + CLUSTER_JSON, "--run-dir", "${RUN_DIR}"]
        procs.append(Process(f"trainer.n{n}", "trainer", n, tuple(argv), dict(t.env), gpus=g, stage=4))
    # orchestrator
    argv = [py, "-m", ORCHESTRATOR_MODULE, "--config", "${RUN_DIR}/" + CLUSTER_JSON, "--run-dir", "${RUN_DIR}",
            "--inference-url", router_url]
    for role in endpoints:  # every replica's API server: weight updates, pause/resume and probes go to each
        for url in endpoints[role]:
            argv += ["--engine-url", f"{role}={url}"]
    procs.append(Process("orchestrator", "orchestrator", 0, tuple(argv), stage=5))
    procs.sort(key=lambda p: (p.stage, p.node))
    return LaunchPlan(cfg, procs, files, frozenset({MOONCAKE_JSON}) & set(files))
