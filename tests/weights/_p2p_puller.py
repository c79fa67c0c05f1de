"""An engine worker of ``test_p2p.py``'s multi-rank scenario, in its own process: joins the trainer ranks' p2p
groups (``PiecePuller``, endpoints from ``p2p_group.json``) and runs the steps the trainer's rank 0 releases.

Usage: ``python _p2p_puller.py <root> <worker rank> <world size>``. For each step ``k`` it waits for
``<root>/step_<k>``, runs it, and writes ``<root>/done_<k>_<worker rank>.json`` (``{"ok": true, ...}`` or the
traceback); the references are ``<root>/ref_<v>.safetensors`` (written by trainer rank 0 from the unsharded model).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file

from moe_rl.weights.p2p import P2PError, P2PTransferError, PiecePuller, group_path, index_path

ROOT, RANK, WORLD = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
KEPT: dict = {}


def wait_for(path: Path, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def same(got: list, version: int, names: set | None = None) -> None:
    ref = load_file(str(ROOT / f"ref_{version}.safetensors"))
    if names is not None:
        ref = {k: v for k, v in ref.items() if k in names}
    got = dict(got)
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))[:5]
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def main() -> None:
    wait_for(group_path(ROOT))
    g = json.loads(group_path(ROOT).read_text())
    puller = PiecePuller(g["endpoints"], RANK, WORLD, timeout_s=10)

    def step1() -> dict:  # versions 1 and 2 (v2 published after an in-place update): whole, bit-identical
        KEPT["index_2"] = json.loads(index_path(ROOT, 2).read_text())
        out = {}
        for v in (1, 2):
            got, rep = puller.pull(index_path(ROOT, v), v)
            same(got, v)
            out[f"v{v}"] = rep
        names = set(sorted(k for k, _ in got)[:3])
        got, rep = puller.pull(index_path(ROOT, 2), 2, names=names)  # only the tensors this engine serves
        same(got, 2, names)
        out["subset_bytes"] = rep["bytes"]
        return out

    def step2() -> dict:  # rank 1 flips a byte on the wire once: re-pulled, counted
        got, rep = puller.pull(index_path(ROOT, 2), 2)
        same(got, 2)
        return {"retries": rep["retries"]}

    def step3() -> dict:  # rank 1's held copy is corrupt: every re-pull fails, nothing is returned
        try:
            puller.pull(index_path(ROOT, 2), 2, retries=2)
        except P2PError as exc:
            assert not isinstance(exc, P2PTransferError) and "CRC-32" in str(exc) and "nothing loaded" in str(exc)
            return {"error": str(exc)[:300]}
        raise AssertionError("a corrupt piece was accepted")

    def step4() -> dict:  # versions 3, 4 published (keep_versions=2): version 2 is gone, 4 pulls
        assert not index_path(ROOT, 2).exists()  # rank 0 removed the index of a version nobody holds
        try:
            puller.pull(KEPT["index_2"], 2)  # the index read earlier: the trainer ranks refuse the request
        except P2PError as exc:
            assert "does not hold version 2" in str(exc), exc
        else:
            raise AssertionError("an evicted version was served")
        got, rep = puller.pull(index_path(ROOT, 4), 4)
        same(got, 4)
        return {"v4": rep}

    def step5() -> dict:  # rank 1 stops after the first bucket: the transfer fails, nothing returned, groups closed
        if RANK != 1:
            return {"skipped": True}
        try:
            puller.pull(index_path(ROOT, 4), 4)
        except P2PTransferError as exc:
            assert "nothing loaded" in str(exc) and "groups are closed" in str(exc), exc
            try:
                puller.pull(index_path(ROOT, 4), 4)
            except P2PTransferError as again:
                assert "closed after an earlier failure" in str(again)
                return {"error": str(exc)[:300]}
        raise AssertionError("a truncated transfer was accepted")

    for k, fn in enumerate([step1, step2, step3, step4, step5], start=1):
        wait_for(ROOT / f"step_{k}")
        try:
            res = {"ok": True, **fn()}
        except BaseException:  # noqa: BLE001 - reported to the trainer's rank 0
            res = {"ok": False, "error": traceback.format_exc()}
        tmp = ROOT / f"done_{k}_{RANK}.json.tmp"
        tmp.write_text(json.dumps(res))
        os.replace(tmp, ROOT / f"done_{k}_{RANK}.json")  # atomic: rank 0 polls for the file


main()
