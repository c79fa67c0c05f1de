"""In-place weight reload and cache_salt on vLLM's CPU backend, with an in-process engine (fast, no server).

The engines run ``moe_rl.weights.engine.WeightSyncExtension`` as their worker extension, and the
tests call ``llm.collective_rpc("reload_and_repack", ...)``: the same worker code the server runs for
``POST /collective_rpc``. Outputs are compared bit for bit (``==`` on token ids and float logprobs) with a
fresh engine loaded from the same checkpoint.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [
    [1, 4, 5, 13, 6, 15],  # "<bos>12+3="
    [1] + list(range(3, 16)) * 3,
    [1, 10, 10, 10, 14, 9, 15],
]
MAX_TOKENS = 12
SALT_PROMPT = [1] + [3 + (7 * i) % 13 for i in range(99)]  # 100 tokens: 3 full 32-token blocks = 96 cached


@pytest.fixture(scope="module")
def fresh(tiny_moe_dirs, vllm_engine, greedy):
    """Greedy ``(tokens, logprobs)`` of ``PROMPTS`` from a fresh engine per weight version."""
    refs = {}
    for name in ("v1", "v2", "v3"):
        with vllm_engine(tiny_moe_dirs[name]) as llm:
            refs[name] = greedy(llm, PROMPTS, MAX_TOKENS)
    assert refs["v1"] != refs["v2"] != refs["v3"], "the weight versions must give different outputs"
    return refs


def _reload(llm, path, version) -> dict:
    (result,) = llm.collective_rpc("reload_and_repack", args=(str(path), version))
    return result


def test_reload_and_repack_matches_fresh_load(tiny_moe_dirs, fresh, vllm_engine, greedy):
    """v1 -> v2 -> v3 -> v1 in place; after each, a new salt gives exactly what a fresh engine gives."""
    with vllm_engine(tiny_moe_dirs["v1"]) as llm:
        assert llm.collective_rpc("weight_version") == [0]
        assert greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="v1") == fresh["v1"]
        for version, name in [(2, "v2"), (3, "v3"), (4, "v1")]:
            result = _reload(llm, tiny_moe_dirs[name], version)
            assert result["version"] == version
            assert result["moe_layers_repacked"] == result["moe_layers_total"] == 1
            assert 0 <= result["repack_s"] <= result["reload_s"] < 30
            assert llm.collective_rpc("weight_version") == [version]
            got = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"{name}-{version}")
            assert got == fresh[name], (
                f"after reload to {name}: tokens/logprobs differ from a fresh {name} load"
            )


def test_reload_handles_padded_moe_intermediate(tiny_moe_padded_dirs, vllm_engine, greedy):
    """moe_intermediate_size=48: vLLM pads it to 64 at load; plain reload_weights cannot even copy the weights
    back (shape mismatch), reload_and_repack pads and prepacks and matches a fresh load."""
    with vllm_engine(tiny_moe_padded_dirs["v2"]) as llm:
        ref = greedy(llm, PROMPTS, MAX_TOKENS)
    with vllm_engine(tiny_moe_padded_dirs["v1"]) as llm:
        before = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="a")
        result = _reload(llm, tiny_moe_padded_dirs["v2"], 2)
        assert result["moe_layers_repacked"] == 1
        after = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="b")
    assert before != ref
    assert after == ref


def test_plain_reload_weights_is_wrong_on_cpu_moe(tiny_moe_dirs, fresh, vllm_engine, greedy):
    """vLLM's own reload leaves the experts unpacked (notes/vllm-cpu.md §5(c)): outputs differ from a fresh load.

    This proves the comparison above can fail. If it starts to match, upstream fixed the bug: the test then
    xfails with a message, and the repack step of ``WeightSyncExtension`` may be redundant.
    """
    with vllm_engine(tiny_moe_dirs["v1"]) as llm:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tiny_moe_dirs["v2"])})
        got = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="plain")
    if got == fresh["v2"]:
        pytest.xfail(
            "plain reload_weights now matches a fresh load on CPU MoE: vLLM seems to re-prepack the experts "
            "itself; check whether WeightSyncExtension's repack step is still needed"
        )
    assert got != fresh["v2"]


def test_reload_rejects_bad_path_and_keeps_weights(tiny_moe_dirs, fresh, vllm_engine, greedy, tmp_path):
    with vllm_engine(tiny_moe_dirs["v1"]) as llm:
        with pytest.raises(Exception, match="is not a directory"):
            _reload(llm, tmp_path / "missing", 2)
        with pytest.raises(Exception, match=r"holds no \*\.safetensors"):
            _reload(llm, tmp_path, 2)
        with pytest.raises(Exception, match="must be an integer"):
            _reload(llm, tiny_moe_dirs["v2"], "two")
        assert llm.collective_rpc("weight_version") == [0]
        assert greedy(llm, PROMPTS, MAX_TOKENS) == fresh["v1"]


def test_cache_salt_isolates_prefix_cache(tiny_moe_dirs, vllm_engine):
    """Same salt hits the 3 full blocks of a 100-token prompt; a new salt misses; after a reload the old salt
    still hits KV computed under the old weights (so a new salt per version is what isolates versions)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4)

    def cached(llm, salt):
        (out,) = llm.generate([{"prompt_token_ids": SALT_PROMPT, "cache_salt": salt}], sp, use_tqdm=False)
        return out.num_cached_tokens

    with vllm_engine(tiny_moe_dirs["v1"]) as llm:
        assert [cached(llm, "A"), cached(llm, "A"), cached(llm, "B")] == [0, 96, 0]
        _reload(llm, tiny_moe_dirs["v3"], 3)
        assert [cached(llm, "C"), cached(llm, "C"), cached(llm, "A")] == [0, 96, 96]
        assert llm.reset_prefix_cache()
        assert cached(llm, "A") == 0
