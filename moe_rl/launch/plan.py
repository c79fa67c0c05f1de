"""``build_plan``: every process of a cluster run, with its node, argv and environment (a :class:`LaunchPlan`).

Hosts are not known until Slurm allocates the nodes, so argv and env refer to them as ``${HOST_<i>}`` (node ``i`` of
the allocation, in ``scontrol show hostnames`` order), to the run directory as ``${RUN_DIR}`` and to the job id as
``${SLURM_JOB_ID}``; the sbatch script defines these (:mod:`moe_rl.launch.slurm`). Nothing else in an argv is a shell
expansion.

Start order (``stage``; each stage's ``health_url`` endpoints answer before the next stage starts)::

    0 mooncake_master   (KV offload only)   head inference node
    1 mooncake_client   (KV offload only)   every inference node
    2 vLLM engines      one ``vllm serve`` per node of every replica (head: API server; others: --headless)
    3 router            trainer node 0, on 127.0.0.1 (beside its only client, the orchestrator: vllm-router's
                        own routes, e.g. adding a worker, have no authentication, so they are not put on the network)
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
           "ORCHESTRATOR_MODULE", "NIXL_SIDE_CHANNEL_PORT", "WILDCARD_PREFIXES"]

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
    token_env: tuple[str, ...] = ()
    """Further environment variables that carry the run's control token (set from ``$MOE_RL_CONTROL_TOKEN`` in the
    process's environment, never on a command line): vllm-router in P/D mode sends ``Bearer $OPENAI_API_KEY`` to the
    engines instead of the client's header."""


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


WILDCARD_PREFIXES = ("*:", "0.0.0.0:", "[::]:")
"""Addresses that mean "every interface" in :attr:`Listener.address`."""

NIXL_SIDE_CHANNEL_PORT = 5600
"""``VLLM_NIXL_SIDE_CHANNEL_PORT`` the plan sets (vLLM's default); engine DP rank ``i`` listens on this + ``i``."""


