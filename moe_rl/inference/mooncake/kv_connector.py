"""A vLLM v1 KV connector that offloads prefix KV blocks to the Mooncake Store (the "Mooncake KV tier").

Use it through ``--kv-transfer-config`` (``VllmServerConfig.kv_transfer_config``)::

    {"kv_connector": "MooncakeKVTier",
     "kv_connector_module_path": "moe_rl.inference.mooncake.kv_connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"master_address": "127.0.0.1:50051",
                                   "metadata_url": "http://127.0.0.1:8080/metadata",
                                   "model": "my-model", "weight_version": 3}}

What it does:

- **scheduler side** (``get_num_new_matched_tokens``): for a new request, hashes the full blocks of its prompt
  (leaving at least one token to compute) into a chain (:func:`~moe_rl.inference.mooncake.keys.kv_chain_hashes`),
  builds one key per block and shard (:func:`~moe_rl.inference.mooncake.keys.kv_block_key`: model, weight version,
  ``cache_salt`` digest, KV dtype, block size, cache layout, shard, chain hash) and asks the store which exist (one
  RPC); the longest present prefix beyond the locally cached tokens is loaded. A request with multimodal inputs, a
  LoRA adapter or prompt embeddings is never looked up or saved.
- **worker side**: before the forward (``start_load_kv``) it fetches every block of a request to load and writes it
  into the paged cache only when all of them arrived with the expected size (never partial KV); after the forward
  (``wait_for_save``) it stores the prompt's full blocks whose KV is complete, skipping keys already present.
- **failures degrade to recompute**: a store error at lookup counts as a miss; at load, the request's blocks are
  reported through ``get_block_ids_with_load_errors`` and vLLM recomputes them (this needs
  ``kv_load_failure_policy="recompute"``, checked at start); at save, the blocks are simply not stored. Each is
  counted in :func:`kv_tier_stats` (process-wide; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the caller's process)
  and logged by vLLM through ``get_kv_connector_stats``.

Weight version: ``cache_salt_for`` (``moe_rl.rl.salt``) already changes the salt with every policy version and
weight dtype, so the salt alone separates versions; ``weight_version`` in the extra config adds the version
explicitly (``"wx"`` in the key when absent). vLLM's scheduler process never sees the worker extension's version,
so an engine whose weights change in place must get a new salt per version (what the orchestrator sends).

Only engines whose KV cache is one group of attention layers (no hybrid/sliding-window groups) are supported; a
different layout raises ValueError at start. Objects live in the segments of the store's clients: a client
(engine) that stops takes its share of the stored blocks with it.

Imported only by vLLM (scheduler and worker); importing it imports vLLM and torch.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from moe_rl.inference.mooncake.keys import kv_block_key, kv_chain_hashes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["MooncakeKVTier", "kv_tier_stats", "reset_kv_tier_stats"]

log = logging.getLogger(__name__)

_STAT_NAMES = (
    "lookups",  # requests looked up in the store
    "lookup_hit_blocks",  # blocks found (beyond the local prefix cache) and scheduled for loading
    "lookup_failures",  # lookups that failed (store unreachable): treated as misses
    "loaded_blocks",  # blocks written into the paged cache from the store
    "load_failures",  # requests whose load failed: their blocks are recomputed
    "saved_blocks",  # blocks newly written to the store
    "save_failures",  # save batches that failed: those blocks are not stored
    "connect_failures",  # attempts to join the store that failed
)
_STATS: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)
_STATS_LOCK = threading.Lock()


def _count(name: str, n: int = 1) -> None:
    with _STATS_LOCK:
        _STATS[name] += n


def kv_tier_stats() -> dict[str, int]:
    """A copy of this process's KV-tier counters (see ``_STAT_NAMES`` for their meaning)."""
    with _STATS_LOCK:
        return dict(_STATS)


