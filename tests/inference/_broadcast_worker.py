"""Receiver rank of ``tests/inference/test_broadcast.py`` (a separate process, as an engine worker would be).

Protocol with the test over stdin/stdout: prints ``ready`` once torch is imported, reads the trainer's port
from stdin, joins the group as rank 1 of 2, then per MODE:

- ``receive N OUT``: receive N updates, ``torch.save`` each ``(version, {name: tensor})`` to ``OUT/update<i>.pt``,
  then exit (the trainer's next send must fail with a dead-peer error);
- ``silent``: join, then take part in nothing for 20 s (the trainer's send must time out).

Usage: ``python _broadcast_worker.py MODE [N OUT]``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from moe_rl.weights.broadcast import BroadcastReceiver


def main() -> None:
    mode = sys.argv[1]
    print("ready", flush=True)
    port = int(sys.stdin.readline())
    rx = BroadcastReceiver("127.0.0.1", port, 1, 2, timeout_s=20.0)
    print("joined", flush=True)
    if mode == "silent":
        time.sleep(20.0)
        return
    n, out = int(sys.argv[2]), Path(sys.argv[3])
    for i in range(n):
        version, tensors = rx.receive_all()
        torch.save((version, {k: v.clone() for k, v in tensors.items()}), out / f"update{i}.pt")
    print("done", flush=True)


if __name__ == "__main__":
    main()