@dataclass(frozen=True)
class Listener:
    """One socket (or set of sockets) a process of the plan listens on, and what guards it (printed by the dry run)."""

    process: str
    address: str
    """``${ADDR_<node>}:<port>`` (the node's cluster interface), ``*:<port>`` where the program binds every interface
    whatever it is told; ``<ephemeral>`` for ports the program picks at start, ``<a>-<b>`` for a range."""
    what: str
    guard: str
    """How requests are authenticated, or why they are not."""
    guarded: bool
    exception: bool = False
    """Unguarded, and documented as such (a program that has no authentication to turn on). Accepted by the dry run
    only on the cluster interface: see :attr:`wildcard`."""

    @property
    def wildcard(self) -> bool:
        """The socket listens on every interface (``*``, ``0.0.0.0``, ``[::]``)."""
        return self.address.startswith(WILDCARD_PREFIXES)

    @property
    def loopback(self) -> bool:
        return self.address.startswith(("127.", "localhost:", "[::1]"))


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def listeners(plan: LaunchPlan) -> list[Listener]:
    """Every listening socket of ``plan``'s processes, with its bind address and its guard.

    Guarded: the vLLM API servers (the run's control token through ``--middleware``
    ``moe_rl.inference.control_plane.ControlTokenMiddleware`` on every path but ``/health``; ``VLLM_API_KEY`` on
    ``/v1``; ``/collective_rpc`` limited to moe_rl's worker methods).

    Unguarded, no authentication to turn on (``exception=True``; the dry run accepts them on the cluster interface
    only):

    - vLLM data parallelism (multi-node replicas), all on ``--data-parallel-address`` (the replica head's
      ``${ADDR}``): the engines' handshake socket on ``--data-parallel-rpc-port`` (ZMQ ROUTER), and the API
      server's engine input/output and the DP coordinator's ZMQ sockets on ports vLLM picks
      (``vllm/v1/engine/utils.py``, ``coordinator.py``); the DP process groups' torch ``TCPStore`` on ports vLLM
      picks (``ParallelConfig.stateless_init_dp_group``), which binds every interface.
    - Inside every engine process: each DP rank's workers form their process group with ``init_process_group`` on
      ``tcp://127.0.0.1:<port>``; the ``TCPStore`` behind it binds every interface too.
    - vLLM's NIXL side channel (prefill/decode disaggregation with ``NixlConnector``): a ZMQ listener on
      ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (the node's ``${ADDR}``), port ``VLLM_NIXL_SIDE_CHANNEL_PORT`` + the DP rank;
      and the NIXL agents themselves (UCX's TCP transport listens on ephemeral ports of every interface; measured
      with nixl 1.5.1: ``ss -ltn`` shows one per interface): the engines' agents for KV blocks, and with
      ``weights.p2p_backend = "nixl"`` each trainer rank's agent for its weight snapshots.
    - Mooncake: the master's RPC, metadata and metrics ports, each client; Mooncake 0.3.13's metadata server binds
      every interface whatever ``-http_metadata_server_host`` says.
    - The trainer: torchrun's c10d rendezvous store on node 0 (``--rdzv-endpoint`` port), the store torchrun's rank-0
      agent shares with the workers (a port it picks), and, for the ``broadcast`` / ``p2p`` weight transports, one
      store per trainer rank (a free port, announced under ``weights/announce/``). torch's ``TCPStore`` server binds
      every interface whatever host it is given (measured with torch 2.13: ``ss -ltn`` shows ``*:<port>``).
    - ``vllm-router``'s own routes (on the loopback of trainer node 0, beside the orchestrator).

    A listener on every interface (:attr:`Listener.wildcard`) is not an accepted exception: the dry run warns about
    each (restrict it with the cluster's network).
    """
    out: list[Listener] = []
    no_auth = "none: {} has no authentication"
    for p in plan.processes:
        a = p.argv
        if p.role in ("engine", "prefill", "decode"):
            h, port = _flag(a, "--host"), _flag(a, "--port")
            dp_size, dp_local = int(_flag(a, "--data-parallel-size") or 1), int(_flag(a, "--data-parallel-size-local") or 1)
            multi_node = dp_size > dp_local
            if h is not None and port is not None:
                guarded = _flag(a, "--middleware") == CONTROL_MIDDLEWARE
                out.append(Listener(p.name, f"{h}:{port}", "vLLM API server (OpenAI + control routes)",
                                    "control token on every path but /health; /collective_rpc: moe_rl's worker "
                                    "methods only" if guarded else "none", guarded))
                if multi_node:  # the replica head hosts the DP sockets
                    dp_addr, rpc = _flag(a, "--data-parallel-address"), _flag(a, "--data-parallel-rpc-port")
                    out.append(Listener(p.name, f"{dp_addr}:{rpc}", "vLLM data-parallel handshake (ZMQ)",
                                        no_auth.format("vLLM"), False, True))
                    out.append(Listener(p.name, f"{dp_addr}:<ephemeral>",
                                        "vLLM engine input/output + DP coordinator (ZMQ)", no_auth.format("vLLM"),
                                        False, True))
                if dp_size > 1:  # DP rank 0 (the replica head) hosts the DP group's store
                    out.append(Listener(p.name, "*:<ephemeral>", "vLLM DP process group store (torch TCPStore)",
                                        no_auth.format("torch"), False, True))
            out.append(Listener(p.name, "*:<ephemeral>", "vLLM workers' process-group store (torch "
                                "init_process_group on tcp://127.0.0.1, per DP rank)", no_auth.format("torch"), False,
                                True))
            side_host = p.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
            if side_host is not None and p.dp_start_rank is not None and p.dp_local is not None:
                base = int(p.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", NIXL_SIDE_CHANNEL_PORT))
                lo, hi = base + p.dp_start_rank, base + p.dp_start_rank + p.dp_local - 1
                out.append(Listener(p.name, f"{side_host}:{lo}" + (f"-{hi}" if hi > lo else ""),
                                    "vLLM NIXL side channel (ZMQ, KV-transfer handshake)", no_auth.format("NIXL"),
                                    False, True))
                out.append(Listener(p.name, "*:<ephemeral>", "vLLM NIXL agent (UCX TCP/RDMA): peers READ its "
                                    "registered KV blocks", no_auth.format("NIXL/UCX"), False, True))
        elif p.role == "router":
            if "OPENAI_API_KEY" in p.token_env:  # P/D mode: the router authenticates to the engines itself
                guard = ("loopback of trainer node 0 only; NOT guarded: in P/D mode the router sends the control token "
                         "($OPENAI_API_KEY) to the engines on every request it receives, so any process on that node "
                         "that reaches this port generates with the run's authorization (and its own routes have no "
                         "authentication)")
            else:
                guard = ("loopback of trainer node 0 only (its own routes have no authentication); generation is "
                         "checked by the engines (the client's token is forwarded)")
            out.append(Listener(p.name, f"{_flag(a, '--host')}:{_flag(a, '--port')}", "vllm-router", guard, False,
                                True))
        elif p.role == "mooncake_master":
            h = _flag(a, "-rpc_address")
            for flag, what, every in (("-rpc_port", "Mooncake master RPC", False),
                                      ("-http_metadata_server_port", "Mooncake metadata server", True),
                                      ("-metrics_port", "Mooncake master metrics/health", False)):
                out.append(Listener(p.name, f"{'*' if every else h}:{_flag(a, flag)}", what,
                                    no_auth.format("Mooncake") + ("; 0.3.13 binds every interface" if every else ""),
                                    False, True))
        elif p.role == "mooncake_client":
            out.append(Listener(p.name, f"{_flag(a, '-host')}:{_flag(a, '-port')}", "Mooncake client (RPC/RDMA)",
                                no_auth.format("Mooncake"), False, True))
        elif p.role == "trainer":
            ep = next((x.split("=", 1)[1] for x in a if x.startswith("--rdzv-endpoint=")), None)
            if ep is not None and p.node == 0:
                port = ep.rsplit(":", 1)[1]
                out.append(Listener(p.name, f"*:{port}", "torch c10d rendezvous store (torchrun, node 0)",
                                    no_auth.format("torch"), False, True))
                out.append(Listener(p.name, "*:<ephemeral>", "torch store shared with the trainer processes "
                                    "(torchrun's rank-0 agent)", no_auth.format("torch"), False, True))
            if plan.config.weights.kind in ("broadcast", "p2p"):
                out.append(Listener(p.name, "*:<ephemeral>", f"weight transport '{plan.config.weights.kind}' store, "
                                    "one per trainer rank (torch TCPStore)", no_auth.format("torch"), False, True))
            if plan.config.weights.kind == "p2p" and plan.config.weights.p2p_backend == "nixl":
                out.append(Listener(p.name, "*:<ephemeral>", "NIXL agent (UCX TCP/RDMA), one per trainer rank: "
                                    "engines READ its registered weight snapshots", no_auth.format("NIXL/UCX"),
                                    False, True))
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
             "--data-parallel-address", addr(head), "--data-parallel-rpc-port", str(grp.dp_rpc_port)]
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
    if cfg.model.hybrid:  # the Mamba-2 state dtype the dry run's memory plan assumes
        argv += ["--mamba-ssm-cache-dtype", grp.mamba_ssm_cache_dtype]
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
                    # the side channel binds this address (ZMQ: a numeric one); peers learn it from the KV params
                    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = addr(node)
                    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_SIDE_CHANNEL_PORT)
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
    # the router serves one client, the orchestrator on trainer node 0: it listens on that node's loopback, so its
    # unauthenticated routes (adding or removing a worker, flushing caches) are not reachable from the network
    argv = [rt.executable, "--host", "127.0.0.1", "--port", str(rt.port)]
    if inf.mode == "disaggregated":
        # vllm-router 0.1.17's P/D switch; its KV handshake follows the engines' connector (nixl: the decode side
        # pulls; mooncake: the prefill side pushes)
        argv += ["--vllm-pd-disaggregation", "--kv-connector",
                 "nixl" if inf.kv_connector == "NixlConnector" else "mooncake"]
        for url in endpoints["prefill"]:
            argv += ["--prefill", url]
        for url in endpoints["decode"]:
            argv += ["--decode", url]
        argv += ["--prefill-policy", rt.prefill_policy or rt.policy, "--decode-policy", rt.decode_policy or rt.policy]
    else:
        argv += ["--worker-urls", *endpoints["engine"], "--policy", rt.policy]
    router_url = f"http://127.0.0.1:{rt.port}"
    # in P/D mode vllm-router 0.1.17 drops the client's Authorization header and sends `Bearer $OPENAI_API_KEY` to
    # both stages (its --api-key does not reach them): give it the control token in that variable
    token_env = ("OPENAI_API_KEY",) if inf.mode == "disaggregated" else ()
    procs.append(Process("router", "router", 0, tuple(argv), stage=3, health_url=f"{router_url}/health",
                         token_env=token_env))
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
