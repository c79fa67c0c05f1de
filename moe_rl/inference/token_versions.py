"""Client-side bookkeeping that turns the worker's reload reports into exact per-request version segments.

How it works (vLLM 0.32, V1 model runner, ``async_scheduling=False`` as the CPU backend forces):

- The weight reload (``WeightSyncExtension.reload_and_repack``) runs in the worker *between* two engine
  steps. At that moment every request the worker knows (``model_runner.requests``: running and preempted)
  has sampled exactly ``len(output_token_ids)`` tokens, all with the old weights; its next token uses the
  new weights. The report lists these counts (``running``) and the ids of the requests *first scheduled*
  since the previous reload (``new``, recorded by a hook on ``model_runner.execute_model``; this includes
  requests that already finished, which ``running`` cannot show).
- The client tags every completion request with a unique ``request_id``; vLLM's internal id of choice ``i``
  is ``"{i}_cmpl-{request_id}-0-{16 hex}"`` for ``n > 1`` and ``"cmpl-{request_id}-0-{16 hex}"`` for
  ``n = 1`` (``serving.py``, ``ParentRequest.get_child_info``, ``InputProcessor.assign_request_id``).
- A request overlaps the reloads whose reports arrive after it was sent. Walking them in order: before the
  request is first seen (in ``running`` or ``new``) it had not been scheduled, so its first token uses the
  newest weights so far; once seen, each report that still lists it in ``running`` adds a switch point
  ``(version, count)``; the first report that no longer lists it means it had finished. A request seen by
  no report ran entirely under the version served before the first overlapping reload not claiming it.
  Segments are resolved only when no reload is in flight (``VllmClient`` waits), so no future report can
  change them.

Inexact cases are reported as ``None`` (never guessed) and counted in ``unknown``: a reload report missing
(a gap in the worker's reload sequence: another client reloaded the server, or an RPC reply was lost), the
``new`` list truncated by the worker's cap, or a server whose scheduler is asynchronous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from moe_rl.rl.token_versions import normalize_segments

__all__ = ["parse_internal_request_id", "ReloadRecord", "VersionTracker"]

_INTERNAL_ID = re.compile(r"^(?:(\d+)_)?cmpl-(.+)-(\d+)-[0-9a-f]+$")


def parse_internal_request_id(internal_id: str) -> tuple[str, int] | None:
    """``(request_id, choice_index)`` of a vLLM internal request id of an OpenAI completion, or None.

    Only single-prompt completions are mapped (prompt index 0), which is how ``VllmClient`` sends them.

    >>> parse_internal_request_id("3_cmpl-moe_rl-ab12-0-00ff00ff00ff00ff")
    ('moe_rl-ab12', 3)
    >>> parse_internal_request_id("cmpl-moe_rl-ab12-0-00ff00ff00ff00ff")
    ('moe_rl-ab12', 0)
    """
    m = _INTERNAL_ID.match(internal_id)
    if m is None or m.group(3) != "0":
        return None
    return m.group(2), int(m.group(1) or 0)


@dataclass
class ReloadRecord:
    """One reload as seen by the worker.

    Attributes:
        version: the version loaded.
        running: ``{(request_id, choice): tokens sampled before the load}``.
        new: requests first scheduled since the previous reload.
        exact: False when the report cannot be trusted (a gap before it, a truncated ``new``, async scheduling).
    """

    version: int
    running: dict[tuple[str, int], int] = field(default_factory=dict)
    new: set[tuple[str, int]] = field(default_factory=set)
    exact: bool = True


def _keyed(ids: Any) -> dict[tuple[str, int], Any]:
    out = {}
    items = ids.items() if isinstance(ids, dict) else ((i, None) for i in ids)
    for internal, value in items:
        key = parse_internal_request_id(str(internal))
        if key is not None:
            out[key] = value
    return out


class VersionTracker:
    """Pure bookkeeping (no I/O, no asyncio); ``VllmClient`` drives it.

    Protocol: ``start(version, seq)`` once; ``begin(request_id)`` right before a request is sent;
    ``add_reload(report)`` when a reload RPC returns; ``segments(request_id, choice, n_tokens)`` once the
    response arrived *and* no reload RPC is in flight; ``end(request_id)`` when done with the request.
    """

    def __init__(self) -> None:
        self.started = False
        self._base = 0  # absolute index of self._records[0]
        self._records: list[ReloadRecord] = []
        self._version_before_base = 0
        self._next_seq = 0
        self._active: dict[str, int] = {}
        self.unknown = 0
        """Completions whose segments could not be determined exactly (returned as None)."""
        self.gaps = 0
        """Reload reports found missing (worker reload sequence jumped)."""

    def start(self, version: int, seq: int) -> None:
        """Begin tracking at the worker's current weight ``version`` after ``seq`` successful reloads."""
        self.started = True
        self._version_before_base = int(version)
        self._next_seq = int(seq)

    @property
    def version(self) -> int:
        """The newest version known (the last report's, else the start version)."""
        return self._records[-1].version if self._records else self._version_before_base

    def begin(self, request_id: str) -> None:
        if request_id in self._active:
            raise ValueError(f"VersionTracker.begin: request_id={request_id!r} is already in flight")
        self._active[request_id] = self._base + len(self._records)

    def end(self, request_id: str) -> None:
        self._active.pop(request_id, None)
        self._prune()

    def add_reload(self, report: dict[str, Any] | None, version: int) -> None:
        """Record a successful reload to ``version`` with the worker's ``token_versions`` report (None when the
        worker sent none, e.g. tracking not installed: every overlapping request becomes unknown)."""
        if report is None:
            self._records.append(ReloadRecord(int(version), exact=False))
            return
        seq = int(report["seq"])
        exact = bool(report.get("exact", True)) and int(report.get("new_dropped", 0)) == 0
        if seq != self._next_seq:
            self.gaps += 1
            exact = False
        self._next_seq = seq + 1
        self._records.append(ReloadRecord(
            version=int(version),
            running={k: int(v) for k, v in _keyed(report.get("running", {})).items()},
            new=set(_keyed(report.get("new", []))),
            exact=exact,
        ))
        self._prune()

    def segments(self, request_id: str, choice: int, num_tokens: int) -> list[tuple[int, int]] | None:
        """Canonical ``[(version, first_token_index), ...]`` of one choice, or None if not exactly known.

        Raises:
            KeyError: ``request_id`` was not ``begin``-ed.
        """
        i0 = self._active[request_id] - self._base
        cur = self._records[i0 - 1].version if i0 > 0 else self._version_before_base
        key = (request_id, choice)
        raw: list[tuple[int, int]] | None = None
        for rec in self._records[i0:]:
            if not rec.exact:
                self.unknown += 1
                return None
            seen = key in rec.running or key in rec.new
            if raw is None:
                if not seen:  # not scheduled yet: its first token will use at least this version
                    cur = rec.version
                    continue
                raw = [(cur, 0)]
            if key not in rec.running:
                break  # finished before this reload
            raw.append((rec.version, rec.running[key]))
        if raw is None:
            raw = [(cur, 0)]
        return normalize_segments(raw, max(1, num_tokens))

    def _prune(self) -> None:
        keep_from = min(self._active.values(), default=self._base + len(self._records)) - self._base
        # keep one record before the oldest active request: it gives that request's starting version
        drop = max(0, keep_from - 1)
        if drop:
            self._version_before_base = self._records[drop - 1].version
            del self._records[:drop]
            self._base += drop
