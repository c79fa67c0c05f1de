"""The rank side of ``tests/conftest.py``'s ``launch_ranks`` protocol, shared by the multi-rank test workers.

``launch_ranks(worker, world, tmp)`` starts ``python worker <rank> <world> <init file> <out dir> [names]`` once per
rank. :func:`run_rank_worker` joins the gloo group through the init file, runs the worker's scenarios one after the
other and, after each, rewrites ``<out dir>/rank<rank>.json``: ``{scenario name: "ok" or its traceback, "_seconds":
{"startup": s, name: s, ...}, plus the worker's extra entries}``, so a rank that dies mid-run still reports what ran.

A worker imports it after putting ``tests/`` on ``sys.path``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _rank_worker import run_rank_worker
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

Scenarios = Sequence[Callable[[], object]] | Mapping[str, Callable[[], object]]


@dataclass(frozen=True)
class RankArgs:
    """The worker's command line: ``<rank> <world> <init file> <out dir> [comma-separated scenario names]``."""

    rank: int
    world: int
    init_file: str
    out_dir: Path
    only: frozenset[str] | None

    @classmethod
    def parse(cls, argv: Sequence[str]) -> RankArgs:
        only = frozenset(argv[5].split(",")) if len(argv) > 5 else None
        return cls(int(argv[1]), int(argv[2]), argv[3], Path(argv[4]), only)


def run_rank_worker(
    scenarios: Scenarios | Callable[[int], Scenarios],
    *,
    started: float,
    timeout_s: float = 60.0,
    extras: Mapping[str, Any] | None = None,
    setup: Callable[[RankArgs], object] | None = None,
    catch: type[BaseException] = Exception,
    barrier_after_each: bool = False,
) -> None:
    """Join the gloo group, run the scenarios, write this rank's report after each one, leave the group.

    Args:
        scenarios: the functions to run (a list: each named by ``__name__``; or ``{name: function}``), or a
            function of the world size that returns them. With a 6th argument only the names it lists run.
        started: ``time.perf_counter()`` when the worker started (its imports: the ``"startup"`` seconds).
        timeout_s: the gloo group's timeout, seconds.
        extras: entries added to the report after each scenario (dicts the scenarios fill in, written as they
            stand then).
        setup: called once after the group is joined, before the first scenario.
        catch: what a failing scenario may raise and still be reported (``BaseException`` for code that raises
            one, e.g. torch DCP's ``CheckpointException``); anything else ends the worker.
        barrier_after_each: every rank waits for the others after each scenario.
    """
    import torch.distributed as dist

    args = RankArgs.parse(sys.argv)
    dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=timeout_s))
    results: dict[str, Any] = {"_seconds": {"startup": round(time.perf_counter() - started, 2)}}
    if setup is not None:
        setup(args)
    chosen = scenarios(args.world) if callable(scenarios) else scenarios
    named = chosen.items() if isinstance(chosen, Mapping) else ((fn.__name__, fn) for fn in chosen)
    for name, fn in named:
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            fn()
            results[name] = "ok"
        except catch:
            results[name] = traceback.format_exc()
        results["_seconds"][name] = round(time.perf_counter() - t0, 2)
        results.update(extras or {})
        (args.out_dir / f"rank{args.rank}.json").write_text(json.dumps(results, indent=1))
        if barrier_after_each:
            dist.barrier()
    dist.destroy_process_group()
