"""Stand-in for DeepEP 2.x ``ElasticBuffer`` / ``EPHandle`` (``deep_ep/buffers/elastic.py``), normal (non-expanded)
mode, on gloo with ``torch.distributed.all_to_all_single``.

Semantics emulated (as DeepEP's ``tests/elastic/test_ep.py`` checks them against ``deep_ep/utils/refs.py``):

- ``get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, ...)``: a 2 MB-aligned
  byte count (this stand-in's own formula; only its shape matters);
- ``dispatch(x, topk_idx=[T, K] int64, topk_weights=[T, K] fp32, num_experts=E, expert_alignment=a)`` sends each
  token at most once to every rank that holds one of its experts and returns ``(recv_x [N, D] (or the FP8
  (codes, scales) pair), recv_topk_idx [N, K] LOCAL ids with -1 for experts on other ranks, recv_topk_weights
  [N, K] (the source's weights, NOT masked at -1 slots: DeepEP leaves them unspecified), EPHandle, EventOverlap)``;
  ``handle.num_recv_tokens_per_expert_list`` is padded to ``expert_alignment``; at most
  ``num_max_tokens_per_rank`` tokens per rank;
- received-token order: sorted by source rank then source token with ``deterministic=True``; otherwise a fixed
  scramble (DeepEP's order then depends on which channel lands first), so callers cannot rely on it;
- a cached ``dispatch(x, handle=h)`` (``topk_idx`` must be None; ``topk_weights`` optional) reuses the layout;
- ``combine(x [N, D], handle, topk_weights=None, bias=None)`` returns ``(combined_x [T, D], combined_topk_weights
  [T, K] | None, EventOverlap)``: ``combined_x[t]`` is the UNWEIGHTED sum (fp32 accumulate, cast to x's dtype) over
  the ranks that received token t of their row (plus bias); ``combined_topk_weights[t, k]`` is slot k's weight
  as sent back by the rank that owns expert ``topk_idx[t, k]`` (0 for -1 slots), so a round trip returns the
  original weights (``test_ep.py``: ``combined_topk_weights == topk_weights``).

The expanded layout (``do_expand=True``) is not emulated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._stats import CALLS
from ..utils.event import EventOverlap

_ALIGN = 2 << 20  # DeepEP's elastic buffer alignment (2 MB)


def _align(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def _a2a(t: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    is_f8 = t.dtype.itemsize == 1 and t.dtype.is_floating_point
    src = (t.view(torch.uint8) if is_f8 else t).contiguous()
    out = src.new_empty((out_rows, *t.shape[1:]))
    dist.all_to_all_single(out, src, out_splits, in_splits, group=group)
    return out.view(t.dtype) if is_f8 else out


class EPHandle:
    """Routing metadata of one dispatch (DeepEP's public attributes, plus the stand-in's own ``_`` fields)."""

    def __init__(self, *, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx,
                 num_recv_tokens, num_recv_tokens_per_expert_list, psum_num_recv_tokens_per_scaleup_rank,
                 psum_num_recv_tokens_per_expert, recv_src_metadata, send_index, send_splits, recv_splits,
                 order, recv_local_idx):
        self.do_expand = False
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = 0
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = None
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = None
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        # stand-in only
        self._send_index = send_index  # [S] source token of each sent row, rank-major
        self._send_splits = send_splits
        self._recv_splits = recv_splits
        self._order = order  # [N] row of the rank-major received rows at each output position
        self._recv_local_idx = recv_local_idx  # [N, K] in output order


class ElasticBuffer:
    def __init__(self, group: dist.ProcessGroup, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False):
        self.group = group
        self.rank_idx = group.rank()  # like DeepEP: a ProcessGroup, not None
        self.num_ranks = group.size()
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        if num_bytes is None:
            num_bytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                           use_fp8_dispatch, allow_hybrid_mode,
                                                           allow_multiple_reduction)
        if num_bytes % _ALIGN:
            raise ValueError(f"fake deep_ep: num_bytes={num_bytes} must be aligned to 2 MB")
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.explicitly_destroy = explicitly_destroy
        CALLS["buffers"] += 1
        dist.barrier(group=group)

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        CALLS["size_hints"] += 1
        row = hidden + 4 * ((hidden + 127) // 128) if use_fp8_dispatch else 2 * hidden
        per_token = row + num_topk * 12 + 16  # payload, top-k ids and weights, metadata
        return _align(2 * group.size() * num_max_tokens_per_rank * per_token, _ALIGN)

    def destroy(self) -> None:
        assert self.explicitly_destroy

    # ----------------------------------------------------------------------------------------------- dispatch

    def _layout(self, topk_idx: torch.Tensor, num_experts: int, max_tok: int, alignment: int):
        R, rank = self.num_ranks, self.rank_idx
        L = num_experts // R
        owner = torch.where(topk_idx >= 0, torch.div(topk_idx, L, rounding_mode="floor"), -1)
        in_rank = torch.stack([(owner == r).any(1) for r in range(R)], 1)  # [T, R]
        send_index = torch.cat([in_rank[:, r].nonzero().flatten() for r in range(R)])  # rank-major, token order
        send_splits = in_rank.sum(0).tolist()
        recv_t = torch.empty(R, dtype=torch.int64)
        dist.all_to_all_single(recv_t, torch.tensor(send_splits, dtype=torch.int64), group=self.group)
        recv_splits = recv_t.tolist()
        n = sum(recv_splits)
        # global ids and the source's global token index travel with the tokens
        ids = _a2a(topk_idx[send_index], n, recv_splits, send_splits, self.group)
        src = _a2a(send_index + rank * max_tok, n, recv_splits, send_splits, self.group)
        order = torch.arange(n)
        if not self.deterministic and n > 1:  # a fixed scramble: odd positions first, then even, reversed
            order = torch.cat([torch.arange(1, n, 2), torch.arange(0, n, 2)]).flip(0)
        ids, src = ids[order], src[order]
        lo = rank * L
        mine = (ids >= lo) & (ids < lo + L)
        local_idx = torch.where(mine, ids - lo, torch.full_like(ids, -1))
        raw = torch.bincount(local_idx[local_idx >= 0], minlength=L)
        aligned = (raw + alignment - 1) // alignment * alignment
        metadata = torch.cat([src.view(-1, 1), torch.zeros(n, 1, dtype=torch.int64)], 1)
        return dict(send_index=send_index, send_splits=send_splits, recv_splits=recv_splits, order=order,
                    recv_local_idx=local_idx, raw_counts=raw, aligned=aligned, metadata=metadata, n=n)

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0,
                 previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream=False,
                 allocate_on_comm_stream=False, handle=None, do_handle_copy=True, do_cpu_sync=None,
                 do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False):
        if do_expand:
            raise NotImplementedError("fake deep_ep: the expanded layout (do_expand=True) is not emulated")
        x, sf = x if isinstance(x, tuple) else (x, None)
        if num_sms == 0 and num_experts is None:
            # DeepEP picks the SM count with get_theoretical_num_sms(num_experts, ...) before it reads the handle
            raise TypeError("fake deep_ep: dispatch with num_sms=0 needs num_experts (even with a cached handle)")
        if handle is not None:
            assert topk_idx is None, "fake deep_ep: a cached dispatch takes topk_idx=None (it is in the handle)"
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            num_experts = handle.num_experts if num_experts is None else num_experts
            expert_alignment = handle.expert_alignment if expert_alignment is None else expert_alignment
            max_tok = handle.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
            assert (num_experts, expert_alignment, max_tok) == (
                handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            if x.shape[0] != handle.topk_idx.shape[0]:
                raise RuntimeError(f"fake deep_ep: cached dispatch of {x.shape[0]} tokens, handle has "
                                   f"{handle.topk_idx.shape[0]}")
            CALLS["cached_dispatch"] += 1
        else:
            if num_experts is None:
                raise TypeError("fake deep_ep: dispatch without a handle needs num_experts")
            if topk_idx is None or topk_idx.dtype != torch.int64:
                raise TypeError("fake deep_ep: topk_idx must be an int64 tensor (deep_ep.topk_idx_t)")
            max_tok = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
            expert_alignment = 1 if expert_alignment is None else expert_alignment
            if num_experts % self.num_ranks:
                raise RuntimeError(f"fake deep_ep: num_experts={num_experts} not a multiple of {self.num_ranks}")
            CALLS["dispatch"] += 1
        if topk_weights is not None and topk_weights.dtype != torch.float32:
            raise TypeError("fake deep_ep: topk_weights must be float32")
        if x.shape[0] > max_tok:
            raise RuntimeError(f"fake deep_ep: {x.shape[0]} tokens > num_max_tokens_per_rank={max_tok}")
        if sf is not None and (sf.shape[0] != x.shape[0] or sf.dtype != torch.float32):
            raise TypeError("fake deep_ep: FP8 scales must be [num_tokens, hidden / 128] float32")
        if handle is None:
            lay = self._layout(topk_idx, num_experts, max_tok, expert_alignment)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats += lay["raw_counts"].to(cumulative_local_expert_recv_stats.dtype)
            handle = EPHandle(
                num_experts=num_experts, expert_alignment=expert_alignment, num_max_tokens_per_rank=max_tok,
                num_sms=num_sms or 20, topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
                num_recv_tokens=lay["n"], num_recv_tokens_per_expert_list=lay["aligned"].tolist(),
                psum_num_recv_tokens_per_scaleup_rank=torch.cumsum(torch.tensor(lay["recv_splits"]), 0).int(),
                psum_num_recv_tokens_per_expert=torch.cumsum(lay["aligned"], 0).int(),
                recv_src_metadata=lay["metadata"], send_index=lay["send_index"], send_splits=lay["send_splits"],
                recv_splits=lay["recv_splits"], order=lay["order"], recv_local_idx=lay["recv_local_idx"])
        h = handle

        def move(t: torch.Tensor) -> torch.Tensor:
            return _a2a(t[h._send_index], h.num_recv_tokens, h._recv_splits, h._send_splits, self.group)[h._order]

        recv_x = move(x) if sf is None else (move(x), move(sf))
        recv_w = move(topk_weights) if topk_weights is not None else None
        return recv_x, h._recv_local_idx.clone(), recv_w, h, EventOverlap()

    # ------------------------------------------------------------------------------------------------ combine

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                previous_event_before_epilogue=None, async_with_compute_stream=False,
                allocate_on_comm_stream=False):
        CALLS["combine"] += 1
        h: EPHandle = handle
        n, T = h.num_recv_tokens, h.topk_idx.shape[0]
        if x.shape[0] < n:
            raise RuntimeError(f"fake deep_ep: combine of {x.shape[0]} rows, the handle received {n}")
        unorder = torch.empty_like(h._order)
        unorder[h._order] = torch.arange(n)

        def back(t: torch.Tensor) -> torch.Tensor:  # output order -> rank-major -> back at the sources
            return _a2a(t[:n][unorder], sum(h._send_splits), h._send_splits, h._recv_splits, self.group)

        rows = back(x)
        out = torch.zeros((T, x.shape[1]), dtype=torch.float32)
        out.index_add_(0, h._send_index, rows.float())
        if bias is not None:
            for b in bias if isinstance(bias, tuple) else (bias,):
                out += b.float()
        combined_w = None
        if topk_weights is not None:
            w_rows = back(topk_weights)  # [S, K]: each sent row's K weights as its destination returned them
            L = h.num_experts // self.num_ranks
            owner = torch.where(h.topk_idx >= 0, torch.div(h.topk_idx, L, rounding_mode="floor"), -1)
            dest = torch.cat([torch.full((c,), r, dtype=torch.int64) for r, c in enumerate(h._send_splits)])
            combined_w = torch.zeros((T, h.topk_idx.shape[1]), dtype=topk_weights.dtype)
            for s in range(dest.shape[0]):  # slot k of token t comes from the rank that owns its expert
                t = int(h._send_index[s])
                keep = owner[t] == dest[s]
                combined_w[t, keep] = w_rows[s, keep]
        return out.to(x.dtype), combined_w, EventOverlap()
