"""``python -m moe_rl.entrypoints.cluster_orchestrator``: argument and config errors, the disaggregated client against
fake vLLM servers (which requests go where), a disaggregated run against fakes, and a colocated run against one real
vLLM CPU server with the real cluster trainer under torchrun (3 steps).

The fake trainer follows the trainer's file protocol (``moe_rl.runtime.trainer.rl_trainer``): it waits for
``batches/step_<n>.safetensors``, publishes version ``n+1`` as ``weights/step_<n+1>/`` (the version-0 checkpoint's
files, lm_head scaled by ``1 + (n+1)/2`` so every version samples differently, then ``STABLE``) and writes
``trainer/step_<n>.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _fake_vllm import FakeVllm  # noqa: E402
from cluster_helpers import cluster_config_dict, write_cluster_config, write_tiny_checkpoint  # noqa: E402

from moe_rl.entrypoints import cluster_orchestrator as co  # noqa: E402
from moe_rl.inference import EngineCallError, InferenceClient, ProxiedClient  # noqa: E402
from moe_rl.runtime.run_dir import RunPaths  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "v0")


def _disagg(**kw):
    return dict(cluster={"num_nodes": 3, "gpus_per_node": 1, "gpu_name": "cpu"},
                inference={"mode": "disaggregated", "max_model_len": 128,
                           "prefill": {}, "decode": {}},
                **kw)


def _orch(**kw):
    base = cluster_config_dict(".")["orchestrator"]
    return {**base, **kw}


def _main(tmp_path, cfg_path, *engine_urls, run_dir=None, inference_url="http://127.0.0.1:9"):
    argv = ["--config", str(cfg_path), "--run-dir", str(run_dir or tmp_path / "run"), "--inference-url", inference_url]
    for u in engine_urls:
        argv += ["--engine-url", u]
    return co.main(argv)


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("url, msg", [
    ("http://h:8000", r"must be ROLE=URL"),
    ("router=http://h:8000", r"role 'router' must be one of \['engine', 'prefill', 'decode'\]"),
    ("engine=h:8000", r"URL 'h:8000' must start with http:// or https://"),
])
def test_bad_engine_url(tmp_path, ckpt, capsys, url, msg):
    cfg = write_cluster_config(tmp_path / "c.json", ckpt)
    assert _main(tmp_path, cfg, url) == 2
    import re

    assert re.search(msg, capsys.readouterr().err)


def test_missing_arguments_and_bad_config(tmp_path, ckpt, capsys):
    assert co.main(["--run-dir", str(tmp_path)]) == 2
    assert "--config" in capsys.readouterr().err
    assert _main(tmp_path, tmp_path / "nope.json", "engine=http://h:1") == 2
    assert "nope.json' cannot be read" in capsys.readouterr().err
    bad = cluster_config_dict(ckpt, orchestrator=_orch(max_inflight=1))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert _main(tmp_path, tmp_path / "bad.json", "engine=http://h:1") == 2
    err = capsys.readouterr().err
    assert "not a valid ClusterConfig" in err and "orchestrator.max_inflight=1 groups x group_size=2 < batch_size=4" in err, err


def _write(tmp_path, ckpt, name="c.json", **kw):
    """Write an unvalidated-by-helper config (ClusterConfig still validates it when loaded)."""
    from moe_rl.launch.config import ClusterConfig

    cfg = ClusterConfig.model_validate(cluster_config_dict(ckpt, **kw))
    (tmp_path / name).write_text(cfg.model_dump_json())
    return tmp_path / name


@pytest.mark.parametrize("kw, urls, msg", [
    (dict(weights={"kind": "broadcast", "quantize_fp8": True}), ["engine=http://h:1"],
     "weights.kind='broadcast' with weights.quantize_fp8=true.*set weights.quantize_fp8=false"),
    (dict(weights={"kind": "p2p", "quantize_fp8": True}), ["engine=http://h:1"],
     "weights.kind='p2p' with weights.quantize_fp8=true.*set weights.quantize_fp8=false"),
    (_disagg(orchestrator=_orch(off_policy_policy="mask")), ["prefill=http://p:1", "decode=http://d:1"],
     "off_policy_policy='mask' with inference.mode='disaggregated'.*use off_policy_policy='drop' or 'withhold'"),
    (_disagg(trainer={"num_nodes": 1, "seq_len": 128, "router_replay": True}), ["prefill=http://p:1",
                                                                                "decode=http://d:1"],
     "trainer.router_replay=true with inference.mode='disaggregated'.*set trainer.router_replay=false"),
    ({}, ["prefill=http://p:1"], r"--engine-url gives \{'prefill': 1\} but inference.mode='colocated' has replicas "
                                 r"\{'engine': 1\}"),
    (_disagg(), ["prefill=http://p:1"], r"gives \{'prefill': 1\} .* \{'prefill': 1, 'decode': 1\}"),
    (_disagg(), ["prefill=http://p:1", "decode=http://p:1"], r"repeats \['http://p:1'\]"),
    (dict(task={"tokenizer": "char", "factory": "no_such_module_xyz:make"}), ["engine=http://h:1"],
     "task.factory='no_such_module_xyz:make': no module named 'no_such_module_xyz'"),
    (dict(task={"tokenizer": "char", "env": "no_such_module_xyz:make"}), ["engine=http://h:1"],
     "task.env='no_such_module_xyz:make': no module named 'no_such_module_xyz'"),
    (dict(task={"tokenizer": "char", "factory": "_factory_tasks:NOT_CALLABLE"}), ["engine=http://h:1"],
     "_factory_tasks.NOT_CALLABLE is a int, not callable"),
    (dict(task={"tokenizer": "char", "env": "_factory_tasks:addition_task", "env_args": {"digits": 2}}),
     ["engine=http://h:1"], r"addition_task\(tokenizer, \*\*task.env_args\) with task.env_args=\{'digits': 2\}"),
])
def test_rejected_settings(tmp_path, ckpt, capsys, kw, urls, msg):
    import re

    assert _main(tmp_path, _write(tmp_path, ckpt, **kw), *urls) == 2
    err = capsys.readouterr().err
    assert re.search(msg, err), err


def test_factory_task_and_tokenizer(tmp_path, ckpt):
    import _factory_tasks

    from moe_rl.envs import CharTokenizer, HfTokenizer
    from moe_rl.launch.config import ClusterConfig

    cfg = ClusterConfig.model_validate(cluster_config_dict(ckpt, task={"factory": "_factory_tasks:addition_task",
                                                                        "tokenizer": "checkpoint"}))
    tok = co.build_tokenizer(cfg)
    assert isinstance(tok, HfTokenizer) and tok.encode("12+3=") == CharTokenizer().encode("12+3=")
    task = co.build_task(cfg, tok)
    assert _factory_tasks.CALLS[-1] is tok and task.tok is tok and task.cfg.num_digits == 1
    spelled = ClusterConfig.model_validate(cluster_config_dict(ckpt, task={"env": "_factory_tasks:addition_task",
                                                                           "tokenizer": "checkpoint"}))
    assert co.build_task(spelled, tok).cfg.num_digits == 1 and _factory_tasks.CALLS[-1] is tok
    bad = cfg.model_copy(update={"task": cfg.task.model_copy(update={"factory": "_factory_tasks:not_a_task"})})
    with pytest.raises(co.UsageError, match=r"returned a object, which is not an environment .*lacks \['sample', "
                                            r"'prompt_ids', 'reward', 'cfg'"):
        co.build_task(bad, tok)
    with pytest.raises(ValueError, match="both name a factory"):
        ClusterConfig.model_validate(cluster_config_dict(ckpt, task={"env": "a:b", "factory": "a:b"}))


def test_used_run_dir_is_refused(tmp_path, ckpt, capsys):
    cfg = write_cluster_config(tmp_path / "c.json", ckpt)
    run = tmp_path / "run"
    (run / "weights" / "step_0").mkdir(parents=True)  # tolerated: version 0 is the engines' checkpoint
    (run / "weights" / "step_2").mkdir()
    (run / "weights" / "step_2" / "STABLE").write_text("{}")
    (run / "trainer").mkdir()
    (run / "trainer" / "step_0.json").write_text("{}")
    assert _main(tmp_path, cfg, "engine=http://127.0.0.1:9", run_dir=run) == 2
    err = capsys.readouterr().err
    assert "holds files of an earlier run (['weights/step_2', 'trainer/step_0.json'])" in err


def test_engines_not_at_version_zero(tmp_path, ckpt, capsys):
    eng = FakeVllm("engine")
    try:
        eng.version = 4
        cfg = write_cluster_config(tmp_path / "c.json", ckpt)
        assert _main(tmp_path, cfg, f"engine={eng.url}") == 1
        assert "the engines serve weight version 4, not 0" in capsys.readouterr().err
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------- proxied client
@pytest.fixture
def pd():
    servers = {n: FakeVllm(n) for n in ("proxy", "prefill.0", "decode.0", "decode.1")}
    yield servers
    for s in servers.values():
        s.close()


def test_proxied_client_routes(pd):
    async def go():
        engines = [(n, pd[n].url) for n in ("prefill.0", "decode.0", "decode.1")]
        async with ProxiedClient(pd["proxy"].url, engines, model="policy", timeout_s=10) as c:
            assert isinstance(c, InferenceClient) and c.return_routed_experts is False
            comps, cached = await c.generate([1, 4, 5], n=3, max_tokens=4, temperature=1.0, cache_salt="s", seed=7)
            assert len(comps) == 3 and cached == 0 and all(x.version_segments is None for x in comps)
            assert c.completions_without_versions == 3
            report = await c.update_weights("/w/step_1", 1)
            assert report["version"] == 1 and sorted(report["engines"]) == ["decode.0", "decode.1", "prefill.0"]
            assert await c.weight_version() == 1
            await c.pause()
            assert await c.is_paused()
            await c.resume()
            assert not await c.is_paused()
            assert await c.reset_prefix_cache() is True
            assert await c.health()
            # a partial update: one decode replica fails, the others load; the error names it
            pd["decode.1"].fail_rpc = True
            with pytest.raises(EngineCallError, match=r"update_weights failed on 1 of 3 engine replicas \(decode.1: "
                                                      r"VllmRequestError: .*decode.1: worker crashed"):
                await c.update_weights("/w/step_2", 2)
            pd["decode.1"].fail_rpc = False
            with pytest.raises(RuntimeError, match=r"serve different versions \{'prefill.0': 2, 'decode.0': 2, "
                                                   r"'decode.1': 1\}"):
                await c.weight_version()
            pd["decode.0"].close()
            assert not await c.health()

    asyncio.run(go())
    # generation only through the proxy; engine-wide calls only to the replicas (each got every one)
    proxy = pd["proxy"].paths()
    assert proxy == ["/v1/completions", "/health", "/health"]
    body = pd["proxy"].requests[0][2]
    assert body["prompt"] == [1, 4, 5] and body["n"] == 3 and body["cache_salt"] == "s" and body["seed"] == 7
    assert body["model"] == "policy" and "request_id" not in body  # no per-request version tracking
    for name in ("prefill.0", "decode.0"):
        assert pd[name].paths() == ["rpc:reload_and_repack", "rpc:weight_version", "/pause", "/is_paused", "/resume",
                                    "/is_paused", "/reset_prefix_cache", "/health", "rpc:reload_and_repack",
                                    "rpc:weight_version"] + (["/health"] if name == "prefill.0" else [])
    assert pd["decode.1"].paths().count("rpc:reload_and_repack") == 2
    with pytest.raises(ValueError, match="repeats a name or a URL"):
        ProxiedClient("http://p:1", [("a", "http://e:1"), ("b", "http://e:1/")])
    with pytest.raises(ValueError, match="engine_urls is empty"):
        ProxiedClient("http://p:1", [])


# ---------------------------------------------------------------------------------------------- runs
def _fake_trainer(run: Path, ckpt: Path, steps: int, stop: threading.Event, errors: list) -> None:
    """The trainer's file protocol (see the module docstring)."""
    try:
        import torch
        from safetensors.torch import load_file, save_file

        from moe_rl.rl.batch import batch_path, read_batch
        from moe_rl.weights.announce import write_announcement
        from moe_rl.weights.filesystem import MARKER, version_dir

        paths = RunPaths(run)
        base = load_file(str(ckpt / "model.safetensors"))
        for n in range(steps):
            while not batch_path(paths.batches, n).exists():
                if stop.wait(0.01):
                    return
            t0 = time.monotonic()
            batch = read_batch(batch_path(paths.batches, n))
            tmp = paths.weights / f"step_{n + 1}.tmp"
            shutil.copytree(ckpt, tmp)
            tensors = dict(base)
            tensors["lm_head.weight"] = base["lm_head.weight"] * (1.0 + (n + 1) / 2)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            os.replace(tmp, version_dir(paths.weights, n + 1))
            (version_dir(paths.weights, n + 1) / MARKER).write_text(json.dumps({"version": n + 1}))
            write_announcement(paths.weights, n + 1, "filesystem", filesystem_copy=True,
                               path=version_dir(paths.weights, n + 1), layout="hf")
            report = {"loss": 0.0, "mismatch_kl": 0.0, "masked_frac": 0.0, "grad_norm": 0.0, "lr": 0.0,
                      "tokens": int(torch.as_tensor(batch.loss_mask).sum()) if hasattr(batch, "loss_mask") else 1,
                      "idle_s": 0.0, "compute_s": time.monotonic() - t0, "publish_s": 0.0}
            out = paths.trainer_step(n)
            out.with_suffix(".tmp").write_text(json.dumps(report))
            os.replace(out.with_suffix(".tmp"), out)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def _run_with_trainer(tmp_path, ckpt, cfg_path, steps, *argv_urls, inference_url):
    run = tmp_path / "run"
    run.mkdir()
    stop, errors = threading.Event(), []
    trainer = threading.Thread(target=_fake_trainer, args=(run, ckpt, steps, stop, errors), daemon=True)
    trainer.start()
    try:
        rc = _main(tmp_path, cfg_path, *argv_urls, run_dir=run, inference_url=inference_url)
    finally:
        stop.set()
        trainer.join(10)
    assert not errors, errors
    return rc, run


