"""A CPU/gloo stand-in for DeepEP's V1 ``deep_ep.Buffer`` normal-mode API, used only by the tests.

It implements the semantics DeepEP's own tests check (``tests/test_intranode.py`` of deepseek-ai/DeepEP;
``shared/notes/specs.md`` §4.1), with ``torch.distributed.all_to_all_single`` instead of NVLink kernels:

- ``get_dispatch_layout(topk_idx [T, K], E)`` -> ``(num_tokens_per_rank [R] int32, None,
  num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)``;
- ``dispatch`` sends every token at most once to each rank holding one of its experts, source-rank-major and in
  token order, with ``recv_topk_idx`` in LOCAL expert ids (-1 elsewhere) and ``recv_topk_weights`` zeroed at -1;
  ``num_recv_tokens_per_expert_list`` padded to ``expert_alignment``; a cached ``dispatch(x, handle=...)`` moves
  only ``x``; an FP8 ``x`` is a ``(codes, scales)`` pair;
- ``combine(x, handle, topk_weights=None)`` is the unweighted sum over the ranks that received each token;
- low-latency mode (``Buffer(..., low_latency_mode=True)``; DeepEP ``deep_ep/buffer.py`` ``low_latency_dispatch`` /
  ``low_latency_combine``, checked by its ``tests/test_low_latency.py``): see :meth:`Buffer.low_latency_dispatch`.

Nothing here is used by the library; it lets the tests prove that ``moe_rl.moe.ep_deepep`` drives that API
correctly (outputs and gradients equal to the single-process MoE). Real DeepEP needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

CALLS = {"dispatch": 0, "cached_dispatch": 0, "combine": 0, "buffers": 0, "ll_dispatch": 0, "ll_combine": 0}


class EventOverlap:
    def current_stream_wait(self) -> None:
        return None


@dataclass
class Config:
    num_sms: int = 20

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 1 << 20

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


@dataclass
class _Handle:
    is_token_in_rank: torch.Tensor  # [T, R]
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


def _a2a(x: torch.Tensor, out_rows: int, out_splits, in_splits, group) -> torch.Tensor:
    is_f8 = x.dtype.itemsize == 1 and x.dtype.is_floating_point
    src = x.view(torch.uint8) if is_f8 else x
    out = src.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out, src.contiguous(), out_splits, in_splits, group=group)
    return out.view(x.dtype) if is_f8 else out


class Buffer:
    num_sms = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, **_):
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        CALLS["buffers"] += 1

    @staticmethod
    def set_num_sms(n: int) -> None:
        Buffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        if topk_idx.dtype != torch.int64:
            raise TypeError("fake deep_ep: topk_idx must be int64")
        local = num_experts // self.group_size
        rank_idx = torch.where(topk_idx >= 0, torch.div(topk_idx, local, rounding_mode="floor"), -1)
        in_rank = torch.stack([(rank_idx == r).any(1) for r in range(self.group_size)], 1)
        per_rank = in_rank.sum(0).to(torch.int32)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).to(torch.int32)
        return per_rank, None, per_expert, in_rank, EventOverlap()

    def _rows_for(self, t: torch.Tensor, in_rank: torch.Tensor) -> torch.Tensor:
        parts = [t[in_rank[:, r]] for r in range(self.group_size)]
        return torch.cat(parts) if parts else t[:0]

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        pair = isinstance(x, tuple)
        x0 = x[0] if pair else x
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("fake deep_ep: cached dispatch takes no top-k arguments")
            CALLS["cached_dispatch"] += 1
            h = handle
        else:
            CALLS["dispatch"] += 1
            in_rank = is_token_in_rank
            send = in_rank.sum(0).tolist()
            recv_t = torch.empty(self.group_size, dtype=torch.int64)
            dist.all_to_all_single(recv_t, torch.tensor(send, dtype=torch.int64), group=self.group)
            h = _Handle(in_rank, send, recv_t.tolist(), x0.shape[0])
        n_recv = sum(h.recv_splits)

        def move(t):
            return _a2a(self._rows_for(t, h.is_token_in_rank), n_recv, h.recv_splits, h.send_splits, self.group)

        recv_x = (move(x[0]), move(x[1])) if pair else move(x)
        if handle is not None:
            return recv_x, None, None, None, None, EventOverlap()
        recv_idx = recv_w = None
        counts: list[int] = []
        if topk_idx is not None:
            local = num_tokens_per_expert.shape[0] // self.group_size
            ids = move(topk_idx)
            lo = self.rank * local
            mine = (ids >= lo) & (ids < lo + local)
            recv_idx = torch.where(mine, ids - lo, torch.full_like(ids, -1))
            recv_w = torch.where(mine, move(topk_weights), torch.zeros((), dtype=topk_weights.dtype))
            raw = torch.bincount(recv_idx[recv_idx >= 0], minlength=local).tolist()
            a = expert_alignment
            counts = [(c + a - 1) // a * a for c in raw]
        return recv_x, recv_idx, recv_w, counts, h, EventOverlap()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        CALLS["combine"] += 1
        h: _Handle = handle

        def back(t):
            rows = _a2a(t, sum(h.send_splits), h.send_splits, h.recv_splits, self.group)
            out = torch.zeros((h.num_tokens, *t.shape[1:]), dtype=torch.float32)
            start = 0
            for r in range(self.group_size):
                idx = torch.nonzero(h.is_token_in_rank[:, r]).flatten()
                out.index_add_(0, idx, rows[start : start + idx.numel()].float())
                start += idx.numel()
            return out.to(t.dtype)

        combined = back(x)
        combined_w = back(topk_weights) if topk_weights is not None else None
        return combined, combined_w, EventOverlap()

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
