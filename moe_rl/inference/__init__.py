"""Inference engines: a vLLM (CPU build) server launcher, its worker extension and an async client.

- ``VllmServerConfig`` / ``VllmServer``: start, health-check and stop ``python -m
  vllm.entrypoints.openai.api_server`` with the settings this project needs (``vllm_server.py``).
- ``VllmClient`` / ``Completion``: token-id completions with sampler logprobs and prefix-cache hit counts,
  in-place weight updates, weight version, prefix-cache reset (``client.py``).
- ``moe_rl.inference.vllm_worker_ext.WeightSyncExtension``: the methods the server's worker gains; imported
  only by vLLM, never here.

Importing this package does not import vllm or torch.
"""

from moe_rl.inference.client import Completion, VllmClient, VllmRequestError
from moe_rl.inference.vllm_server import VllmServer, VllmServerConfig

__all__ = ["Completion", "VllmClient", "VllmRequestError", "VllmServer", "VllmServerConfig"]