def _loaded_versions(wt: dict) -> list[int]:
    """The loaded versions from summary.json's compact ``versions_loaded`` (count, first, last, gaps)."""
    vl = wt["versions_loaded"]
    if not vl["count"]:
        return []
    gaps = {v for a, b in vl["gaps"] for v in range(a, b + 1)}
    loaded = [v for v in range(vl["first"], vl["last"] + 1) if v not in gaps]
    assert len(loaded) == vl["count"], vl
    return loaded


def _check_accounting(summary: dict, steps: int) -> None:
    s = summary
    assert s["steps"] == steps
    assert s["rollouts_started"] == (s["rollouts_trained"] + s["rollouts_dropped"] + s["rollouts_withheld"]
                                     + s["rollouts_inflight_at_exit"])
    assert s["rollouts_trained"] == steps * 4  # batch_size 4 per step
    wt = s["weight_transport"]
    loaded = set(_loaded_versions(wt))
    accounted = loaded | set(wt["versions_skipped_newer"]) | set(wt["versions_not_loaded_at_exit"])
    assert accounted == set(range(1, steps + 1)) and loaded, wt


def test_disaggregated_run_against_fakes(tmp_path, ckpt, pd):
    steps = 3
    cfg = _write(tmp_path, ckpt, **_disagg(max_steps=steps))
    rc, run = _run_with_trainer(tmp_path, ckpt, cfg, steps, f"prefill={pd['prefill.0'].url}",
                                f"decode={pd['decode.0'].url}", inference_url=pd["proxy"].url)
    assert rc == 0
    summary = json.loads((run / "summary.json").read_text())
    _check_accounting(summary, steps)
    assert summary["cluster"]["mode"] == "disaggregated"
    tv = summary["token_versions"]
    assert tv["tracked"] is False and tv["completions_without_versions"] >= summary["rollouts_trained"]
    # generation (rollouts and probes) only through the proxy; weight loads on both replicas, never the proxy
    assert set(pd["proxy"].paths()) <= {"/v1/completions", "/health"}
    loaded = _loaded_versions(summary["weight_transport"])
    for name in ("prefill.0", "decode.0"):
        assert "/v1/completions" not in pd[name].paths()
        # every loaded version reached this replica (one more load may have been cut off by the run's end)
        assert pd[name].loads[:len(loaded)] == loaded and len(pd[name].loads) <= len(loaded) + 1, pd[name].loads
    events = [json.loads(x) for x in (run / "engine_events.jsonl").read_text().splitlines()]
    # the run may end while the last loaded version's probe is in flight: its event is then not written
    assert [e["served_version"] for e in events] == [e["version"] for e in events] == [0, *loaded][:len(events)]
    assert len(events) >= 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) == steps and (run / "curves.png").exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_cluster_run_on_cpu_real_trainer_and_vllm(tmp_path, ckpt):
    """The whole cluster path on one CPU machine: the cluster trainer under torchrun (2 gloo ranks, FSDP2, meta
    build + sharded load, chunked log-probs, optimizer offload, streaming publish), this orchestrator (colocated,
    RoutedClient) and one real vLLM CPU server that reloads every published version, 3 steps."""
    pytest.importorskip("vllm")
    import subprocess

    from moe_rl.inference import VllmServer, VllmServerConfig

    steps = 3
    cfg = write_cluster_config(tmp_path / "c.json", ckpt, max_steps=steps, gpus_per_node=2,
                               trainer={"num_nodes": 1, "seq_len": 128, "activation_checkpointing": "none",
                                        "optimizer_offload": True, "loss_chunk_tokens": 16, "env": {},
                                        "optim": {"lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 0}})
    run = tmp_path / "run"
    run.mkdir()
    cores = [0] if len(os.sched_getaffinity(0)) >= 2 else None
    server = VllmServer(VllmServerConfig(cpu_affinity=cores, max_model_len=128, logprobs_mode="processed_logprobs",
                                         kv_cache_memory_bytes=32 * 2**20, startup_timeout_s=240),
                        ckpt, tmp_path / "vllm.log")
    trainer = None
    log = open(tmp_path / "trainer.log", "w")  # noqa: SIM115 - closed below
    server.start()
    try:
        # the trainer starts while the server loads (it reads the checkpoint and waits for batches; it never calls
        # the server), so the two start-ups overlap as in a real launch
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]))
        trainer = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "-m", "moe_rl.entrypoints.cluster_trainer", "--config", str(cfg), "--run-dir", str(run)],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        server.wait_ready()
        rc = _main(tmp_path, cfg, f"engine={server.base_url}", run_dir=run, inference_url=server.base_url)
        trainer_rc = trainer.wait(timeout=180)
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        log.close()
        server.stop()
    trainer_log = (tmp_path / "trainer.log").read_text()
    assert trainer_rc == 0, trainer_log[-4000:]
    assert rc == 0, trainer_log[-2000:] + (tmp_path / "vllm.log").read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    _check_accounting(summary, steps)
    assert summary["engine_errors"] == 0
    tv = summary["token_versions"]
    assert tv["tracked"] is True and tv["tracking_errors"] == []
    for n in range(steps):  # the real trainer's reports: finite loss, a gradient, the streaming publish
        rep = json.loads((run / "trainer" / f"step_{n}.json").read_text())
        assert rep["step"] == n and rep["grad_norm"] > 0 and rep["loss"] == rep["loss"]
        assert rep["weight_transport"]["versions"] == n + 1
    events = [json.loads(x) for x in (run / "engine_events.jsonl").read_text().splitlines()]
    loaded = _loaded_versions(summary["weight_transport"])
    # the run may end while the last loaded version's probe is in flight: its event is then not written
    assert [e["version"] for e in events] == [0, *loaded][:len(events)] and len(events) >= 2
    assert all(e["served_version"] == e["version"] for e in events)  # the engine reports each loaded version
    # the trainer's updates reach the engine: the greedy probe's log-probs change with every loaded version
    probes = [tuple(e["probe_logprobs"]) for e in events]
    assert len(set(probes)) == len(probes), probes
