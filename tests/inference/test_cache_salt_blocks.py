"""shared/cases B17, the block-hash part, against vLLM's own prefix-cache hasher (no engine needed).

The engine-level parts of B17 are tested elsewhere: same salt hits / new salt misses / the old salt still hits
after a reload (``test_vllm_reload.py::test_cache_salt_isolates_prefix_cache``, ``test_vllm_server.py``),
the salt of every request equals the version at rollout start (``tests/rl/test_orchestrator_sim.py``), and
the salt changes only with the weights (``tests/rl/test_salt.py``). Here: block size 4, token ids 1..8
(2 blocks), salts "v1", "v1", "v2" and none, and a second prompt whose first block matches.
"""

from types import SimpleNamespace

import pytest

from moe_rl.rl.salt import cache_salt_for

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def block_hashes():
    pytest.importorskip("vllm")
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)

    def hashes(token_ids: list[int], salt: str | None) -> list[bytes]:
        # the Request attributes the hasher reads (vllm.v1.request.Request)
        req = SimpleNamespace(block_hashes=[], num_tokens=len(token_ids), all_token_ids=token_ids, mm_features=[],
                              cache_salt=salt, lora_request=None, prompt_embeds=None)
        return hasher(req)

    return hashes


def test_b17_salt_enters_block_0_and_chains(block_hashes):
    ids = list(range(1, 9))
    v1, v1_again, v2, none = (block_hashes(ids, s) for s in ("v1", "v1", "v2", None))
    assert len(v1) == 2
    assert v1 == v1_again  # same tokens, same salt: both blocks equal
    assert v1[0] != v2[0] and v1[1] != v2[1]  # a new salt changes block 0, and block 1 through the chain
    assert v1[0] != none[0] and v1[1] != none[1]  # so does no salt


def test_b17_same_salt_shared_prefix(block_hashes):
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], "v1")
    b = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], "v1")
    assert a[0] == b[0] and a[1] != b[1]


def test_b17_moe_rl_salts_isolate_versions(block_hashes):
    """The salts the orchestrator sends: equal for two rollouts started under v7, different under v8."""
    ids = list(range(1, 9))
    s7, s7b, s8 = cache_salt_for(7, run_id="r"), cache_salt_for(7, run_id="r"), cache_salt_for(8, run_id="r")
    assert block_hashes(ids, s7) == block_hashes(ids, s7b)
    assert block_hashes(ids, s7)[0] != block_hashes(ids, s8)[0]
