"""Sharded Hugging Face checkpoint load (:mod:`moe_rl.models.sharded_load`) into meta-built, parallelized models.

Tier 1 (one process): a plain model built on meta and loaded equals ``load_state_dict(load_hf_state_dict(...))``
bit for bit (both families, single file and sharded index); the errors for a missing tensor, an unused tensor,
a wrong shape, a model left on meta.

Tier 2 (gloo; ``tests/models/_sharded_load_worker.py``, the checks are described there): 2 ranks (dp_shard=2;
dp_shard=2 x ep=2 with tied embeddings and activation checkpointing; GLM-5 + MTP at dp_shard=2 x ep=2) and 4 ranks
(dp_shard=4 x ep=2 with AC, uneven embedding shards, experts ``(_StridedShard(0), Shard(0))``; dp_shard=2 x cp=2
x ep=2 ring; tied dp_shard=4 x ep=4; 2 experts at dp_shard=4 x ep=2, experts ``(Shard(1), Shard(0))``; GLM-5 +
MTP at dp_shard=4 x ep=2 with AC): every gathered tensor bit-exact against the single-process load, forward (and
MTP logits) within 1e-6, and each rank reads about its 1/world share of the checkpoint bytes (the sum over ranks
is exact). Runtime on the shared 2-core machine: ~45 s for the file.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_sharded_load_worker.py")
TIMEOUT_S = 240


def _worker_module():
    spec = importlib.util.spec_from_file_location("_sharded_load_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


W = _worker_module()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    W.write_all(root)
    return root


# ------------------------------------------------------------------------------- tier 1: one process


@pytest.mark.parametrize("kind", ["glm4", "glm4_tied", "dsa"])
def test_single_process_load_matches_load_state_dict(ckpts, kind):
    from moe_rl.models.glm4_moe import load_hf_state_dict as load4
    from moe_rl.models.glm_moe_dsa import load_hf_state_dict as load5
    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint

    cfg = W.CONFIGS[kind]()
    path = ckpts / kind
    model = build_on_meta(cfg)
    stats = load_sharded_hf_checkpoint(model, path, cfg, device="cpu")
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight  # B20: re-tied after to_empty
    ref = W.reference_model(cfg, seed=5)
    ref.load_state_dict((load5 if kind == "dsa" else load4)(path, cfg))
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    files = sorted(path.glob("*.safetensors"))
    assert stats.files_opened == len(files) >= 3
    ids = torch.randint(1, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=0, rtol=0)  # same weights, same ops: bitwise


def test_single_file_checkpoint(tmp_path):
    from moe_rl.models.glm4_moe import save_hf_checkpoint
    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint

    cfg = W.glm4_config()
    ref = W.reference_model(cfg)
    save_hf_checkpoint(ref, cfg, tmp_path)
    model = build_on_meta(cfg)
    stats = load_sharded_hf_checkpoint(model, tmp_path, device="cpu")
    assert stats.files_opened == 1
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def _rewrite(path: Path, key: str, new: torch.Tensor | None) -> str:
    """Replace (or, with None, drop) ``key`` in its file and the index; returns the file name."""
    from safetensors.torch import load_file, save_file

    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    fname = index["weight_map"][key]
    tensors = load_file(str(path / fname))
    if new is None:
        del tensors[key], index["weight_map"][key]
        index_file.write_text(json.dumps(index))
    else:
        tensors[key] = new
    save_file(tensors, str(path / fname))
    return fname


def _copy(ckpts: Path, kind: str, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(ckpts / kind, tmp_path / kind))


def _assert_load_fails(path: Path, cfg, match: str) -> None:
    """Loading the checkpoint at ``path`` into a meta-built model of ``cfg`` raises ValueError matching ``match``."""
    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint

    with pytest.raises(ValueError, match=match):
        load_sharded_hf_checkpoint(build_on_meta(cfg), path, device="cpu")


def test_missing_tensor_raises(ckpts, tmp_path):
    path = _copy(ckpts, "glm4", tmp_path)
    _rewrite(path, "model.layers.2.mlp.experts.3.up_proj.weight", None)
    _assert_load_fails(path, W.glm4_config(), r"lacks 1 tensor.*model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight")


def test_index_names_a_key_its_file_lacks(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(ckpts, "glm4", tmp_path)
    key = "model.norm.weight"
    fname = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(str(path / fname))
    del tensors[key]
    save_file(tensors, str(path / fname))
    _assert_load_fails(path, W.glm4_config(), rf"model\.norm\.weight \(for norm\.weight of the model\) is listed in "
                       rf"the index of .* under {fname}, but .* does not contain it")


def test_wrong_shape_raises(ckpts, tmp_path):
    path = _copy(ckpts, "dsa", tmp_path)
    key = "model.layers.1.mlp.experts.5.down_proj.weight"  # [D, F] = [64, 32]
    fname = _rewrite(path, key, torch.zeros(64, 31, dtype=torch.bfloat16))
    _assert_load_fails(path, W.dsa_config(), rf"{key} in .*{fname} has shape \(64, 31\), but "
                       r"layers\.1\.mlp\.experts\.down_proj of the model needs \(64, 32\)")


def test_unused_tensor_and_config_mismatch_raise(ckpts, tmp_path):
    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint

    path = _copy(ckpts, "glm4", tmp_path)
    _rewrite(path, "model.norm.weight", None)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    fname = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = fname
    index["weight_map"]["model.extra.weight"] = fname
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_load_fails(path, W.glm4_config(), r"1 tensor\(s\) the model does not use.*model\.extra\.weight")
    # a model with more experts than the checkpoint: the missing experts are named
    with pytest.raises(ValueError, match=r"lacks 24 tensor.*experts\.4\."):
        cfg = W.glm4_config().model_copy(update={"n_routed_experts": 8})
        load_sharded_hf_checkpoint(build_on_meta(cfg), ckpts / "glm4", cfg, device="cpu")


def test_model_left_on_meta_raises(ckpts):
    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint

    with pytest.raises(ValueError, match=r"meta device; call model\.to_empty"):
        load_sharded_hf_checkpoint(build_on_meta(W.glm4_config()), ckpts / "glm4")
    with pytest.raises(TypeError, match=r"cfg must be a GlmMoeDsaConfig"):
        load_sharded_hf_checkpoint(
            build_on_meta(W.dsa_config()), ckpts / "dsa", W.glm4_config(), device="cpu"
        )


# ---------------------------------------------------------------------------------- tier 2: gloo


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_ranks):
    results = launch_ranks(WORKER, 2, tmp_path_factory.mktemp("sl2"), TIMEOUT_S)
    print("\nseconds:", results[0]["_seconds"], "\nstats:", results[0].get("_stats"))
    return results


@pytest.fixture(scope="module")
def world4(tmp_path_factory, launch_ranks):
    results = launch_ranks(WORKER, 4, tmp_path_factory.mktemp("sl4"), TIMEOUT_S)
    print("\nseconds:", results[0]["_seconds"], "\nstats:", results[0].get("_stats"))
    return results


@pytest.mark.parametrize("scenario", list(W.SCENARIOS_2))
def test_two_ranks(world2, check_scenario, scenario):
    check_scenario(world2, scenario)


@pytest.mark.parametrize("scenario", list(W.SCENARIOS_4))
def test_four_ranks(world4, check_scenario, scenario):
    check_scenario(world4, scenario)
