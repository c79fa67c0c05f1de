"""Environments of the ``verifiers`` package (v1 API, ``verifiers==0.4.0``) behind moe_rl's environment protocol.

Install the optional extra first: ``pip install 'moe_rl[envs]'``. In a run config::

    env = "moe_rl.envs.verifiers_env:make_env"
    [env_args]
    env = {taskset = {id = "my_taskset"}}     # the verifiers env config (its `[env]` block)
    max_tokens = 8                            # tokens per model call

How an episode runs: :class:`VerifiersEnv` plays one verifiers episode per moe_rl episode through verifiers'
in-process entry point (``Env.run_episode`` inside ``Env.serving()``), with a training client
(``TrainClientConfig``) whose engine is a loopback :class:`moe_rl.envs.verifiers_endpoint.GenerateEndpoint`.
verifiers renders each prompt to token ids itself (``renderers``) and posts it there; the endpoint hands the
request to the episode's own :class:`~moe_rl.envs.protocol.EpisodeContext` (found by a per-episode key carried in
the sampling parameters), so every model call goes through :func:`moe_rl.envs.runner.run_group`: the run's
``cache_salt``, a seed per sample and call, moe_rl's engine request ids, the served version and the per-token
version segments, and the routed experts (router replay) are recorded exactly as for a built-in environment, and
the orchestrator builds the trainable samples by token prefix (:func:`moe_rl.rl.trajectory.interleave_calls`):
tokens, loss mask (the model's completions in, rendered scaffold and environment turns out), engine log-probs, the
episode's reward and the group baseline. A verifiers branch (a re-rendered prompt that does not extend the earlier
tokens, e.g. a chat template that strips past reasoning, or a rollback) is a separate trajectory there and for
moe_rl too: each trainable branch becomes one sample (its tokens, loss mask, engine log-probs, per-token versions
and routed-expert rows, the latter stitched with the rows of the prefix it shares with an earlier branch), every
branch carries the episode's reward, and the group baseline counts the episode once (``Sample.episode``); the
branch samples are counted (``multiturn_branches``). A failed episode trains nothing and is counted as dropped.

What is taken from verifiers: the sampled-tokens-to-text parsing, the harness loop, tools, the task's rewards. The
reward of a sample is its trace's ``reward`` (the weighted sum of its ``@reward`` scores); the named scores are the
episode's ``rewards`` and the trace's numeric metrics its ``metrics`` (plus ``vf_model_calls``). Stop reasons:
``max_turns`` (verifiers' turn limit), ``token_budget`` (a verifiers token limit), ``timeout`` (a verifiers
timeout), ``answered`` otherwise. An episode that verifiers marks failed (``episode.ok`` False: a harness, task or
model-call error) raises, so it trains nothing and is counted (an engine failure as an engine error).

Sampling: ``max_tokens`` and ``temperature`` come from the verifiers request (this adapter's values are the
defaults it sends); ``max_tokens`` is clamped to the engine's context (``max_model_len`` minus the prompt). A seed
from the verifiers side is replaced by the runner's per-sample seed (samples of a group must differ). Parameters
that change the sampling distribution beyond temperature (``top_p`` < 1, ``top_k`` > 0, ``min_p`` > 0,
penalties, ...) are refused: the trainer's importance ratios assume plain temperature sampling.

Offline defaults (each only where the env config leaves the field unset): every agent role runs in the
``subprocess`` runtime with ``network_notice = false``; the client reads its API key from
``MOE_RL_VERIFIERS_API_KEY`` (never a CLI config). Harnesses that launch programs with ``uv`` (verifiers' ``null``
and ``bash``) download packages on first use: use an in-process harness for offline runs (``Harness.launch`` may
run its loop in the process as long as every model call goes through the interception endpoint).

The tokenizer verifiers renders with: ``tokenizer_path`` (a Hugging Face tokenizer folder with a chat template),
else the run's tokenizer saved to a private temporary folder (``tokenizer.save_pretrained``) with
``chat_template`` (default :data:`CHAR_CHAT_TEMPLATE`, for moe_rl's character tokenizer). It must tokenize
prompts exactly as the trainer does: the prompt ids verifiers sends are the ids trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe_rl.envs.protocol import Environment, EpisodeContext, EpisodeResult, ModelRequest, SamplingParams

__all__ = ["CHAR_CHAT_TEMPLATE", "ROUTE_KEY", "VerifiersEnv", "make_env"]

ROUTE_KEY = "moe_rl_episode"
"""The sampling-parameter key that carries an episode's routing key to the endpoint."""

