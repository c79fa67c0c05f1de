"""One rank of the trainer-parallelism tests (launched once per rank by ``tests/distributed/test_parallelize.py``).

Every rank first computes the single-process reference (the full :class:`GlmMoeForCausalLM` on the full batch: loss,
gradients, AdamW step, then the next step's loss and parameters). Then each scenario builds the same model, applies
:func:`parallelize_model` for one :class:`ParallelDims` layout of the 4-rank gloo world, trains on this rank's
part of the batch (its rows for its data rank, its columns for its CP rank) and compares the global loss, every
gathered gradient and every gathered updated parameter with the reference. Two scenarios resume from a
``torch.distributed.checkpoint`` saved by another layout and compare the next step.

Writes ``{scenario: "ok" | traceback, "_seconds": {...}, "_max_err": {...}}`` to ``<out>/rank<r>.json``.

Usage: ``python _parallelize_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tolerance helpers
from _rank_worker import RankArgs, run_rank_worker  # noqa: E402
from _tiny_glm import glm4_micro  # noqa: E402
from _tolerance import assert_normwise_close, decoder_chain  # noqa: E402

from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.distributed.parallelize import clip_grad_norm_, parallelize_model, shard_for_context_parallel
from moe_rl.models.glm4_moe.config import GlmMoeConfig
from moe_rl.models.glm4_moe.model import GlmMoeForCausalLM

_T0 = time.perf_counter()
torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
# fp32 throughout. Sharded runs differ from the reference only in summation order (FSDP reduce-scatter of the
# per-rank gradients, EP combine, the CP attention's blockwise softmax merge): every compared tensor (logits,
# gradients, parameters after the AdamW steps) is checked with the per-tensor normwise chain bound of
# tests/_tolerance.py (``close``: reductions of <= k terms, depth = 2 paths x the forward + backward chain of the
# deeper of the two tiny models, + the MTP layer). A missing or doubled gradient contribution is O(1) relative on
# its tensor.
B, S, V = 4, 8, 32
OPT = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.01)
# Adam's first update is lr * g / (|g| + eps): with eps=1e-3 its sensitivity to a gradient error d is at most
# lr * d / eps = d, so parameter differences stay below the gradients' (eps=1e-8 would amplify d by 1e5); the
# parameters' own bound (relative to their norm) is far below one update (lr per element).
MAX_ERR: dict[str, float] = {}


def config(tied: bool) -> GlmMoeConfig:
    return glm4_micro(vocab_size=V, n_routed_experts=4, tie_word_embeddings=tied)


def build(tied: bool, seed: int = 0) -> GlmMoeForCausalLM:
    torch.manual_seed(seed)
    model = GlmMoeForCausalLM(config(tied))
    # spread the router scores so no top-k choice is a near tie (flips would not be bugs)
    with torch.no_grad():
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.router.weight.normal_(0.0, 1.0)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        ids = torch.randint(3, V, (B, S), generator=g)
        labels = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.int64)], dim=1)
        mask = torch.ones(B, S)
        mask[:, -1] = 0.0
        mask[0, :3] = 0.0  # a prompt with no loss
        out.append((ids, labels, mask))
    return out


def token_loss_sum(logits, labels, mask):
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * mask.reshape(-1)).sum()


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reference(tied: bool) -> dict:
    model = build(tied)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    (ids, labels, mask), (ids2, labels2, mask2) = batches()
    loss = token_loss_sum(model(ids), labels, mask) / mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grad_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]))
    opt.step()
    opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss2 = token_loss_sum(model(ids2), labels2, mask2) / mask2.sum()
    loss2.backward()
    opt.step()
    params2 = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(
        loss=loss.detach(),
        grads=grads,
        grad_norm=grad_norm,
        params=params,
        loss2=loss2.detach(),
        params2=params2,
    )


REF: dict[bool, dict] = {}


def ref(tied: bool) -> dict:
    if tied not in REF:
        REF[tied] = reference(tied)
    return REF[tied]


_CHAIN: list[tuple[int, int]] = []


def close(actual, expected, what: str) -> None:
    if not _CHAIN:
        (k1, d1), (k2, d2) = (decoder_chain(c, B * S, backward=True) for c in (config(False), dsa_config()))
        _CHAIN.append((max(k1, k2), 2 * max(d1, d2) + 2 + 16))  # two paths, loss + clip, the MTP layer
    k, depth = _CHAIN[0]
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    MAX_ERR[what.split(":")[0]] = max(MAX_ERR.get(what.split(":")[0], 0.0), err)
    assert_normwise_close(actual, expected, dtype=torch.float32, k=k, depth=depth, what=what)


def local_batch(mesh, dims: ParallelDims, batch, cp_layout="zigzag"):
    """This rank's rows (data rank) and columns (CP rank) of ``(ids, labels, mask)`` plus positions."""
    ids, labels, mask = batch
    data_ranks = dims.dp_replicate * dims.dp_shard
    data_rank = mesh.data_rank
    assert data_rank == dist.get_rank() // dims.cp  # rank order: dp_replicate, dp_shard, cp (innermost)
    rows = slice(data_rank * B // data_ranks, (data_rank + 1) * B // data_ranks)
    ids, labels, mask = ids[rows], labels[rows], mask[rows]
    if dims.cp == 1:
        return ids, labels, mask, None
    r = mesh.coordinate("cp")
    sid = shard_for_context_parallel(ids, dims.cp, r, layout=cp_layout)
    slab = shard_for_context_parallel(labels, dims.cp, r, layout=cp_layout)
    smask = shard_for_context_parallel(mask, dims.cp, r, layout=cp_layout)
    return sid.local, slab.local, smask.local * smask.valid, sid.positions


def train_step(model, opt, mesh, dims, batch) -> torch.Tensor:
    """One step on this rank's part of ``batch``; returns the global loss (token mean)."""
    ids, labels, mask, positions = local_batch(mesh, dims, batch)
    n_global = batch[2].sum()
    loss_sum = token_loss_sum(model(ids, positions=positions), labels, mask)
    # FSDP averages gradients over the dims.dp_size data ranks: scale the per-rank sum to get the global mean.
    (loss_sum * dims.dp_size / n_global).backward()
    total = loss_sum.detach().clone()
    dist.all_reduce(total)
    return total / n_global


def make(dims: ParallelDims, tied: bool, seed: int = 0, **kw):
    mesh = dims.build_mesh("cpu")
    model = parallelize_model(build(tied, seed), dims, mesh, **kw)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    return mesh, model, opt


def check_step(dims: ParallelDims, tied: bool = False, **kw):
    r = ref(tied)
    mesh, model, opt = make(dims, tied, **kw)
    loss = train_step(model, opt, mesh, dims, batches()[0])
    close(loss, r["loss"], "loss")
    names = set()
    for n, p in model.named_parameters():
        n = clean(n)
        names.add(n)
        close(full(p.grad), r["grads"][n], f"grad: {n}")
    assert names == set(r["grads"]), f"parameter names differ: {sorted(names ^ set(r['grads']))}"
    # global norm across the dense and the (efsdp, ep) meshes; max_norm above it, so the clip factor is 1.0
    close(clip_grad_norm_(model.parameters(), 1e6, dims), r["grad_norm"], "grad norm")
    opt.step()
    opt.zero_grad()
    for n, p in model.named_parameters():
        close(full(p.detach()), r["params"][clean(n)], f"param: {clean(n)}")
    return mesh, model, opt


# ------------------------------------------------------------------------------------------------ scenarios

CKPT: dict[str, Path] = {}


def hsdp_dp2_ep2():
    """dp_replicate=2 x dp_shard=2 (HSDP), ep=2 borrowed from dp_shard."""
    _, model, opt = check_step(ParallelDims(dp_replicate=2, dp_shard=2, ep=2))
    save(model, opt, "hsdp_dp2_ep2")


def dp2_cp2_ring():
    check_step(ParallelDims(dp_shard=2, cp=2), cp_method="ring")


def dp2_cp2_ep2_ulysses_ac():
    check_step(ParallelDims(dp_shard=2, cp=2, ep=2), cp_method="ulysses", activation_checkpointing=True)


def b20_tied_dp4_ep2():
    _, model, _ = check_step(ParallelDims(dp_shard=4, ep=2), tied=True)
    assert model.lm_head.weight is model.embed_tokens.weight, (
        "B20: the tie was broken by fully_shard or the step"
    )
    names = [n for n, _ in model.named_parameters()]
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names, names
    sd = model.state_dict()
    torch.testing.assert_close(full(sd["lm_head.weight"]), full(sd["embed_tokens.weight"]), atol=0, rtol=0)


def b20_meta_to_empty_tied_dp4_ep2():
    """B20's sequence: build on meta, fully_shard, to_empty, load the weights; then one step vs the reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    dims = ParallelDims(dp_shard=4, ep=2)
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = GlmMoeForCausalLM(config(True))
    parallelize_model(model, dims, mesh)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.embed_tokens.weight, "B20: to_empty broke the tie"
    set_model_state_dict(model, build(True).state_dict(), options=StateDictOptions(full_state_dict=True))
    assert model.lm_head.weight is model.embed_tokens.weight, "B20: loading broke the tie"
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    r = ref(True)
    close(train_step(model, opt, mesh, dims, batches()[0]), r["loss"], "loss")
    close(
        full(model.embed_tokens.weight.grad),
        r["grads"]["embed_tokens.weight"],
        "grad: tied embed_tokens.weight",
    )
    opt.step()
    for n, p in model.named_parameters():
        close(full(p.detach()), r["params"][clean(n)], f"param: {clean(n)}")
    assert model.lm_head.weight is model.embed_tokens.weight, "B20: the step broke the tie"
    unsharded = GlmMoeForCausalLM(config(True))
    unsharded.load_state_dict({k: full(v) for k, v in model.state_dict().items()})
    assert unsharded.lm_head.weight is unsharded.embed_tokens.weight
    close(
        unsharded.embed_tokens.weight.detach(),
        r["params"]["embed_tokens.weight"],
        "param: reloaded unsharded",
    )


def bf16_mixed_precision_dp2_cp2_ep2():
    """FSDP2 MixedPrecisionPolicy (bf16 compute, fp32 gradient reduction) through EP + CP: the step runs and stays
    close to the fp32 reference. bf16 keeps 8 significant bits (relative rounding 2**-9 = 2e-3 per op); through
    two layers and the loss that gives ~1e-2 relative error, so the bounds are 2e-2 on the loss and 5e-2 on the
    relative norm of the whole gradient vector (a wrong reduction factor or a missing CP/EP term is >= 0.3)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dims = ParallelDims(dp_shard=2, cp=2, ep=2)
    r = ref(False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh, model, opt = make(dims, False, mp_policy=mp)
    loss = train_step(model, opt, mesh, dims, batches()[0])
    rel_loss = abs(loss.item() - r["loss"].item()) / r["loss"].item()
    names = [clean(n) for n, _ in model.named_parameters()]
    got = torch.cat([full(p.grad).float().reshape(-1) for p in model.parameters()])
    want = torch.cat([r["grads"][n].reshape(-1) for n in names])
    rel_grad = ((got - want).norm() / want.norm()).item()
    MAX_ERR["bf16 relative loss"], MAX_ERR["bf16 relative grad norm"] = rel_loss, rel_grad
    assert all(p.dtype == torch.float32 for p in model.parameters()), "sharded parameters must stay fp32"
    assert rel_loss < 2e-2 and rel_grad < 5e-2, (rel_loss, rel_grad)


def save(model, opt, tag: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(CKPT["root"] / tag))


def resume(dims: ParallelDims, tag: str, **kw) -> None:
    """Fresh model (other seed) on ``dims``, load the checkpoint of another layout, then compare the next step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    r = ref(False)
    mesh, model, opt = make(dims, False, seed=123, **kw)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(CKPT["root"] / tag))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for n, p in model.named_parameters():
        close(full(p.detach()), r["params"][clean(n)], f"resumed param: {clean(n)}")
    loss2 = train_step(model, opt, mesh, dims, batches()[1])
    close(loss2, r["loss2"], "resumed next-step loss")
    opt.step()
    for n, p in model.named_parameters():
        close(full(p.detach()), r["params2"][clean(n)], f"resumed step-2 param: {clean(n)}")


def resume_dp4():
    resume(ParallelDims(dp_shard=4), "hsdp_dp2_ep2")


def resume_dp2_cp2_ep2():
    resume(ParallelDims(dp_shard=2, cp=2, ep=2), "hsdp_dp2_ep2")


def validation_errors():
    import pytest

    dims = ParallelDims(dp_shard=4)
    mesh = dims.build_mesh("cpu")
    dims_ep4 = ParallelDims(dp_shard=4, ep=4)
    torch.manual_seed(0)
    six_experts = GlmMoeForCausalLM(config(False).model_copy(update={"n_routed_experts": 6}))
    with pytest.raises(ValueError, match=r"ep=4 must divide n_routed_experts=6"):
        parallelize_model(six_experts, dims_ep4, dims_ep4.build_mesh("cpu"))
    with pytest.raises(ValueError, match=r"mesh was built for"):
        parallelize_model(build(False), ParallelDims(dp_shard=2, cp=2), mesh)
    with pytest.raises(ValueError, match=r"the product of the degrees must equal the world size"):
        ParallelDims(dp_shard=2).build_mesh("cpu")
    model = build(True)
    model.lm_head.weight = torch.nn.Parameter(model.embed_tokens.weight.detach().clone())
    with pytest.raises(ValueError, match=r"tie was broken.*re-tie"):
        parallelize_model(model, dims, mesh)


# ------------------------------------------------------------------------ glm_moe_dsa (GLM-5: MLA + DSA + MTP)

# S_DSA = 16 tokens per row > index_topk = 4, so from position 4 on each query attends to a strict subset of its
# causal keys chosen by the indexer (a CP rank that selected over its local keys only, or in local coordinates,
# gives O(1e-2) errors); 16 is a multiple of 2 * cp = 4, so the zigzag CP shards need no padding.
S_DSA, TOPK_DSA = 16, 4
MTP_WEIGHT = 0.3  # the MTP loss term's weight (any non-zero value; it makes the MTP gradients matter)


def dsa_config():
    from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

    # 4 indexer heads: a key scores exactly 0 only when all 4 ReLU terms are 0 (ties are broken by the lower
    # token index in both runs anyway)
    return GlmMoeDsaConfig.tiny_debug(index_topk=TOPK_DSA, index_n_heads=4)


def build_dsa(seed: int = 0):
    """Tiny GLM-5 (1 dense + 2 MoE layers, 1 MTP layer with its own MoE and indexer, 8 experts, top-2)."""
    from moe_rl.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(dsa_config())
    with torch.no_grad():
        for layer in [*model.layers, *model.mtp_layers]:
            if layer.is_moe:  # spread the router scores (no near-tie top-k choices) and use the noaux_tc bias
                layer.mlp.router.weight.normal_(0.0, 1.0)
                layer.mlp.router.e_score_correction_bias.normal_(0.0, 0.1)
        for p in model.indexer_parameters():  # spread the indexer scores (no near-tie key selections)
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    return model


def batches_dsa():
    g = torch.Generator().manual_seed(11)
    V_DSA = dsa_config().vocab_size
    ids = torch.randint(3, V_DSA, (B, S_DSA), generator=g)
    labels = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.int64)], dim=1)
    mask = torch.ones(B, S_DSA)
    mask[:, -1] = 0.0
    mask[1, :5] = 0.0  # a prompt with no loss
    return ids, labels, mask


def dsa_loss(model, ids, labels, mask, positions, n_main, n_mtp, mtp: bool):
    """``sum(main token losses) / n_main [+ MTP_WEIGHT * sum(depth-1 MTP token losses) / n_mtp]`` of the given
    rows/columns; the MTP logits at t predict token t + 2 = ``labels[t + 1]`` (mask ``mask[t + 1]``)."""
    if not mtp:
        return token_loss_sum(model(ids, positions=positions), labels, mask) / n_main
    out = model.forward_full(ids, positions=positions)
    mtp_sum = token_loss_sum(out.mtp_logits[0], labels[:, 1:], mask[:, 1:])
    return token_loss_sum(out.logits, labels, mask) / n_main + MTP_WEIGHT * mtp_sum / n_mtp


REF_DSA: dict[bool, dict] = {}


def ref_dsa(mtp: bool) -> dict:
    """Single-process reference of one AdamW step of :func:`build_dsa` on the full batch (``mtp``: with the MTP
    loss term). The DSA indexer runs under no_grad, so its parameters have no gradient (None) and AdamW leaves
    them unchanged."""
    if mtp not in REF_DSA:
        model = build_dsa()
        opt = torch.optim.AdamW(model.parameters(), **OPT)
        ids, labels, mask = batches_dsa()
        loss = dsa_loss(model, ids, labels, mask, None, mask.sum(), mask[:, 1:].sum(), mtp)
        loss.backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        got = [g.reshape(-1) for g in grads.values() if g is not None]
        opt.step()
        REF_DSA[mtp] = dict(
            loss=loss.detach(),
            grads=grads,
            # float64: one fp32 vector_norm over the ~2.8e5 gradient entries is off by ~2e-5 relative (measured
            # 4.6e-5 absolute), more than the sharded runs' per-parameter norms combined
            grad_norm=torch.linalg.vector_norm(torch.cat(got).double()).float(),
            params={n: p.detach().clone() for n, p in model.named_parameters()},
        )
    return REF_DSA[mtp]


def check_step_dsa(dims: ParallelDims, mtp: bool, **kw):
    """One step of the parallelized GLM-5 on this rank's rows/columns vs :func:`ref_dsa`: loss, every gradient
    (indexer parameters: None in both), the EP-aware clip norm and every updated parameter."""
    r = ref_dsa(mtp)
    mesh = dims.build_mesh("cpu")
    model = parallelize_model(build_dsa(), dims, mesh, **kw)
    from moe_rl.moe.ep import ExpertParallelMoE

    moe_layers = [layer for layer in [*model.layers, *model.mtp_layers] if layer.is_moe]
    assert len(moe_layers) == 3, len(moe_layers)  # 2 decoder MoE layers + the MTP layer's MoE
    # EP reached every MoE block, the MTP one included (a miss would still give correct values)
    for layer in moe_layers:
        assert isinstance(layer.mlp, ExpertParallelMoE), type(layer.mlp)
        assert "ep" in layer.mlp.experts.gate_up_proj.device_mesh.mesh_dim_names
    assert (model.cp_group is not None) == (dims.cp > 1)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    ids, labels, mask = batches_dsa()
    n_main, n_mtp = mask.sum(), mask[:, 1:].sum()
    lids, llabels, lmask, positions = local_batch(mesh, dims, (ids, labels, mask))
    if dims.cp > 1:  # the MTP term needs cp = 1 (its shift crosses CP shards; mtp_logits raises)
        assert not mtp
    else:  # the MTP labels of the last column are labels[:, S] = padding: mask[:, -1] = 0 covers them
        assert bool((mask[:, -1] == 0).all())
    loss = dsa_loss(model, lids, llabels, lmask, positions, n_main, n_mtp, mtp)
    (loss * dims.dp_size).backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    close(total, r["loss"], "dsa loss")
    names = set()
    for n, p in model.named_parameters():
        n = clean(n)
        names.add(n)
        if r["grads"][n] is None:
            assert p.grad is None, (
                f"{n}: the reference has no gradient (frozen DSA indexer) but this run has one"
            )
            assert ".self_attn.indexer." in n or (not mtp and n.startswith("mtp_layers.")), n
            continue
        close(full(p.grad), r["grads"][n], f"dsa grad: {n}")
    assert names == set(r["grads"]), f"parameter names differ: {sorted(names ^ set(r['grads']))}"
    assert any(".self_attn.indexer." in n for n in names)
    close(clip_grad_norm_(model.parameters(), 1e6, dims), r["grad_norm"], "dsa grad norm")
    opt.step()
    opt.zero_grad()
    for n, p in model.named_parameters():
        close(full(p.detach()), r["params"][clean(n)], f"dsa param: {clean(n)}")
    return mesh, model, (lids, positions)


def dsa_dp2_cp2_ep2_ac():
    """GLM-5 at dp_shard=2 x cp=2 with ep=2 borrowed from them: DSA all-gather CP, EP of the MoE layers (and of the
    MTP layer, built but unused: no MTP under CP), activation checkpointing (recompute re-runs the all-gathers)."""
    import pytest

    dims = ParallelDims(dp_shard=2, cp=2, ep=2)
    _, model, (lids, positions) = check_step_dsa(dims, mtp=False, activation_checkpointing=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"MTP under context parallelism is not supported"):
        model.forward_full(lids, positions=positions)


def dsa_mtp_dp4_ep2():
    """GLM-5 with the MTP loss at dp_shard=4, ep=2 (efsdp=2): FSDP of the MTP layer's forward modules as one
    group, enorm/hnorm/eh_proj/shared_head in the root group, forward_full as an FSDP forward method."""
    check_step_dsa(ParallelDims(dp_shard=4, ep=2), mtp=True)


def dsa_mtp_dp4_ep2_ac():
    """As :func:`dsa_mtp_dp4_ep2` with activation checkpointing (the MTP layer wrapped; its FSDP group inside)."""
    check_step_dsa(ParallelDims(dp_shard=4, ep=2), mtp=True, activation_checkpointing=True)


def dsa_validation_errors():
    import pytest

    dims = ParallelDims(dp_shard=2, cp=2)
    mesh = dims.build_mesh("cpu")
    with pytest.raises(ValueError, match=r"cp_method='ring'.*supports only 'dsa_allgather'"):
        parallelize_model(build_dsa(), dims, mesh, cp_method="ring")
    model = parallelize_model(build_dsa(), dims, mesh)
    ids = batches_dsa()[0][:1, :8]
    with pytest.raises(ValueError, match=r"context-parallel forward needs positions"):
        model(ids)


SCENARIOS = [
    hsdp_dp2_ep2,
    dp2_cp2_ring,
    dp2_cp2_ep2_ulysses_ac,
    b20_tied_dp4_ep2,
    b20_meta_to_empty_tied_dp4_ep2,
    resume_dp4,
    resume_dp2_cp2_ep2,
    bf16_mixed_precision_dp2_cp2_ep2,
    validation_errors,
    dsa_dp2_cp2_ep2_ac,
    dsa_mtp_dp4_ep2,
    dsa_mtp_dp4_ep2_ac,
    dsa_validation_errors,
]


def main() -> None:
    def setup(args: RankArgs) -> None:
        CKPT["root"] = args.out_dir / "ckpt"

    # DCP raises CheckpointException (a BaseException)
    run_rank_worker(SCENARIOS, started=_T0, extras={"_max_err": MAX_ERR}, setup=setup, catch=BaseException)


if __name__ == "__main__":
    main()