def reset_kv_tier_stats() -> None:
    """Zero this process's KV-tier counters."""
    with _STATS_LOCK:
        for k in _STATS:
            _STATS[k] = 0


# ---------------------------------------------------------------------------------------------- store client
_CLIENTS: dict[str, Any] = {}
_CLIENT_RETRY_AT: dict[str, float] = {}
_CLIENT_LOCK = threading.Lock()


def _client(config: Any, count: Any = None) -> Any:
    """The process's ``StoreClient`` for ``config`` (scheduler and worker connectors in one process share it);
    raises ``StoreError``/``RuntimeError`` when the store cannot be joined (retried after the cooldown; each failed
    attempt is counted through ``count``)."""
    import time

    from moe_rl.inference.mooncake.store import StoreClient, StoreError

    key = config.model_dump_json()
    with _CLIENT_LOCK:
        client = _CLIENTS.get(key)
        if client is not None:
            return client
        if time.monotonic() < _CLIENT_RETRY_AT.get(key, 0.0):
            raise StoreError("setup", config.master_address, -900, "not retried during the cooldown")
        try:
            client = StoreClient(config)
        except Exception:
            (count or _count)("connect_failures")
            _CLIENT_RETRY_AT[key] = time.monotonic() + config.unreachable_cooldown_s
            raise
        _CLIENTS[key] = client
        return client


# ---------------------------------------------------------------------------------------------- engine metrics
@dataclass
class MooncakeKVTierStats(KVConnectorStats):
    """Counter increments (``{name: int}``, names as in :func:`kv_tier_stats`) sent from the engine to vLLM's
    stat loggers."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> MooncakeKVTierStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _TierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per KV-tier counter, labelled per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: {idx: self._counter_cls(name=f"vllm:moe_rl_kv_tier_{name}",
                                          documentation=f"moe_rl Mooncake KV tier: {name.replace('_', ' ')}",
                                          labelnames=labelnames).labels(*values)
                   for idx, values in per_engine_labelvalues.items()}
            for name in _STAT_NAMES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)


# ---------------------------------------------------------------------------------------------- metadata
@dataclass
class _Transfer:
    """Blocks of one request to move: ``block_ids[i]`` holds the block keyed ``chain[i]``."""

    req_id: str
    block_ids: list[int]
    chain: list[str]
    salt: str | None


@dataclass
class MooncakeKVTierMetadata(KVConnectorMetadata):
    """What the worker does this step: loads before the forward, saves after it."""

    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of a running request."""

    prompt: list[int]
    salt: str | None
    saveable_blocks: int  # full prompt blocks
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # blocks [0, saved) already handed to the worker for saving


def _extra(config: Any, name: str, default: Any) -> Any:
    return config.get_from_extra_config(name, default)


