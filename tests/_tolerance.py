"""Tolerances for numeric tests, derived from the dtype and the reduction size (shared by every test package).

The rule (a reviewer checks it):

* **Bit-equality** (``torch.equal``) only between two paths that do the same arithmetic in the same order on the
  same inputs (same kernel, same shapes and tile sizes, same thread count), or when every value is exactly
  representable (integers, indices, masks, copies, exact powers of two).
* **Otherwise** compare each path to a **float64 reference** and bound the error of every element by the
  rounding-error model of its reductions. A length-``K`` dot product computed in precision ``u = eps/2`` in *any*
  summation order (MKL picks its kernel, blocking and so its order per CPU, per ``MKL_CBWR`` and per thread count;
  Triton's interpreter runs ``tl.dot`` through numpy) satisfies

  - worst case:        ``|fl(x.y) - x.y| <= K * u * sum_k |x_k| |y_k|``   (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., eq. 3.5; ``gamma_K ~ K u``),
  - probabilistic:     ``|fl(x.y) - x.y| <= lam * sqrt(K) * u * sum_k |x_k| |y_k|``  with probability at least
    ``1 - 2 exp(-lam^2 / 2)`` per element for independent rounding errors (Higham & Mary, "A New Approach to
    Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019, Thm. 3.1).

  :func:`rounding_bound` returns ``c * sqrt(K) * eps * scale`` with ``c = 4`` (``lam = 8``: a failure
  probability below 1e-13 per element) or, with ``worst_case=True``, ``K * eps * scale``. ``scale`` is the sum of
  absolute products (:func:`abs_matmul` for a GEMM), not ``|result|``: cancellation makes ``|result|`` small
  while the rounding errors stay ``~ eps * sum |x||y|``.
* **Quantized paths** (FP8) are compared to the float64 model with an **SQNR floor in dB**
  (:func:`assert_sqnr_at_least`); the floor follows from the format's mantissa bits (E4M3: ~28-29 dB for one GEMM
  of two quantized Gaussian operands).
* A bound must still catch a real bug: a wrong index, a missing scale or a dropped term changes an element by
  ``~ |result|``, which is ``~ 1/(sqrt(K) eps)`` (>= 1e3 for fp32 at the sizes used here) times the bound. Tests
  say so next to the assertion when it is not obvious.

Tests import this module as ``from _tolerance import ...`` (``tests/conftest.py`` puts ``tests/`` on
``sys.path``; worker scripts started in a subprocess insert it themselves).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

C_PROB = 4.0
"""``c`` of the probabilistic bound ``c * sqrt(K) * eps`` (``eps = 2u``, so ``lam = 2c = 8``)."""


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype`` (spacing of numbers at 1.0; ``u = eps / 2`` is the unit roundoff)."""
    return float(torch.finfo(dtype).eps)


