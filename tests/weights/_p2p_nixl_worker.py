"""2-rank trainer side of ``test_p2p_nixl.py``, and its engine-worker processes.

Trainer (``python _p2p_nixl_worker.py <rank> <world> <init file> <out dir>``): a FSDP2-sharded tiny GLM-4.5 MoE,
published by every rank twice per version: with ``trainer.p2p.backend = "gloo"`` (root ``<out>/gloo``) and
``"nixl"`` (root ``<out>/nixl``). Versions 1 and 2 (2 after an in-place update; the model is updated again before
the pulls, so the held copies must be snapshots). Rank 0 starts two pullers and waits for their answers.

Puller (``python _p2p_nixl_worker.py puller <out dir> <worker rank> <world size>``): opens a puller on each root
with ``open_puller`` (which must pick the gloo puller for one and the NIXL puller for the other), pulls both versions
whole and a 3-tensor subset from both, and checks that the pieces and the assembled tensors are bit-identical
between the two backends and equal to the unsharded model's tensors (``ref_<v>.safetensors``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

STARTED = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def puller_main(out: Path, rank: int, world: int) -> None:
    from safetensors.torch import load_file

    from moe_rl.weights.p2p import PiecePuller, group_path, index_path, read_index
    from moe_rl.weights.p2p_nixl import NixlPiecePuller, open_puller

    res: dict = {"ok": False}
    try:
        end = time.monotonic() + 300
        while not (out / "go").exists():
            assert time.monotonic() < end, "trainer never released the pullers"
            time.sleep(0.01)
        pullers = {}
        for b in ("gloo", "nixl"):
            g = json.loads(group_path(out / b).read_text())
            assert g["backend"] == b, g
            pullers[b] = open_puller(g["endpoints"], rank, world, timeout_s=60)
        assert type(pullers["gloo"]) is PiecePuller and type(pullers["nixl"]) is NixlPiecePuller
        for v in (1, 2):
            ref = load_file(str(out / f"ref_{v}.safetensors"))
            got, pieces = {}, {}
            for b, p in pullers.items():
                idx = read_index(index_path(out / b, v), v)
                plan = p.plan(idx)
                pieces[b], _ = p._pull(plan, v, 1)  # the raw pieces, CRC-32 checked
                pieces[b] = {k: t.clone() for k, t in pieces[b]}
                w, rep = p.pull(index_path(out / b, v), v)
                got[b] = dict(w)
                res[f"{b}_v{v}"] = rep
            assert sorted(pieces["gloo"]) == sorted(pieces["nixl"]) and len(pieces["gloo"]) > len(ref)
            for k, t in pieces["gloo"].items():
                u = pieces["nixl"][k]
                assert t.dtype == u.dtype and t.shape == u.shape, k
                assert torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)), k
            assert set(got["gloo"]) == set(got["nixl"]) == set(ref)
            for k, t in ref.items():
                for b in ("gloo", "nixl"):
                    assert got[b][k].dtype == t.dtype and torch.equal(got[b][k], t), (b, k)
            names = set(sorted(ref)[:3])
            for b, p in pullers.items():
                w, rep = p.pull(index_path(out / b, v), v, names=names)
                assert {k for k, _ in w} == names and all(torch.equal(t, ref[k]) for k, t in w), b
                res[f"{b}_subset_bytes"] = rep["bytes"]
        res["nixl_stats"] = pullers["nixl"].stats
        res["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the trainer's rank 0
        res["error"] = traceback.format_exc()
    tmp = out / f"done_{rank}.json.tmp"
    tmp.write_text(json.dumps(res))
    os.replace(tmp, out / f"done_{rank}.json")


def trainer_main() -> None:
    import torch.distributed as dist
    from _p2p_pieces import tiny_fsdp_glm
    from _rank_worker import RankArgs, run_rank_worker
    from safetensors.torch import save_file

    from moe_rl.models.glm4_moe import to_hf_state_dict
    from moe_rl.models.hf_io import keeps_fp32
    from moe_rl.weights.p2p import P2PTransportConfig
    from moe_rl.weights.p2p_nixl import NixlPieceServer, p2p_publisher

    args = RankArgs.parse(sys.argv)
    extras: dict = {}

    def nixl_vs_gloo_fsdp2_two_pullers() -> None:
        out = args.out_dir / "pull"
        workers = (1, 2)
        procs = []
        if args.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            procs = [subprocess.Popen([sys.executable, __file__, "puller", str(out), str(w), str(1 + len(workers))],
                                      stdout=open(out / f"puller{w}.log", "w"), stderr=subprocess.STDOUT)
                     for w in workers]
        cfg, ref_model, model = tiny_fsdp_glm()
        pubs = {b: p2p_publisher(out / b, P2PTransportConfig(engine_workers=len(workers), timeout_s=60, bucket_bytes=4096,
                                                           backend=b), mcfg=cfg, dtype=torch.bfloat16)
                for b in ("gloo", "nixl")}
        assert isinstance(pubs["nixl"].server, NixlPieceServer) and not isinstance(pubs["gloo"].server,
                                                                                   NixlPieceServer)

        def bump(*models: torch.nn.Module) -> None:
            with torch.no_grad():
                for m in models:
                    for p in m.parameters():
                        p.mul_(1.0625).add_(0.125)

        def publish(v: int) -> None:
            for pub in pubs.values():
                pub.publish(model, v)
            if args.rank == 0:
                ref = {k: t.detach().to(torch.float32 if keeps_fp32(k) else torch.bfloat16).contiguous()
                       for k, t in to_hf_state_dict(ref_model.state_dict(), cfg).items()}
                save_file(ref, str(out / f"ref_{v}.safetensors"))

        publish(1)
        bump(model, ref_model)
        publish(2)
        bump(model)  # in place, after publishing: the held version 2 must not change
        dist.barrier()
        if args.rank == 0:
            (out / "go").write_text("")
            for w in workers:
                f = out / f"done_{w}.json"
                end = time.monotonic() + 240
                while not f.exists():
                    assert time.monotonic() < end, (out / f"puller{w}.log").read_text()[-3000:]
                    time.sleep(0.02)
                ans = json.loads(f.read_text())
                assert ans["ok"], ans.get("error")
                extras[f"puller{w}"] = ans
            for p in procs:
                assert p.wait(60) == 0
        dist.barrier()
        extras[f"nixl_server_rank{args.rank}"] = dict(pubs["nixl"].server.stats_nixl)
        for pub in pubs.values():
            pub.close()

    run_rank_worker([nixl_vs_gloo_fsdp2_two_pullers], started=STARTED, extras=extras, barrier_after_each=True,
                    timeout_s=300)


if __name__ == "__main__":
    if sys.argv[1] == "puller":
        puller_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        trainer_main()
