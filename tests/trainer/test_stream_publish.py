"""publish_model_streaming writes exactly ``to_hf_state_dict(model.state_dict())`` (cast), in several shards with an
HF index, FP8-quantized like ``quantize_state_dict_fp8`` when asked; ShardedVersionWriter's folder protocol.
(The sharded, multi-rank case is covered by tests/entrypoints/test_cluster_trainer.py.)"""

import json

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.weights.filesystem import MARKER, ShardedVersionWriter, is_published, version_dir
from moe_rl.weights.streaming import publish_model_streaming


def _families():
    from moe_rl.models import GlmMoeConfig, GlmMoeDsaConfig, GlmMoeDsaForCausalLM, GlmMoeForCausalLM
    from moe_rl.models.glm4_moe.state_dict import to_hf_state_dict as hf4
    from moe_rl.models.glm_moe_dsa.state_dict import to_hf_state_dict as hf5

    return [(GlmMoeForCausalLM, GlmMoeConfig.tiny_debug(), hf4),
            (GlmMoeForCausalLM, GlmMoeConfig.tiny_debug(tie_word_embeddings=True), hf4),
            (GlmMoeDsaForCausalLM, GlmMoeDsaConfig.tiny_debug(), hf5)]


def _read(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        part = load_file(str(folder / f))
        assert all(index["weight_map"][k] == f for k in part)
        out.update(part)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


@pytest.mark.parametrize("fam", range(3))
def test_equals_to_hf_state_dict_in_shards(tmp_path, fam):
    cls, cfg, to_hf = _families()[fam]
    torch.manual_seed(fam)
    model = cls(cfg)
    rep = publish_model_streaming(model, cfg, tmp_path, 3, {"x": 1}, dtype=torch.bfloat16, max_shard_bytes=20_000)
    folder = version_dir(tmp_path, 3)
    assert is_published(tmp_path, 3) and rep["shards"] >= 3
    got = _read(folder)
    from moe_rl.models.hf_io import keeps_fp32

    ref = {k: v if keeps_fp32(k) else v.to(torch.bfloat16) for k, v in to_hf(model.state_dict(), cfg).items()}
    assert set(got) == set(ref)
    for k in ref:  # bit-equal: the same element-wise cast of the same values (streaming changes only the order)
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    assert any(keeps_fp32(k) and got[k].dtype == torch.float32 for k in got)  # the router bias stayed fp32
    assert json.loads((folder / "config.json").read_text()) == {"x": 1}


def test_fp8_matches_quantize_state_dict(tmp_path):
    from moe_rl.weights.fp8 import quantize_state_dict_fp8

    cls, cfg, to_hf = _families()[0]
    torch.manual_seed(0)
    model = cls(cfg)
    publish_model_streaming(model, cfg, tmp_path, 1, {}, dtype=torch.bfloat16, quantize_fp8=True)
    got = _read(version_dir(tmp_path, 1))
    from moe_rl.models.hf_io import keeps_fp32

    ref, report = quantize_state_dict_fp8({k: v if keeps_fp32(k) else v.to(torch.bfloat16)
                                           for k, v in to_hf(model.state_dict(), cfg).items()})
    assert report["quantized"] > 0 and set(got) == set(ref)
    for k in ref:  # bit-equal: the same per-block amax, scale and cast on the same bf16 values
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k].view(torch.uint8) if got[k].element_size() == 1
                                                             else got[k], ref[k].view(torch.uint8)
                                                             if ref[k].element_size() == 1 else ref[k]), k


def test_writer_protocol(tmp_path):
    w = ShardedVersionWriter(tmp_path, 0, {}, max_shard_bytes=1)
    w.add("a", torch.zeros(2))
    with pytest.raises(ValueError, match="added twice"):
        w.add("a", torch.zeros(2))
    assert not (version_dir(tmp_path, 0) / MARKER).exists()  # nothing visible before finish()
    w.finish()
    assert is_published(tmp_path, 0)
    with pytest.raises(ValueError, match="already published"):
        ShardedVersionWriter(tmp_path, 0, {})
    with pytest.raises(ValueError, match="max_shard_bytes"):
        ShardedVersionWriter(tmp_path, 1, {}, max_shard_bytes=0)