def abs_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``|a| @ |b|`` in float64: the per-element scale ``sum_k |a_ik| |b_kj|`` of the GEMM ``a @ b``."""
    return a.detach().double().abs() @ b.detach().double().abs()


def rounding_bound(scale: Tensor | float, k: int, dtype: torch.dtype, *, c: float = C_PROB,
                   worst_case: bool = False) -> Tensor | float:
    """Error bound of a length-``k`` reduction in ``dtype`` whose terms have absolute sum ``scale``.

    Args:
        scale: ``sum |terms|`` per element (tensor, broadcastable to the result) or one float.
        k: number of terms summed per element (the reduction size; ``k >= 1``).
        dtype: precision the reduction runs in (``torch.float32`` for an fp32 GEMM; the accumulator dtype).
        c: constant of the probabilistic bound (module docstring).
        worst_case: ``k * eps * scale`` instead of ``c * sqrt(k) * eps * scale``.

    Returns:
        The bound, same type as ``scale``.
    """
    if k < 1:
        raise ValueError(f"k={k}: the reduction size must be >= 1")
    factor = k * eps(dtype) if worst_case else c * math.sqrt(k) * eps(dtype)
    return scale * factor


def assert_within(actual: Tensor, ref: Tensor, bound: Tensor | float, what: str = "") -> None:
    """Assert ``|actual - ref| <= bound`` element-wise; non-finite values must match exactly (same positions, signs).

    ``ref`` is normally float64. The message gives the worst element's error, bound and their ratio.
    """
    a, r = actual.detach().double(), ref.detach().double()
    assert a.shape == r.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(r.shape)}"
    fin = torch.isfinite(r)
    assert torch.equal(torch.isfinite(a), fin), f"{what}: finite/non-finite pattern differs from the reference"
    nonfin = ~fin
    assert torch.equal(a[nonfin], r[nonfin]), f"{what}: inf/nan values differ from the reference"
    b = torch.as_tensor(bound, dtype=torch.float64).expand_as(r)
    err = (a - r).abs()
    bad = fin & (err > b)
    if bool(bad.any()):
        ratio = torch.where(fin, err / b.clamp_min(1e-300), torch.zeros_like(err))
        i = int(ratio.flatten().argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{int(fin.sum())} elements outside the bound; worst at flat index {i}: "
            f"err {err.flatten()[i].item():.3e} > bound {b.flatten()[i].item():.3e} "
            f"(x{ratio.flatten()[i].item():.1f}); actual {a.flatten()[i].item():.6e}, ref {r.flatten()[i].item():.6e}"
        )


def assert_close_to_reference(actual: Tensor, ref64: Tensor, *, dtype: torch.dtype, k: int,
                              scale: Tensor | float, c: float = C_PROB, worst_case: bool = False,
                              out_dtype: torch.dtype | None = None, what: str = "") -> None:
    """Assert ``actual`` equals the float64 ``ref64`` up to the rounding of a length-``k`` reduction in ``dtype``.

    Bound per element: :func:`rounding_bound` ``(scale, k, dtype)`` plus, when the result was rounded to a
    narrower ``out_dtype`` (e.g. bf16 output of an fp32-accumulating GEMM), half an ulp of ``out_dtype``
    (``eps(out_dtype) / 2 * |ref|``) on top.

    Args:
        actual: the tested path's result (any float dtype).
        ref64: the float64 reference (same shape).
        dtype: accumulation precision of the tested path.
        k: reduction size per element (for chained reductions pass the terms of the longest chain, or add
            :func:`rounding_bound` terms yourself and call :func:`assert_within`).
        scale: ``sum |terms|`` per element, e.g. :func:`abs_matmul` of the operands.
        c, worst_case: see :func:`rounding_bound`.
        out_dtype: dtype the result was rounded to after accumulating (None: ``dtype``).
        what: label for the failure message.
    """
    if isinstance(scale, Tensor):
        scale = scale.detach().double()
    bound = rounding_bound(scale, k, dtype, c=c, worst_case=worst_case)
    if out_dtype is not None and eps(out_dtype) > eps(dtype):
        bound = bound + 0.5 * eps(out_dtype) * ref64.detach().double().abs()
    assert_within(actual, ref64, bound, what)


def assert_paths_agree(a: Tensor, b: Tensor, *, dtype: torch.dtype, k: int, scale: Tensor | float,
                       c: float = C_PROB, what: str = "") -> None:
    """Two ``dtype`` paths computing the same length-``k`` reductions in possibly different orders.

    Each is within :func:`rounding_bound` of the exact result, so ``|a - b| <= 2 * rounding_bound`` (triangle
    inequality). Use this when a float64 reference of the *same* inputs is impractical (e.g. gradients behind
    quantizers that both paths apply identically); prefer :func:`assert_close_to_reference` otherwise.
    """
    if isinstance(scale, Tensor):
        scale = scale.detach().double()
    assert_within(a, b, 2 * rounding_bound(scale, k, dtype, c=c), what)


def sqnr_db(ref: Tensor, out: Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(sum ref^2 / sum (out - ref)^2)`` in dB (float64)."""
    r, o = ref.detach().double(), out.detach().double()
    noise = float(((o - r) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((r**2).sum()) / noise)


def assert_sqnr_at_least(ref: Tensor, out: Tensor, floor_db: float, what: str = "") -> None:
    """Assert ``sqnr_db(ref, out) >= floor_db`` (quantized paths; the floor comes from the format's mantissa)."""
    s = sqnr_db(ref, out)
    assert s >= floor_db, f"{what}: SQNR {s:.2f} dB < floor {floor_db} dB"


def attention_bounds(q: Tensor, k: Tensor, v: Tensor, *, scale: float, dtype: torch.dtype) -> tuple[float, float]:
    """Scalar error bounds ``(out_bound, lse_bound)`` of softmax attention computed in ``dtype``, any order.

    Shapes: ``q [Tq, H, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]`` (GQA: ``H`` a multiple of ``Hkv``).
    Derivation: every score ``s = scale * q.k`` is off by at most ``B = rounding_bound(scale * max |q|.|k|, D)``;
    shifting scores by ``|delta| <= B`` scales each softmax weight by ``exp(+-2B)``, so the output
    ``sum_j p_j v_j`` moves by ``<= 2B max|v|``; exp, the normalizer and the ``Tk``-term weighted sum add
    ``rounding_bound(max|v|, Tk) + 3 eps max|v|``. ``lse = max + log(sum exp)`` moves by ``<= B`` plus the
    ``Tk``-term sum and the log (``rounding_bound(1, Tk) + eps * (1 + max|lse|)``, with ``max|lse| <= max|s| +
    log Tk``). A wrong mask/window or a dropped key changes outputs by ``~ max|v| / Tk`` (>= 1e3 times
    ``out_bound`` for fp32 at test sizes).
    """
    G = q.shape[1] // k.shape[1]
    qa, ka = q.detach().double().abs(), k.detach().double().abs().repeat_interleave(G, 1)
    dots = torch.einsum("thd,shd->hts", qa, ka) * abs(scale)
    s_max = float(dots.max()) if dots.numel() else 0.0
    Tk, D = k.shape[0], q.shape[-1]
    B = float(rounding_bound(s_max, D, dtype))
    vmax = float(v.detach().double().abs().max()) if v.numel() else 0.0
    e = eps(dtype)
    out_b = 2 * B * vmax + float(rounding_bound(vmax, max(Tk, 1), dtype)) + 3 * e * vmax
    lse_b = B + float(rounding_bound(1.0, max(Tk, 1), dtype)) + e * (1 + s_max + math.log(max(Tk, 1)))
    return out_b, lse_b


def assert_normwise_close(actual: Tensor, ref64: Tensor, *, dtype: torch.dtype, k: int, depth: int = 1,
                          c: float = C_PROB, what: str = "") -> None:
    """Normwise check for a chain of ``depth`` reductions of size ``<= k`` (layers, GEMMs and their backward).

    ``||actual - ref64||_F <= depth * c * sqrt(k) * eps(dtype) * ||ref64||_F``: each GEMM of a well-conditioned
    chain (Gaussian data, weights scaled ``~1/sqrt(fan_in)``, no catastrophic cancellation) adds a relative error
    ``<= c sqrt(k) eps`` and those add up to first order over the chain (Higham, ch. 3 and 8). Use it where a
    per-element bound would need the whole chain's absolute values. A wrong expert, token, scale or a missing
    term moves the norm by ``>~ 1/sqrt(numel)`` relative, orders of magnitude above ``c sqrt(k) eps depth``.
    """
    a, r = actual.detach().double(), ref64.detach().double()
    assert a.shape == r.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(r.shape)}"
    err, norm = float((a - r).norm()), float(r.norm())
    bound = depth * c * math.sqrt(k) * eps(dtype) * norm
    assert err <= bound, (f"{what}: ||err|| {err:.3e} > bound {bound:.3e} (||ref|| {norm:.3e}, k={k}, "
                          f"depth={depth}, {dtype}); relative {err / max(norm, 1e-300):.3e}")


