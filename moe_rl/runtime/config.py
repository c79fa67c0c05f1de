"""``RLConfig``: the composed configuration of one ``moe-rl rl`` run (each section owned by its component).

The launcher (``moe_rl.entrypoints.rl``), the trainer process (``moe_rl.runtime.trainer``) and the cluster plan
(``moe_rl.launch``) all read this one type; it lives in the runtime so that none of them imports another's main.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.envs.addition import AdditionTaskConfig
from moe_rl.envs.chained_addition import ChainedAdditionTaskConfig
from moe_rl.envs.tokenizer import DEFAULT_ALPHABET, CharTokenizer
from moe_rl.inference.vllm_server import VllmServerConfig
from moe_rl.models import GlmMoeConfig
from moe_rl.rl.salt import check_run_id
from moe_rl.runtime.orchestrator import OrchestratorConfig
from moe_rl.runtime.sinks import MetricSinksConfig
from moe_rl.runtime.trainer.config import SftConfig, TrainerConfig

__all__ = ["RLConfig", "VLLM_CPU_HEAD_DIMS"]

# vLLM 0.32 CPU attention kernels support only these head sizes (any other size fails at the first generate,
# not at engine start-up).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class RLConfig(BaseConfig):
    """Everything one ``moe-rl rl`` run needs; each section is owned by its component."""

    output_dir: Path
    """Run directory (created). Its name is the run id in every ``cache_salt``, so it must be at most 77 characters
    without ``'@'`` or ``'\\'`` (``moe_rl.rl.salt.check_run_id``). A directory that holds an earlier run (finished or
    failed) is refused unless ``moe-rl rl`` is given ``--overwrite`` (deletes that run's RL files; the cached SFT
    warm-up is kept and reused) or
    ``--resume`` (continues it from its newest complete checkpoint, ``trainer.checkpoint_every``)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of model init, SFT, prompt sampling and request sampling seeds."""
    max_steps: int = Field(100, ge=1)
    """Trainer (optimizer) steps."""
    alphabet: str = DEFAULT_ALPHABET
    """Characters of the local tokenizer (after <pad>, <bos>, <eos>)."""
    model: GlmMoeConfig = Field(default_factory=GlmMoeConfig.tiny_debug)
    task: AdditionTaskConfig | ChainedAdditionTaskConfig = Field(AdditionTaskConfig(), union_mode="left_to_right")
    """Single-turn addition, or chained (multi-turn) addition when ``num_turns`` is given
    (``moe_rl.envs.ChainedAdditionTaskConfig``; e.g. ``--task.num-turns 2``). Unused when ``env`` is set."""
    env: str | None = None
    """``"package.module:factory"``: the environment of the run, built as ``factory(tokenizer, **env_args)``
    (``moe_rl.envs.load_env``; e.g. ``"moe_rl.envs.calculator:make_env"``). None: the built-in ``task``."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the ``env`` factory (a TOML table ``[env_args]``)."""
    sft: SftConfig = SftConfig()
    inference: VllmServerConfig = VllmServerConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    metrics: MetricSinksConfig = MetricSinksConfig()
    """Optional metric sinks besides ``metrics.jsonl``: TensorBoard, Weights & Biases offline (off by default)."""

    @property
    def pad_id(self) -> int:
        return CharTokenizer.pad_id

    @model_validator(mode="after")
    def _cross_checks(self) -> RLConfig:
        if str(self.output_dir).strip() in ("", "."):
            raise ValueError("output_dir must name a run directory (e.g. runs/debug_cpu), not '' or '.'")
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(f"output_dir={str(self.output_dir)!r} exists and is not a directory; pick another path")
        try:  # the run id (mixed into every cache_salt) is the directory's name, plus "-<8 hex>" after --resume
            check_run_id(self.output_dir.resolve().name, name="its directory name", reserve=len("-") + 8)
        except ValueError as exc:
            raise ValueError(f"output_dir={str(self.output_dir)!r}: the run id is the directory's name; {exc}") from None
        if self.env is not None:
            from moe_rl.envs.loader import check_env_spec

            check_env_spec(self.env)
        elif self.env_args:
            raise ValueError(f"env_args={self.env_args!r} is set but env is not; name the factory with env = "
                             "'package.module:factory' or drop env_args")
        missing = sorted(set("0123456789+=") - set(self.alphabet)) if self.env is None else []
        if missing:
            raise ValueError(f"alphabet={self.alphabet!r} lacks {missing}, which the addition task writes; add them")
        mode = self.inference.effective_logprobs_mode
        if mode != "processed_logprobs":
            raise ValueError(
                f"inference logprobs mode {mode!r} (inference.logprobs_mode / inference.extra_args) mixes two "
                "distributions: the trainer recomputes log_softmax(logits / orchestrator.temperature) over the full "
                "vocabulary, which is the engine's 'processed_logprobs'; set inference.logprobs_mode="
                "'processed_logprobs' and drop --logprobs-mode from inference.extra_args"
            )
        if self.env is None and self.task.max_new_tokens < self.task.num_digits + 2:
            raise ValueError(
                f"task.max_new_tokens={self.task.max_new_tokens} cannot hold the longest answer of "
                f"task.num_digits={self.task.num_digits} ({self.task.num_digits + 1} digits + <eos>); set it to at "
                f"least {self.task.num_digits + 2}"
            )
        if self.inference.max_model_len > self.model.max_position_embeddings:
            raise ValueError(
                f"inference.max_model_len={self.inference.max_model_len} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; lower it or raise the model's"
            )
        cores = os.sched_getaffinity(0)
        for name, aff in (("inference.cpu_affinity", self.inference.cpu_affinity),
                          ("trainer.cpu_affinity", self.trainer.cpu_affinity)):
            if aff is not None and (not aff or not set(aff) <= cores):
                raise ValueError(f"{name}={aff} must be a non-empty subset of this machine's cores {sorted(cores)}")
        tok_vocab = CharTokenizer(self.alphabet).vocab_size
        if self.model.vocab_size != tok_vocab:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} must equal the tokenizer's vocabulary ({tok_vocab} = 3 "
                f"special tokens + {len(self.alphabet)} characters of alphabet); set --model.vocab-size {tok_vocab}"
            )
        for name, tid in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0)):
            if getattr(self.model, name) != tid:
                raise ValueError(f"model.{name}={getattr(self.model, name)} must be {tid} (the tokenizer's id)")
        if self.model.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(
                f"model.head_dim={self.model.head_dim} is not supported by vLLM's CPU attention; use one of "
                f"{list(VLLM_CPU_HEAD_DIMS)}"
            )
        if self.model.moe_intermediate_size % 32:
            raise ValueError(
                f"model.moe_intermediate_size={self.model.moe_intermediate_size} must be a multiple of 32 "
                "(vLLM's CPU MoE kernel pads otherwise and its weight reload would need re-padding)"
            )
        longest = 1 + 2 * self.task.num_digits + 2 + self.task.max_new_tokens
        if isinstance(self.task, ChainedAdditionTaskConfig):
            longest = self.task.max_sequence_len()
        if self.env is not None:
            longest = 0  # the environment's own limit is checked when it is built (moe_rl.entrypoints.rl)
        needed = max(longest, 72)  # the engine probe sends a 70-token prompt + 2 tokens
        if self.inference.max_model_len < needed:
            raise ValueError(
                f"inference.max_model_len={self.inference.max_model_len} must be >= {needed} (longest task "
                f"sequence {longest}, engine probe 72); raise it"
            )
        if self.trainer.router_replay and not any(
            self.model.is_moe_layer(i) for i in range(self.model.num_hidden_layers)
        ):
            raise ValueError(
                "trainer.router_replay=true needs an MoE model, but every layer of this model is dense "
                f"(first_k_dense_replace={self.model.first_k_dense_replace}); turn router_replay off"
            )
        if self.trainer.router_replay and self.model.n_routed_experts > 2**15:
            raise ValueError(
                f"trainer.router_replay=true supports up to 32768 routed experts (int16 transport); the model has "
                f"n_routed_experts={self.model.n_routed_experts}"
            )
        if self.trainer.sampling_mask_replay and self.trainer.loss_chunk_tokens is not None:
            raise ValueError(
                f"trainer.sampling_mask_replay=true needs the full-logits head, but trainer.loss_chunk_tokens="
                f"{self.trainer.loss_chunk_tokens}; set loss_chunk_tokens to None or turn sampling_mask_replay off"
            )
        if self.trainer.sampling_mask_replay and self.env is None and getattr(self.task, "num_turns", 1) > 1:
            raise ValueError(
                f"trainer.sampling_mask_replay=true with task.num_turns={self.task.num_turns}: kept-set records are not "
                "merged across turns, so multi-turn samples would train over the whole vocabulary while the engine "
                "sampled from a truncated one; use a single-turn task or turn sampling_mask_replay off"
            )
        dp = self.trainer.data_parallel_size  # dp_replicate * dp_shard: the ranks taking distinct rows
        if self.orchestrator.batch_size % dp:
            raise ValueError(
                f"orchestrator.batch_size={self.orchestrator.batch_size} must be divisible by the trainer's "
                f"data-parallel ranks dp_replicate*dp_shard={dp} (trainer.nproc_per_node="
                f"{self.trainer.nproc_per_node}, trainer.parallel.cp={self.trainer.parallel.cp}; each data rank "
                "trains an equal shard of rows)"
            )
        ep = self.trainer.parallel.ep
        if self.model.n_routed_experts % ep:
            raise ValueError(
                f"trainer.parallel.ep={ep} must divide model.n_routed_experts={self.model.n_routed_experts} (each "
                "EP rank holds n_routed_experts / ep experts); change ep"
            )
        inf = self.inference
        if inf.num_engines > 1 and self.trainer.weight_transport != "filesystem":
            raise ValueError(
                f"inference.num_engines={inf.num_engines} needs trainer.weight_transport='filesystem' (a restarted "
                f"engine rejoins by loading the current version folder), not {self.trainer.weight_transport!r}; set "
                "trainer.weight_transport='filesystem' or inference.num_engines=1"
            )
        if inf.port and inf.port + inf.num_engines - 1 > 65535:
            raise ValueError(f"inference.port={inf.port} with inference.num_engines={inf.num_engines}: engine i listens "
                             f"on port + i, past 65535; lower inference.port or set it to 0 (free ports)")
        if self.trainer.p2p.backend == "nixl":
            if self.trainer.weight_transport != "p2p":
                raise ValueError(
                    f"trainer.p2p.backend='nixl' is used only by trainer.weight_transport='p2p', not "
                    f"{self.trainer.weight_transport!r}; set trainer.weight_transport='p2p' or drop the backend")
            import importlib.util

            if importlib.util.find_spec("nixl") is None:  # before any engine starts (the trainer would fail later)
                raise ValueError("trainer.p2p.backend='nixl' needs the NIXL wheels, which are not installed: "
                                 "pip install 'moe_rl[nixl]', or set trainer.p2p.backend='gloo'")
        name = self.inference.served_model_name
        if self.trainer.weight_transport == "mooncake" and any(c == "|" or c.isspace() for c in name):
            raise ValueError(
                f"trainer.weight_transport='mooncake' keys the store by inference.served_model_name={name!r}, which "
                "may not contain '|' or whitespace (moe_rl.inference.mooncake.StoreKey); rename the served model"
            )
        o = self.orchestrator
        if o.off_policy_policy == "mask" and o.partial_groups == "survivors" and dp > 1:
            raise ValueError(
                "orchestrator.off_policy_policy='mask' with partial_groups='survivors' makes batches smaller than "
                f"batch_size (fully masked samples leave their group), which the trainer's {dp} data-parallel "
                "ranks cannot shard equally; set orchestrator.partial_groups='drop_group' (whole groups only) or "
                "use one data-parallel rank"
            )
        if self.env is not None and o.partial_groups == "survivors" and dp > 1:
            raise ValueError(
                f"env={self.env!r} with orchestrator.partial_groups='survivors' makes a batch smaller than batch_size "
                f"when an episode fails (it leaves its group), which the trainer's {dp} data-parallel ranks cannot "
                "shard equally; set orchestrator.partial_groups='drop_group' (recipes/agentic_cpu/rl.toml does) or "
                "use one data-parallel rank"
            )
        if self.env is None and getattr(self.task, "num_turns", 1) > 1 and o.partial_groups == "survivors" and dp > 1:
            raise ValueError(
                f"task.num_turns={self.task.num_turns} with orchestrator.partial_groups='survivors' makes a batch "
                "smaller than batch_size when a later turn of one sample fails (the sample leaves its group), which "
                f"the trainer's {dp} data-parallel ranks cannot shard equally; set orchestrator.partial_groups="
                "'drop_group' (recipes/debug_cpu/rl_multiturn.toml does) or use one data-parallel rank"
            )
        return self

