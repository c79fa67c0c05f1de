"""The Mamba-2 mixer (:class:`moe_rl.ssm.Mamba2Mixer`) against transformers' ``Mamba2Mixer`` and
``NemotronHMamba2Mixer`` (their PyTorch path: no ``mamba_ssm`` / ``causal_conv1d`` kernels are installed) on tiny
configs with copied weights: the state dict loads with ``strict=True`` (same names and shapes), outputs and every
parameter and input gradient agree.

Tolerances: two fp32 paths of the same reductions in other orders (``tests/_tolerance.py``): the output at the
issue's ``atol 1e-5`` (outputs are O(1): a normalized, projected vector), and normwise for everything with
``k = max(hidden, conv_dim + I + H, T N)`` and ``depth = 24``: each path is a chain of about 12 reductions
(in_proj, conv, the scan's five, the norm, out_proj; the backward's transposes of the same), and the two paths'
errors add (x 2 covers the forward and backward chain of one path per path). A wrong group mapping, norm group
size or a missing ``D`` skip moves outputs by O(1).
"""

from __future__ import annotations

import pytest
import torch
from _tolerance import assert_normwise_close, assert_within, rounding_bound

from moe_rl.ssm import Mamba2Mixer, Mamba2MixerConfig, causal_conv1d

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
T = 21  # not a multiple of the chunk size (8)


def _hf_mamba2():
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HF

    cfg = Mamba2Config(hidden_size=16, num_heads=8, head_dim=4, state_size=8, n_groups=2, expand=2, conv_kernel=4,
                       chunk_size=8, num_hidden_layers=1, vocab_size=10)
    return cfg, HF(cfg, 0)


def _hf_nemotron_h():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer as HF

    cfg = NemotronHConfig(hidden_size=16, mamba_num_heads=8, mamba_head_dim=4, ssm_state_size=8, n_groups=2,
                          conv_kernel=4, chunk_size=8, num_hidden_layers=1, vocab_size=10,
                          layers_block_type=["mamba"])
    return cfg, HF(cfg, 0)


@pytest.mark.parametrize("family", ["mamba2", "nemotron_h"])
def test_mixer_equals_transformers(family):
    torch.manual_seed(0)
    hf_cfg, hf = (_hf_mamba2 if family == "mamba2" else _hf_nemotron_h)()
    with torch.no_grad():  # random weights everywhere (HF's init leaves D = 1, dt_bias = 1: too regular a test)
        for name, p in hf.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
            elif name == "dt_bias":
                p.copy_(torch.randn_like(p) - 2.0)
            else:
                shift = 1.0 if name == "norm.weight" else 0.0
                p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5) + shift)
    ours = Mamba2Mixer(Mamba2MixerConfig.from_hf(hf_cfg))
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in hf.named_parameters())
    ours.load_state_dict(hf.state_dict(), strict=True)
    hf.eval()
    ours.eval()

    u = torch.randn(2, T, 16)
    go = torch.randn(2, T, 16)
    u1, u2 = u.clone().requires_grad_(), u.clone().requires_grad_()
    o_ours, o_hf = ours(u1), hf(u2)
    (o_ours * go).sum().backward()
    (o_hf * go).sum().backward()

    c = ours.config
    k = max(c.hidden_size, c.conv_dim + c.intermediate_size + c.num_heads, T * c.ssm_state_size)
    assert_within(o_ours, o_hf, ATOL, f"{family} output (atol)")
    assert_normwise_close(o_ours, o_hf, dtype=torch.float32, k=k, depth=24, what=f"{family} output")
    assert_normwise_close(u1.grad, u2.grad, dtype=torch.float32, k=k, depth=24, what=f"{family} d input")
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert_normwise_close(p.grad, hf_params[name].grad, dtype=torch.float32, k=k, depth=24,
                              what=f"{family} d {name}")


def test_config_from_hf_conventions():
    c = Mamba2MixerConfig.from_hf(_hf_nemotron_h()[0])
    assert (c.norm_groups, c.n_groups, c.dt_limit[0], c.dt_limit[1]) == (2, 2, 0.001, float("inf"))
    m = Mamba2MixerConfig.from_hf(_hf_mamba2()[0])
    assert (m.norm_groups, m.intermediate_size, m.conv_dim) == (1, 32, 32 + 2 * 2 * 8)


def test_causal_conv1d_halo_continues_the_sequence():
    """Convolving a row in two pieces, the second with the first's last K - 1 inputs as its halo, equals one conv.

    Each output is a sum of K + 1 = 5 terms; the kernels may order them differently for other lengths, so the
    bound is ``rounding_bound(|w| * |x| + |bias|, 5)`` per element."""
    torch.manual_seed(1)
    x, w, bias = torch.randn(2, 10, 6), torch.randn(6, 1, 4), torch.randn(6)
    full = causal_conv1d(x, w, bias)
    ref = causal_conv1d(x.double(), w.double(), bias.double())
    scale = causal_conv1d(x.double().abs(), w.double().abs(), bias.double().abs())
    bound = rounding_bound(scale, 5, torch.float32)
    assert_within(full, ref, bound, "conv")
    ref_hf = torch.nn.functional.conv1d(x.double().transpose(1, 2), w.double(), bias.double(), padding=3,
                                        groups=6)[..., :10].transpose(1, 2)
    assert_within(ref, ref_hf, 1e-12, "conv vs nn.functional.conv1d padding (float64)")
    second = causal_conv1d(x[:, 6:], w, bias, halo=x[:, 3:6])
    assert_within(second, ref[:, 6:], bound[:, 6:], "conv with halo")


def test_bad_config_raises():
    with pytest.raises(ValueError, match="not a multiple of n_groups"):
        Mamba2MixerConfig(hidden_size=8, num_heads=6, head_dim=2, ssm_state_size=4, n_groups=4)
    with pytest.raises(ValueError, match="chunk_size=0"):
        Mamba2MixerConfig(hidden_size=8, num_heads=4, head_dim=2, ssm_state_size=4, chunk_size=0)
    with pytest.raises(ValueError, match="dt_limit"):
        Mamba2MixerConfig(hidden_size=8, num_heads=4, head_dim=2, ssm_state_size=4, dt_limit=(0.1, 0.01))
    m = Mamba2Mixer(Mamba2MixerConfig(hidden_size=8, num_heads=4, head_dim=2, ssm_state_size=4))
    with pytest.raises(ValueError, match=r"hidden_states has shape"):
        m(torch.randn(1, 3, 7))