def decoder_chain(cfg: object, tokens: int, *, backward: bool = False) -> tuple[int, int]:
    """``(k, depth)`` for :func:`assert_normwise_close` on a whole decoder forward (and backward) pass.

    ``k``: the largest reduction (hidden, FFN widths, vocab, tokens for weight gradients and attention);
    ``depth``: ~8 reductions per layer (q/k/v/o projections, scores, weighted sum, MLP up/down) plus the norm
    and the head, doubled when the backward pass is included. Compare two fp32 paths of the same model with
    ``depth=2 * depth`` (each path is within the bound of the exact result).
    """
    sizes = [getattr(cfg, n, 0) or 0 for n in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                                "vocab_size", "kv_lora_rank", "q_lora_rank")]
    depth = 8 * int(cfg.num_hidden_layers) + 2
    return max([tokens, *sizes]), 2 * depth if backward else depth


# ------------------------------------------------------------------------------------ trainer runs (fp32)
def logprob_error(logits: Tensor, *, k: int, depth: int, dtype: torch.dtype = torch.float32) -> float:
    """Bound ``Delta`` on ``|lp_t - lp_t^exact|`` for the token log-probs of a decoder chain (forward only).

    ``lp = z_y - logsumexp(z)``: with the chain's normwise relative error ``beta = depth c sqrt(k) eps`` on the
    logits (:func:`assert_normwise_close`), every logit moves by at most ``beta * max|z|`` and the log-sum-exp by
    at most that plus its own rounding, so ``|delta lp| <= beta (2 max|z| + log V)`` (``V``: the vocabulary,
    ``logits``' last dim). ``logits``: the reference path's logits (any shape ``[..., V]``).
    """
    beta = depth * C_PROB * math.sqrt(k) * eps(dtype)
    return beta * (2 * float(logits.detach().abs().max()) + math.log(logits.shape[-1]))


