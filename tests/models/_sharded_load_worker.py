"""One rank of the sharded-checkpoint-load tests (launched once per rank by ``tests/models/test_sharded_load.py``).

Rank 0 writes four Hugging Face checkpoints split over several safetensors files + index (tiny GLM-4.5 untied,
tied, and with 2 experts, fp32; tiny GLM-5 with one MTP layer, stored bf16 so the load also casts). Then every scenario builds the model on the meta
device, applies :func:`parallelize_model` for one layout, ``to_empty(cpu)``, :func:`load_sharded_hf_checkpoint`,
and compares with the single-process reference ``model.load_state_dict(load_hf_state_dict(path))``:

* every state-dict tensor's ``full_tensor()`` bit-exactly (the loader only copies and casts, as the reference);
* one forward (and, for GLM-5, the MTP logits) on the same ids: at most 1e-6 abs. The parallel forward differs
  from the reference only in summation order (EP combine, CP merge), a few fp32 ulps of O(1) logits (~1e-7);
* the bytes read: summed over ranks they are exactly the checkpoint's used bytes plus (world - 1) copies of the
  replicated buffers (every parameter is partitioned over all ranks in these layouts, buffers are replicated),
  and each rank read at most ``used / world`` plus its uneven-shard and buffer slack.

Writes ``{scenario: "ok" | traceback, "_seconds": {...}, "_stats": {...}}`` to ``<out>/rank<r>.json``.

Usage: ``python _sharded_load_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tolerance helpers
from _tiny_glm import glm4_micro  # noqa: E402
from _tolerance import assert_normwise_close, decoder_chain  # noqa: E402

_T0 = time.perf_counter()
torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
STATS: dict[str, dict] = {}


def glm4_config(tied: bool = False, experts: int = 4):
    """Tiny GLM-4.5 (1 dense + 2 MoE layers); vocab 30 makes the embedding / head FSDP shards uneven at 4 ranks
    (8, 8, 8, 6 rows); ``experts=2`` at dp_shard=4 x ep=2 gives 1 local expert over efsdp=2, so FSDP shards the
    experts' dim 1 (``Shard(1)``)."""
    return glm4_micro(vocab_size=30, n_routed_experts=experts, num_hidden_layers=3, tie_word_embeddings=tied)


def dsa_config():
    from moe_rl.models.glm_moe_dsa import GlmMoeDsaConfig

    return GlmMoeDsaConfig.tiny_debug(index_topk=4, index_n_heads=4)


def reference_model(cfg, seed: int = 0):
    """The model with random weights (router weights and correction bias spread, so a wrong expert row or a
    zero bias changes the routing and the logits)."""
    from moe_rl.models.glm4_moe import GlmMoeConfig, GlmMoeForCausalLM
    from moe_rl.models.glm_moe_dsa import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeForCausalLM(cfg) if isinstance(cfg, GlmMoeConfig) else GlmMoeDsaForCausalLM(cfg)
    with torch.no_grad():
        for layer in [*model.layers, *getattr(model, "mtp_layers", [])]:
            if layer.is_moe:
                layer.mlp.router.weight.normal_(0.0, 1.0)
                layer.mlp.router.e_score_correction_bias.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.normal_(1.0, 0.1)  # not all ones / zeros: a skipped tensor would show
    return model


def write_sharded(model, cfg, out: Path, dtype: torch.dtype, n_files: int) -> Path:
    """Save ``model`` in HF format, then split ``model.safetensors`` into ``n_files`` files + index."""
    from safetensors.torch import load_file, save_file

    from moe_rl.models.glm4_moe import GlmMoeConfig
    from moe_rl.models.glm4_moe import save_hf_checkpoint as save4
    from moe_rl.models.glm_moe_dsa import save_hf_checkpoint as save5

    (save4 if isinstance(cfg, GlmMoeConfig) else save5)(model, cfg, out, dtype)
    single = out / "model.safetensors"
    tensors = load_file(str(single))
    keys = sorted(tensors)
    weight_map = {}
    for i in range(n_files):
        name = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::n_files]}  # interleaved: every layer spans several files
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    single.unlink()
    return out


