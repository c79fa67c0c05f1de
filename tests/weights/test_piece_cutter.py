"""``moe_rl.weights.regions.PieceCutter``: the publishers' cut of a model into pieces, planned once and reused while
the model's layout is unchanged. Its pieces must equal :func:`local_pieces`'s (keys, order, dtypes, bits) after every
in-place update, and any change of the layout (a parameter replaced, ``.data`` reassigned, another model) must
rebuild the plan rather than publish stale tensors. The FSDP2 case (DTensor shards on 2 ranks, in-place updates
between versions, bit-exact pulls) runs in ``test_p2p.py`` through ``P2PPublisher``, which cuts with it."""

import pytest
import torch

from moe_rl.models.glm4_moe.config import GlmMoeConfig
from moe_rl.models.glm4_moe.model import GlmMoeForCausalLM
from moe_rl.weights.regions import PieceCutter, local_pieces


def _model(seed: int = 3) -> tuple[GlmMoeForCausalLM, GlmMoeConfig]:
    cfg = GlmMoeConfig.tiny_debug(vocab_size=40, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  head_dim=8, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4,
                                  num_experts_per_tok=2)
    torch.manual_seed(seed)
    return GlmMoeForCausalLM(cfg), cfg


def _same(a: list, b: list) -> None:
    assert [p.key for p in a] == [p.key for p in b]
    for x, y in zip(a, b, strict=True):
        assert x.tensor.dtype == y.tensor.dtype and x.tensor.shape == y.tensor.shape, x.key
        # bit equality: the same elements cast the same way (no arithmetic, so no tolerance)
        assert torch.equal(x.tensor.reshape(-1).view(torch.uint8), y.tensor.reshape(-1).view(torch.uint8)), x.key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cutter_equals_local_pieces_across_in_place_updates(dtype):
    model, cfg = _model()
    cut = PieceCutter(cfg, dtype)
    for step in range(3):
        _same(cut(model), list(local_pieces(model, cfg, dtype)))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0625).add_(0.125 * (step + 1))  # an optimizer step, in place
    assert cut.builds == 1  # planned once, reused while the layout stayed the same


def test_cutter_rebuilds_when_the_layout_changes():
    model, cfg = _model()
    cut = PieceCutter(cfg, torch.float32)
    cut(model)
    name, param = next(iter(model.named_parameters()))
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    attr = name.rsplit(".", 1)[1]
    setattr(owner, attr, torch.nn.Parameter(param.detach() + 7.0))  # a parameter replaced
    _same(cut(model), list(local_pieces(model, cfg, torch.float32)))
    assert cut.builds == 2
    w = getattr(owner, attr)
    w.data = w.detach() - 3.0  # same Parameter object, new storage
    _same(cut(model), list(local_pieces(model, cfg, torch.float32)))
    assert cut.builds == 3
    other, _ = _model(seed=4)  # another model: its own plan
    _same(cut(other), list(local_pieces(other, cfg, torch.float32)))
    assert cut.builds == 4
    cut(other)
    assert cut.builds == 4