def train_step_bounds(lp: Tensor, logits: Tensor, out: object, *, k: int, depth: int) -> dict[str, float]:
    """Error bounds of one trainer step's reported scalars, from the single-process reference's tensors.

    Call after ``(out.loss_sum / normalizer).backward()`` with ``lp.retain_grad()`` set, so ``lp.grad`` is
    ``d loss / d lp`` (zero off the loss mask). First order in ``Delta = logprob_error(logits, k, depth)``:

    - ``loss``: ``sum_t |d loss / d lp_t| * Delta`` (every kind: the loss depends on the model only through
      ``lp``), plus one rounding of the result;
    - ``mismatch_kl``: mean over loss tokens of ``k3 = r - log r - 1``, ``d k3 / d lp = r - 1``:
      ``mean |r - 1| * Delta``;
    - ``ratio``: any statistic of the ratios that moves by at most their largest change (quantiles):
      ``max r * Delta`` (``r = exp(lp - lp_inference)``, ``dr = r dlp``).

    ``out``: the reference's :class:`moe_rl.rl.loss.LossOutput` (its ``ratios``).
    """
    delta = logprob_error(logits, k=k, depth=depth)
    assert lp.grad is not None, "call lp.retain_grad() before the backward"
    r = out.ratios.detach().double() if out.ratios is not None and out.ratios.numel() else torch.ones(1)
    return {"loss": delta * float(lp.grad.detach().double().abs().sum()),
            "mismatch_kl": delta * float((r - 1).abs().mean()),
            "ratio": delta * float(r.max())}


