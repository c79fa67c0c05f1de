"""simulate_pipeline against hand-computed timelines, determinism, the long-tail behaviour, and the
--from-run fit/compare path on a synthetic run directory."""

import json
import math
import random

import pytest

from moe_rl.rl.simulator import (
    PipelineSimConfig,
    compare_with_run,
    empirical_group_lengths,
    lognormal_lengths,
    main,
    simulate_pipeline,
)


def _const(x: float):
    return lambda rng, n: [x] * n


def test_sync_timeline_hand_computed():
    """max_off_policy_steps=0: rollouts 10 s, train 5 s -> every step waits 10 s and trains 5 s."""
    cfg = PipelineSimConfig(batch_size=4, group_size=2, max_inflight=100, max_off_policy_steps=0,
                            tokens_per_s=1.0, train_step_s=5.0, max_steps=7)
    r = simulate_pipeline(cfg, _const(10.0))
    assert r.time_s == pytest.approx(15.0 * 7)
    assert r.trained_samples == 28
    assert r.trained_samples_per_hour == pytest.approx(28 / 105 * 3600)
    assert r.trainer_idle_frac == pytest.approx(10 / 15)
    assert r.step_idle_s == pytest.approx([10.0] * 7)
    assert r.staleness_hist == {0: 28}
    assert r.dropped_frac == 0.0


def test_async_overlaps_inference_with_training_hand_computed():
    """max_off_policy_steps=1, rollouts 10 s, train 20 s, weight update 1 s: batches 0 and 1 start at t=0 (v0),
    the trainer runs 10..30, 30..50, ...; batch n>=2 starts when v_{n-1} is served (20n - 9 s) and is ready
    10 s later, before the trainer needs it -> no idle after the first batch; staleness 0 for batch 0, 1 after."""
    cfg = PipelineSimConfig(batch_size=4, group_size=2, max_inflight=100, max_off_policy_steps=1,
                            tokens_per_s=1.0, train_step_s=20.0, weight_update_s=1.0, max_steps=6)
    r = simulate_pipeline(cfg, _const(10.0))
    assert r.time_s == pytest.approx(10.0 + 20.0 * 6)
    assert r.trainer_idle_s == 0.0 and r.trainer_idle_frac == 0.0
    assert r.staleness_hist == {0: 4, 1: 20}
    sync = simulate_pipeline(cfg.model_copy(update={"max_off_policy_steps": 0}), _const(10.0))
    assert sync.time_s == pytest.approx(6 * 30.0 + 5 * 1.0)  # + the weight update before every later batch


def test_weight_watcher_is_busy_after_an_update():
    """Sync, rollouts 0.1 s, steps 1 s, probe 2.5 s: v1 is adopted at 1.1 s (watcher busy until 3.6 s), v2
    (published 2.2 s) at 3.6 s, v3 (published 4.7 s) at 6.1 s -> steps start at 0.1, 1.2, 3.7, 6.2."""
    cfg = PipelineSimConfig(batch_size=2, group_size=2, max_inflight=10, max_off_policy_steps=0, tokens_per_s=1.0,
                            train_step_s=1.0, watcher_busy_s=2.5, max_steps=4)
    r = simulate_pipeline(cfg, _const(0.1))
    assert r.step_idle_s == pytest.approx([0.1, 0.1, 1.5, 1.5])
    assert r.time_s == pytest.approx(7.2)


def test_engine_slots_queue_sequences():
    """2 slots, 4 sequences of 10 s: the second pair starts at 10 s, so batch 0 is ready at 20 s."""
    cfg = PipelineSimConfig(batch_size=4, group_size=2, max_inflight=100, max_off_policy_steps=0,
                            inference_slots=2, tokens_per_s=1.0, train_step_s=1.0, max_steps=1)
    r = simulate_pipeline(cfg, _const(10.0))
    assert r.step_idle_s == [20.0] and r.time_s == 21.0


def test_deterministic_and_seeded():
    kw = dict(batch_size=16, group_size=4, max_inflight=16, max_off_policy_steps=2, inference_slots=32,
              tokens_per_s=10.0, train_step_s=3.0, weight_update_s=0.5, max_steps=30)
    lengths = lognormal_lengths(20, 1.3)
    a = simulate_pipeline(PipelineSimConfig(**kw, seed=1), lengths)
    b = simulate_pipeline(PipelineSimConfig(**kw, seed=1), lengths)
    c = simulate_pipeline(PipelineSimConfig(**kw, seed=2), lengths)
    assert a == b
    assert a.time_s != c.time_s


