"""The cluster trainer entry point trains a tiny model of each newer family like one process does: DeepSeek-V3
(``deepseek_v3``: plain MLA with YaRN, group-limited sigmoid routing, a shared expert, 1 dense + 2 MoE layers) and
Nemotron-H (``nemotron_h``: Mamba-2, GQA attention without positional encoding, a squared-ReLU MLP and latent MoE
layers, pattern ``ME*EM-``).

The same run as ``test_cluster_trainer.py`` does for GLM-5: the real entry point under ``torchrun`` on 2 gloo ranks
(dp_shard=2 with ep=2 borrowed from it, or cp=2 with ep=2: ring attention; for Nemotron-H also the Mamba-2 state
passed from CP rank 0 to rank 1, so the trainer cuts the columns in the model's contiguous layout,
``model.cp_layout``), meta-device build through the family's ``parallelize`` + sharded checkpoint load, AdamW moments
offloaded to the host, head + log-probs in chunks of 5 tokens, micro-batches of 1 row; two batches in the
orchestrator's format, versions 1 and 2 published as sharded folders. Reference: the unsharded model loaded with
``load_hf_state_dict``, the same ``train_step`` on one process, unchunked log-probs.

Tolerances (fp32) as in ``test_cluster_trainer.py``: the runs differ in summation order only (FSDP reduce-scatter,
EP combine, ring attention's merged partial softmaxes, the SSD scan's state hand-over between CP ranks, chunked
log-sum-exp, micro-batch accumulation), so loss and mismatch_kl are bounded by ``train_step_bounds`` of the
reference's log-probs, grad_norm by the normwise relative error ``beta`` of a decoder chain's gradient (two paths),
each published tensor by AdamW's ``2 (lr / eps) sum_s beta ||g_s||`` plus the rounding of each update. AdamW runs
with ``eps = lr``: a wrong shard, a lost moment, a zigzag-cut Mamba-2 sequence or a missing expert gradient moves a tensor by ``~ lr`` per element, orders of magnitude above these bounds.

With router replay (R3: every sample carries a random engine record, the last token a placeholder) and FP8
(``trainer.fp8``: linears and routed experts, both runs converted alike) on dp_shard=2 x ep=2: the forward and the
data gradients quantize per token and per weight block, unchanged by sharding; the Wgrad operands are quantized in
128-token groups that the micro-batches form from other tokens, so ``beta`` gets twice the e4m3 unit roundoff
``2 * 2^-4`` and the later steps' loss the first-order drift of the weights that follows. A reference that does
not replay the records fails the loss check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_cluster_trainer import (  # noqa: E402
    _run_cluster_trainer,
    assert_matches_reference,
    cluster_config,
    family,
)

ARCHITECTURES = ("deepseek_v3", "nemotron_h")


def _tiny(arch: str):
    mod, _ = family(arch)
    return getattr(mod, {"deepseek_v3": "DeepseekV3Config", "nemotron_h": "NemotronHConfig"}[arch]).tiny_debug()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    mod, model_cls = family(arch)
    torch.manual_seed(0)
    cfg = _tiny(arch)
    out = tmp_path_factory.mktemp("ckpt") / f"{arch}_tiny"
    mod.save_hf_checkpoint(model_cls(cfg), cfg, out)
    return arch, out


@pytest.mark.multirank  # torchrun inside _run_cluster_trainer
@pytest.mark.parametrize("cp", [1, 2], ids=["dp_shard2_ep2", "cp2_ep2"])
def test_cluster_trainer_two_ranks_equals_one_process(tmp_path, tiny_checkpoint, cp):
    arch, ckpt = tiny_checkpoint
    steps = 2
    cfg = cluster_config(ckpt, max_steps=steps, cp=cp)
    cfg["model"] = {"architecture": arch, "trainer_checkpoint": str(ckpt),
                    "inference_checkpoint": str(ckpt), "config": _tiny(arch).model_dump(mode="json")}
    run, batches, _ = _run_cluster_trainer(tmp_path, cfg, steps)
    assert_matches_reference(run, cfg, ckpt, batches, _tiny(arch))


@pytest.mark.multirank  # torchrun inside _run_cluster_trainer
def test_cluster_trainer_router_replay_fp8_equals_one_process(tmp_path, tiny_checkpoint):
    """dp_shard=2 x ep=2 with router replay (every sample carries an engine record) and FP8 linears and routed experts
    (``trainer.fp8``; DeepSeek-V3's SwiGLU experts, Nemotron-H's squared-ReLU latent experts) against the one-process
    run with the same replay and conversion."""
    import json

    arch, ckpt = tiny_checkpoint
    tiny, steps = _tiny(arch), 2
    cfg = cluster_config(ckpt, max_steps=steps, router_replay=True, fp8=True)
    cfg["model"] = {"architecture": arch, "trainer_checkpoint": str(ckpt), "inference_checkpoint": str(ckpt),
                    "config": tiny.model_dump(mode="json")}
    from moe_rl.fp8 import Fp8Config
    from moe_rl.moe.fp8_convert import convert_model_to_fp8, fp8_parameter_fraction

    with torch.device("meta"):
        model = family(arch)[1](tiny)
    moe_layers = sum(layer.is_moe for layer in model.layers)
    counts = convert_model_to_fp8(model, Fp8Config(enabled=True))
    assert counts["experts"] == moe_layers
    run, batches, _ = _run_cluster_trainer(tmp_path, cfg, steps,
                                           routing=(moe_layers, tiny.n_routed_experts, tiny.num_experts_per_tok))
    assert all(b.routed_experts is not None and (b.routed_experts_state == 0).any() for b in batches)
    frac = json.loads((run / "trainer" / "step_0.json").read_text())["fp8_param_fraction"]
    # under EP the linears and the local routed experts stay FP8: the same global counts as the converted model
    assert frac == fp8_parameter_fraction(model) and frac["fraction"] > 0.5, frac
    # FP8 (trainer.fp8): the forward and the data gradients quantize per token (1x128) and per 128 x 128 weight
    # block, which sharding does not change, but the Wgrad operands are quantized in groups of 128 tokens, which
    # the micro-batches and ranks form from other tokens: gradients may differ by twice the e4m3 unit roundoff
    assert_matches_reference(run, cfg, ckpt, batches, tiny, grad_rel_err=2 * 2.0**-4)