def assert_train_run_close(reports: list[dict], grads: list[dict[str, Tensor]], params: dict[str, Tensor],
                           ref_steps: list[dict], ref_params: dict[str, Tensor], *, k: int, depth: int, lr: float,
                           adam_eps: float, smooth: dict[str, str], exact: tuple[str, ...] = (),
                           what: str = "") -> None:
    """A trainer run (sharded, micro-batched, chunked...) vs the single-process fp32 reference of the same steps.

    Both are fp32 chains of the same reductions in other orders (FSDP reduce-scatter, EP combine, CP merges,
    micro-batch accumulation), so, per step (``depth``: :func:`decoder_chain` with ``backward=True``, doubled for
    the two paths, +2 for the normalization and the clip factor):

    - every gradient (right before the AdamW step, after the clip) per tensor: :func:`assert_normwise_close`;
    - ``grad_norm``: ``| ||a|| - ||b|| | <= ||a - b||``, the per-tensor bounds added in quadrature:
      ``beta * grad_norm``;
    - the keys of ``smooth`` (report key -> bound key of ``ref["bounds"]``, see :func:`train_step_bounds`;
      a ``"loss_metrics.<name>"`` key reads ``rep["loss_metrics"][name]``): within that bound + one rounding;
    - the keys of ``exact``: equal (counts, integer ages, the lr schedule: the same arithmetic on the same
      integers, or decisions whose inputs the data keeps away from the thresholds).

    Parameters after the steps: AdamW's update ``lr m / (sqrt(v) + eps)`` moves by at most ``2 lr / eps`` times a
    gradient difference at each step (first order; ``|d m_hat / d g_s| <= 1`` and ``|m_hat| <= sqrt(v_hat)`` for the
    default betas over <= 2 steps), so element-wise ``|dp| <= 2 (lr / eps) sum_s |dg_s|`` with the *measured*
    gradient differences, plus the rounding of each update (``2 eps32 (|p| + lr)`` per step). With ``eps = lr``
    a wrong learning rate, update or weight decay moves parameters by ``~ lr`` >> this bound.
    """
    f32 = torch.float32
    beta = depth * C_PROB * math.sqrt(k) * eps(f32)
    e = eps(f32)
    for step, (rep, ref) in enumerate(zip(reports, ref_steps, strict=True)):
        tag = f"{what} step {step}"
        gn, gn_ref = float(rep["grad_norm"]), float(ref["grad_norm"])
        assert abs(gn - gn_ref) <= beta * gn_ref + e * gn_ref, f"{tag} grad_norm {gn} vs {gn_ref}"
        for key, bkey in smooth.items():
            if key.startswith("loss_metrics."):
                name = key.split(".", 1)[1]
                a, b = float(rep["loss_metrics"][name]), float(ref["loss_metrics"][name])
            else:
                a, b = float(rep[key]), float(ref[key])
            bound = ref["bounds"][bkey] + e * abs(b)
            assert abs(a - b) <= bound, f"{tag} {key}: {a!r} vs {b!r}: |diff| {abs(a - b):.3e} > bound {bound:.3e}"
        for key in exact:
            if key.startswith("loss_metrics."):
                name = key.split(".", 1)[1]
                assert rep["loss_metrics"][name] == ref["loss_metrics"][name], (tag, key)
            else:
                assert rep[key] == ref[key], (tag, key, rep[key], ref[key])
        g_step = grads[step]
        assert set(g_step) == set(ref["grads"]), sorted(set(g_step) ^ set(ref["grads"]))
        for n, g in ref["grads"].items():
            assert_normwise_close(g_step[n], g, dtype=f32, k=k, depth=depth, what=f"{tag} grad {n}")
    assert set(params) == set(ref_params), sorted(set(params) ^ set(ref_params))
    n_steps = len(ref_steps)
    for n, p in ref_params.items():
        dg = sum((grads[s][n].double() - ref_steps[s]["grads"][n].double()).abs() for s in range(n_steps)
                 if n in ref_steps[s]["grads"])  # buffers: no gradient, no update
        bound = 2 * (lr / adam_eps) * dg + 2 * n_steps * e * (p.double().abs() + lr)
        assert_within(params[n], p, bound, f"{what} param {n}")


