"""Resumable checkpoints (``moe_rl.runtime.checkpoint``) without a vLLM server or torchrun: the writer and reader
(single process: torch.distributed.checkpoint without a process group), atomicity (a folder without its COMPLETE
marker is never read), pruning, the orchestrator's accounting round trip and the refusals of ``--resume``. The
two-rank FSDP2 path and the whole resume are exercised by ``tests/test_e2e_resume.py``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_rl.envs.addition import AdditionTask, AdditionTaskConfig
from moe_rl.envs.tokenizer import CharTokenizer
from moe_rl.models import GlmMoeConfig, GlmMoeForCausalLM
from moe_rl.rl.buffer import RolloutGroup, Sample
from moe_rl.runtime import checkpoint as ck
from moe_rl.runtime.config import RLConfig
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths
from moe_rl.runtime.trainer.config import OptimizerConfig
from moe_rl.runtime.trainer.step import make_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trainer_state(seed: int, steps: int) -> SimpleNamespace:
    """A tiny GLM MoE with AdamW + warm-up after ``steps`` optimizer steps on fixed random tokens."""
    cfg = GlmMoeConfig.tiny_debug()
    torch.manual_seed(seed)
    model = GlmMoeForCausalLM(cfg)
    opt, sched = make_optimizer(model, OptimizerConfig(warmup_steps=3, weight_decay=0.1))
    st = SimpleNamespace(model=model, opt=opt, sched=sched, cfg=cfg)
    for _ in range(steps):
        _step(st)
    return st


def _step(st: SimpleNamespace) -> None:
    g = torch.Generator().manual_seed(len(st.opt.state) + st.sched.last_epoch)
    ids = torch.randint(0, st.cfg.vocab_size, (2, 8), generator=g)
    st.model(ids).float().logsumexp(-1).mean().backward()
    st.opt.step()
    st.sched.step()
    st.opt.zero_grad(set_to_none=True)


def _save(st: SimpleNamespace, root: Path, step: int) -> Path:
    return ck.save_trainer_state(st, root, step, hf_config=st.cfg.to_hf_config_dict(torch_dtype="float32"),
                                 extra_files=[], mcfg=st.cfg, dtype=torch.float32)


def test_trainer_state_round_trip_is_bit_exact_and_training_continues_identically(tmp_path):
    saved = _trainer_state(seed=0, steps=2)
    tmp = _save(saved, tmp_path, 2)
    assert (tmp / "trainer" / "trainer.json").is_file() and (tmp / "engine" / "step_2" / "STABLE").is_file()
    ck.finalize(tmp_path, 2, {"any": 1}, {"seed": 0}, keep=2)
    # a different model (other init, no steps): loading replaces every byte of model, optimizer, schedule and RNG
    fresh = _trainer_state(seed=1, steps=0)
    torch.manual_seed(999)
    info = ck.load_trainer_state(fresh, ck.checkpoint_dir(tmp_path, 2))
    assert info["step"] == 2 and info["digest_loaded"] == info["digest_saved"] == ck.state_digest(saved.model, saved.opt)
    for (k, a), (_, b) in zip(saved.model.state_dict().items(), fresh.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert fresh.sched.last_epoch == saved.sched.last_epoch == 2
    assert fresh.opt.param_groups[0]["lr"] == saved.opt.param_groups[0]["lr"]
    # the same next step on both gives the same bytes (same arithmetic, same state)
    _step(saved)
    _step(fresh)
    assert ck.state_digest(saved.model, saved.opt) == ck.state_digest(fresh.model, fresh.opt)


def test_rng_states_are_restored(tmp_path):
    st = _trainer_state(seed=0, steps=1)
    torch.manual_seed(5)
    random.seed(5)
    _save(st, tmp_path, 1)
    expected = (torch.rand(4), random.random())
    ck.finalize(tmp_path, 1, {}, {}, keep=1)
    torch.manual_seed(77)
    random.seed(77)
    ck.load_trainer_state(st, ck.checkpoint_dir(tmp_path, 1))
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]


def test_a_corrupted_checkpoint_is_refused_by_its_digest(tmp_path):
    st = _trainer_state(seed=0, steps=1)
    _save(st, tmp_path, 1)
    ck.finalize(tmp_path, 1, {}, {}, keep=1)
    rank_file = ck.checkpoint_dir(tmp_path, 1) / "trainer" / "rank_0.pt"
    data = torch.load(rank_file, weights_only=False)
    data["digest"] = "0" * 64
    torch.save(data, rank_file)
    with pytest.raises(RuntimeError, match="differs from the state saved there"):
        ck.load_trainer_state(_trainer_state(seed=1, steps=0), ck.checkpoint_dir(tmp_path, 1))


def _fake_checkpoint(root: Path, step: int, complete: bool = True, tmp: bool = False) -> Path:
    d = ck.tmp_dir(root, step) if tmp else ck.checkpoint_dir(root, step)
    (d / "trainer").mkdir(parents=True)
    (d / "trainer" / "trainer.json").write_text("{}")
    if complete and not tmp:
        (d / ck.COMPLETE).write_text("{}")
    return d


def test_only_marked_checkpoints_count(tmp_path):
    assert ck.complete_checkpoints(tmp_path) == [] and ck.latest_checkpoint(tmp_path) is None
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 6, complete=False)  # a writer that stopped before the marker: ignored
    _fake_checkpoint(tmp_path, 8, tmp=True)  # still being assembled: ignored
    (tmp_path / ck.CHECKPOINTS / "step_x").mkdir()
    assert ck.complete_checkpoints(tmp_path) == [2] and ck.latest_checkpoint(tmp_path) == 2
    # finalize completes a .tmp atomically (marker inside, then one rename)
    final = ck.finalize(tmp_path, 8, {"counters": {}}, {"seed": 0}, keep=5)
    assert final == ck.checkpoint_dir(tmp_path, 8) and not ck.tmp_dir(tmp_path, 8).exists()
    assert json.loads((final / "meta.json").read_text())["config"] == {"seed": 0}
    assert ck.complete_checkpoints(tmp_path) == [2, 8]
    with pytest.raises(RuntimeError, match="trainer's part .* is not complete"):
        ck.finalize(tmp_path, 9, {}, {}, keep=5)  # no trainer part


def test_prune_keeps_the_newest_and_later_tmp_folders(tmp_path):
    for s in (2, 4, 6):
        _fake_checkpoint(tmp_path, s)
    _fake_checkpoint(tmp_path, 3, tmp=True)  # an abandoned writer below the newest: removed
    _fake_checkpoint(tmp_path, 7, tmp=True)  # may be being written right now: kept
    gone = ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["step_2", "step_3.tmp"]
    assert ck.complete_checkpoints(tmp_path) == [4, 6] and ck.tmp_dir(tmp_path, 7).exists()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep=.* must be an int >= 1"):
            ck.prune(tmp_path, keep=bad)


def test_checkpoint_due():
    assert [s for s in range(1, 11) if ck.checkpoint_due(s, 4, 10)] == [4, 8, 10]
    assert not any(ck.checkpoint_due(s, 0, 10) for s in range(0, 11))  # 0 = off, also at the end
    assert not ck.checkpoint_due(0, 1, 10)


def _orchestrator(tmp_path: Path) -> Orchestrator:
    tok = CharTokenizer()
    task = AdditionTask(AdditionTaskConfig(), tok)
    cfg = OrchestratorConfig(batch_size=16, group_size=8, max_off_policy_steps=1)
    return Orchestrator(cfg, task, client=None, paths=RunPaths(tmp_path), max_steps=10, seed=3)


def _group(orch: Orchestrator, gid: int, version: int) -> RolloutGroup:
    samples = [Sample([1, 5], [6, 2], [-0.1, -0.2], 1.0, "stop") for _ in range(8)]
    return RolloutGroup(gid, version, "salt", samples, version_end=version, problem=None)


def test_orchestrator_accounting_continues_across_a_resume(tmp_path):
    orch = _orchestrator(tmp_path)
    buf = orch.buffer
    for gid in range(5):  # 5 groups of 8: 2 trained (one batch), 1 in an untrained batch, 1 queued, 1 in flight
        orch.rng.random()
        buf.start(gid, 0, 8, prompt=("p", gid))
    for gid in range(4):
        buf.put(_group(orch, gid, 0))
    assert buf.take(2, consume_version=0) is not None
    buf.mark_trained(16)
    buf.take(1, consume_version=1)
    orch._next_group_id = 5
    orch.state.completion_tokens = 123
    orch.state.weights_loaded = {1: "filesystem", 2: "filesystem"}
    buf._retry.append((("p", 99), 1))
    state = json.loads(json.dumps(ck.orchestrator_state(orch)))  # JSON-serialisable
    c = buf.counters
    assert (c.started, c.trained, c.in_batch, c.queued, c.inflight) == (40, 16, 8, 8, 8)

    fresh = _orchestrator(tmp_path)
    resume = ck.Resume(step=1, path=tmp_path, orchestrator=state)
    ck.restore_orchestrator(fresh, resume)
    r = fresh.buffer.counters
    r.check()
    assert (r.started, r.trained, r.dropped, r.inflight, r.queued, r.in_batch) == (40, 16, 24, 0, 0, 0)
    assert r.dropped_by_reason == {"resume": 24}
    assert r.started == r.trained + r.dropped + r.withheld
    assert fresh._next_group_id == 5 and fresh.state.completion_tokens == 123
    assert fresh.rng.random() == orch.rng.random()  # the prompt stream continues where it was
    assert fresh.buffer.next_retry() == (("p", 99), 1)
    assert fresh.start_step == fresh.state.engine_version == fresh.state.next_batch == 1
    assert fresh.state.weights_loaded == {1: "checkpoint"}  # version 2 is published again after the resume
    s = fresh.summary()
    assert s["steps"] == 1 and s["rollouts_started"] == 40


def _cfg(root: Path, **kw) -> RLConfig:
    return RLConfig(output_dir=root, max_steps=kw.pop("max_steps", 10), **kw)


def _resumable_run(root: Path, step: int) -> RunPaths:
    """A run directory as an interrupted segment leaves it: checkpoint ``step`` complete, later work on disk."""
    paths = RunPaths(root)
    (paths.weights / "step_0").mkdir(parents=True)
    (paths.weights / "step_0" / "STABLE").write_text("{}")
    for v in (step + 1, step + 2):
        (paths.weights / f"step_{v}").mkdir()
        (paths.weights / f"step_{v}" / "STABLE").write_text("{}")
    ann = paths.weights / "announce"
    ann.mkdir()
    for name in (f"step_{step}.json", f"step_{step + 1}.json", "p2p_group.json", f"request_{step + 2}.json",
                 f"p2p_{step + 1}.json"):
        (ann / name).write_text("{}")
    paths.batches.mkdir()
    paths.trainer.mkdir()
    for k in range(step + 2):
        (paths.batches / f"step_{k}.safetensors").write_text("x")
        (paths.trainer / f"step_{k}.json").write_text("{}")
    paths.metrics.write_text("".join(json.dumps({"step": k}) + "\n" for k in range(step + 2)))
    (root / "summary.json").write_text(json.dumps({"exit": {"status": "interrupted"}, "steps": step + 2,
                                                   "rollouts_started": 100}))
    d = _fake_checkpoint(root, step)
    (d / "engine" / f"step_{step}").mkdir(parents=True)
    (d / "engine" / f"step_{step}" / "STABLE").write_text(json.dumps({"version": step}))
    (d / "meta.json").write_text(json.dumps({"config": json.loads(_cfg(root).model_dump_json())}))
    counters = {"started": 64, "inflight": 8, "queued": 0, "in_batch": 16, "trained": 32, "dropped": 8,
                "withheld": 0, "dropped_by_reason": {"error": 8}, "withheld_by_reason": {}}
    (d / "orchestrator.json").write_text(json.dumps({"counters": counters}))
    _fake_checkpoint(root, step + 2, tmp=True)
    return paths


def test_prepare_resume_sets_aside_the_work_after_the_checkpoint(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    paths = _resumable_run(root, 2)
    res = ck.prepare_resume(paths, _cfg(root))
    assert res.step == 2 and res.discarded_steps == [2, 3] and res.dropped_at_resume == 24
    assert res.discarded_rollouts_started == 36 and res.earlier == [{"exit": {"status": "interrupted"}, "steps": 4}]
    assert sorted(p.name for p in paths.batches.iterdir()) == ["step_0.safetensors", "step_1.safetensors"]
    assert sorted(p.name for p in paths.trainer.iterdir()) == ["resume.json", "step_0.json", "step_1.json"]
    assert json.loads((paths.trainer / "resume.json").read_text()) == {"step": 2, "path": str(res.path)}
    assert sorted(p.name for p in (paths.weights / "announce").iterdir()) == ["step_2.json"]
    # versions above the checkpoint's are gone; version 2 (pruned from weights/) comes back from the checkpoint
    assert sorted(p.name for p in paths.weights.iterdir()) == ["announce", "step_0", "step_2"]
    assert json.loads((paths.weights / "step_2" / "STABLE").read_text()) == {"version": 2}
    assert [json.loads(x)["step"] for x in paths.metrics.read_text().splitlines()] == [0, 1]
    assert [json.loads(x) for x in (root / "resume_discarded.jsonl").read_text().splitlines()] == [
        {"resumed_from": 2, "step": 2}, {"resumed_from": 2, "step": 3}]
    assert not ck.tmp_dir(root, 4).exists()


def test_prepare_resume_keeps_each_segments_logs(tmp_path):
    """The processes of a resumed segment start fresh logs: the earlier segment's move to logs/segment_<k>/ first,
    one folder per segment, nothing overwritten."""
    root = tmp_path / "run"
    root.mkdir()
    paths = _resumable_run(root, 2)
    (paths.logs / "mooncake").mkdir(parents=True)
    (paths.logs / "trainer.log").write_text("segment 1 trainer\n")
    (paths.logs / "mooncake" / "master.log").write_text("m1\n")
    res = ck.prepare_resume(paths, _cfg(root))
    assert res.logs_kept == str(paths.logs / "segment_1") and res.summary()["earlier_logs"] == res.logs_kept
    assert sorted(p.name for p in paths.logs.iterdir()) == ["segment_1"]
    assert (paths.logs / "segment_1" / "trainer.log").read_text() == "segment 1 trainer\n"
    assert (paths.logs / "segment_1" / "mooncake" / "master.log").read_text() == "m1\n"
    (paths.logs / "trainer.log").write_text("segment 2 trainer\n")  # the second segment ran, then stopped
    (paths.trainer / "resume.json").unlink()
    res2 = ck.prepare_resume(paths, _cfg(root))
    assert res2.logs_kept == str(paths.logs / "segment_2")
    assert sorted(p.name for p in paths.logs.iterdir()) == ["segment_1", "segment_2"]
    assert (paths.logs / "segment_2" / "trainer.log").read_text() == "segment 2 trainer\n"
    assert ck.prepare_resume(paths, _cfg(root)).logs_kept is None  # nothing new to keep


def test_prepare_resume_refusals_name_the_reason(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    with pytest.raises(ck.ResumeRefused, match="has no complete checkpoint: it has no checkpoints/"):
        ck.prepare_resume(RunPaths(root), _cfg(root))
    _fake_checkpoint(root, 4, complete=False)
    with pytest.raises(ck.ResumeRefused, match=r"only incomplete ones \(step_4: no COMPLETE marker\)"):
        ck.prepare_resume(RunPaths(root), _cfg(root))
    paths = _resumable_run(root, 2)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    cfg = _cfg(root, model={**GlmMoeConfig.tiny_debug().model_dump(), "num_hidden_layers": 3},
               trainer={"nproc_per_node": 1}, orchestrator={"max_inflight": 7})
    with pytest.raises(ck.ResumeRefused) as err:
        ck.prepare_resume(paths, cfg)
    msg = str(err.value)
    assert "model.num_hidden_layers: 2 (checkpoint) != 3 (now)" in msg
    assert "trainer.nproc_per_node: 2 (checkpoint) != 1 (now)" in msg
    assert "max_inflight" not in msg  # free to change
    with pytest.raises(ck.ResumeRefused, match="max_steps=2 but checkpoint .* is already at step 2"):
        ck.prepare_resume(paths, _cfg(root, max_steps=2))
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before  # refused: nothing changed


def test_config_differences_only_compares_the_fields_that_matter():
    a = {"seed": 0, "max_steps": 5, "model": {"hidden_size": 128, "rope": {"theta": 1.0}}, "trainer": {"optim": {"lr": 1}}}
    b = {"seed": 1, "max_steps": 9, "model": {"hidden_size": 128}, "trainer": {"optim": {"lr": 2}}}
    assert ck.config_differences(a, b) == ["model.rope.theta: 1.0 (checkpoint) != (unset) (now)",
                                           "seed: 0 (checkpoint) != 1 (now)"]
