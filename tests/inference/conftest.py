"""Fixtures for the vLLM tests: a tiny GLM-4.5-architecture MoE checkpoint built locally (no model hub).

The checkpoint follows ``notes/vllm-cpu.md`` §3: ``Glm4MoeForCausalLM`` with head_dim 32 (the CPU attention
kernels accept only head_dim in {32, 64, 80, ...}), ``moe_intermediate_size`` a multiple of 32 (so the CPU MoE
kernel pads nothing), fp32, and a character-level tokenizer. Layer 0 is dense (``first_k_dense_replace=1``)
and layer 1 is the MoE layer (8 routed experts, top-2, plus 1 shared expert).

Weight versions (each a full HF checkpoint dir with the same config and tokenizer):

- ``v1``: the base weights.
- ``v2``: v1 with new layer-1 routed experts and router, and a new lm_head. This is **KV-neutral**: the K/V
  of every layer depend only on layer 0 and the layer-1 attention input, so the prefix cache stays valid
  and outputs after a reload can be compared exactly with a fresh load (``notes/vllm-cpu-inflight.md``).
- ``v3``: v2 plus new layer-0 attention projections, so the K/V of every prompt change.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

VOCAB_SIZE = 32
"""Model vocabulary. The tokenizer defines ids 0..15; ids 16..31 exist only in the model."""

CHARS = [str(d) for d in range(10)] + ["+", "-", "="]
"""Tokenizer symbols after the specials ``<pad>``=0, ``<bos>``=1, ``<eos>``=2 (so '0' is id 3)."""


def build_char_tokenizer(out_dir: Path) -> None:
    """Save a character-level WordLevel tokenizer (specials, digits, ``+-=``) to ``out_dir``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )
    fast.save_pretrained(out_dir)


def build_tiny_glm4_moe(out_dir: Path, *, moe_intermediate_size: int = 64, seed: int = 0) -> Path:
    """Write a random tiny Glm4Moe checkpoint (fp32, ~0.5M parameters) plus tokenizer to ``out_dir``.

    Args:
        out_dir: destination folder (created).
        moe_intermediate_size: routed-expert hidden size; not a multiple of 32 makes vLLM's CPU MoE pad.
        seed: torch seed for the random weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    from moe_rl.models.glm4_moe.config import GlmMoeConfig

    # The addition task's tiny model with a narrower dense MLP, no q/k/v biases and 256 positions.
    ours = GlmMoeConfig.tiny_debug(vocab_size=VOCAB_SIZE, intermediate_size=128, attention_bias=False,
                                   moe_intermediate_size=moe_intermediate_size, max_position_embeddings=256)
    cfg = Glm4MoeConfig.from_dict(ours.to_hf_config_dict())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Peaked, expert-sensitive outputs: a larger lm_head and expert scale than the default init (0.02).
        for name, p in model.named_parameters():
            if name == "lm_head.weight":
                p.normal_(0.0, 0.3)
            elif ".mlp.experts." in name or ".mlp.gate." in name:
                p.normal_(0.0, 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    build_char_tokenizer(out_dir)
    return out_dir


def perturb_checkpoint(src: Path, dst: Path, select: Callable[[str], bool], *, seed: int, std: float) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with every tensor whose name passes ``select`` redrawn N(0, std).

    Raises:
        ValueError: ``select`` matched no tensor (the perturbation would be a no-op).
    """
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    changed = [name for name in tensors if select(name)]
    if not changed:
        raise ValueError(
            f"perturb_checkpoint: no tensor of {src} matched the selector; names: {sorted(tensors)}"
        )
    for name in changed:
        t = tensors[name]
        tensors[name] = (torch.randn(t.shape, generator=gen, dtype=torch.float32) * std).to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _is_layer1_moe_or_head(name: str) -> bool:
    return name == "lm_head.weight" or (
        name.startswith("model.layers.1.mlp.") and "shared_experts" not in name
    )


def _is_layer0_attention(name: str) -> bool:
    return name.startswith("model.layers.0.self_attn.") and name.endswith("weight")


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"v1", "v2", "v3"}`` -> checkpoint dirs (see the module docstring)."""
    root = tmp_path_factory.mktemp("tiny_glm4_moe")
    v1 = build_tiny_glm4_moe(root / "v1", seed=0)
    v2 = perturb_checkpoint(v1, root / "v2", _is_layer1_moe_or_head, seed=1, std=0.3)
    v3 = perturb_checkpoint(v2, root / "v3", _is_layer0_attention, seed=2, std=0.3)
    return {"v1": v1, "v2": v2, "v3": v3}


@pytest.fixture(scope="session")
def tiny_moe_padded_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Like ``tiny_moe_dirs`` (v1, v2 only) with ``moe_intermediate_size=48``: vLLM's CPU MoE pads it to 64."""
    root = tmp_path_factory.mktemp("tiny_glm4_moe_pad48")
    v1 = build_tiny_glm4_moe(root / "v1", moe_intermediate_size=48, seed=0)
    v2 = perturb_checkpoint(v1, root / "v2", _is_layer1_moe_or_head, seed=1, std=0.3)
    return {"v1": v1, "v2": v2}


