"""``VersionSkewMonitor`` with fake engines: skew, laggards, unreachable engines, counters, raising mode."""

from __future__ import annotations

import asyncio

import pytest

from moe_rl.inference.version_skew import VersionSkewError, VersionSkewMonitor


class _Engine:
    def __init__(self, version: int | None, delay_s: float = 0.0):
        self.version, self.delay_s = version, delay_s

    async def weight_version(self) -> int:
        await asyncio.sleep(self.delay_s)
        if self.version is None:
            raise ConnectionError("engine down")
        return self.version


def test_skew_laggards_and_counters():
    mon = VersionSkewMonitor(max_skew=1)

    async def body():
        agree = await mon.check({"a": _Engine(5), "b": _Engine(5)})
        one_behind = await mon.check({"a": _Engine(5), "b": _Engine(4), "c": _Engine(5)})
        two_behind = await mon.check({"a": _Engine(7), "b": _Engine(5), "c": _Engine(6)}, expected=7)
        expected_ahead = await mon.check({"a": _Engine(6), "b": _Engine(6)}, expected=8)
        return agree, one_behind, two_behind, expected_ahead

    agree, one_behind, two_behind, expected_ahead = asyncio.run(body())
    assert agree.ok and agree.skew == 0 and agree.lagging == {} and agree.target == 5
    assert one_behind.ok and one_behind.skew == 1 and one_behind.lagging == {"b": 1}
    assert not two_behind.ok and two_behind.skew == 2 and two_behind.lagging == {"b": 2, "c": 1}
    assert "VIOLATION" in two_behind.describe() and "b by 2 (at 5)" in two_behind.describe()
    # all agree with each other but not with the version just pushed: skew 0, yet both lag by 2
    assert not expected_ahead.ok and expected_ahead.skew == 0 and expected_ahead.lagging == {"a": 2, "b": 2}
    assert mon.stats == {"checks": 4, "skew_events": 3, "violations": 2, "unreachable": 0, "max_skew_seen": 2}
    assert mon.last is expected_ahead


def test_unreachable_engine_and_raise_mode():
    mon = VersionSkewMonitor(max_skew=3, raise_on_violation=True, timeout_s=0.2)

    async def body():
        with pytest.raises(VersionSkewError, match=r"unreachable down: ConnectionError: engine down, "
                                                   r"slow: TimeoutError") as err:  # fmt: skip
            await mon.check({"up": _Engine(2), "down": _Engine(None), "slow": _Engine(2, delay_s=5.0)})
        return err.value.report

    report = asyncio.run(body())
    assert report.versions == {"up": 2} and set(report.errors) == {"down", "slow"} and not report.ok
    assert mon.stats["unreachable"] == 2 and mon.stats["violations"] == 1
    with pytest.raises(ValueError, match="max_skew=-1 must be >= 0"):
        VersionSkewMonitor(max_skew=-1)
    with pytest.raises(ValueError, match="engines=\\{\\} is empty"):
        asyncio.run(mon.check({}))
