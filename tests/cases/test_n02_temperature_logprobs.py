"""N02: temperature (and top-k) semantics of trainer vs engine log-probabilities.

One position, logits ``z = [2, 1, 0]``, ``T = 0.5``:

* the trainer (``moe_rl.runtime.trainer.step.token_logprobs`` and the chunked LM-head path
  ``moe_rl.models.common.head.head_label_logprobs``) gives ``log_softmax(z / T) = [-0.142932, -2.142932,
  -4.142932]``;
* the engine's sampler (vLLM's own ``Sampler`` in ``processed_logprobs`` mode, the mode every engine moe_rl starts
  runs with) gives the same values to fp32 rounding; vLLM's default ``raw_logprobs`` gives ``log_softmax(z)``, and
  the "fix" ``raw / T`` carries the constant ratio bias ``exp(LSE(z)/T - LSE(z/T)) = 1.958699`` on every token;
* kept-set mode: with ``top_k = 2`` the engine renormalises over the kept set, ``[-0.126928, -2.126928, -inf]``.
  moe_rl's trainer has only the full-vocabulary mode, so a configuration that would mix the modes (an engine whose
  logprobs are not ``processed_logprobs``) is rejected by ``RLConfig`` and by the cluster launcher's engine groups.

Tolerance: the case's figures are printed to 6 decimals, so they are checked against the float64 values at
``5e-7`` (half a unit of the last digit). The fp32 paths are compared with the float64 values (:data:`LP_TOL`): one
log-softmax over ``V = 3`` logits ``z / T`` (``T = 0.5``, exact): the shift by the max rounds each value by
``u (|z/T| + max|z/T|)``, exp / the ``V``-term sum / log / the difference add ``(V + 3) u`` relative to values
<= 1 or to ``|lse|`` (``tests/_tolerance.py``, worst case), so ``|err| <= eps32 (2 max|z/T| + V + 3)`` (1.7e-6);
the biased values are >= 0.28 away (1.7e5 times the bound).
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.models.common.head import head_label_logprobs
from moe_rl.runtime.trainer.step import token_logprobs

Z = [2.0, 1.0, 0.0]
T = 0.5
CORRECT = [-0.142932, -2.142932, -4.142932]
RAW = [-0.407606, -1.407606, -2.407606]
TOPK2 = [-0.126928, -2.126928, -math.inf]
FIGURES = 5e-7  # the case's values are rounded to 6 decimals
LP_TOL = torch.finfo(torch.float32).eps * (2 * max(abs(v / T) for v in Z) + len(Z) + 3)  # module docstring
EXACT = torch.log_softmax(torch.tensor(Z, dtype=torch.float64) / T, -1).tolist()
EXACT_RAW = torch.log_softmax(torch.tensor(Z, dtype=torch.float64), -1).tolist()
EXACT_TOPK2 = torch.log_softmax(torch.tensor(Z[:2], dtype=torch.float64) / T, -1).tolist()


def _trainer_logprobs() -> torch.Tensor:
    """``[3]`` trainer log-prob of each vocabulary token at the one position (three rows, one label each)."""
    logits = torch.tensor(Z, dtype=torch.float32).expand(3, 2, 3).contiguous()  # [B=3, L=2, V=3]
    ids = torch.tensor([[0, 0], [0, 1], [0, 2]])  # row b predicts token b at position 0
    return token_logprobs(logits, ids, temperature=T)[:, 0]


def test_n02_case_figures_are_the_float64_values():
    assert CORRECT == pytest.approx(EXACT, abs=FIGURES)
    assert RAW == pytest.approx(EXACT_RAW, abs=FIGURES)
    assert TOPK2[:2] == pytest.approx(EXACT_TOPK2, abs=FIGURES)


def test_n02_trainer_logprobs_are_log_softmax_of_z_over_t():
    lp = _trainer_logprobs()
    assert lp.tolist() == pytest.approx(EXACT, abs=LP_TOL)
    # the chunked LM-head path: hidden [1] times W = [[2], [1], [0]] gives the same logits
    hidden = torch.ones(3, 1, 1)
    weight = torch.tensor([[2.0], [1.0], [0.0]])
    lp_chunked = head_label_logprobs(hidden, weight, torch.tensor([[0], [1], [2]]), temperature=T, chunk_tokens=2)
    assert lp_chunked[:, 0].tolist() == pytest.approx(EXACT, abs=LP_TOL)
    # neither is the biased raw / T: every ratio to it is the bias exp(LSE(z)/T - LSE(z/T)) (float64 here), off by
    # at most a factor exp(LP_TOL) (the fp32 log-prob's error; raw / T is taken in float64)
    lse = math.log(sum(math.exp(v) for v in Z))
    lse_t = math.log(sum(math.exp(v / T) for v in Z))
    bias = math.exp(lse / T - lse_t)
    assert bias == pytest.approx(1.958699, abs=FIGURES)  # the case's figure
    raw_over_t = [r / T for r in EXACT_RAW]
    ratios = [math.exp(c - w) for c, w in zip(lp.tolist(), raw_over_t, strict=True)]
    assert ratios == pytest.approx([bias] * 3, abs=bias * math.expm1(LP_TOL))


def _vllm_sampler_logprobs(mode: str, top_k: int | None = None) -> list[float]:
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    md = SamplingMetadata(
        temperature=torch.tensor([T]), all_greedy=False, all_random=True, top_p=None,
        top_k=None if top_k is None else torch.tensor([top_k], dtype=torch.int32), generators={},
        max_num_logprobs=-1, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(1),
        presence_penalties=torch.zeros(1), repetition_penalties=torch.ones(1), output_token_ids=[[]],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )
    out = Sampler(logprobs_mode=mode)(torch.tensor([Z]), md)
    return out.logprobs_tensors.logprobs[0].tolist()


@pytest.mark.vllm
def test_n02_engine_processed_logprobs_match_trainer():
    pytest.importorskip("vllm.v1.sample.sampler")
    trainer = _trainer_logprobs().tolist()
    processed = _vllm_sampler_logprobs("processed_logprobs")
    assert processed == pytest.approx(EXACT, abs=LP_TOL)
    # full-vocabulary mode: both sides log_softmax(z / T), each within LP_TOL of the float64 values
    assert processed == pytest.approx(trainer, abs=2 * LP_TOL)
    raw = _vllm_sampler_logprobs("raw_logprobs")
    assert raw == pytest.approx(EXACT_RAW, abs=LP_TOL)  # vLLM's default: before temperature, != the trainer at T != 1
    kept = _vllm_sampler_logprobs("processed_logprobs", top_k=2)
    assert kept[:2] == pytest.approx(EXACT_TOPK2, abs=LP_TOL) and kept[2] == -math.inf


def test_n02_every_engine_moe_rl_starts_reports_processed_logprobs(tmp_path):
    from moe_rl.config import load_config
    from moe_rl.inference.vllm_server import VllmServer, VllmServerConfig
    from moe_rl.launch.config import ClusterConfig
    from moe_rl.launch.plan import build_plan

    argv = VllmServer(VllmServerConfig(), tmp_path, tmp_path / "log").command(8000)
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    plan = build_plan(load_config(ClusterConfig, ["@", str(repo / "recipes/glm5_1/rl.toml")]))
    engines = [p for p in plan.processes if p.role in ("prefill", "decode", "engine")]
    assert engines
    for p in engines:
        assert p.argv[list(p.argv).index("--logprobs-mode") + 1] == "processed_logprobs", p.argv


def test_n02_config_mixing_logprob_modes_is_rejected(tmp_path):
    from moe_rl.config import load_config
    from moe_rl.launch.config import ClusterConfig
    from moe_rl.runtime.config import RLConfig

    with pytest.raises(ValueError, match="raw_logprobs.*log_softmax\\(logits / orchestrator.temperature\\)"):
        RLConfig(output_dir=tmp_path / "run", inference={"logprobs_mode": "raw_logprobs"})
    with pytest.raises(ValueError, match="raw_logits"):
        RLConfig(output_dir=tmp_path / "run", inference={"extra_args": ["--logprobs-mode=raw_logits"]})
    RLConfig(output_dir=tmp_path / "run")  # the default is consistent
    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    with pytest.raises(ValueError, match="--logprobs-mode raw_logprobs"):
        load_config(ClusterConfig, ["@", str(repo / "recipes/glm5_1/rl.toml"),
                                    "--inference.decode.extra-args", '["--logprobs-mode", "raw_logprobs"]'])