CHAR_CHAT_TEMPLATE = ("<bos>{% for m in messages %}{{ m['content'] }}"
                      "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
"""Chat template for moe_rl's character tokenizer: ``<bos>``, then each message's text, an assistant message
closed by ``<eos>``; no role markers (the alphabet has no letters), no generation prompt. A completion re-renders
to its sampled tokens (plus ``<eos>`` when it was cut at ``max_tokens``), so a multi-turn conversation extends its
earlier prompt (see ``_materialize_tokenizer`` for sampled special tokens)."""

_API_KEY_VAR = "MOE_RL_VERIFIERS_API_KEY"
# sampling keys the endpoint accepts: the fields it maps, the renderer's fixed fields, and neutral values
_MAPPED = {"max_tokens", "temperature", "seed", "stop_token_ids", ROUTE_KEY}
_IGNORED = {"logprobs", "skip_special_tokens", "routed_experts_prompt_start", "include_stop_str_in_output",
            "spaces_between_special_tokens", "detokenize", "reasoning_effort"}
_NEUTRAL = {"top_p": 1.0, "top_k": (-1, 0), "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, "n": 1, "stop": ([],)}


def _import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError("moe_rl.envs.verifiers_env needs the `verifiers` package (v1 API, verifiers==0.4.0): "
                          "pip install -e '.[envs]' in a moe_rl checkout (or pip install 'moe_rl[envs]')") from exc
    return vf


def _materialize_tokenizer(tokenizer: Any, chat_template: str) -> str:
    """Save ``tokenizer`` with ``chat_template`` to a fresh temporary folder; return its path.

    Every special token except EOS is saved as an ordinary added token (``special: false``; no ``bos_token``,
    ``pad_token``, ``unk_token`` entries), so a ``<pad>``/``<bos>`` the model samples inside an answer stays in the
    text verifiers parses and re-renders to the same id: the next prompt extends the sampled tokens. EOS stays
    special (it is the renderer's stop token and is stripped from the parsed text).
    """
    save = getattr(tokenizer, "save_pretrained", None)
    if not callable(save):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no save_pretrained; pass tokenizer_path= (a Hugging "
                        "Face tokenizer folder with a chat template) instead")
    d = Path(tempfile.mkdtemp(prefix="moe_rl_vf_tok_"))
    save(d)
    cfg_path, tok_path = d / "tokenizer_config.json", d / "tokenizer.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    eos = cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    for key in ("bos_token", "pad_token", "unk_token"):
        cfg.pop(key, None)
    for entry in (cfg.get("added_tokens_decoder") or {}).values():
        if entry.get("content") != eos:
            entry["special"] = False
    cfg["chat_template"] = chat_template
    cfg_path.write_text(json.dumps(cfg, indent=1))
    if tok_path.exists():
        tj = json.loads(tok_path.read_text())
        for entry in tj.get("added_tokens") or []:
            if entry.get("content") != eos:
                entry["special"] = False
        tok_path.write_text(json.dumps(tj))
    return str(d)


def _role_defaults(vf: Any, env: Mapping[str, Any]) -> dict[str, Any]:
    """``env`` with the offline defaults (module docstring) filled into every agent role that leaves them unset."""
    raw = json.loads(json.dumps(dict(env)))  # a deep copy of plain data
    cfg = vf.resolve_env_config(raw)
    from verifiers.v1.configs.agent import agent_config_fields

    for role in agent_config_fields(cfg):
        r = raw.setdefault(role, {})
        if not isinstance(r, dict):
            continue
        r.setdefault("runtime", {"type": "subprocess"})
        r.setdefault("network_notice", False)
    return raw


def _split_of(key: str, heldout_percent: int) -> bool:
    """True when the task with ``key`` is held out (a stable hash of the key, ``% 100 < heldout_percent``)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % 100 < heldout_percent


class VerifiersEnv(Environment):
    """A verifiers v1 environment as a moe_rl :class:`~moe_rl.envs.protocol.Environment` (module docstring).

    Args:
        tokenizer: the run's tokenizer (``encode``/``decode``/``eos_id``...; kept as ``tok``).
        env: the verifiers env config (its ``[env]`` block as a mapping, e.g. ``{"taskset": {"id": "gsm8k"}}``),
            resolved with ``verifiers.v1.resolve_env_config`` after the offline defaults are filled in.
        max_tokens: default tokens per model call (>= 1), sent as verifiers' sampling ``max_tokens``.
        temperature: default sampling temperature (> 0), or None for the run's ``orchestrator.temperature``.
        tokenizer_path: a Hugging Face tokenizer folder with a chat template for verifiers' renderer, or None to
            save ``tokenizer`` with ``chat_template``.
        chat_template: the Jinja chat template used when ``tokenizer_path`` is None.
        renderer: a ``renderers`` config mapping (e.g. ``{"name": "glm45"}``), or None for the default renderer
            (the tokenizer's chat template).
        model_name: the model name verifiers sends (any string; the run serves one policy).
        num_tasks: read at most this many tasks of the taskset (required for an endless taskset).
        heldout_percent: share of tasks (percent, by a hash of the task key) kept for evaluation, 0 to 50.
        max_sequence_len: the longest conversation in tokens, if known (checked against the engine at startup).

    Raises:
        ImportError: verifiers is not installed (the message says ``pip install 'moe_rl[envs]'``).
        ValueError: a bad argument (named), an endless taskset without ``num_tasks``, or no training task.
    """

    def __init__(self, tokenizer: Any, *, env: Mapping[str, Any], max_tokens: int, temperature: float | None = None,
                 tokenizer_path: str | None = None, chat_template: str = CHAR_CHAT_TEMPLATE,
                 renderer: Mapping[str, Any] | None = None, model_name: str = "moe_rl-policy",
                 num_tasks: int | None = None, heldout_percent: int = 5,
                 max_sequence_len: int | None = None) -> None:
        vf = _import_verifiers()
        if not isinstance(env, Mapping) or not env.get("taskset"):
            raise ValueError(f"env={env!r} must be a verifiers env config mapping naming a taskset, e.g. "
                             "{'taskset': {'id': 'my_taskset'}}")
        SamplingParams(max_tokens=max_tokens, temperature=temperature)  # validates both (ValueError names them)
        if num_tasks is not None and (isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1):
            raise ValueError(f"num_tasks={num_tasks!r} must be an int >= 1 or None (the whole taskset)")
        if isinstance(heldout_percent, bool) or not isinstance(heldout_percent, int) or not 0 <= heldout_percent <= 50:
            raise ValueError(f"heldout_percent={heldout_percent!r} must be an int in [0, 50]")
        if max_sequence_len is not None and (not isinstance(max_sequence_len, int) or max_sequence_len < 2):
            raise ValueError(f"max_sequence_len={max_sequence_len!r} must be an int >= 2 or None (unknown)")
        self.tok = tokenizer
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.model_name = str(model_name)
        self._max_sequence_len = max_sequence_len
        self._tmp: str | None = None
        if tokenizer_path is None:
            self._tmp = tokenizer_path = _materialize_tokenizer(tokenizer, chat_template)
            weakref.finalize(self, shutil.rmtree, self._tmp, True)
        from pydantic import TypeAdapter
        from renderers import RendererConfig

        renderer_cfg = TypeAdapter(RendererConfig).validate_python(dict(renderer or {"name": "default"}))
        self.config = vf.resolve_env_config(_role_defaults(vf, env))
        self.vf_env = vf.load_environment(self.config)
        self._client_kwargs = {"api_key_var": _API_KEY_VAR, "renderer": renderer_cfg,
                               "renderer_model_name": str(tokenizer_path)}
        taskset = self.vf_env.taskset
        if not taskset.bounded and num_tasks is None:
            raise ValueError(f"the taskset {self.config.taskset.id!r} is endless; set num_tasks (tasks to read)")
        if num_tasks is not None:
            taskset = taskset.take(num_tasks)
        tasks = list(taskset)
        self.train_tasks = [t for t in tasks if not _split_of(t.key, heldout_percent)]
        self.heldout_tasks = [t for t in tasks if _split_of(t.key, heldout_percent)]
        if not self.train_tasks:
            raise ValueError(f"the taskset {self.config.taskset.id!r} gave {len(tasks)} tasks, none for training "
                             f"(heldout_percent={heldout_percent}); add tasks or lower heldout_percent")
        self._contexts: dict[str, EpisodeContext] = {}
        self._engine_failures: dict[str, BaseException] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock: asyncio.Lock | None = None
        self._endpoint: Any = None
        self._max_model_len: int | None = None

    # ------------------------------------------------------------------ problems
    def sample(self, rng: random.Random, heldout: bool = False) -> Any:
        """A verifiers task drawn uniformly from the training (or held-out) split."""
        pool = self.heldout_tasks if heldout else self.train_tasks
        if not pool:
            raise ValueError("no held-out task: raise heldout_percent or add tasks to the taskset")
        return pool[rng.randrange(len(pool))]

    def max_sequence_len(self) -> int | None:
        return self._max_sequence_len

    # ------------------------------------------------------------------ serving
    async def _ensure_serving(self, max_model_len: int | None) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new event loop (the old one's resources died with it)
            self._loop, self._stack, self._endpoint = loop, None, None
            self._start_lock = asyncio.Lock()
        assert self._start_lock is not None
        async with self._start_lock:
            if self._stack is not None:
                return
            from moe_rl.envs.verifiers_endpoint import GenerateEndpoint

            stack = contextlib.AsyncExitStack()
            try:
                endpoint = GenerateEndpoint(self._handle, model=self.model_name, max_model_len=max_model_len)
                await stack.enter_async_context(endpoint)
                await stack.enter_async_context(self.vf_env.serving())
            except BaseException:
                await stack.aclose()
                raise
            vf = _import_verifiers()
            self._client = vf.TrainClientConfig(base_url=endpoint.base_url, **self._client_kwargs)
            self._endpoint, self._max_model_len, self._stack = endpoint, max_model_len, stack

    async def aclose(self) -> None:
        """Stop verifiers' serving resources and the endpoint (a later episode starts them again)."""
        stack, self._stack, self._endpoint = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @property
    def endpoint(self) -> Any:
        """The running :class:`~moe_rl.envs.verifiers_endpoint.GenerateEndpoint`, or None."""
        return self._endpoint

    async def _handle(self, req: Any) -> Any:
        """One model call of an episode: the endpoint's request -> ``ctx.generate``."""
        from moe_rl.envs.runner import EngineCallError
        from moe_rl.envs.verifiers_endpoint import GenerateResult

        key = req.sampling_params.get(ROUTE_KEY)
        ctx = self._contexts.get(key) if isinstance(key, str) else None
        if ctx is None:
            raise ValueError(f"sampling_params[{ROUTE_KEY!r}]={key!r} names no running episode; requests reach this "
                             "endpoint only through VerifiersEnv.episode")
        bad = []
        for k, v in req.sampling_params.items():
            if k in _MAPPED or k in _IGNORED or v is None:
                continue
            neutral = _NEUTRAL.get(k)
            if neutral is None or v not in (neutral if isinstance(neutral, tuple) else (neutral,)):
                bad.append(f"{k}={v!r}")
        if bad:
            raise ValueError(f"sampling parameters {bad} are not supported (the trainer assumes plain temperature "
                             "sampling); remove them from the verifiers sampling config")
        prompt = req.prompt_ids
        max_tokens = req.max_tokens if req.max_tokens is not None else self.max_tokens
        limit = ctx.max_model_len
        if limit is not None:
            if len(prompt) >= limit:
                raise ValueError(f"the prompt has {len(prompt)} tokens; the engine's max_model_len={limit} leaves "
                                 "none to sample")
            max_tokens = min(max_tokens, limit - len(prompt))
        temperature = req.temperature if req.temperature is not None else self.temperature
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                            stop_token_ids=tuple(req.stop_token_ids))
        try:
            resp = await ctx.generate(ModelRequest(sp, prompt_ids=prompt))
        except EngineCallError as exc:
            self._engine_failures.setdefault(key, exc)
            raise
        return GenerateResult(resp.token_ids, resp.logprobs, resp.finish_reason)

    # ------------------------------------------------------------------ episodes
    async def episode(self, problem: Any, ctx: EpisodeContext) -> EpisodeResult:
        """Play one verifiers episode of ``problem`` (module docstring).

        Raises:
            moe_rl.envs.runner.EngineCallError: a model call failed in the engine.
            RuntimeError: verifiers marked the episode failed (its first error is in the message).
            ValueError: the episode has no trainable trace or several (one per episode is supported).
        """
        vf = _import_verifiers()
        await self._ensure_serving(ctx.max_model_len)
        key = uuid.uuid4().hex
        self._contexts[key] = ctx
        sampling: dict[str, Any] = {"max_tokens": self.max_tokens, ROUTE_KEY: key}
        if self.temperature is not None:
            sampling["temperature"] = self.temperature
        mctx = vf.ModelContext(model=self.model_name, client=self._client, sampling=vf.SamplingConfig(**sampling))
        try:
            ep = await self.vf_env.run_episode(problem, mctx)
        finally:
            self._contexts.pop(key, None)
            failure = self._engine_failures.pop(key, None)
        if failure is not None:
            raise failure
        if not ep.ok:
            errs = [*ep.errors, *(e for t in ep.traces for e in t.errors)]
            first = f"{errs[0].type}: {errs[0].message}" if errs else "no error recorded"
            raise RuntimeError(f"verifiers episode of task {problem.key!r} failed ({len(errs)} error(s)); first: "
                               f"{first[:500]}")
        traces = [t for t in ep.traces if t.agent.trainable]
        if len(traces) != 1:
            raise ValueError(f"the verifiers episode has {len(traces)} trainable traces; VerifiersEnv trains episodes "
                             "with exactly one (mark the other agents trainable=False)")
        (t,) = traces
        reward = float(t.reward)
        rewards = {k: float(r.score) for k, r in t.rewards.items() if r is not None}
        metrics = {k: float(v) for k, v in t.metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        metrics["vf_model_calls"] = float(len(t.calls))
        cond = t.stop_condition or ""
        stop = ("timeout" if t.is_timeout else "max_turns" if cond == "max_turns"
                else "token_budget" if cond.startswith("max_") and cond.endswith("_tokens") else "answered")
        return EpisodeResult(reward=reward, stop_reason=stop, rewards=rewards, metrics=metrics)


def make_env(tokenizer: Any, **env_args: Any) -> VerifiersEnv:
    """The ``"moe_rl.envs.verifiers_env:make_env"`` factory: ``VerifiersEnv(tokenizer, **env_args)``."""
    return VerifiersEnv(tokenizer, **env_args)
