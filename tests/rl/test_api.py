"""The public surface of ``moe_rl.rl``: everything in ``__all__`` exists, the loss and token-version helpers are
exported, and the submodule ``moe_rl.rl.token_versions`` is not shadowed by its function of the same name."""

import importlib
import types

import moe_rl.rl as rl


def test_all_names_exist_and_loss_and_version_helpers_are_exported():
    assert len(rl.__all__) == len(set(rl.__all__))
    missing = [n for n in rl.__all__ if not hasattr(rl, n)]
    assert missing == []
    for name in ("compute_loss", "loss_normalizer", "ratio_quantiles", "mismatch_kl", "LossConfig",
                 "token_versions_from_segments", "check_segments", "normalize_segments", "version_runs"):
        assert name in rl.__all__, name
    from moe_rl.rl.loss import compute_loss
    from moe_rl.rl.token_versions import token_versions_from_segments

    assert rl.compute_loss is compute_loss and rl.token_versions_from_segments is token_versions_from_segments


def test_token_versions_submodule_is_not_shadowed():
    assert isinstance(rl.token_versions, types.ModuleType)
    assert rl.token_versions is importlib.import_module("moe_rl.rl.token_versions")
    assert "token_versions" not in rl.__all__
    assert rl.token_versions.token_versions(3, 4, [(4, 0), (6, 2)]) == [4, 4, 6]
