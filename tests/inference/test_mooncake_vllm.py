"""``WeightSyncExtension.update_weights_from_mooncake`` on vLLM's CPU backend (in-process engine, real master).

Loading a version through the Mooncake Store must give bit-identical greedy tokens and logprobs to loading the
same checkpoint by path (``reload_and_repack``), CPU MoE repack included.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 4, 5, 13, 6, 15], [1] + list(range(3, 16)) * 3]
MAX_TOKENS = 10
MiB = 1 << 20


def test_update_from_mooncake_matches_path_reload(tiny_moe_dirs, vllm_engine, greedy, start_mooncake_master):
    from safetensors.torch import load_file

    from moe_rl.inference.mooncake import StoreClient
    from moe_rl.weights.mooncake import MooncakeWeightTransport

    master = start_mooncake_master()
    try:
        trainer = StoreClient(master.client_config(global_segment_bytes=64 * MiB, local_buffer_bytes=16 * MiB))
        v2 = load_file(str(tiny_moe_dirs["v2"] / "model.safetensors"))
        MooncakeWeightTransport(trainer, "tiny-glm").publish(v2, 2)
        store_cfg = master.client_config(local_buffer_bytes=16 * MiB).model_dump()
        with vllm_engine(tiny_moe_dirs["v1"]) as llm:
            before = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="v1")
            (res,) = llm.collective_rpc("update_weights_from_mooncake", args=(store_cfg, "tiny-glm", 2))
            assert res["source"] == "mooncake" and res["version"] == 2
            assert res["moe_layers_repacked"] == res["moe_layers_total"] == 1
            assert res["bytes"] == sum(t.numel() * t.element_size() for t in v2.values())
            assert llm.collective_rpc("weight_version") == [2]
            via_store = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="store-v2")
            assert via_store != before
            llm.collective_rpc("reload_and_repack", args=(str(tiny_moe_dirs["v1"]), 3))
            llm.collective_rpc("reload_and_repack", args=(str(tiny_moe_dirs["v2"]), 4))
            via_path = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="path-v2")
            assert via_store == via_path  # tokens and float logprobs, exactly
            with pytest.raises(Exception, match="version 9 of model 'tiny-glm'"):
                llm.collective_rpc("update_weights_from_mooncake", args=(store_cfg, "tiny-glm", 9))
            assert llm.collective_rpc("weight_version") == [4]  # a failed load changes nothing
        trainer.close()
    finally:
        master.stop()
