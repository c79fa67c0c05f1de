"""Issue 19, item 3 (input hygiene): every input that used to pass silently now raises a clear error naming the
argument, the value, the rule and the fix, or has a defined, documented result.

One test (or parametrized group) per silent input of the issue:
fp8_block_linear dtypes, compute_loss / mismatch_kl dtypes and non-finite values, mismatch_kl's empty mask,
build_batch([]), NaN engine log-probs, empty prompts, cache_salt_for(weight_dtype=...) spellings, misspelt
``backend=``, negative staleness, zero-row routed-experts records, router top-k ties.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moe_rl.rl.batch import build_batch
from moe_rl.rl.buffer import RolloutGroup, Sample, staleness
from moe_rl.rl.loss import LossConfig, compute_loss, dppo_kl_loss, mismatch_kl
from moe_rl.rl.salt import WEIGHT_DTYPES, cache_salt_for, canonical_weight_dtype


# ------------------------------------------------------------------------------------------- fp8_block_linear
@pytest.mark.parametrize("bad", ["x", "weight", "bias"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_fp8_block_linear_refuses_non_floating_tensors(bad, dtype):
    from moe_rl.fp8.linear import fp8_block_linear

    t = {"x": torch.randn(4, 128), "weight": torch.randn(128, 128), "bias": torch.randn(128)}
    t[bad] = torch.ones(t[bad].shape, dtype=dtype)
    with pytest.raises(TypeError, match=rf"{bad} has dtype {dtype}.*floating-point.*{bad}\.float\(\)"):
        fp8_block_linear(t["x"], t["weight"], t["bias"])


def test_fp8_block_linear_float_input_keeps_its_dtype():
    from moe_rl.fp8.linear import fp8_block_linear

    for dtype in (torch.float32, torch.bfloat16):
        y = fp8_block_linear(torch.randn(3, 128, dtype=dtype), torch.randn(256, 128))
        assert y.dtype == dtype and y.shape == (3, 256)


# ------------------------------------------------------------------------------------------- misspelt backend=
def _bad_backend_calls():
    from moe_rl.fp8.grouped import contiguous_layout, fp8_grouped_linear
    from moe_rl.fp8.linear import Fp8BlockLinear, convert_to_fp8_block_linear, fp8_block_linear
    from moe_rl.moe.ep import ExpertParallelMoE
    from moe_rl.moe.experts import GroupedExperts
    from moe_rl.moe.fp8_experts import Fp8GroupedExperts, fp8_experts_forward
    from moe_rl.moe.moe import MoE
    from moe_rl.moe.router import TopKRouter

    experts = GroupedExperts(4, 128, 128, backend="loop")
    lay = contiguous_layout(torch.tensor([1, 0, 0, 0]))
    return {
        "Fp8BlockLinear": lambda b: Fp8BlockLinear(128, 128, backend=b),
        "Fp8BlockLinear.from_linear": lambda b: Fp8BlockLinear.from_linear(nn.Linear(128, 128), backend=b),
        "convert_to_fp8_block_linear": lambda b: convert_to_fp8_block_linear(nn.Sequential(nn.Linear(128, 128)),
                                                                             backend=b),
        "fp8_block_linear": lambda b: fp8_block_linear(torch.randn(2, 128), torch.randn(128, 128), backend=b),
        "Fp8GroupedExperts.from_experts": lambda b: Fp8GroupedExperts.from_experts(experts, backend=b),
        "fp8_grouped_linear": lambda b: fp8_grouped_linear(torch.zeros(lay.num_rows, 128), torch.randn(4, 128, 128),
                                                           lay, b),
        "fp8_experts_forward": lambda b: fp8_experts_forward(torch.randn(1, 128), torch.zeros(1, 1, dtype=torch.int64),
                                                             experts.gate_up_proj, experts.down_proj, backend=b),
        "GroupedExperts": lambda b: GroupedExperts(4, 8, 16, backend=b),
        "MoE": lambda b: MoE(8, 16, 4, 2, backend=b),
        # checked before any process group is touched (no torch.distributed init needed to see the error)
        "ExpertParallelMoE": lambda b: ExpertParallelMoE(TopKRouter(8, 4, 2), GroupedExperts(4, 8, 16, backend="loop"),
                                                         None, backend=b),
        "ExpertParallelMoE.from_full": lambda b: ExpertParallelMoE.from_full(MoE(8, 16, 4, 2), backend=b),
    }


@pytest.mark.parametrize("where", sorted(_bad_backend_calls()))
def test_misspelt_backend_is_refused_where_it_enters(where):
    call = _bad_backend_calls()[where]
    with pytest.raises(ValueError, match=r"backend='tirton' is not"):
        call("tirton")


def test_convert_with_bad_backend_leaves_the_model_unchanged():
    from moe_rl.fp8.linear import convert_to_fp8_block_linear

    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    with pytest.raises(ValueError, match="backend='deepgemm'"):
        convert_to_fp8_block_linear(model, backend="deepgemm")
    assert all(type(m) is nn.Linear for m in model)


def test_torchtitan_converter_modules_refuse_a_misspelt_fp8_backend():
    pytest.importorskip("torchtitan")
    from moe_rl.fp8.torchtitan_converter import MoeRlFp8BlockConverter, MoeRlFp8Linear

    with pytest.raises(ValueError, match="backend='tirton'"):
        MoeRlFp8BlockConverter(MoeRlFp8BlockConverter.Config(backend="tirton"))
    with pytest.raises(ValueError, match="fp8_backend='tirton'"):
        MoeRlFp8Linear(MoeRlFp8Linear.Config(in_features=128, out_features=128, fp8_backend="tirton"))


# ------------------------------------------------------------------------------------- compute_loss dtypes
def _loss_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 3, generator=g, dtype=torch.float64).to(dtype)
    lpi = -torch.rand(2, 3, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.tensor([[True, True, False], [False, True, True]])
    return lp, lpi, torch.tensor([1.0, -1.0], dtype=dtype), mask


@pytest.mark.parametrize("which", ["logprobs", "inference_logprobs"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_compute_loss_refuses_low_precision_and_integer_logprobs(which, dtype):
    lp, lpi, adv, mask = _loss_inputs()
    args = {"logprobs": lp, "inference_logprobs": lpi}
    args[which] = args[which].to(dtype)
    with pytest.raises(TypeError, match=rf"{which} has dtype {dtype}.*float32"):
        compute_loss(LossConfig(), args["logprobs"], args["inference_logprobs"], adv, mask)
    with pytest.raises(TypeError, match=rf"{which} has dtype {dtype}"):
        dppo_kl_loss(args["logprobs"], args["inference_logprobs"], adv, mask)
    with pytest.raises(TypeError, match=rf"{which} has dtype {dtype}"):
        mismatch_kl(args["logprobs"], args["inference_logprobs"], mask)


def test_compute_loss_refuses_mismatched_logprob_dtypes_and_integer_advantages():
    lp, lpi, adv, mask = _loss_inputs()
    with pytest.raises(TypeError, match=r"logprobs \(torch.float32\) and inference_logprobs \(torch.float64\)"):
        compute_loss(LossConfig(), lp, lpi.double(), adv, mask)
    with pytest.raises(TypeError, match=r"advantages has dtype torch.int64.*advantages.float\(\)"):
        compute_loss(LossConfig(), lp, lpi, torch.tensor([1, -1]), mask)
    # the documented dtypes still work
    for dtype in (torch.float32, torch.float64):
        lp, lpi, adv, mask = _loss_inputs(dtype)
        assert torch.isfinite(compute_loss(LossConfig(), lp, lpi, adv, mask).loss_sum)


# --------------------------------------------------------------------------------------------- mismatch_kl
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["logprobs", "inference_logprobs"])
def test_mismatch_kl_refuses_non_finite_values_at_masked_tokens(bad, which):
    lp, lpi, _, mask = _loss_inputs()
    t = {"logprobs": lp, "inference_logprobs": lpi}
    t[which][0, 1] = bad  # a masked (selected) token
    with pytest.raises(ValueError, match=rf"{which} has 1 non-finite value"):
        mismatch_kl(t["logprobs"], t["inference_logprobs"], mask)


def test_mismatch_kl_ignores_non_finite_values_off_the_mask_and_is_zero_on_an_empty_mask():
    lp, lpi, _, mask = _loss_inputs(torch.float64)
    ref = mismatch_kl(lp, lpi, mask)
    lp2, lpi2 = lp.clone(), lpi.clone()
    lp2[0, 2], lpi2[1, 0] = float("nan"), float("-inf")  # both off the mask
    assert mismatch_kl(lp2, lpi2, mask).item() == ref.item()
    empty = torch.zeros_like(mask)
    lp2[:] = float("nan")
    out = mismatch_kl(lp2, lpi2, empty)
    assert out.item() == 0.0 and not math.isnan(out.item())


# --------------------------------------------------------------------------------------------- build_batch
def test_build_batch_of_no_groups_raises_a_clear_error():
    with pytest.raises(ValueError, match=r"groups=\[\] is empty; a batch needs at least one RolloutGroup"):
        build_batch([], step=0, pad_id=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_build_batch_refuses_a_non_finite_engine_logprob_at_a_trained_position(bad):
    g = RolloutGroup(7, 0, "s", [Sample([1, 2], [3, 4], [-0.1, bad], reward=1.0), Sample([1, 2], [5], [-0.2])])
    with pytest.raises(ValueError, match=r"group 7: completion_logprobs\[1\] = .* is not finite at a trained"):
        build_batch([g], step=0, pad_id=0)


def test_build_batch_accepts_a_non_finite_logprob_that_is_not_trained():
    s = Sample([1, 2], [3, 4], [-0.1, float("nan")], reward=1.0, train_mask=[True, False])
    b = build_batch([RolloutGroup(0, 0, "s", [s, Sample([1, 2], [5], [-0.2])])], step=0, pad_id=0)
    assert b.loss_mask[0].tolist() == [False, True, False]  # position 2 predicts the untrained NaN token


def test_empty_prompt_is_refused_by_sample_and_build_batch():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        Sample([], [3], [-0.1])
    s = Sample([1], [3], [-0.1])
    s.prompt_ids = []  # mutated after construction: build_batch checks again
    with pytest.raises(ValueError, match=r"group 0: a sample has prompt_ids=\[\] \(empty\)"):
        build_batch([RolloutGroup(0, 0, "s", [s])], step=0, pad_id=0)


def test_engine_client_refuses_an_empty_prompt_before_any_request():
    from moe_rl.inference.client import VllmClient

    async def go():
        client = VllmClient("http://127.0.0.1:9")  # nothing listens: the check must come first
        try:
            await client.generate([], n=1, max_tokens=4, temperature=1.0)
        finally:
            await client.aclose()

    with pytest.raises(ValueError, match=r"prompt_ids=\[\] is empty"):
        asyncio.run(go())


# ------------------------------------------------------------------------------------------------ staleness
def test_staleness_is_never_negative():
    assert staleness(3, 5) == 2 and staleness(5, 5) == 0
    with pytest.raises(ValueError, match="negative staleness: consume_version=4 < version_start=5"):
        staleness(5, 4)


# ------------------------------------------------------------------------------------------ cache salt dtype
@pytest.mark.parametrize(
    ("canonical", "spellings"),
    [
        ("bfloat16", ["bf16", "bfloat16", "torch.bfloat16", " BF16 ", torch.bfloat16]),
        ("float32", ["float32", "fp32", "float", "torch.float32", torch.float32, torch.float]),
        ("float16", ["float16", "fp16", "half", "torch.float16", torch.half]),
        ("float8_e4m3fn", ["fp8", "float8_e4m3fn", torch.float8_e4m3fn]),
    ],
)
def test_weight_dtype_spellings_give_one_salt(canonical, spellings):
    assert {canonical_weight_dtype(s) for s in spellings} == {canonical}
    salts = {cache_salt_for(3, weight_dtype=s, run_id="r") for s in spellings}
    assert salts == {f"moe_rl-r-v3-{canonical}"}


def test_distinct_weight_dtypes_keep_distinct_salts():
    assert len({cache_salt_for(1, weight_dtype=d) for d in WEIGHT_DTYPES}) == len(WEIGHT_DTYPES)


@pytest.mark.parametrize("bad", ["bfloat", "auto", "int8", ""])
def test_unknown_weight_dtype_lists_the_accepted_values(bad):
    with pytest.raises(ValueError, match=rf"weight_dtype={bad!r} is not a known dtype.*bfloat16: bfloat16, bf16"):
        cache_salt_for(1, weight_dtype=bad)


def test_non_string_weight_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="weight_dtype=16 has type int"):
        cache_salt_for(1, weight_dtype=16)


def test_salt_module_does_not_import_torch():
    """salt.py itself stays torch-free (torch.dtype is handled by duck typing). The package ``moe_rl.rl`` imports
    torch for its other modules, so the file is loaded on its own."""
    path = Path(__file__).resolve().parents[1] / "moe_rl" / "rl" / "salt.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('salt_alone', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert m.cache_salt_for(2, weight_dtype='bf16') == 'moe_rl-v2-bfloat16'\n"
        "assert 'torch' not in sys.modules, 'salt.py imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------ zero-row routed-experts records
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind", ["RoutedExperts", "DsaIndices"])
def test_zero_row_records_round_trip(kind, packed):
    import moe_rl.replay.indices as ix

    cls = getattr(ix, kind)
    rec = cls.from_array(np.zeros((0, 3, 2), dtype=np.int64), 8, start=5)
    back = cls.from_bytes(rec.to_bytes(packed=packed))
    assert back == rec and back.shape == (0, 3, 2) and back.start == 5
    full = ix.RoutedExperts.from_array(np.array([[[0, 1]], [[2, 3]]]), 4)
    empty = full.slice_rows(1, 1)  # an empty delta of a multi-turn sample
    assert ix.RoutedExperts.from_bytes(empty.to_bytes(packed=packed)) == empty


# ------------------------------------------------------------------------------------------------ router ties
def _reference_select(scores: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int) -> np.ndarray:
    """float64 numpy reference: best first, ties to the lower index (np.lexsort: last key is primary)."""
    choice = scores + bias
    t, e = choice.shape
    out = np.empty((t, k), dtype=np.int64)
    for i in range(t):
        c = choice[i].copy()
        if n_group > 1:
            grp = c.reshape(n_group, e // n_group)
            gscore = np.sort(grp, axis=1)[:, -2:].sum(axis=1)
            keep = np.lexsort((np.arange(n_group), -gscore))[:topk_group]
            drop = np.setdiff1d(np.arange(n_group), keep)
            grp[drop] = -np.inf
            c = grp.reshape(e)
        out[i] = np.lexsort((np.arange(e), -c))[:k]
    return out


@pytest.mark.parametrize(("n_group", "topk_group"), [(1, 1), (4, 2), (8, 3)])
def test_router_ties_go_to_the_lower_expert_and_group_index(n_group, topk_group):
    from moe_rl.moe.router import select_experts

    g = torch.Generator().manual_seed(n_group)
    # scores on a grid of 1/8: many exact ties, and every sum below is exact in fp32
    scores = torch.randint(0, 4, (256, 32), generator=g).float() / 8
    bias = torch.randint(-1, 2, (32,), generator=g).float() / 8
    ids = select_experts(scores, 6, correction_bias_E=bias, n_group=n_group, topk_group=topk_group)
    ref = _reference_select(scores.double().numpy(), bias.double().numpy(), 6, n_group, topk_group)
    np.testing.assert_array_equal(ids.numpy(), ref)


def test_router_group_tie_keeps_the_lower_group():
    from moe_rl.moe.router import select_experts

    # 4 groups of 2; groups 1 and 3 tie exactly (0.5 + 0.25 == 0.625 + 0.125 in binary floating point) for the
    # best group score, and group 3 holds the single best expert score
    scores = torch.tensor([[0.0625, 0.0625, 0.5, 0.25, 0.125, 0.125, 0.625, 0.125]])
    assert select_experts(scores, 2, n_group=4, topk_group=1).tolist() == [[2, 3]]


def test_zero_initialised_router_picks_the_first_experts_for_every_token():
    from moe_rl.moe.router import TopKRouter

    router = TopKRouter(16, 8, 3)
    nn.init.zeros_(router.weight)  # all logits 0: every score ties at sigmoid(0) = 0.5
    ids, w, _ = router(torch.randn(5, 16))
    assert ids.tolist() == [[0, 1, 2]] * 5
    torch.testing.assert_close(w, torch.full((5, 3), 1 / 3), rtol=0, atol=2 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize(("n_group", "topk_group"), [(1, 1), (8, 4)])
def test_router_selection_equals_torch_topk_when_scores_are_distinct(n_group, topk_group):
    from moe_rl.moe.router import select_experts

    g = torch.Generator().manual_seed(1)
    scores = torch.rand(512, 64, generator=g).sigmoid()
    bias = torch.randn(64, generator=g) * 1e-2
    choice = scores + bias
    assert all(len(set(r)) == 64 for r in choice.tolist())  # distinct: no tie to break
    if n_group > 1:
        grp = choice.view(512, n_group, -1)
        gs = grp.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(topk_group, dim=-1).indices, True)
        choice = grp.masked_fill(~keep[..., None], float("-inf")).view(512, 64)
    expected = choice.topk(8, dim=-1, sorted=True).indices
    got = select_experts(scores, 8, correction_bias_E=bias, n_group=n_group, topk_group=topk_group)
    assert torch.equal(got, expected)
