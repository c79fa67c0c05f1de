"""A CPU/gloo stand-in for DeepEP's V1 ``deep_ep.Buffer`` normal-mode API, used only by the tests.

It implements the semantics DeepEP's own tests check (``tests/test_intranode.py`` of deepseek-ai/DeepEP;
``shared/notes/specs.md`` §4.1), with ``torch.distributed.all_to_all_single`` instead of NVLink kernels:

- ``get_dispatch_layout(topk_idx [T, K], E)`` -> ``(num_tokens_per_rank [R] int32, None,
  num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)``;
- ``dispatch`` sends every token at most once to each rank holding one of its experts, source-rank-major and in
  token order, with ``recv_topk_idx`` in LOCAL expert ids (-1 elsewhere) and ``recv_topk_weights`` zeroed at -1;
  ``num_recv_tokens_per_expert_list`` padded to ``expert_alignment``; a cached ``dispatch(x, handle=...)`` moves
  only ``x``; an FP8 ``x`` is a ``(codes, scales)`` pair;
- ``combine(x, handle, topk_weights=None)`` is the unweighted sum over the ranks that received each token.

Nothing here is used by the library; it lets the tests prove that ``moe_rl.moe.ep_deepep`` drives that API
correctly (outputs and gradients equal to the single-process MoE). Real DeepEP needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

CALLS = {"dispatch": 0, "cached_dispatch": 0, "combine": 0, "buffers": 0}


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
