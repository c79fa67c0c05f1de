"""The Mamba-2 mixer layer (Dao & Gu 2024) on top of :func:`moe_rl.ssm.ssd.ssd_scan`, single-process or
context-parallel.

Shape legend:
    b        rows (each row its own sequence)
    T        tokens per row (under CP: this rank's contiguous slice of the row, ``Tl``)
    hidden   model width (``hidden_size``)
    H, P     SSM heads and head dim; ``I = H * P`` the inner width (``intermediate_size``)
    G, N     B/C groups (``n_groups``) and state size (``ssm_state_size``)
    K        conv kernel width (``conv_kernel``); ``conv_dim = I + 2 G N``

Forward, per token (parameter names as Hugging Face's ``Mamba2Mixer`` / ``NemotronHMamba2Mixer``, so a checkpoint's
``...mixer.*`` tensors load as they are)::

    z | xBC | dt_raw = in_proj(u)                  [I | conv_dim | H]
    xBC = silu(conv1d(xBC))                          depthwise causal conv over time, weight [conv_dim, 1, K]
    x | B | C = xBC                                  [I | G N | G N]
    dt = clamp(softplus(dt_raw + dt_bias), dt_limit) [H]
    A = -exp(A_log)                                  [H]
    y = ssd(x, dt, A, B, C) + D x                    (moe_rl.ssm.ssd)
    y = norm(y * silu(z))                            gated RMSNorm over groups of I / norm_groups channels
    out = out_proj(y)

Context parallelism (``group`` given): the sequence is split over the ranks of ``group`` in rank order, each rank
holding a contiguous slice of every row. The conv reads the previous rank's last ``K - 1`` pre-conv inputs (a halo,
one all-gather) and the scan passes the recurrent state between ranks (:func:`moe_rl.ssm.cp.ssd_scan_cp`); both
are differentiable, so the backward pass returns the halo's and the state's gradients to the ranks that produced
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moe_rl.ssm.cp import all_gather_stack, check_same_across_ranks, ssd_scan_cp
from moe_rl.ssm.ssd import ssd_scan

__all__ = ["GatedRMSNorm", "Mamba2Mixer", "Mamba2MixerConfig", "causal_conv1d"]


@dataclass(frozen=True)
class Mamba2MixerConfig:
    """Sizes of one Mamba-2 mixer. Field names follow Hugging Face's ``NemotronHConfig`` (``mamba_num_heads`` ->
    ``num_heads``, ``mamba_head_dim`` -> ``head_dim``; :meth:`from_hf` reads either config class).

    ``norm_groups``: groups of the gated RMSNorm (each normalizes ``I / norm_groups`` channels). Nemotron-H and the
    reference Mamba-2 kernels use ``n_groups``; transformers' ``Mamba2Mixer`` normalizes all ``I`` channels
    together (``norm_groups = 1``). ``dt_limit``: ``(min, max)`` clamp of the discretized step (Nemotron-H:
    ``(time_step_min, inf)``). ``time_step_min/max/floor``: the ``dt_bias`` initialization range.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    ssm_state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    norm_groups: int = 1
    layer_norm_epsilon: float = 1e-5
    dt_limit: tuple[float, float] = (0.0, math.inf)
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                     "chunk_size", "norm_groups"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Mamba2MixerConfig.{name}={v!r}: it must be an int >= 1")
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2MixerConfig: num_heads={self.num_heads} is not a multiple of n_groups="
                             f"{self.n_groups}; each group of B/C serves num_heads // n_groups heads")
        if self.intermediate_size % self.norm_groups:
            raise ValueError(f"Mamba2MixerConfig: intermediate_size={self.intermediate_size} (num_heads * head_dim) "
                             f"is not a multiple of norm_groups={self.norm_groups}")
        lo, hi = self.dt_limit
        if not lo >= 0 or not hi > lo:
            raise ValueError(f"Mamba2MixerConfig.dt_limit={self.dt_limit!r}: it must be (min, max) with "
                             "0 <= min < max (max may be inf)")
        if not 0 < self.time_step_min <= self.time_step_max:
            raise ValueError(f"Mamba2MixerConfig: time_step_min={self.time_step_min}, time_step_max="
                             f"{self.time_step_max}: need 0 < min <= max")

    @property
    def intermediate_size(self) -> int:
        """``I = num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: ``I + 2 * n_groups * ssm_state_size`` (x, B, C)."""
        return self.intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @classmethod
    def from_hf(cls, config: object) -> Mamba2MixerConfig:
        """From a transformers ``NemotronHConfig`` (``mamba_num_heads``...; ``norm_groups = n_groups``,
        ``dt_limit = (time_step_min, inf)``, as its mixer does) or ``Mamba2Config`` (``num_heads``, ``state_size``;
        ``norm_groups = 1``, ``dt_limit = time_step_limit``)."""
        g = getattr
        if hasattr(config, "mamba_num_heads"):  # NemotronH
            return cls(hidden_size=config.hidden_size, num_heads=config.mamba_num_heads,
                       head_dim=config.mamba_head_dim, ssm_state_size=config.ssm_state_size,
                       n_groups=config.n_groups, conv_kernel=config.conv_kernel, chunk_size=config.chunk_size,
                       use_conv_bias=config.use_conv_bias, use_bias=g(config, "use_bias", False),
                       norm_groups=config.n_groups, layer_norm_epsilon=config.layer_norm_epsilon,
                       dt_limit=(float(config.time_step_min), math.inf), time_step_min=config.time_step_min,
                       time_step_max=config.time_step_max, time_step_floor=config.time_step_floor)
        return cls(hidden_size=config.hidden_size, num_heads=config.num_heads, head_dim=config.head_dim,
                   ssm_state_size=config.state_size, n_groups=config.n_groups, conv_kernel=config.conv_kernel,
                   chunk_size=config.chunk_size, use_conv_bias=config.use_conv_bias, use_bias=config.use_bias,
                   norm_groups=1, layer_norm_epsilon=config.layer_norm_epsilon,
                   dt_limit=tuple(float(v) for v in config.time_step_limit), time_step_min=config.time_step_min,
                   time_step_max=config.time_step_max, time_step_floor=config.time_step_floor)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, *, halo: Tensor | None = None) -> Tensor:
    """Depthwise causal convolution over time: ``out_t = bias + sum_j weight[:, 0, j] * x_{t - K + 1 + j}``.

    Args:
        x: ``[b, T, C]`` inputs (token-major).
        weight: ``[C, 1, K]`` (``nn.Conv1d(C, C, K, groups=C).weight``).
        bias: ``[C]`` or None.
        halo: ``[b, K - 1, C]`` the ``K - 1`` inputs before ``x[:, 0]`` (the previous CP rank's last inputs), or
            None for zeros (the start of the sequence).

    Returns:
        ``[b, T, C]`` in ``x``'s dtype (no activation).
    """
    b, T, Cn = x.shape
    K = weight.shape[-1]
    if tuple(weight.shape) != (Cn, 1, K):
        raise ValueError(f"weight has shape {tuple(weight.shape)}: it must be [C, 1, K] with C = {Cn}")
    if halo is None:
        halo = x.new_zeros(b, K - 1, Cn)
    elif tuple(halo.shape) != (b, K - 1, Cn):
        raise ValueError(f"halo has shape {tuple(halo.shape)}: it must be [b, K - 1, C] = {(b, K - 1, Cn)}")
    full = torch.cat([halo.to(x.dtype), x], dim=1).transpose(1, 2)  # [b, C, K - 1 + T]
    return F.conv1d(full, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), groups=Cn).transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_g(y * silu(z))`` with the RMS taken over groups of ``size / groups`` channels, in fp32
    (the result is cast back to ``y``'s dtype before the weight, as transformers does). ``forward(y [..., I],
    z [..., I]) -> [..., I]``."""

    def __init__(self, size: int, groups: int = 1, eps: float = 1e-5) -> None:
        super().__init__()
        if size % groups:
            raise ValueError(f"GatedRMSNorm: size={size} is not a multiple of groups={groups}")
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer (see the module docstring for the forward pass and the legend).

    Parameters (Hugging Face names and shapes): ``in_proj.weight [I + conv_dim + H, hidden]`` (+ ``bias`` with
    ``use_bias``), ``conv1d.weight [conv_dim, 1, K]``, ``conv1d.bias [conv_dim]``, ``dt_bias [H]``, ``A_log [H]``,
    ``D [H]``, ``norm.weight [I]``, ``out_proj.weight [hidden, I]``.

    ``forward(hidden_states [b, T, hidden], group=None) -> [b, T, hidden]`` in the input dtype (the scan and the
    norm run in fp32). With ``group``: context parallel, ``T`` is this rank's contiguous slice of each row (ranks
    in sequence order; slices may differ in length but each must hold at least ``K - 1`` tokens).
    """

    def __init__(self, config: Mamba2MixerConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg = config
        kw = {"device": device, "dtype": dtype}
        H, inner = cfg.num_heads, cfg.intermediate_size
        self.in_proj = nn.Linear(cfg.hidden_size, inner + cfg.conv_dim + H, bias=cfg.use_bias, **kw)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim,
                                padding=cfg.conv_kernel - 1, bias=cfg.use_conv_bias, **kw)
        self.dt_bias = nn.Parameter(torch.empty(H, **kw))
        self.A_log = nn.Parameter(torch.empty(H, **kw))
        self.D = nn.Parameter(torch.empty(H, **kw))
        self.norm = GatedRMSNorm(inner, cfg.norm_groups, cfg.layer_norm_epsilon).to(**kw)
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.use_bias, **kw)
        if self.A_log.device.type != "meta":
            self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """Mamba-2's initialization: ``A = 1..H`` (``A_log = log A``), ``D = 1``, ``dt_bias`` = inverse softplus of
        steps drawn log-uniformly in ``[time_step_min, time_step_max]`` (floored at ``time_step_floor``)."""
        cfg = self.config
        H = cfg.num_heads
        self.A_log.copy_(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
        dt = torch.exp(torch.rand(H) * (hi - lo) + lo).clamp(min=cfg.time_step_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def forward(self, hidden_states: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
        cfg = self.config
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != cfg.hidden_size:
            raise ValueError(f"hidden_states has shape {tuple(hidden_states.shape)}: it must be [b, T, hidden] "
                             f"with hidden = {cfg.hidden_size}")
        b, T, _ = hidden_states.shape
        H, P, G, N, inner = cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.ssm_state_size, cfg.intermediate_size
        K = cfg.conv_kernel
        dtype = hidden_states.dtype
        z, xbc, dt = self.in_proj(hidden_states).split([inner, cfg.conv_dim, H], dim=-1)

        halo = None
        if group is not None:
            check_same_across_ranks([b], ["b"], "Mamba2Mixer (CP)", group)
            if T < K - 1:
                raise ValueError(f"Mamba2Mixer (CP): this rank holds T={T} tokens per row, fewer than conv_kernel - 1 "
                                 f"= {K - 1}; the conv halo comes from the previous rank only, so give every rank at "
                                 "least that many tokens (fewer CP ranks or a longer sequence)")
            if K > 1:
                tails = all_gather_stack(xbc[:, T - (K - 1):], group)  # [cp, b, K - 1, conv_dim]
                rank = dist.get_rank(group)
                # rank 0: zeros (the sequence start), still computed from the gather so that its backward takes
                # part in the gather's all-reduce like every other rank's
                halo = tails[rank - 1] if rank > 0 else tails[0] * 0
        xbc = F.silu(causal_conv1d(xbc, self.conv1d.weight, self.conv1d.bias, halo=halo))
        x, B, C = xbc.split([inner, G * N, G * N], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(cfg.dt_limit[0], cfg.dt_limit[1])
        A = -torch.exp(self.A_log.float())
        args = (x.reshape(b, T, H, P), dt, A, B.reshape(b, T, G, N), C.reshape(b, T, G, N))
        if group is None:
            y = ssd_scan(*args, chunk_size=cfg.chunk_size, D=self.D).y
        else:
            y = ssd_scan_cp(*args, chunk_size=cfg.chunk_size, D=self.D, group=group).y
        y = self.norm(y.reshape(b, T, inner), z)
        return self.out_proj(y.to(dtype))
