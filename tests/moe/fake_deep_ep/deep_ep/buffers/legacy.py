"""Stand-in for DeepEP's legacy ``Buffer`` (``deep_ep/buffers/legacy.py`` in DeepEP 2.x, exported as
``deep_ep.Buffer``): only the low-latency (decode) part, ``low_latency_dispatch`` / ``low_latency_combine``, which
DeepEP's ``tests/legacy/test_low_latency.py`` checks. Its normal-mode methods are not emulated: moe_rl's normal-mode
backend drives :class:`deep_ep.ElasticBuffer`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._stats import CALLS
from ..utils.event import EventOverlap


class Buffer:
    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, **_):
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        CALLS["buffers"] += 1

    def _normal_mode(self, *_, **__):
        raise NotImplementedError(
            "fake deep_ep: the legacy Buffer's normal mode is not emulated (use ElasticBuffer.dispatch / combine)"
        )

    dispatch = combine = get_dispatch_layout = _normal_mode

    # ----- low-latency mode ---------------------------------------------------------------------------------------
    # Implemented with all_gather of every rank's (padded) tokens, a different algorithm from moe_rl's torch backend,
    # so a test comparing the two is not comparing a function with itself. Like DeepEP: padding rows of the slabs
    # are garbage (NaN here, 0x7F = NaN codes and NaN scales for FP8), and the order of the rows inside one source
    # rank's block is not token order (reversed here: DeepEP's slots go to whichever sending warp claims them first).

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        # two buffers (double buffering) of bf16 messages, one per (expert, source-rank, token) slot
        return 2 * num_experts * num_max_dispatch_tokens_per_rank * (2 * hidden + 16)

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        is_f8 = t.dtype.itemsize == 1 and t.dtype.is_floating_point
        src = (t.view(torch.uint8) if is_f8 else t).contiguous()
        parts = [torch.empty_like(src) for _ in range(self.group_size)]
        dist.all_gather(parts, src, group=self.group)
        return [p.view(t.dtype) for p in parts] if is_f8 else parts

    @staticmethod
    def _per_token_cast(x: torch.Tensor, round_scale: bool):
        # DeepEP's LL FP8 cast: 1x128 groups, amax clamped at 1e-4, scale = amax / 448 (power of 2 if round_scale)
        n, h = x.shape
        g = x.float().view(n, h // 128, 128)
        scale = g.abs().amax(-1).clamp(min=1e-4) / 448.0
        if round_scale:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        codes = (g / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(n, h)
        return codes, scale

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False):
        if not self.low_latency_mode:
            raise RuntimeError("fake deep_ep: low_latency_dispatch needs Buffer(..., low_latency_mode=True)")
        if topk_idx.dtype != torch.int64:
            raise TypeError("fake deep_ep: topk_idx must be int64")
        if use_ue8m0:
            raise NotImplementedError("fake deep_ep: packed UE8M0 scales are not emulated")
        CALLS["ll_dispatch"] += 1
        M, (T, H), R = num_max_dispatch_tokens_per_rank, x.shape, self.group_size
        if T > M:
            raise RuntimeError(f"fake deep_ep: {T} tokens > num_max_dispatch_tokens_per_rank={M}")
        L = num_experts // R
        xp = torch.cat([x, x.new_zeros(M - T, H)])
        ip = torch.cat([topk_idx, topk_idx.new_full((M - T, topk_idx.shape[1]), -1)])
        gx, gi = self._gather(xp), self._gather(ip)
        if use_fp8:
            casts = [self._per_token_cast(t, round_scale) for t in gx]
            slab = torch.full((L, R * M, H), 0x7F, dtype=torch.uint8)  # 0x7F is NaN in e4m3fn
            slab_s = torch.full((L, R * M, H // 128), float("nan"))
        else:
            slab = torch.full((L, R * M, H), float("nan"), dtype=x.dtype)
        src_info = torch.full((L, R * M), -1, dtype=torch.int32)
        layout_range = torch.zeros((L, R), dtype=torch.int64)
        count = torch.zeros(L, dtype=torch.int32)
        for le in range(L):
            e, n = self.rank * L + le, 0
            for j in range(R):
                toks = (gi[j] == e).any(1).nonzero().flatten().flip(0)
                c = toks.numel()
                if use_fp8:
                    slab[le, n:n + c] = casts[j][0][toks].view(torch.uint8)
                    slab_s[le, n:n + c] = casts[j][1][toks]
                else:
                    slab[le, n:n + c] = gx[j][toks]
                src_info[le, n:n + c] = toks.to(torch.int32)
                layout_range[le, j] = (n << 32) | c
                n += c
            count[le] = n
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += count
        handle = (src_info, layout_range, M, H, num_experts)
        if use_fp8:  # scales column-major in the last two dims, as DeepEP returns them
            recv = (slab.view(torch.float8_e4m3fn), slab_s.transpose(1, 2).contiguous().transpose(1, 2))
        else:
            recv = slab
        return recv, count, handle, EventOverlap(), (lambda: None)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None):
        if not self.low_latency_mode:
            raise RuntimeError("fake deep_ep: low_latency_combine needs Buffer(..., low_latency_mode=True)")
        if topk_weights.dtype != torch.float32:
            raise TypeError("fake deep_ep: topk_weights must be float32")
        CALLS["ll_combine"] += 1
        src_info, layout_range, M, H, E = handle
        L = x.shape[0]
        g_x, g_info, g_range = self._gather(x), self._gather(src_info), self._gather(layout_range)
        T = topk_idx.shape[0]
        result = torch.zeros(T, H, dtype=torch.float32)
        for t in range(T):
            for k in range(topk_idx.shape[1]):
                e = int(topk_idx[t, k])
                if e < 0:
                    continue
                owner, le = divmod(e, L)
                packed = int(g_range[owner][le, self.rank])
                begin, c = packed >> 32, packed & 0xFFFFFFFF
                rows = (g_info[owner][le, begin:begin + c] == t).nonzero().flatten()
                if rows.numel() != 1:
                    raise RuntimeError(f"fake deep_ep: token {t} found {rows.numel()} times in expert {e}'s slab")
                result[t] += topk_weights[t, k] * g_x[owner][le, begin + int(rows[0])].float()
        combined = result.to(x.dtype)
        if out is not None:
            out.copy_(combined)
            combined = out
        return combined, EventOverlap(), (lambda: None)