@contextmanager
def inprocess_llm(model_dir: Path, **overrides: Any) -> Iterator[Any]:
    """A vLLM ``LLM`` running in this process (no EngineCore/Worker processes; ``notes/vllm-cpu.md`` §4).

    Uses ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` + ``distributed_executor_backend="uni"`` (init ~2 s instead of
    12-15 s), an explicit KV size (else vLLM sizes it from the NUMA node's memory, E2), block_size 32 (the CPU
    attention needs a multiple of 32, E4) and this package's worker extension, so ``llm.collective_rpc(
    "reload_and_repack", ...)`` runs the same code as the server's ``/collective_rpc``.
    """
    from vllm import LLM

    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "HF_HUB_OFFLINE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=True,
        block_size=32,
        kv_cache_memory_bytes=64 * 2**20,
        distributed_executor_backend="uni",
        worker_extension_cls="moe_rl.weights.engine.WeightSyncExtension",
    )
    kwargs.update(overrides)
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        import gc

        gc.collect()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def greedy_outputs(llm: Any, prompts: list[list[int]], max_tokens: int, cache_salt: str | None = None):
    """Greedy-decode ``prompts`` (token ids) in one batch.

    Returns:
        ``(tokens, logprobs)``: per prompt, the sampled ids and the sampled tokens' logprobs.
    """
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    inputs = []
    for p in prompts:
        item: dict[str, Any] = {"prompt_token_ids": p}
        if cache_salt is not None:
            item["cache_salt"] = cache_salt
        inputs.append(item)
    outs = llm.generate(inputs, sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [step[tok].logprob for step, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
        for o in outs
    ]
    return tokens, logprobs


@pytest.fixture(scope="session")
def vllm_engine() -> Callable[..., Any]:
    """``vllm_engine(model_dir, **llm_overrides)``: context manager of an in-process LLM (``inprocess_llm``).

    A fixture rather than an import, so test modules never import ``conftest`` by name.
    """
    return inprocess_llm


@pytest.fixture(scope="session")
def greedy() -> Callable[..., Any]:
    """``greedy(llm, prompts, max_tokens, cache_salt=None) -> (tokens, logprobs)`` (``greedy_outputs``)."""
    return greedy_outputs


def _start_mooncake_master(**config: Any) -> Any:
    """Start a ``MooncakeMaster`` on loopback with ``MooncakeMasterConfig(**config)``; skip the test when Mooncake
    cannot run here (no wheel, no ``libibverbs1``), or fail it when ``MOE_RL_REQUIRE_MOONCAKE=1`` (CI sets it)."""
    from moe_rl.inference.mooncake import MooncakeMaster, MooncakeMasterConfig

    try:
        return MooncakeMaster(MooncakeMasterConfig(**config)).start()
    except ImportError as exc:
        if os.environ.get("MOE_RL_REQUIRE_MOONCAKE") == "1":
            pytest.fail(f"MOE_RL_REQUIRE_MOONCAKE=1 but Mooncake cannot run: {exc}")
        pytest.skip(f"Mooncake cannot run here: {exc}")


@pytest.fixture(scope="session")
def start_mooncake_master() -> Callable[..., Any]:
    """``start_mooncake_master(**MooncakeMasterConfig fields) -> MooncakeMaster`` (started; the caller stops it)."""
    return _start_mooncake_master


class SharedVllmServer:
    """One real vLLM CPU server (the tiny MoE's ``v1``, pinned to core 0 when there are 2+ cores) shared by the test
    modules whose tests need no server flags of their own: each start costs ~20-60 s on the 2-core CI machine.

    :meth:`get` returns the running server if it still serves the base weights (weight version 0), else (exited,
    stopped by a test, or its weights changed by an earlier module) stops it and starts a fresh one, so a module
    sees the same state whatever ran before it. A module may change the weights or stop the server; the next
    ``get`` pays a new start.
    """

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.server: Any = None
        self.starts = 0

    def _fresh(self) -> bool:
        import asyncio

        from moe_rl.inference import VllmClient

        if self.server is None or self.server.poll() is not None:
            return False

        async def version() -> int:
            async with VllmClient(self.server.base_url) as client:
                return await client.weight_version()

        try:
            return asyncio.run(version()) == 0
        except Exception:  # noqa: BLE001 - an unhealthy server is replaced
            return False

    def get(self) -> Any:
        from moe_rl.inference import VllmServer, VllmServerConfig

        if self._fresh():
            return self.server
        self.stop()
        cores = [0] if len(os.sched_getaffinity(0)) >= 2 else None
        cfg = VllmServerConfig(cpu_affinity=cores, max_model_len=256, startup_timeout_s=240)
        self.starts += 1
        srv = VllmServer(cfg, self.model_dir, self.log_dir / f"server{self.starts}.log")
        srv.start()
        try:
            ready_s = srv.wait_ready()
        except BaseException:
            srv.stop()
            raise
        print(f"\nshared vLLM server #{self.starts} ready in {ready_s:.1f} s (pid {srv.pid}, cores {cores})")
        self.server = srv
        return srv

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="session")
def shared_vllm_server(tiny_moe_dirs, tmp_path_factory) -> Iterator[SharedVllmServer]:
    """The session's :class:`SharedVllmServer` (started on the first ``get()``; stopped at the end)."""
    pytest.importorskip("vllm")
    shared = SharedVllmServer(tiny_moe_dirs["v1"], tmp_path_factory.mktemp("shared_vllm"))
    try:
        yield shared
    finally:
        shared.stop()
