"""``pop_records`` / ``requests_of``: the external ids must be a list of ids, not one id as a bare str."""

from __future__ import annotations

import pytest

from moe_rl.inference.request_ids import completion_external_id, pop_records, requests_of


class Recorder:
    """A worker recorder: ``requests`` keyed by engine id, ``pop`` returns (and forgets) one record."""

    def __init__(self, records: dict[str, list[int]]) -> None:
        self.requests = dict(records)

    def pop(self, engine_id: str):
        return self.requests.pop(engine_id, None)


def _pop(rec, ids):
    return pop_records(rec, ids, lambda r: {"n": len(r)}, method="pop_x", enable="enable_x")


def test_pop_records_refuses_a_bare_str_instead_of_a_list():
    ext = completion_external_id("moe_rl-ab")  # "cmpl-moe_rl-ab-0"
    rec = Recorder({f"{ext}-1a2b3c4d": [1, 2], f"2_{ext}-1a2b3c4d": [3]})
    with pytest.raises(TypeError, match=r"pop_x: external_ids='cmpl-moe_rl-ab-0' is a single str, not a list of str ids.*"
                                        r"pass a list, e.g. \['cmpl-moe_rl-ab-0'\]"):
        _pop(rec, ext)
    with pytest.raises(TypeError, match="pop_x: external_ids holds int 7; every external request id is a str"):
        _pop(rec, [ext, 7])
    with pytest.raises(TypeError, match=r"requests_of: external_ids=b'x' is a single bytes.*e.g. \['x'\]"):
        list(requests_of(rec.requests, b"x"))
    for bad in (None, 5):
        with pytest.raises(TypeError, match=r"pop_x: external_ids=.* is not an iterable of ids; pass a list"):
            _pop(rec, bad)
    assert len(rec.requests) == 2  # nothing popped by a refused call
    assert _pop(rec, (i for i in [ext])) == {ext: {"0": {"n": 2}, "2": {"n": 1}}}  # any non-str iterable of ids
    assert rec.requests == {}
    with pytest.raises(RuntimeError, match="pop_x: capture is off; call enable_x first"):
        _pop(None, [ext])
