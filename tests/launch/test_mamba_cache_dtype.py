"""The Mamba-2 SSM cache dtype of a hybrid model's engines has one source: ``EngineGroup.mamba_ssm_cache_dtype``.

The launch plan passes it as ``--mamba-ssm-cache-dtype`` to every engine of a hybrid model (Nemotron-H) and to no
engine of an attention-only model; the dry run's per-sequence Mamba-2 state uses the same value (4 bytes per SSM
element for ``float32``, 2 for ``float16`` / ``bfloat16``); a value the launcher cannot plan for is refused naming the field, the
value and the choices, and so is the flag given behind the field's back in ``extra_args``."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl import cli
from moe_rl.config import ConfigError, load_config
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.dry_run import inference_memory_plan
from moe_rl.launch.engines import EngineGroup
from moe_rl.launch.plan import build_plan
from moe_rl.models.nemotron_h import NemotronHConfig

REPO = Path(__file__).resolve().parents[2]
NEMO = str(REPO / "recipes/nemotron_3_ultra_550b/rl.toml")
ENGINE_ROLES = ("prefill", "decode", "engine")


def _engine_flags(plan, flag: str) -> list[str | None]:
    out = []
    for p in plan.processes:
        if p.role in ENGINE_ROLES:
            out.append(p.argv[p.argv.index(flag) + 1] if flag in p.argv else None)
    return out


def _ultra_state(ssm_bytes: int) -> int:
    """Nemotron-3-Ultra's Mamba-2 state per sequence, by hand: 48 Mamba-2 layers, each the conv state (3 inputs of
    16384 + 2 x 8 x 128 channels, bf16) and the SSM state (256 heads x 64 x 128 state) of ``ssm_bytes`` per element."""
    cfg = NemotronHConfig.ultra_550b_a55b()
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups, cfg.conv_kernel) == \
        (256, 64, 128, 8, 4)
    assert sum(cfg.layer_kind(i) == "mamba" for i in range(cfg.num_hidden_layers)) == 48
    return 48 * (3 * (16384 + 2 * 8 * 128) * 2 + 256 * 64 * 128 * ssm_bytes)


def test_hybrid_engines_get_the_fp32_ssm_cache_flag_and_the_plan_uses_it():
    cfg = load_config(ClusterConfig, ["@", NEMO])
    assert cfg.model.hybrid
    flags = _engine_flags(build_plan(cfg), "--mamba-ssm-cache-dtype")
    assert flags and set(flags) == {"float32"}
    plans = inference_memory_plan(cfg)
    assert {r.role for r in plans} == {"prefill", "decode"}
    assert all(r.state_bytes_per_seq == _ultra_state(4) for r in plans)


def test_fp16_ssm_cache_is_rendered_and_halves_the_ssm_part_of_the_state(capsys):
    args = ["@", NEMO, "--inference.decode.mamba-ssm-cache-dtype", "float16",
            "--inference.prefill.mamba-ssm-cache-dtype", "float16"]
    cfg = load_config(ClusterConfig, args)
    plan = build_plan(cfg)
    by_role = {p.role: p.argv[p.argv.index("--mamba-ssm-cache-dtype") + 1] for p in plan.processes
               if p.role in ENGINE_ROLES}
    assert by_role == {"prefill": "float16", "decode": "float16"}
    state = {r.role: r.state_bytes_per_seq for r in inference_memory_plan(cfg)}
    assert state == {"prefill": _ultra_state(2), "decode": _ultra_state(2)}
    assert _ultra_state(2) < _ultra_state(4)  # the recipe's float32 state is larger
    # the dry run prints the state with the dtype the engines get
    cli.main(["cluster", *args, "--dry-run"])
    out = capsys.readouterr().out
    assert (f"Mamba-2 state per sequence: {_ultra_state(2) / 2**20:.1f} MiB (conv bf16 + SSM float16, "
            "--mamba-ssm-cache-dtype float16)") in out  # one line: prefill and decode share the format


@pytest.mark.parametrize("recipe", ["glm5_1", "kimi_k2_7_code"])
def test_attention_only_models_get_no_mamba_flag(recipe):
    cfg = load_config(ClusterConfig, ["@", str(REPO / f"recipes/{recipe}/rl.toml")])
    assert not cfg.model.hybrid
    flags = _engine_flags(build_plan(cfg), "--mamba-ssm-cache-dtype")
    assert flags and set(flags) == {None}
    assert all(r.state_bytes_per_seq == 0.0 for r in inference_memory_plan(cfg))


@pytest.mark.parametrize("bad", ["auto", "fp8", "fp32", 4])
def test_bad_ssm_cache_dtype_is_refused_naming_field_value_and_choices(bad):
    with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype=.* is not a Mamba SSM cache dtype the launcher "
                                         r"passes.*use one of \['bfloat16', 'float16', 'float32'\]"):
        EngineGroup(mamba_ssm_cache_dtype=bad)
    if bad == "auto":
        with pytest.raises(ValueError, match="'auto' lets vLLM pick the dtype from the checkpoint"):
            EngineGroup(mamba_ssm_cache_dtype=bad)
    with pytest.raises(ConfigError, match=r"mamba_ssm_cache_dtype"):
        load_config(ClusterConfig, ["@", NEMO, "--inference.decode.mamba-ssm-cache-dtype", str(bad)])


@pytest.mark.parametrize("extra", [["--mamba-ssm-cache-dtype", "float16"], ["--mamba_ssm_cache_dtype=float16"]])
def test_the_flag_in_extra_args_is_refused(extra):
    import json

    with pytest.raises(ConfigError, match=r"inference.decode.extra_args sets .* which the cluster plan sets from "
                                          r"inference.decode.mamba_ssm_cache_dtype"):
        load_config(ClusterConfig, ["@", NEMO, "--inference.decode.extra-args", json.dumps(extra)])


@pytest.mark.parametrize("field, value", [("mamba-ssm-cache-dtype", "bfloat16"), ("kv-cache-dtype", "fp8")])
def test_prefill_and_decode_must_share_the_cache_format(field, value):
    """P/D: decode reads the KV (and Mamba state) prefill wrote; a dtype on one group only is refused, naming both."""
    recipe = str(Path(__file__).resolve().parents[2] / "recipes/nemotron_3_ultra_550b/rl.toml")
    with pytest.raises(ConfigError, match=f"inference.prefill.{field.replace('-', '_')}=.*inference.decode"):
        load_config(ClusterConfig, ["@", recipe, f"--inference.decode.{field}", value])
    cfg = load_config(ClusterConfig, ["@", recipe, f"--inference.decode.{field}", value,
                                      f"--inference.prefill.{field}", value])
    assert getattr(cfg.inference.decode, field.replace("-", "_")) == value