class MooncakeKVTier(KVConnectorBase_V1):
    """vLLM v1 connector: prefix KV blocks in the Mooncake Store (see the module docstring).

    Extra config (``kv_connector_extra_config``): ``master_address`` and ``metadata_url`` (required), ``model``
    (default: the served model name), ``weight_version`` (int, optional), ``global_segment_bytes`` (memory this
    engine lends the store, default 256 MiB), ``local_buffer_bytes`` (default 64 MiB), ``unreachable_cooldown_s``
    (default 5).

    Raises (at start):
        ValueError: a missing address, ``kv_load_failure_policy`` other than ``"recompute"``, a KV cache that is not
            one attention group, a bad ``weight_version``.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from moe_rl.inference.mooncake.store import StoreClientConfig

        tc = self._kv_transfer_config
        if tc.kv_load_failure_policy != "recompute":
            raise ValueError(
                f"MooncakeKVTier: kv_load_failure_policy={tc.kv_load_failure_policy!r}; set it to 'recompute' in "
                "--kv-transfer-config so a block the store fails to deliver is recomputed instead of failing the request"
            )
        missing = [k for k in ("master_address", "metadata_url") if not _extra(tc, k, None)]
        if missing:
            raise ValueError(f"MooncakeKVTier: kv_connector_extra_config lacks {missing}; give the Mooncake master's "
                             "'master_address' (host:port) and 'metadata_url' (MooncakeMaster.client_config())")
        self._store_config = StoreClientConfig(
            master_address=_extra(tc, "master_address", None), metadata_url=_extra(tc, "metadata_url", None),
            global_segment_bytes=int(_extra(tc, "global_segment_bytes", 256 << 20)),
            local_buffer_bytes=int(_extra(tc, "local_buffer_bytes", 64 << 20)),
            unreachable_cooldown_s=float(_extra(tc, "unreachable_cooldown_s", 5.0)),
        )
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        self._model = str(_extra(tc, "model", None) or mc.served_model_name or mc.model)
        version = _extra(tc, "weight_version", None)
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"MooncakeKVTier: weight_version={version!r} must be an int >= 0 (or absent)")
        self._version: int | None = version
        self._block_size = int(cc.block_size)
        self._kv_dtype = (str(mc.dtype).removeprefix("torch.") if cc.cache_dtype == "auto" else str(cc.cache_dtype))
        self._world = int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)
        self._layout = self._layout_fingerprint(kv_cache_config)
        try:  # a model id or dtype that cannot be a key component fails here, not at every lookup
            self._keys(["0"], None, 0)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"MooncakeKVTier: cannot build store keys ({exc}); set kv_connector_extra_config"
                             "['model'] to an id without '|' or whitespace") from None
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._rank: int | None = None
        # scheduler side
        self._lookups: dict[str, tuple[int, int, list[str]]] = {}  # req -> (first block, end block, chain)
        self._pending_load: dict[str, tuple[int, int, list[str]]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._salts: dict[str, str | None] = {}  # req -> cache_salt (NewRequestData does not carry it)
        self._unreported: dict[str, int] = {}  # counts since the last get_kv_connector_stats

    # ------------------------------------------------------------------ counters
    def _inc(self, name: str, n: int = 1) -> None:
        _count(name, n)
        self._unreported[name] = self._unreported.get(name, 0) + n

    def get_kv_connector_stats(self) -> MooncakeKVTierStats | None:
        """This instance's counts since the last call (vLLM sums the scheduler's and the workers' and adds them to
        the Prometheus counters ``vllm:moe_rl_kv_tier_<name>``)."""
        if not self._unreported:
            return None
        out, self._unreported = MooncakeKVTierStats(data=self._unreported), {}
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> MooncakeKVTierStats:
        """vLLM's hook to rebuild the stats object from its serialized ``data``."""
        return MooncakeKVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> _TierPromMetrics:
        """Prometheus counters ``vllm:moe_rl_kv_tier_<name>`` (one per counter of :func:`kv_tier_stats`)."""
        return _TierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ keys
    @staticmethod
    def _layout_fingerprint(kv_cache_config: Any) -> str:
        if kv_cache_config is None:
            raise ValueError("MooncakeKVTier needs vLLM's kv_cache_config (vLLM >= 0.11 passes it to connectors)")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"MooncakeKVTier: the KV cache has {len(groups)} groups; only one group of attention "
                             "layers is supported (no hybrid/sliding-window models)")
        spec = groups[0].kv_cache_spec
        desc = (type(spec).__name__, tuple(groups[0].layer_names), getattr(spec, "num_kv_heads", None),
                getattr(spec, "head_size", None), getattr(spec, "head_size_v", None), str(getattr(spec, "dtype", "")),
                int(spec.block_size))
        return hashlib.sha256(repr(desc).encode()).hexdigest()[:12]

    def _keys(self, chain: list[str], salt: str | None, rank: int) -> list[str]:
        return [kv_block_key(model=self._model, cache_salt=salt, weight_version=self._version, kv_dtype=self._kv_dtype,
                             block_size=self._block_size, layout=self._layout, rank=rank, world=self._world,
                             chain_hash=h).to_str() for h in chain]

    # ------------------------------------------------------------------ scheduler side
    @staticmethod
    def _eligible(request: Any) -> bool:
        return (bool(request.prompt_token_ids) and not request.mm_features and request.lora_request is None
                and getattr(request, "prompt_embeds", None) is None)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` whose KV the store holds (block-aligned; 0 on any error)."""
        if not self._eligible(request):
            return 0, False
        self._salts[request.request_id] = request.cache_salt
        prompt = list(request.prompt_token_ids)
        bs = self._block_size
        n_blocks = (len(prompt) - 1) // bs  # at least one token is left to compute
        first = num_computed_tokens // bs
        if n_blocks <= first:
            return 0, False
        chain = kv_chain_hashes(prompt, bs, n_blocks)
        self._inc("lookups")
        try:
            client = _client(self._store_config, self._inc)
            keys = [k for r in range(self._world) for k in self._keys(chain[first:], request.cache_salt, r)]
            present = client.exists_batch(keys)
        except Exception as exc:  # the store is down: a miss, counted
            self._inc("lookup_failures")
            log.warning("MooncakeKVTier: lookup of request %s failed, recomputing: %s", request.request_id, exc)
            return 0, False
        per_block = n_blocks - first
        end = first
        for j in range(per_block):
            if not all(present[r * per_block + j] for r in range(self._world)):
                break
            end = first + j + 1
        if end == first:
            return 0, False
        self._lookups[request.request_id] = (first, end, chain)
        return end * bs - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Schedule the load of the blocks found by the lookup (when vLLM accepted them)."""
        found = self._lookups.pop(request.request_id, None)
        if found is not None and num_external_tokens > 0:
            first, end, chain = found
            self._inc("lookup_hit_blocks", end - first)
            self._pending_load[request.request_id] = found

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Loads for newly scheduled requests that hit, saves for prompt blocks completed by this step."""
        meta = MooncakeKVTierMetadata()
        bs = self._block_size
        num_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0])
            load = self._pending_load.pop(new.req_id, None)
            prompt = list(new.prompt_token_ids or [])
            eligible = bool(prompt) and not new.mm_features and new.lora_request is None and new.prompt_embeds is None
            if not eligible or new.req_id not in self._salts:
                continue
            req_salt = self._salts[new.req_id]
            if load is not None:
                first, end, chain = load
                meta.loads.append(_Transfer(new.req_id, block_ids[first:end], chain[first:end], req_salt))
            tracked = _Tracked(prompt=prompt, salt=req_salt, saveable_blocks=len(prompt) // bs, block_ids=block_ids)
            self._tracked[new.req_id] = tracked
            self._queue_saves(meta, new.req_id, tracked, new.num_computed_tokens + num_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            load = self._pending_load.pop(req_id, None)
            if load is not None and cached.new_block_ids[i] is not None:  # a preempted request resumed with a hit
                first, end, chain = load  # on resumption new_block_ids is the request's whole block list
                meta.loads.append(_Transfer(req_id, list(cached.new_block_ids[i][0])[first:end], chain[first:end],
                                            self._salts.get(req_id)))
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._queue_saves(meta, req_id, tracked, cached.num_computed_tokens[i] + num_sched.get(req_id, 0))
        return meta

    def _queue_saves(self, meta: MooncakeKVTierMetadata, req_id: str, tracked: _Tracked, done_tokens: int) -> None:
        upto = min(done_tokens // self._block_size, tracked.saveable_blocks, len(tracked.block_ids))
        if upto > tracked.saved:
            chain = kv_chain_hashes(tracked.prompt, self._block_size, upto)
            meta.saves.append(_Transfer(req_id, tracked.block_ids[tracked.saved:upto], chain[tracked.saved:upto],
                                        tracked.salt))
            tracked.saved = upto
        if tracked.saved >= tracked.saveable_blocks:
            self._tracked.pop(req_id, None)

    def on_new_request(self, request: Request) -> None:
        """Remember the request's ``cache_salt`` (``NewRequestData`` does not carry it)."""
        self._salts[request.request_id] = request.cache_salt

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request (its saves were queued synchronously: blocks may be freed at once)."""
        for d in (self._tracked, self._lookups, self._pending_load, self._salts):
            d.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer paged caches (``[num_blocks, ...]`` views, blocks at dim 0)."""
        self._kv_caches = {name: kv_caches[name] for name in sorted(kv_caches)}

    def _worker_rank(self) -> int:
        if self._rank is None:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp = get_tp_group()
            self._rank = get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group
        return self._rank

    def _block_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._kv_caches.values())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Write the scheduled blocks into the paged cache; a request whose blocks do not all arrive intact is
        left untouched and its blocks are reported as load errors (vLLM recomputes them)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeKVTierMetadata)
        if not meta.loads:
            return
        if not self._kv_caches:
            self._kv_caches = self._caches_from_context(forward_context)
        expected = self._block_bytes()
        for t in meta.loads:
            try:
                payloads = _client(self._store_config, self._inc).get_batch(self._keys(t.chain, t.salt, self._worker_rank()))
                bad = [len(p) for p in payloads if len(p) != expected]
                if bad:
                    raise ValueError(f"stored block has {bad[0]} bytes, this engine's block has {expected}")
            except Exception as exc:
                self._inc("load_failures")
                self._load_errors.update(t.block_ids)
                log.warning("MooncakeKVTier: load of %d blocks for request %s failed, recomputing them: %s",
                            len(t.block_ids), t.req_id, exc)
                continue
            for block_id, payload in zip(t.block_ids, payloads, strict=True):
                flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                offset = 0
                for cache in self._kv_caches.values():
                    dst = cache[block_id]
                    n = dst.numel() * dst.element_size()
                    dst.copy_(flat[offset:offset + n].view(dst.dtype).view(dst.shape))
                    offset += n
            self._inc("loaded_blocks", len(t.block_ids))

    @staticmethod
    def _caches_from_context(forward_context: Any) -> dict[str, torch.Tensor]:
        out = {}
        for name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, torch.Tensor):
                out[name] = cache
        return {k: out[k] for k in sorted(out)}

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous (``start_load_kv``): nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saving happens once per step in :meth:`wait_for_save` (all layers of a block in one object)."""

    def wait_for_save(self) -> None:
        """Store the blocks the scheduler queued (after this step's forward wrote them); keys already present are
        skipped; a failure is counted and the blocks stay unstored."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeKVTierMetadata)
        if not meta.saves or not self._kv_caches:
            return
        rank = self._worker_rank()
        for t in meta.saves:
            try:
                client = _client(self._store_config, self._inc)
                keys = self._keys(t.chain, t.salt, rank)
                there = client.exists_batch(keys)
                items = []
                for key, block_id, present in zip(keys, t.block_ids, there, strict=True):
                    if present:
                        continue
                    parts = [c[block_id].contiguous().reshape(-1).view(torch.uint8) for c in self._kv_caches.values()]
                    items.append((key, torch.cat(parts).numpy()))
                if items:
                    report = client.put_batch(items)
                    self._inc("saved_blocks", report.written)
            except Exception as exc:
                self._inc("save_failures")
                log.warning("MooncakeKVTier: save of %d blocks for request %s failed (not stored): %s",
                            len(t.block_ids), t.req_id, exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        """Leave the store (closes this process's shared client; idempotent): the blocks stored in this engine's
        segment disappear from the store."""
        with _CLIENT_LOCK:
            client = _CLIENTS.pop(self._store_config.model_dump_json(), None)
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # a dead master: nothing left to unmount
                log.warning("MooncakeKVTier: closing the store client failed: %s", exc)
