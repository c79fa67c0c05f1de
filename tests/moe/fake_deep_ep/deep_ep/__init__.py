"""A CPU/gloo stand-in for DeepEP 2.1 (``deep_ep``), used only by the tests.

It follows DeepEP's current public API (github.com/deepseek-ai/DeepEP, ``deep_ep/__init__.py`` and
``deep_ep/buffers/elastic.py``): ``ElasticBuffer`` (normal-mode expert-parallel ``dispatch`` / ``combine`` with a
cached ``EPHandle``, sized with ``ElasticBuffer.get_buffer_size_hint``) and the legacy ``Buffer`` (kept in V2 as
``deep_ep.buffers.legacy.Buffer``; only its low-latency ``low_latency_dispatch`` / ``low_latency_combine`` are
emulated here). Collectives are ``torch.distributed`` on gloo instead of NVLink/RDMA kernels; the semantics are
those DeepEP's own tests check (``tests/elastic/test_ep.py`` against ``deep_ep/utils/refs.py``;
``tests/legacy/test_low_latency.py``).

Nothing here is used by the library; it lets the tests prove that ``moe_rl.moe.ep`` drives that API correctly
(outputs and gradients equal to the single-process MoE and to the ``torch`` backend). Real DeepEP needs CUDA.
"""

import torch

from ._stats import CALLS  # noqa: F401
from .buffers.elastic import ElasticBuffer, EPHandle  # noqa: F401
from .buffers.legacy import Buffer  # noqa: F401
from .utils.event import EventHandle, EventOverlap  # noqa: F401

topk_idx_t = torch.int64

__version__ = "2.1.0"
