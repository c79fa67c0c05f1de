"""The RL trainer on the library's parallelism (``trainer.parallel``: EP x CP x FSDP2/HSDP) equals one process.

Tier 1 (no process group): the layout config's validation (product = ``nproc_per_node``, ``ep`` divides
``dp_shard * cp`` and ``n_routed_experts``, batch rows divisible by the data-parallel ranks, FP8 experts accepted
under EP as FP8 local experts, see ``test_mixed_precision.py``) and the default layout (FSDP2 over every rank).

Tier 2: one 4-rank gloo world (``_parallel_trainer_worker.py``) runs the real trainer step
(:func:`moe_rl.runtime.trainer.step.build_trainer` / :func:`~moe_rl.runtime.trainer.step.train_step` /
:func:`~moe_rl.runtime.trainer.step.full_state_dict`, what ``rl_trainer`` runs per step) for 2 steps with router replay on,
on batches whose rows carry real routed-experts records (one sample without a record: the trainer routes it; pad
and last-token fill rows) and whose length (11) is not a multiple of ``2 * cp``, so the CP shards are padded:

* ``dp2_cp2_ep2_ring_replay``: dp_shard=2 x cp=2 with ep=2 borrowed from them, ring attention, ``dppo_kl`` loss,
  warm-up schedule, a clip threshold below the gradient norm (the clip is active);
* ``hsdp2_cp2_ulysses_ac_gspo_replay``: dp_replicate=2 x cp=2 (HSDP, the CP pair is the FSDP shard group), Ulysses,
  activation checkpointing, the sequence-level ``gspo`` loss with token-age weighting (whole-row loss under CP).

Each is compared with a single-process fp32 reference (the unsharded model on the whole batch, the same replay
rows, ``compute_loss`` / ``loss_normalizer``, torch's clip, AdamW): the reported loss, mismatch_kl and grad_norm of
each step, every gradient right before each AdamW step (gathered; after the clip), and every parameter after the 2
steps. The gradient check is what proves the loss scaling (``world / normaliser`` with FSDP2's SUM-then-divide by
the world on gloo, CP ranks owning disjoint columns): AdamW is invariant to a constant gradient scale, parameters
alone would not catch a wrong factor.

Tolerances (fp32, ``tests/_tolerance.py`` ``assert_train_run_close``): the runs differ only in summation order
(FSDP reduce-scatter, EP combine, the CP attention's blockwise softmax merge, the loss sums). Gradients: per-tensor
normwise bound of the decoder chain (forward + backward, two paths); loss and ``mismatch_kl``: the log-prob error
bound propagated through the reference's ``d loss / d lp``; the lr schedule: exact. A wrong reduction factor, a
missing CP/EP term or a token replaying another token's routing is O(1) relative. AdamW runs with
``eps = 1e-3 = lr``: its update ``lr * m / (sqrt(v) + eps)`` then moves a parameter by at most ``2 lr / eps = 2``
times a gradient difference, so the parameter check (against the measured gradient differences) is as strict as
the gradient check and not scale-invariant (with the default eps = 1e-8 an element whose gradient is ~1e-9 would
amplify a 5e-11 summation-order difference to ~5e-6).

Runtime on the shared 2-core machine: ~20-30 s (4 processes start, 2 scenarios x 2 steps, 2 reference runs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _ranks import scenario_result
from _reference_trainer import reference_steps, spread_router_model, write_run_inputs
from _rollout_groups import random_groups
from _tolerance import assert_train_run_close, decoder_chain

from moe_rl.runtime.config import RLConfig
from moe_rl.runtime.trainer.config import TrainerConfig

WORLD = 4
TIMEOUT_S = 300


# ------------------------------------------------------------------------------- tier 1: configuration


def test_default_layout_is_fsdp_over_every_rank():
    for n in (1, 2, 4):
        t = TrainerConfig(nproc_per_node=n)
        d = t.dims
        assert (d.dp_replicate, d.dp_shard, d.cp, d.ep) == (1, n, 1, 1)
        assert t.data_parallel_size == n
    t = TrainerConfig(nproc_per_node=8, parallel={"dp_replicate": 2, "cp": 2, "ep": 2})
    assert (t.dims.dp_shard, t.data_parallel_size) == (2, 4)


@pytest.mark.parametrize(
    ("trainer", "match"),
    [
        ({"nproc_per_node": 4, "parallel": {"cp": 3}},
         r"dp_replicate\*cp = 1\*3 = 3 does not divide .*nproc_per_node=4"),
        ({"nproc_per_node": 4, "parallel": {"dp_shard": 1, "cp": 2}},
         r"dp_replicate\*dp_shard\*cp = 1\*1\*2 = 2 must equal trainer.nproc_per_node=4"),
        ({"nproc_per_node": 2, "parallel": {"ep": 4}}, r"trainer.parallel: ep=4 must divide dp_shard\*cp = 2\*1 = 2"),
        ({"nproc_per_node": 2, "parallel": {"dp_replicate": 2}}, r"dp_replicate=2 with dp_shard\*cp = 1"),
    ],
)
def test_layout_validation_names_the_fields(trainer, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**trainer)


def test_rl_config_checks_the_layout_against_model_and_batch(tmp_path):
    TrainerConfig(nproc_per_node=2, parallel={"ep": 2}, fp8={"enabled": True, "experts": False})  # FP8 linears + EP
    TrainerConfig(nproc_per_node=2, parallel={"ep": 2}, fp8=True)  # FP8 experts under EP: FP8 LocalExperts
    with pytest.raises(ValueError, match=r"trainer.parallel.ep=3 must divide model.n_routed_experts=8"):
        RLConfig(output_dir=tmp_path / "r", orchestrator={"batch_size": 12, "group_size": 2},
                 trainer={"nproc_per_node": 6, "parallel": {"ep": 3}})
    # cp ranks share rows: 4 ranks at cp=2 are 2 data ranks, so a batch of 6 rows fits; at cp=1 it does not
    RLConfig(output_dir=tmp_path / "r", orchestrator={"batch_size": 6, "group_size": 2},
             trainer={"nproc_per_node": 4, "parallel": {"cp": 2}})
    with pytest.raises(ValueError, match=r"batch_size=6 must be divisible by the trainer's data-parallel ranks"):
        RLConfig(output_dir=tmp_path / "r", orchestrator={"batch_size": 6, "group_size": 2},
                 trainer={"nproc_per_node": 4})


# ---------------------------------------------------------------------------------- tier 2: gloo, 4 ranks

SCENARIOS = {
    "dp2_cp2_ep2_ring_replay": {
        "parallel": {"cp": 2, "ep": 2, "cp_method": "ring"},
        "optim": {"lr": 1e-3, "eps": 1e-3, "warmup_steps": 2, "max_grad_norm": 0.05},
    },
    "hsdp2_cp2_ulysses_ac_gspo_replay": {
        "parallel": {"dp_replicate": 2, "cp": 2, "cp_method": "ulysses", "activation_checkpointing": True},
        "optim": {"lr": 1e-3, "eps": 1e-3, "warmup_steps": 0, "weight_decay": 0.01},
        "loss": {"kind": "gspo", "kl_tau": 0.01, "gspo": {"clip_low": 0.9, "clip_high": 9.0}, "age": {"decay": 0.5}},
    },
}
LENGTHS = [(4, 3), (6, 5), (5, 2), (4, 1), (7, 4), (5, 5), (4, 2), (6, 3)]  # (prompt, completion): L = 11


def _groups(step: int, cfg: RLConfig):
    """2 groups of 4 samples; every sample but one carries a routed-experts record (last row a placeholder); at
    step 1 half the samples switch to policy version 1 after their first token (token ages for the age weight)."""
    from moe_rl.replay import RoutedExperts

    m = cfg.model
    moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    rng = np.random.default_rng(300 + step)

    def routed(gid: int, j: int, p: int, c: int) -> dict:
        if (gid, j) == (0, 2):  # this one has no record: OWN_ROW, the trainer routes it
            return {"routed_experts": None}
        ids = np.argsort(rng.random((p + c, moe, m.n_routed_experts)), axis=-1)[..., : m.num_experts_per_tok]
        ids[-1] = -1  # the last sampled token is never forwarded by the engine: placeholder
        return {"routed_experts": RoutedExperts.from_array(ids, m.n_routed_experts)}

    groups = random_groups(rng, LENGTHS, m.vocab_size, extra=routed)
    if step == 1:  # odd samples of a group switch to policy version 1 after their first token
        for s in (s for g in groups for s in g.samples[1::2] if len(s.completion_ids) > 1):
            s.version_segments = [(0, 0), (1, 1)]
    return groups


def _init_model(cfg: RLConfig):
    return spread_router_model(cfg.model)  # spread router scores: the non-replayed sample has no near-tie top-k


def _prepare(root, name: str, trainer: dict):
    from moe_rl.rl.batch import build_batch

    d = root / name
    cfg = RLConfig(output_dir=d, max_steps=2, orchestrator={"batch_size": 8, "group_size": 4},
                   trainer={"nproc_per_node": WORLD, "router_replay": True, **trainer})
    d.mkdir()
    init = _init_model(cfg).state_dict()
    batches = [build_batch(_groups(s, cfg), s, pad_id=cfg.pad_id) for s in range(2)]
    assert batches[0].input_ids.shape[1] == 11 and int(batches[1].token_versions.max()) == 1
    state = batches[0].routed_experts_state
    assert (state == 0).any() and (state == -1).any() and (state == -2).any()  # replay, fill and own rows
    write_run_inputs(cfg, init, batches)
    return cfg, batches


def _reference(cfg: RLConfig, batches):
    """Single process, fp32, the whole batch: per step (report fields, gradients after the clip), final params."""
    from moe_rl.models.glm4_moe import load_hf_state_dict

    model = _init_model(cfg)
    model.load_state_dict(load_hf_state_dict(cfg.output_dir / "weights" / "step_0"))
    return reference_steps(cfg, model, batches)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, launch_ranks):
    from pathlib import Path

    root = tmp_path_factory.mktemp("trainer4")
    prepared = {name: _prepare(root, name, trainer) for name, trainer in SCENARIOS.items()}
    worker = Path(__file__).with_name("_parallel_trainer_worker.py")
    results = launch_ranks(worker, WORLD, root, TIMEOUT_S)
    print("\nseconds:", results[0]["_seconds"])
    return root, prepared, results


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_parallel_trainer_step_matches_single_process(world4, scenario):
    (cfg, batches), got = scenario_result(world4, scenario)
    ref_steps, ref_params = _reference(cfg, batches)
    if scenario.startswith("dp2_cp2_ep2"):  # the clip is active: the step's gradients were rescaled
        assert all(ref["grad_norm"] > cfg.trainer.optim.max_grad_norm for ref in ref_steps)
    k, depth = decoder_chain(cfg.model, max(r["chain_tokens"] for r in ref_steps), backward=True)
    o = cfg.trainer.optim
    assert_train_run_close(got["reports"], got["grads"], got["params"], ref_steps, ref_params, k=k,
                           depth=2 * depth + 2, lr=o.lr, adam_eps=o.eps,
                           smooth={"loss": "loss", "mismatch_kl": "mismatch_kl"}, exact=("lr",), what=scenario)
    err = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step, (rep, ref) in enumerate(zip(got["reports"], ref_steps, strict=True)):
        err["loss"] = max(err["loss"], abs(rep["loss"] - ref["loss"]))
        for n, g in ref["grads"].items():
            err["grad"] = max(err["grad"], _max_abs(got["grads"][step][n], g))
    for n, p in ref_params.items():
        err["param"] = max(err["param"], _max_abs(got["params"][n], p))
    print(f"\n{scenario}: max abs error vs single process {err}")
