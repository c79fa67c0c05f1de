"""The config checks the model families share (:mod:`moe_rl.models.common.config`): the routed-expert rules
(:func:`expert_routing_problems`), the leading-dense-layer rule on top (:func:`moe_routing_problems`) and the token-id
range (:func:`token_id_problems`), alone and as the GLM-4.5 and Nemotron-H configs raise them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from moe_rl.models.common.config import expert_routing_problems, moe_routing_problems, token_id_problems
from moe_rl.models.glm4_moe.config import GlmMoeConfig
from moe_rl.models.nemotron_h.config import NemotronHConfig


def _routing(**kw):
    return SimpleNamespace(**{"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, **kw})


@pytest.mark.parametrize(
    ("overrides", "problems"),
    [
        ({}, []),
        # one sentence per cause: K > E is not also reported as K > the experts left after the group limit
        (dict(num_experts_per_tok=9, n_group=1), ["num_experts_per_tok=9 must be <= n_routed_experts=8"]),
        (dict(n_group=3), ["n_routed_experts=8 must be divisible by n_group=3"]),
        (dict(n_group=8, topk_group=2), ["n_group=8 leaves 1 expert per group; the group score sums the top-2 "
                                          "experts of a group, so each group needs >= 2 (lower n_group)"]),
        (dict(topk_group=3), ["topk_group=3 must be <= n_group=2"]),
        (dict(num_experts_per_tok=5), ["num_experts_per_tok=5 must be <= topk_group * n_routed_experts / n_group = 4 "
                                       "(the experts left after the group limit)"]),
    ],
)
def test_expert_routing_problems(overrides, problems):
    assert expert_routing_problems(_routing(**overrides)) == problems


def test_moe_routing_problems_adds_the_dense_layer_rule():
    ok = _routing(first_k_dense_replace=3, num_hidden_layers=3)
    assert moe_routing_problems(ok) == []
    bad = _routing(num_experts_per_tok=5, first_k_dense_replace=4, num_hidden_layers=3)
    assert moe_routing_problems(bad) == expert_routing_problems(bad) + [
        "first_k_dense_replace=4 must be <= num_hidden_layers=3"
    ]


def test_token_id_problems_names_every_id_outside_the_vocabulary():
    ids = dict(vocab_size=10, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert token_id_problems(SimpleNamespace(**ids)) == []
    assert token_id_problems(SimpleNamespace(**{**ids, "bos_token_id": 0, "eos_token_id": [9, 3], "pad_token_id": 9})) == []
    bad = SimpleNamespace(**{**ids, "bos_token_id": 10, "eos_token_id": [2, -1, 12], "pad_token_id": 11})
    fix = " (a row of the embedding); set it to a token of this vocabulary or None"
    assert token_id_problems(bad) == [
        "bos_token_id=10 must be in [0, vocab_size=10)" + fix,
        "eos_token_id=-1 must be in [0, vocab_size=10)" + fix,
        "eos_token_id=12 must be in [0, vocab_size=10)" + fix,
        "pad_token_id=11 must be in [0, vocab_size=10)" + fix,
    ]
    assert token_id_problems(SimpleNamespace(**{**ids, "eos_token_id": 10})) == [
        "eos_token_id=10 must be in [0, vocab_size=10)" + fix
    ]


@pytest.mark.parametrize("cls", [GlmMoeConfig, NemotronHConfig])
@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (dict(n_group=8, topk_group=2), r"n_group=8 leaves 1 expert per group"),
        (dict(n_group=4, topk_group=1, num_experts_per_tok=3),
         r"num_experts_per_tok=3 must be <= topk_group \* n_routed_experts / n_group = 2 \(the experts left"),
        (dict(eos_token_id=[2, 70]), r"eos_token_id=70 must be in \[0, vocab_size=\d+\)"),
        (dict(bos_token_id=70, pad_token_id=71), r"bos_token_id=70 must be in .*; pad_token_id=71 must be in"),
    ],
)
def test_families_raise_the_shared_messages(cls, overrides, pattern):
    with pytest.raises(ValidationError, match=pattern):
        cls.tiny_debug(**overrides)


def test_nemotron_has_no_dense_layer_rule():
    # Nemotron-H places its dense layers by pattern (no first_k_dense_replace): only the routing rules apply
    assert "first_k_dense_replace" not in NemotronHConfig.model_fields
    NemotronHConfig.tiny_debug(hybrid_override_pattern="---E")