def ckpt_dir(kind: str) -> Path:
    return CKPT["root"] / kind


CKPT: dict[str, Path] = {}
CONFIGS = {
    "glm4": lambda: glm4_config(False),
    "glm4_tied": lambda: glm4_config(True),
    "glm4_e2": lambda: glm4_config(False, experts=2),
    "dsa": dsa_config,
}
STORE = {"glm4": torch.float32, "glm4_tied": torch.float32, "glm4_e2": torch.float32, "dsa": torch.bfloat16}


def write_all(root: Path) -> None:
    for kind, make in CONFIGS.items():
        cfg = make()
        write_sharded(reference_model(cfg), cfg, root / kind, STORE[kind], n_files=3 if kind != "dsa" else 4)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check(kind: str, dims_kw: dict, *, ac: bool = False, expert_shard_dim: int | None = None) -> None:
    from safetensors import safe_open

    from moe_rl.distributed.parallel_dims import ParallelDims
    from moe_rl.distributed.parallelize import parallelize_model, shard_for_context_parallel
    from moe_rl.models.glm4_moe import load_hf_state_dict as load4
    from moe_rl.models.glm_moe_dsa import load_hf_state_dict as load5
    from moe_rl.models.hf_io import strip_wrappers
    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint

    cfg = CONFIGS[kind]()
    dsa = kind == "dsa"
    path = ckpt_dir(kind)
    dims = ParallelDims(**dims_kw)
    mesh = dims.build_mesh("cpu")
    model = build_on_meta(cfg)
    parallelize_model(model, dims, mesh, activation_checkpointing=ac)
    model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight, "B20: to_empty broke the tie"
    stats = load_sharded_hf_checkpoint(model, path, cfg)
    placements = model.layers[1].mlp.experts.gate_up_proj.placements
    if expert_shard_dim is not None:  # the layout this scenario is meant to exercise
        assert [getattr(p, "dim", None) for p in placements] == [expert_shard_dim, 0], placements

    ref = reference_model(cfg, seed=123)  # other random weights, then the checkpoint's
    ref.load_state_dict((load5 if dsa else load4)(path, cfg))
    ref_sd = ref.state_dict()
    sd = {strip_wrappers(k): v for k, v in model.state_dict().items()}
    assert set(sd) == set(ref_sd), sorted(set(sd) ^ set(ref_sd))
    for k, v in sd.items():
        got = full(v.detach())
        assert got.dtype == ref_sd[k].dtype and torch.equal(got, ref_sd[k]), f"{k} differs from the reference"

    # bytes: every parameter is partitioned over all ranks, buffers are replicated
    buffers = {k for k, _ in ref.named_buffers()}
    if dsa:
        from moe_rl.models.glm_moe_dsa.state_dict import hf_key_ignored

        def ignored(key):
            return hf_key_ignored(key, cfg, with_mtp=True)
    else:
        from moe_rl.models.glm4_moe.state_dict import hf_key_ignored

        def ignored(key):
            return hf_key_ignored(key, cfg)

    itemsize = {"F32": 4, "BF16": 2}
    used = 0
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():  # noqa: SIM118
                sl = fh.get_slice(key)
                if not ignored(key):
                    used += math.prod(sl.get_shape()) * itemsize[sl.get_dtype()]
    buf_bytes = sum(ref_sd[k].numel() * ref_sd[k].element_size() for k in buffers)
    world = dist.get_world_size()
    total = torch.tensor([stats.bytes_read])
    dist.all_reduce(total)
    assert total.item() == used + (world - 1) * buf_bytes, (total.item(), used, buf_bytes)
    slack = buf_bytes + sum(
        (t.numel() // t.shape[0]) * STORE[kind].itemsize * 2 for k, t in ref_sd.items() if k not in buffers
    )  # uneven dim-0 shards: at most one extra row per tensor (x2 for the stacked experts' two dims)
    assert stats.bytes_read <= used / world + slack, (stats.bytes_read, used / world, slack)
    assert stats.bytes_read < used * 0.75, (stats.bytes_read, used)
    assert 1 <= stats.files_opened <= len(files)
    STATS[f"{kind}_{'_'.join(f'{k}{v}' for k, v in dims_kw.items())}"] = {
        "bytes_read": stats.bytes_read,
        "used": used,
        "tensors_read": stats.tensors_read,
        "files_opened": stats.files_opened,
        "headers_read": stats.headers_read,
        "expert_placements": str(placements),
    }

    # forward on the same ids as the reference
    torch.manual_seed(7)
    ids = torch.randint(1, cfg.vocab_size, (2, 16))
    # the sharded model and the reference: two fp32 paths of the same decoder (other GEMM shapes and orders under
    # FSDP / EP / CP): per-tensor normwise chain bound, doubled (tests/_tolerance.py); a weight loaded into the
    # wrong shard or expert changes the logits by O(1) relative
    k, depth = decoder_chain(cfg, ids.numel())
    with torch.no_grad():
        if dims.cp > 1:
            shard = shard_for_context_parallel(ids, dims.cp, mesh.coordinate("cp"))
            out = model(shard.local, positions=shard.positions)
            want = ref(ids)[:, shard.positions[shard.valid]]
            out = out[:, shard.valid]
            assert_normwise_close(out, want, dtype=torch.float32, k=k, depth=2 * depth, what="cp logits")
        elif dsa:
            out, want = model.forward_full(ids), ref.forward_full(ids)
            assert_normwise_close(out.logits, want.logits, dtype=torch.float32, k=k, depth=2 * depth, what="logits")
            assert len(want.mtp_logits) == 1
            assert_normwise_close(out.mtp_logits[0], want.mtp_logits[0], dtype=torch.float32, k=k,
                                  depth=2 * depth + 16, what="mtp logits")  # + the MTP layer's reductions
        else:
            assert_normwise_close(model(ids), ref(ids), dtype=torch.float32, k=k, depth=2 * depth, what="logits")


SCENARIOS_2 = {
    "glm4_dp2": lambda: check("glm4", {"dp_shard": 2}),
    "glm4_tied_dp2_ep2_ac": lambda: check("glm4_tied", {"dp_shard": 2, "ep": 2}, ac=True),
    "dsa_mtp_dp2_ep2": lambda: check("dsa", {"dp_shard": 2, "ep": 2}),
}
SCENARIOS_4 = {
    "glm4_dp4_ep2_ac": lambda: check("glm4", {"dp_shard": 4, "ep": 2}, ac=True, expert_shard_dim=0),
    "glm4_dp2_cp2_ep2": lambda: check("glm4", {"dp_shard": 2, "cp": 2, "ep": 2}),
    "glm4_tied_dp4_ep4": lambda: check("glm4_tied", {"dp_shard": 4, "ep": 4}),
    "glm4_e2_dp4_ep2_shard1": lambda: check("glm4_e2", {"dp_shard": 4, "ep": 2}, expert_shard_dim=1),
    "dsa_mtp_dp4_ep2_ac": lambda: check("dsa", {"dp_shard": 4, "ep": 2}, ac=True),
}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the launch_ranks protocol
    from _rank_worker import run_rank_worker

    def setup(args) -> None:
        CKPT["root"] = args.out_dir / "ckpt"
        if args.rank == 0:
            write_all(CKPT["root"])
        dist.barrier()

    run_rank_worker(lambda world: SCENARIOS_2 if world == 2 else SCENARIOS_4, started=_T0, extras={"_stats": STATS},
                    setup=setup, catch=BaseException, barrier_after_each=True)


if __name__ == "__main__":
    main()
