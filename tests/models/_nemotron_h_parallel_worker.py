"""One rank of ``tests/models/test_nemotron_h_parallel.py``: NemotronHForCausalLM under
:func:`moe_rl.distributed.parallelize.parallelize_model` on 2 or 4 gloo ranks against the single-process model.

Each scenario builds the tiny hybrid model (pattern ``ME*EM-``: Mamba-2, latent MoE, attention, MLP; same seed on
every rank), parallelizes it for one layout, runs forward and backward on this rank's part of the batch (its rows
and, under CP, its contiguous columns) and compares this rank's logits, the global loss and every gathered
gradient with the full model on the full batch (:func:`_tolerance.assert_normwise_close` with the decoder chain of
forward + backward, twice: each path is within the bound of the exact result). ``*_r3`` scenarios replay a fixed
routing (not the model's own) in every MoE layer, sharded like the ids.

Usage: ``python _nemotron_h_parallel_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

_T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from _glm_parity import random_ids, randomize_for_parity  # noqa: E402
from _rank_worker import run_rank_worker  # noqa: E402
from _tolerance import assert_normwise_close, decoder_chain  # noqa: E402

from moe_rl.distributed.parallel_dims import ParallelDims  # noqa: E402
from moe_rl.distributed.parallelize import parallelize_model, shard_for_context_parallel  # noqa: E402
from moe_rl.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM  # noqa: E402

torch.set_num_threads(1)
B, S = 2, 16  # S a multiple of cp = 4, Sl >= conv_kernel - 1 = 3 tokens per CP rank, chunk_size 4 < Sl
CFGS = {
    "latent": NemotronHConfig.tiny_debug(n_routed_experts=4),
    # no latent projections (experts on the hidden width), lm_head tied to the embedding: one root parameter
    "tied_no_latent": NemotronHConfig.tiny_debug(n_routed_experts=4, moe_latent_size=None, tie_word_embeddings=True),
}
CFG = CFGS["latent"]  # sizes shared by both
LAYOUT = NemotronHForCausalLM.cp_layout


def build(cfg: str = "latent") -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(CFGS[cfg])
    randomize_for_parity(model, seed=11)
    return model


def batch(seq: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(CFG.vocab_size, B, S + 1)[:, :seq + 1]
    return ids[:, :-1], ids[:, 1:]


def routing(seq: int = S) -> torch.Tensor:
    """``[B, S, L, K]`` distinct expert ids per token and layer, drawn independently of the model (so replay changes
    which experts run, and equal results mean the replayed ids reached every rank's MoE)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.rand(B, S, CFG.num_hidden_layers, CFG.n_routed_experts, generator=gen)
    return keys.argsort(dim=-1)[:, :seq, :, :CFG.num_experts_per_tok]


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


_REF: dict[tuple[str, bool, int], dict] = {}


def reference(cfg: str, replay: bool, seq: int) -> dict:
    key = (cfg, replay, seq)
    if key not in _REF:
        model = build(cfg)
        ids, labels = batch(seq)
        logits = model(ids, replay_ids=routing(seq) if replay else None)
        loss = loss_sum(logits, labels) / ids.numel()
        loss.backward()
        _REF[key] = dict(logits=logits.detach(), loss=loss.detach(),
                         grads={n: p.grad.clone() for n, p in model.named_parameters()})
        if replay:  # the replayed routing is not the model's own: it changes the result
            assert not torch.allclose(_REF[key]["logits"], reference(cfg, False, seq)["logits"], rtol=1e-3,
                                      atol=1e-3)
    return _REF[key]


def check(dims: ParallelDims, *, replay: bool = False, cfg: str = "latent", logprobs: bool = False, seq: int = S,
          meta: bool = False, **kw) -> None:
    """``logprobs``: the loss from the FSDP forward method ``token_logprobs`` (chunked head) instead of the logits.
    ``seq``: tokens per row; one that cp does not divide pads every row at its end (padding columns get label -100
    and pad routing, and are left out of the comparison). ``meta``: build on the meta device, parallelize,
    ``to_empty`` and load the full state dict (the large-model sequence)."""
    ref = reference(cfg, replay, seq)
    mesh = dims.build_mesh("cpu")
    if meta:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        with torch.device("meta"):
            model = NemotronHForCausalLM(CFGS[cfg])
        parallelize_model(model, dims, mesh, **kw)
        model.to_empty(device="cpu")
        assert model.lm_head.weight is model.embeddings.weight or not CFGS[cfg].tie_word_embeddings
        set_model_state_dict(model, build(cfg).state_dict(), options=StateDictOptions(full_state_dict=True))
    else:
        model = parallelize_model(build(cfg), dims, mesh, **kw)
    assert (model.cp_group is not None) == (dims.cp > 1)
    ids, labels = batch(seq)
    replay_ids = routing(seq) if replay else None
    data_rank, data_ranks = mesh.data_rank, dims.dp_replicate * dims.dp_shard
    rows = slice(data_rank * B // data_ranks, (data_rank + 1) * B // data_ranks)
    ids, labels = ids[rows], labels[rows]
    replay_ids = None if replay_ids is None else replay_ids[rows]
    ref_logits = ref["logits"][rows]
    positions, valid = None, slice(None)
    if dims.cp > 1:
        r = mesh.coordinate("cp")
        sid = shard_for_context_parallel(ids, dims.cp, r, layout=LAYOUT)
        ids, positions, valid = sid.local, sid.positions, sid.valid
        labels = shard_for_context_parallel(labels, dims.cp, r, layout=LAYOUT, pad_value=-100).local
        if replay_ids is not None:
            replay_ids = shard_for_context_parallel(replay_ids, dims.cp, r, layout=LAYOUT, pad_value=-1).local
        ref_logits = ref_logits[:, positions[valid]]
    if logprobs:
        with torch.no_grad():
            logits = model(ids, positions=positions, replay_ids=replay_ids)
        lp = model.token_logprobs(ids, labels.clamp(min=0), chunk_tokens=5, positions=positions, replay_ids=replay_ids)
        local = -(lp * (labels >= 0)).sum()
    else:
        logits = model(ids, positions=positions, replay_ids=replay_ids)
        local = loss_sum(logits, labels)
    logits = logits[:, valid]
    (local * dims.dp_size / (B * seq)).backward()
    total = local.detach().clone()
    dist.all_reduce(total)
    # every collective (the gradients' all-gathers) before any assertion, so a mismatch on one rank is reported by
    # this scenario instead of desynchronizing the ranks' collectives
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
             else p.grad for n, p in model.named_parameters()}
    k, depth = decoder_chain(CFG, B * seq, backward=True)
    k_fwd, depth_fwd = decoder_chain(CFG, B * seq)
    assert_normwise_close(logits.detach(), ref_logits, dtype=torch.float32, k=k_fwd, depth=2 * depth_fwd,
                          what="local logits")
    assert_normwise_close(total / (B * seq), ref["loss"], dtype=torch.float32, k=k, depth=2 * depth, what="loss")
    assert set(grads) == set(ref["grads"]), sorted(set(grads) ^ set(ref["grads"]))
    for n, g in grads.items():
        assert_normwise_close(g, ref["grads"][n], dtype=torch.float32, k=k, depth=2 * depth, what=f"grad {n}")


def fsdp2():
    check(ParallelDims(dp_shard=2))


def dp2_ep2_r3():
    check(ParallelDims(dp_shard=2, ep=2), replay=True)


def cp2_ring_ac():
    check(ParallelDims(cp=2), cp_method="ring", activation_checkpointing=True)


def cp2_ulysses_ep2():
    check(ParallelDims(cp=2, ep=2), cp_method="ulysses")


def cp2_ring_r3_logprobs():
    check(ParallelDims(cp=2), replay=True, logprobs=True)


def cp2_ring_padded():
    check(ParallelDims(cp=2), seq=S - 1, replay=True)


def dp2_ep2_tied_no_latent_meta():
    check(ParallelDims(dp_shard=2, ep=2), cfg="tied_no_latent", meta=True)


def validation_errors():
    import pytest

    dims = ParallelDims(cp=2)
    mesh = dims.build_mesh("cpu")
    with pytest.raises(ValueError, match=r"cp_method='dsa_allgather'.*'ring' or 'ulysses'"):
        parallelize_model(build(), dims, mesh, cp_method="dsa_allgather")
    with pytest.raises(TypeError, match=r"must be a NemotronHForCausalLM"):
        from moe_rl.models.nemotron_h.parallelize import parallelize_nemotron_h

        parallelize_nemotron_h(torch.nn.Linear(2, 2), dims, mesh)
    broken = build("tied_no_latent")
    broken.lm_head.weight = torch.nn.Parameter(broken.lm_head.weight.detach().clone())
    with pytest.raises(ValueError, match=r"lm_head.weight is not embeddings.weight.*re-tie"):
        parallelize_model(broken, dims, mesh)
    model = parallelize_model(build(), dims, mesh)
    ids = batch()[0]
    r = mesh.coordinate("cp")
    with pytest.raises(ValueError, match=r"context-parallel forward needs positions"):
        model(ids[:, :8])
    zig = shard_for_context_parallel(ids, 2, r, layout="zigzag")
    with pytest.raises(ValueError, match=r"not the contiguous slice.*layout='contiguous'"):
        model(zig.local, positions=zig.positions)
    cont = shard_for_context_parallel(ids, 2, r, layout="contiguous")
    with pytest.raises(ValueError, match=r"cu_seqlens .* not supported under context parallelism"):
        model(cont.local[:1], positions=cont.positions, cu_seqlens=[0, 3, 8])


def cp4_ring():
    check(ParallelDims(cp=4), cp_method="ring")


def dp2_cp2_ep2_ulysses_r3():
    check(ParallelDims(dp_shard=2, cp=2, ep=2), cp_method="ulysses", replay=True, activation_checkpointing=True)


def scenarios(world: int) -> list:
    if world == 2:
        return [fsdp2, dp2_ep2_r3, cp2_ring_ac, cp2_ulysses_ep2, cp2_ring_r3_logprobs, cp2_ring_padded,
                dp2_ep2_tied_no_latent_meta, validation_errors]
    return [cp4_ring, dp2_cp2_ep2_ulysses_r3]


if __name__ == "__main__":
    run_rank_worker(scenarios, started=_T0)