def label_logprob_bounds(h: Tensor, w: Tensor, labels: Tensor, grad: Tensor, temperature: float, *,
                         dtype: torch.dtype = torch.float32, logits_dtype: torch.dtype | None = None,
                         grad_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-element bounds ``(lp [N], dh [N, D], dW [V, D])`` of ``log_softmax(h w^T / T)[labels]`` and its gradients
    for the upstream ``grad [N]``, computed in ``dtype`` in any order, vs the float64 result of the same inputs.

    Shapes: ``h [N, D]``, ``w [V, D]``, ``labels [N]`` int, ``grad [N]``. ``logits_dtype``: the logits are rounded
    to it before the fp32 softmax (a bf16 head matmul; its backward rounds ``d logits`` to it too);
    ``grad_dtype``: ``dh`` / ``dW`` are rounded to it (bf16 parameters), and each partial product over a token
    chunk may be (the bound uses ``eps/2 * sum |terms|``, which covers any chunking).

    Derivation (first order, ``u``-terms as in :func:`rounding_bound`): logit ``z = h.w / T`` is off by
    ``Bz = rounding_bound(|h|.|w| / T, D) + eps |z|`` (+ ``eps_l / 2 |z|`` when rounded to ``logits_dtype``);
    ``lse`` by ``max_j Bz + rounding_bound(1, V) + eps (1 + |lse|)`` (the ``V`` shifted exponentials are <= 1 and
    sum to >= 1); ``lp = z_y - lse`` adds one rounding. ``p = exp(z - lse)`` is off by ``p expm1(Bz + Blse) + 2 eps
    p``; ``d logit = g (1[y] - p) / T`` by ``|g| dp / T`` plus its roundings; ``dh = d logit @ w`` and
    ``dW = d logit^T @ h`` add the propagated ``|d d logit| @ |w|`` and their own ``rounding_bound`` over ``V`` and
    ``N`` terms. A wrong softmax term, a missing ``1/T`` or a dropped chunk moves elements by ``~ |value|``.
    """
    e = eps(dtype)
    h64, w64, g64 = h.detach().double(), w.detach().double(), grad.detach().double()
    N, D = h64.shape
    V = w64.shape[0]
    z = h64 @ w64.T / temperature
    bz = rounding_bound(h64.abs() @ w64.abs().T / temperature, D, dtype) + e * z.abs()
    if logits_dtype is not None:
        bz = bz + 0.5 * eps(logits_dtype) * z.abs()
    lse = torch.logsumexp(z, dim=-1)
    blse = bz.max(dim=-1).values + float(rounding_bound(1.0, V, dtype)) + e * (1 + lse.abs())
    lp = z.gather(-1, labels[:, None].long()).squeeze(-1) - lse
    b_lp = bz.gather(-1, labels[:, None].long()).squeeze(-1) + blse + e * lp.abs()
    p = torch.exp(z - lse[:, None])
    bp = p * torch.expm1(bz + blse[:, None]) + 2 * e * p
    onehot = torch.zeros_like(p).scatter_(-1, labels[:, None].long(), 1.0)
    dl = g64[:, None] * (onehot - p) / temperature
    bdl = g64.abs()[:, None] * bp / temperature + 2 * e * dl.abs()
    if logits_dtype is not None:
        bdl = bdl + 0.5 * eps(logits_dtype) * dl.abs()
    s_dh, s_dw = dl.abs() @ w64.abs(), dl.abs().T @ h64.abs()
    b_dh = bdl @ w64.abs() + rounding_bound(s_dh, V, dtype)
    b_dw = bdl.T @ h64.abs() + rounding_bound(s_dw, N, dtype)
    if grad_dtype is not None:  # each chunk's partial product and the final sum rounded: <= 2 x eps/2 x sum|terms|
        b_dh = b_dh + eps(grad_dtype) * s_dh
        b_dw = b_dw + eps(grad_dtype) * s_dw
    return b_lp, b_dh, b_dw
