"""How a client's request id becomes vLLM engine request ids (vLLM 0.32.0, read from the installed source).

Shared by every worker-side feature that must find "its" requests inside the engine (routed-experts
capture, per-token policy versions). No vLLM import.

The chain for ``POST /v1/completions`` with body field ``request_id = X`` (or header ``X-Request-Id: X``;
``vllm/entrypoints/serve/engine/serving.py::_base_request_id``, the header wins):

1. External id of prompt ``i`` of the request: ``cmpl-X-i`` (``completion/serving.py``: ``request_id =
   f"cmpl-{base}"``, then ``request_id_item = f"{request_id}-{i}"``); one prompt -> ``cmpl-X-0``.
2. ``InputProcessor.assign_request_id`` (``v1/engine/input_processor.py``) appends 8 random hex chars:
   ``cmpl-X-0-1a2b3c4d`` (skipped when ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set).
3. ``n > 1``: ``AsyncLLM.add_request`` fans out children ``f"{j}_{parent}"`` (``v1/engine/parallel_sampling.py
   ::ParentRequest.get_child_info``), ``j = 0..n-1`` = the choice index: ``3_cmpl-X-0-1a2b3c4d``.

The worker (``model_runner.input_batch.req_ids``) sees the ids of steps 2-3. ``vllm.LLM.generate`` uses the
same steps 2-3 with the external id ``str(counter)``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = [
    "EngineRequestId", "completion_external_id", "new_client_request_id", "parse_engine_request_id", "pop_records",
    "requests_of",
]

_CHILD = re.compile(r"^(\d+)_(.+)$")
_RANDOM_SUFFIX = re.compile(r"^(.+)-[0-9a-f]{8}$")


def new_client_request_id(prefix: str = "moe_rl") -> str:
    """A fresh id to send as the completion body's ``request_id`` (unique per request)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_external_id(client_request_id: str, prompt_index: int = 0) -> str:
    """External engine id of prompt ``prompt_index`` of a ``/v1/completions`` request sent with ``client_request_id``.

    Raises:
        ValueError: empty id or a negative index.
    """
    if not client_request_id:
        raise ValueError("completion_external_id: client_request_id='' is empty")
    if prompt_index < 0:
        raise ValueError(f"completion_external_id: prompt_index={prompt_index} must be >= 0")
    return f"cmpl-{client_request_id}-{prompt_index}"


class EngineRequestId(tuple):
    """``(external_id, choice_index)`` parsed from an engine request id (a named 2-tuple)."""

    __slots__ = ()

    def __new__(cls, external_id: str, choice_index: int) -> EngineRequestId:
        return super().__new__(cls, (external_id, choice_index))

    @property
    def external_id(self) -> str:
        return self[0]

    @property
    def choice_index(self) -> int:
        return self[1]


def parse_engine_request_id(engine_id: str, *, randomized: bool = True) -> EngineRequestId:
    """Split an engine request id into the external id and the choice index (0 when ``n == 1``).

    Args:
        engine_id: an id from ``input_batch.req_ids`` (e.g. ``3_cmpl-X-0-1a2b3c4d``).
        randomized: vLLM appended its 8-hex-char suffix (the default; False under
            ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``).

    Raises:
        ValueError: ``randomized`` and the id has no ``-xxxxxxxx`` suffix.

    Note: an external id that itself starts with ``<digits>_`` is ambiguous with a child id; the ids this
    project sends (``cmpl-...``) never do.
    """
    choice = 0
    rest = engine_id
    m = _CHILD.match(rest)
    if m:
        choice, rest = int(m.group(1)), m.group(2)
    if randomized:
        s = _RANDOM_SUFFIX.match(rest)
        if s is None:
            raise ValueError(
                f"parse_engine_request_id: {engine_id!r} has no 8-hex-char random suffix; pass randomized=False "
                "if the engine runs with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"
            )
        rest = s.group(1)
    return EngineRequestId(rest, choice)


def _id_list(external_ids: Any, where: str) -> list[str]:
    """``external_ids`` as a list of str ids; a bare str (or bytes) or a non-str member is refused."""
    if isinstance(external_ids, (str, bytes)):
        example = external_ids if isinstance(external_ids, str) else external_ids.decode(errors="replace")
        raise TypeError(f"{where}: external_ids={external_ids!r} is a single {type(external_ids).__name__}, not a list "
                        f"of str ids (iterating it would give its characters); pass a list, e.g. [{example!r}]")
    try:
        ids = list(external_ids)
    except TypeError:
        raise TypeError(f"{where}: external_ids={external_ids!r} ({type(external_ids).__name__}) is not an iterable of "
                        "ids; pass a list of str request ids") from None
    bad = [i for i in ids if not isinstance(i, str)]
    if bad:
        raise TypeError(f"{where}: external_ids holds {type(bad[0]).__name__} {bad[0]!r}; every external request id "
                        "is a str (completion_external_id)")
    return ids


def requests_of(engine_ids: Iterable[str], external_ids: Iterable[str]) -> Iterator[tuple[str, EngineRequestId]]:
    """The engine request ids among ``engine_ids`` that belong to one of ``external_ids``, each with its parsed id.

    An id with vLLM's random suffix is parsed as such, one without it as under
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``. ``engine_ids`` is copied first, so a caller may pop what it yields.

    Yields:
        ``(engine_id, parsed)`` in ``engine_ids`` order.

    Raises:
        TypeError: (when iterated) ``external_ids`` is a single str instead of a list of ids, or holds a non-str.
    """
    wanted = set(_id_list(external_ids, "requests_of"))
    for engine_id in list(engine_ids):
        try:
            parsed = parse_engine_request_id(engine_id)
        except ValueError:
            parsed = parse_engine_request_id(engine_id, randomized=False)
        if parsed.external_id in wanted:
            yield engine_id, parsed


def pop_records(recorder: Any, external_ids: Iterable[str], encode: Callable[[Any], dict[str, Any]], *,
                method: str, enable: str) -> dict[str, dict[str, Any]]:
    """Pop a worker-side recorder's records of every engine request belonging to ``external_ids``, for a client.

    Args:
        recorder: the worker's capture recorder, None when the capture is off: an object with a ``requests``
            mapping keyed by engine request id and ``pop(engine_id)`` returning that request's record (None or
            empty when it has none).
        external_ids: a list (any non-str iterable) of external request ids (``completion_external_id``); a bare
            str is refused, not read as its characters.
        encode: one popped record -> the JSON-able entry sent to the client.
        method: the ``collective_rpc`` method popping (named in the error).
        enable: the ``collective_rpc`` method installing the capture (the error's fix).

    Returns:
        ``{external_id: {str(choice_index): encode(record)}}``; requests with no (or an empty) record are absent.

    Raises:
        TypeError: ``external_ids`` is a single str (pass ``[id]``) or holds a non-str.
        RuntimeError: the capture is off (``recorder`` is None).
    """
    external_ids = _id_list(external_ids, method)
    if recorder is None:
        raise RuntimeError(f"{method}: capture is off; call {enable} first")
    out: dict[str, dict[str, Any]] = {}
    for engine_id, parsed in requests_of(recorder.requests, external_ids):
        got = recorder.pop(engine_id)
        if got:
            out.setdefault(parsed.external_id, {})[str(parsed.choice_index)] = encode(got)
    return out