@pytest.mark.parametrize("policy", ["drop", "withhold", "mask"])
def test_long_tail_policies_account_for_every_sample(policy):
    cfg = PipelineSimConfig(batch_size=16, group_size=4, max_inflight=32, max_off_policy_steps=1, max_ahead=1,
                            admission="queued", inference_slots=64, tokens_per_s=10.0, train_step_s=3.0,
                            weight_update_s=0.2, policy=policy, max_steps=40)
    r = simulate_pipeline(cfg, lognormal_lengths(20, 1.5))
    c = r.counters
    assert c["started"] == c["inflight"] + c["queued"] + c["in_batch"] + c["trained"] + c["dropped"] + c["withheld"]
    # every batch is full except for fully masked members removed at take time (mask policy)
    assert r.trained_samples == 40 * 16 if policy != "mask" else 0 < r.trained_samples <= 40 * 16
    if policy == "drop":
        assert r.dropped_frac > 0 and r.withheld_frac == 0 and max(r.staleness_hist) <= 1
    elif policy == "withhold":
        assert r.withheld_frac > 0 and c["dropped"] == 0 and max(r.staleness_hist) <= 1
    else:  # mask trains whole-rollout staleness > 1 but masks the old tokens
        assert c["dropped"] == 0 and r.masked_token_frac > 0 and max(r.staleness_hist) > 1


def test_lognormal_tail_ratio():
    rng = random.Random(0)
    xs = sorted(lognormal_lengths(100, 1.3)(rng, 20000))
    assert xs[int(0.99 * len(xs))] / xs[len(xs) // 2] == pytest.approx(math.exp(2.326 * 1.3), rel=0.1)
    with pytest.raises(ValueError, match="sigma=-1"):
        lognormal_lengths(100, -1)
    with pytest.raises(ValueError, match="durations"):
        empirical_group_lengths([], 1.0)


def test_config_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        PipelineSimConfig(batch_size=6, group_size=4)
    with pytest.raises(ValueError, match="max_ahead=3 must be <= max_off_policy_steps=2"):
        PipelineSimConfig(max_off_policy_steps=2, max_ahead=3)
    assert PipelineSimConfig(max_off_policy_steps=2, max_ahead=2).max_ahead == 2


@pytest.mark.parametrize(("sampler", "msg"), [
    (lambda r, n: [10.0] * (n - 1), "lengths sampler returned 1 lengths for a group of group_size=2"),
    (lambda r, n: [10.0, -3.0], r"lengths sampler returned -3.0 \(1 bad of 2\)"),
    (lambda r, n: [float("nan")] * n, r"lengths sampler returned nan \(2 bad of 2\)"),
    (lambda r, n: [0] * n, "finite number of tokens > 0"),
])
def test_bad_length_sampler_raises(sampler, msg):
    cfg = PipelineSimConfig(batch_size=4, group_size=2, max_steps=2)
    with pytest.raises(ValueError, match=msg):
        simulate_pipeline(cfg, sampler)


@pytest.mark.parametrize("name", ["train_step_time", "weight_update_time", "watcher_busy_time"])
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_time_sampler_raises(name, bad):
    cfg = PipelineSimConfig(batch_size=4, group_size=2, max_steps=3)
    with pytest.raises(ValueError, match=rf"{name} sampler returned {bad!r}; it must return a finite number"):
        simulate_pipeline(cfg, _const(3.0), **{name: lambda r: bad})
    # the same run with a valid sampler completes (the checks do not reject good values)
    assert simulate_pipeline(cfg, _const(3.0), **{name: lambda r: 0.5}).steps == 3


def _write_run(tmp_path, steps=20, dur=2.0, train=1.0):
    """A synchronous run (max_off_policy_steps=0) as moe-rl rl would log it: groups take `dur` s, steps `train` s."""
    cfg = {"orchestrator": {"batch_size": 4, "group_size": 2, "max_inflight": 8, "max_off_policy_steps": 0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "trainer").mkdir()
    with open(tmp_path / "rollouts.jsonl", "w") as f, open(tmp_path / "metrics.jsonl", "w") as m, \
            open(tmp_path / "engine_events.jsonl", "w") as e:
        for s in range(steps):
            t0 = s * (dur + train)
            for g in range(2):
                f.write(json.dumps({"group_id": 2 * s + g, "t_start": t0, "t_end": t0 + dur}) + "\n")
            m.write(json.dumps({"step": s, "trainer_idle_s": dur, "trainer_busy_s": train, "staleness_counts": {"0": 4},
                                "rollouts_dropped": 0, "rollouts_started": 4 * (s + 1), "time_s": t0 + dur + train})
                    + "\n")
            e.write(json.dumps({"version": s, "reload_s": 0.0, "t": t0, "probe_s": 0.0}) + "\n")
            (tmp_path / "trainer" / f"step_{s}.json").write_text(json.dumps({"compute_s": train, "publish_s": 0.0}))


def test_compare_with_run_reproduces_a_synchronous_run(tmp_path):
    _write_run(tmp_path)
    r = compare_with_run(tmp_path, seeds=[0, 1])
    assert r["measured"]["trainer_idle_frac"] == pytest.approx(2 / 3)
    assert r["simulated"]["trainer_idle_frac"] == pytest.approx(2 / 3)
    assert r["simulated"]["staleness_frac"] == {"0": 1.0}
    assert r["within_tolerance"]
    out = tmp_path / "cmp.json"
    assert main(["--from-run", str(tmp_path), "--out", str(out), "--seeds", "1"]) == 0
    saved = json.loads(out.read_text())
    assert saved["comparisons"][0]["within_tolerance"] and "commit" in saved["provenance"]
    with pytest.raises(FileNotFoundError, match="rollouts.jsonl"):
        (tmp_path / "rollouts.jsonl").unlink()
        compare_with_run(tmp_path)
