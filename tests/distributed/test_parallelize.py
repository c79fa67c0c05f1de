"""Trainer parallelism (:func:`moe_rl.distributed.parallelize.parallelize_model`): FSDP2 x EP x CP on gloo.

Tier 1 (no process group): mesh-building and CP-sharding argument errors, the zigzag shard of a batch.
Tier 2: one 4-rank gloo world (``tests/distributed/_parallelize_worker.py``, launched once per module) runs every
scenario; each test below checks one scenario on every rank. Each training scenario compares one AdamW step of the
parallel model against the single-process model on the full batch: the global loss, every gradient and every
updated parameter (gathered full tensors) at fp32 atol 1e-5 (the justification is in the worker). Layouts:

* ``hsdp_dp2_ep2``: dp_replicate=2 x dp_shard=2, ep=2 (efsdp=1; HSDP all-reduce of expert gradients)
* ``dp2_cp2_ring``: dp_shard=2 x cp=2, ring attention
* ``dp2_cp2_ep2_ulysses_ac``: dp_shard=2 x cp=2 with ep=2 borrowed from them, Ulysses, activation checkpointing
* ``b20_tied_dp4_ep2``: tied embeddings (case B20) at dp_shard=4, ep=2: one parameter, still aliased after the
  step, gradient = both uses; ``b20_meta_to_empty_tied_dp4_ep2``: B20's exact sequence (build on meta,
  parallelize, ``to_empty``, load the full state dict): still one parameter after each stage, the step matches the
  reference, and the saved state dict reloads into an unsharded model with the tie intact
* ``resume_dp4`` / ``resume_dp2_cp2_ep2``: a DCP checkpoint (model + AdamW state) saved at the HSDP+EP layout is
  loaded by a differently-seeded model at another layout; parameters, the next step's loss and the parameters
  after the next step equal the reference.
* ``bf16_mixed_precision_dp2_cp2_ep2``: ``MixedPrecisionPolicy(bf16, reduce fp32)`` through EP + CP, within bf16
  bounds of the fp32 reference (relative loss < 2e-2, relative gradient norm < 5e-2; measured 6e-5 and 6e-3).
* GLM-5 (``GlmMoeDsaForCausalLM.tiny_debug``: MLA + DSA with index_topk=4 < S=16, 1 dense + 2 MoE layers, one MTP
  layer): ``dsa_dp2_cp2_ep2_ac`` (DSA all-gather CP, EP, activation checkpointing; MTP built but unused, and
  ``forward_full`` raises under CP), ``dsa_mtp_dp4_ep2`` / ``dsa_mtp_dp4_ep2_ac`` (main + MTP loss through
  ``forward_full``). The frozen DSA indexer has no gradient in either run; every other gradient and updated parameter
  matches at 1e-5 (measured: loss 5e-7, gradients 4e-8, parameters 6e-8). ``dsa_validation_errors``: ring CP
  refused for DSA, a CP forward without positions.

Every training scenario also checks :func:`clip_grad_norm_` (torchtitan's EP-aware clip over the dense and the
(efsdp, ep) meshes) against the reference's global gradient norm.

Runtime on the shared 2-core machine: ~25-40 s for the file (process start-up plus the reference; each
scenario takes 1-3 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _ranks import check_scenario

from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.distributed.parallelize import shard_for_context_parallel

WORKER = Path(__file__).with_name("_parallelize_worker.py")
WORLD = 4
TIMEOUT_S = 300


# ------------------------------------------------------------------------------- tier 1: no process group


def test_build_mesh_without_process_group_raises():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        ParallelDims(dp_shard=2).build_mesh("cpu")


def test_ep_must_divide_dp_shard_times_cp():
    with pytest.raises(ValueError, match=r"ep=4 must divide dp_shard\*cp = 2\*1 = 2"):
        ParallelDims(dp_shard=2, ep=4)


def test_zigzag_shard_for_context_parallel():
    x = torch.arange(20).view(2, 10)  # S=10 -> padded to 12 for cp=2 zigzag (chunks of 3)
    s0 = shard_for_context_parallel(x, 2, 0, pad_value=-1)
    s1 = shard_for_context_parallel(x, 2, 1, pad_value=-1)
    assert s0.positions.tolist() == [0, 1, 2, 9, 10, 11]
    assert s1.positions.tolist() == [3, 4, 5, 6, 7, 8]
    assert s0.local[1].tolist() == [10, 11, 12, 19, -1, -1]
    assert s0.valid.tolist() == [True, True, True, True, False, False]
    with pytest.raises(ValueError, match=r"x_BS must be \[B, S, \.\.\.\], got shape \(10,\)"):
        shard_for_context_parallel(x[0], 2, 0)


def test_glm_moe_dsa_positions_need_context_parallelism():
    from moe_rl.models.glm_moe_dsa import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.tiny_debug(), with_mtp=False)
    ids = torch.randint(3, 64, (2, 6))
    with pytest.raises(ValueError, match=r"positions is only for context parallelism"):
        model(ids, positions=torch.arange(6))


def test_parallelize_model_dispatches_to_the_family_without_importing_it():
    """``distributed`` imports no model family: ``parallelize_model`` calls the model's own ``parallelize`` (the
    family's function), a family function rejects the other family, and a model without ``parallelize`` is a
    TypeError naming the fix."""
    from moe_rl.distributed.parallelize import apply_cp, parallelize_model
    from moe_rl.models.glm4_moe import GlmMoeConfig, GlmMoeForCausalLM, parallelize_glm4_moe
    from moe_rl.models.glm_moe_dsa import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, parallelize_glm_moe_dsa

    with pytest.raises(TypeError, match=r"model must provide parallelize\(dims, mesh, \.\.\.\).*got Linear"):
        parallelize_model(torch.nn.Linear(2, 2), ParallelDims(), None)  # type: ignore[arg-type]
    torch.manual_seed(0)
    gqa = GlmMoeForCausalLM(GlmMoeConfig.tiny_debug())
    mla = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.tiny_debug(), with_mtp=False)
    with pytest.raises(TypeError, match=r"model must be a GlmMoeForCausalLM, got GlmMoeDsaForCausalLM"):
        parallelize_glm4_moe(mla, ParallelDims(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be a GlmMoeDsaForCausalLM, got GlmMoeForCausalLM"):
        parallelize_glm_moe_dsa(gqa, ParallelDims(), None)  # type: ignore[arg-type]
    # the generic entry reaches the family's checks through model.parallelize
    with pytest.raises(TypeError, match=r"mesh must be the ParallelMesh"):
        parallelize_model(gqa, ParallelDims(), None)  # type: ignore[arg-type]
    # the options pass through unchanged; a misspelt one is refused before the family is called
    with pytest.raises(TypeError, match=r"parallelize_model: unexpected keyword arguments \['activation_checkpoint'\]"):
        parallelize_model(gqa, ParallelDims(), None, activation_checkpoint=True)  # type: ignore[arg-type,call-arg]
    with pytest.raises(ValueError, match=r"cp_method='zigzag' is not supported; use 'ring' or 'ulysses'"):
        apply_cp([], ParallelDims(), None, "zigzag")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- tier 2: gloo, 4 ranks


@pytest.fixture(scope="module")
def world4(tmp_path_factory, launch_ranks):
    results = launch_ranks(WORKER, WORLD, tmp_path_factory.mktemp("par4"), TIMEOUT_S)
    print("\nseconds:", results[0]["_seconds"], "\nmax abs error vs reference:", results[0]["_max_err"])
    return results


@pytest.mark.parametrize(
    "scenario",
    [
        "hsdp_dp2_ep2",
        "dp2_cp2_ring",
        "dp2_cp2_ep2_ulysses_ac",
        "b20_tied_dp4_ep2",
        "b20_meta_to_empty_tied_dp4_ep2",
        "resume_dp4",
        "resume_dp2_cp2_ep2",
        "bf16_mixed_precision_dp2_cp2_ep2",
        "validation_errors",
        "dsa_dp2_cp2_ep2_ac",
        "dsa_mtp_dp4_ep2",
        "dsa_mtp_dp4_ep2_ac",
        "dsa_validation_errors",
    ],
)
def test_parallel_step_matches_single_process(world4, scenario):
    check_scenario(world4, scenario)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_routed_experts_are_sharded_exactly_like_input_ids(layout):
    """Router replay under CP: ``[B, S, L, K]`` routed experts go through the same helper as ``input_ids``, so
    every local token replays its own row; padding columns carry the -1 pad sentinel."""
    import torch

    from moe_rl.distributed.parallelize import shard_for_context_parallel

    B, S, L, K, cp = 2, 11, 3, 2, 2  # 11 is not a multiple of 2 * cp: padded
    ids = torch.arange(B * S).view(B, S)
    routed = torch.stack([ids * 10 + layer for layer in range(L)], dim=-1)[..., None].expand(B, S, L, K).clone()
    for rank in range(cp):
        sid = shard_for_context_parallel(ids, cp, rank, layout=layout, pad_value=-1)
        srt = shard_for_context_parallel(routed, cp, rank, layout=layout, pad_value=-1)
        assert torch.equal(sid.positions, srt.positions) and torch.equal(sid.valid, srt.valid)
        tok = sid.local[:, sid.valid]
        assert torch.equal(srt.local[:, sid.valid], torch.stack([tok * 10 + layer for layer in range(L)], -1)[..., None]
                           .expand(*tok.shape, L, K))
        assert (srt.local[:, ~sid.valid] == -1).all()


def test_apply_ep_names_a_wrong_block_attr_and_what_the_layer_has():
    from torch import nn

    from moe_rl.distributed.parallelize import apply_ep

    class Experts(nn.Module):
        pass

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

    class Layer(nn.Module):
        is_moe = True

        def __init__(self):
            super().__init__()
            self.attn, self.mixer = nn.Linear(2, 2), Block()

    layers, dims = [Layer(), Layer()], ParallelDims()
    with pytest.raises(ValueError, match=r"apply_ep: block_attr='mlp': MoE layer 0 \(Layer\) has no such attribute; "
                                         r"its child modules are \['attn', 'mixer'\], of which \['mixer'\] hold "
                                         r"'experts'.*\(e.g. block_attr='mixer'\)"):
        apply_ep(layers, dims, None)
    with pytest.raises(ValueError, match=r"block_attr='attn': MoE layer 0 \(Layer\) is a Linear, which has no "
                                         r"'experts'"):
        apply_ep(layers, dims, None, block_attr="attn")
    for bad in (None, 5):
        with pytest.raises(TypeError, match=r"apply_ep: block_attr=.* has type .*; pass the name \(a str\)"):
            apply_ep(layers, dims, None, block_attr=bad)
    assert apply_ep(layers, dims, None, block_attr="mixer") == [layer.mixer.experts for layer in layers]  # ep == 1
