"""Publish a (sharded) model as one Hugging Face checkpoint folder, one tensor at a time (the FP8 path of the
``filesystem`` transport: 128x128 FP8 blocks are cut from whole tensors; otherwise every rank writes its own shards,
:class:`moe_rl.weights.filesystem.ShardedFilesystemPublisher`).

Gathering the whole state dict on rank 0 needs the full model in one host's memory (about 1.5 TB for GLM-5.1 in bf16). Here every rank walks the model's tensors in the same order; each
DTensor (FSDP2 / EP shard) is gathered alone (``full_tensor``, a collective), rank 0 cuts it into its Hugging Face
tensors (the regions of ``hf_sources`` in the family's ``state_dict`` module: per-expert slices of the stacked
experts, the router rename, MTP layers as ``model.layers.{L+m}``), casts them, optionally quantizes them to the
128x128 block FP8 checkpoint format (:mod:`moe_rl.weights.fp8`), and streams them into safetensors shards
(:class:`moe_rl.weights.filesystem.ShardedVersionWriter`). Rank 0 holds at most one gathered tensor plus one shard;
the folder's tensors equal ``to_hf_state_dict(full_state_dict(model))`` cast to ``dtype`` (fp32 tensors named by
:func:`moe_rl.models.hf_io.keeps_fp32` stay fp32, as in the models' checkpoints).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["publish_model_streaming"]


def publish_model_streaming(
    model: torch.nn.Module,
    mcfg: Any,
    root: str | Path,
    version: int,
    hf_config: dict,
    extra_files: list[str | Path] | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    quantize_fp8: bool = False,
    max_shard_bytes: int = 4 << 30,
) -> dict[str, Any] | None:
    """Write ``model``'s weights as version ``version`` under ``root`` (a collective when the default process
    group has several ranks: every rank must call it with the same model structure; rank 0 writes).

    Args:
        model: a ``GlmMoeForCausalLM`` / ``GlmMoeDsaForCausalLM``, plain or from ``parallelize_model``.
        mcfg: its config.
        root: the run's ``weights/`` folder (shared with the engines).
        version: the version (folder ``step_<version>``; immutable once published).
        hf_config: the ``config.json`` dict (add ``quantization_config`` yourself when ``quantize_fp8``).
        extra_files: files copied into the folder (tokenizer files).
        dtype: dtype of the published tensors (those not FP8-quantized).
        quantize_fp8: quantize 2-D weights to e4m3 with ``weight_scale_inv`` (the kept-in-precision list of
            :func:`moe_rl.weights.fp8.keep_high_precision`).
        max_shard_bytes: target size of one safetensors shard.

    Returns:
        On rank 0 ``{"transport": "filesystem", "version", "tensors", "bytes", "shards", "path", "seconds"}``;
        None on the other ranks.

    Raises:
        ValueError: the model's keys do not match ``mcfg`` (from ``hf_sources``), or ``version`` already published.
    """
    from torch.distributed.tensor import DTensor

    from moe_rl.models.hf_io import keeps_fp32, strip_wrappers

    t0 = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    sd = model.state_dict()
    keys = list(sd)
    shapes = {strip_wrappers(k): tuple(v.shape) for k, v in sd.items()}
    writer = None
    sources: dict = {}
    tied = bool(getattr(mcfg, "tie_word_embeddings", False))
    if rank == 0:
        from moe_rl.weights.filesystem import ShardedVersionWriter
        from moe_rl.weights.regions import hf_sources_of

        sources = hf_sources_of(model, mcfg, shapes)
        writer = ShardedVersionWriter(root, version, hf_config, extra_files, max_shard_bytes=max_shard_bytes)
    n = 0
    for k in keys:
        v = sd[k]
        full = v.full_tensor() if isinstance(v, DTensor) else v  # collective for DTensors: every rank, same order
        if writer is None:
            del full
            continue
        key = strip_wrappers(k)
        if key == "lm_head.weight" and tied:
            continue  # the checkpoint stores the embedding once
        for blk in sources[key]:
            region = tuple(slice(o, o + s) for o, s in zip(blk.offset, (1,) * (full.dim() - len(blk.shape))
                                                          + tuple(blk.shape), strict=True))
            t = full.detach()[region].reshape(blk.shape)
            # router bias correction and DSA indexer head stay fp32, as in every checkpoint of these models
            t = t.to("cpu", torch.float32 if keeps_fp32(blk.key) else dtype)
            if quantize_fp8:
                from moe_rl.weights.fp8 import quantize_state_dict_fp8

                q, _ = quantize_state_dict_fp8({blk.key: t})
                for name, qt in q.items():
                    writer.add(name, qt)
                    n += 1
            else:
                writer.add(blk.key, t)
                n += 1
        del full
    if writer is None:
        return None
    path = writer.finish()
    return {"transport": "filesystem", "version": version, "tensors": n, "bytes": writer.total_bytes,
            "shards": writer.shards, "path": str(path), "seconds": time.perf_counter() - t0}
