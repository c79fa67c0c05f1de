"""The real ``vllm-router`` (the ``router`` extra) in front of two real vLLM CPU servers, started the way the cluster
plan starts it (``--host 127.0.0.1 --worker-urls U0 U1 --policy consistent_hash``):

- the run's control token reaches the engines through the router (a request without it is refused by the engines,
  401; with it, served);
- through the router, a completion's request id (body ``request_id``), its ``cache_salt`` and the serving engine's
  routed-experts record survive: exactly one engine holds the record under the client's id, and a prompt repeated
  with another salt hits no cached block;
- the turns of one multi-turn rollout (session key: the ``X-Session-ID`` header) all run on one engine (each engine's
  ``vllm:request_success_total`` counts them) and hit its prefix cache;
- weight updates, pause / resume and version probes are sent to every engine directly (``ProxiedClient``: the
  router does not forward the control token on ``/collective_rpc`` and would reach only one engine), and afterwards
  completions through the router run on the new weights whichever engine serves them;
- per-token versions survive the hop when the client tracks them per engine (``VersionTracker`` of each engine's
  ``VllmClient``): an update landing while a routed request decodes is reported by the serving engine under the
  client's request id, and the tokens on each side of the switch are those of the old and new weights.

CI installs the extra and sets ``MOE_RL_REQUIRE_ROUTER=1``, so a missing binary fails the test there; elsewhere it is
skipped.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re

import httpx
import pytest
from _vllm_fleet import fleet as vllm_fleet
from _vllm_fleet import metric, router_executable

from moe_rl.inference import ProxiedClient, VllmClient, VllmServerConfig
from moe_rl.inference.control_plane import auth_headers
from moe_rl.inference.request_ids import completion_external_id

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
"""KV block size of the servers (``VllmServerConfig.block_size``): cached tokens come in whole blocks."""


def _successes(url: str) -> float:
    """An engine's finished requests: ``vllm:request_success_total`` summed over its label sets (finish reasons)."""
    return metric(url, "vllm:request_success_total")


@pytest.fixture(scope="module")
def fleet(tiny_moe_dirs, tmp_path_factory):
    """``(router_url, [engine_url_0, engine_url_1])``: two servers (one per core when there are two) and the router."""
    exe = router_executable()
    logs = tmp_path_factory.mktemp("vllm_router")
    cores = len(os.sched_getaffinity(0))
    configs = [(f"engine{i}", VllmServerConfig(cpu_affinity=[i % cores] if cores >= 2 else None, max_model_len=256,
                                               startup_timeout_s=300, kv_cache_memory_bytes=64 * 2**20,
                                               block_size=BLOCK), {}) for i in range(2)]
    with vllm_fleet(tiny_moe_dirs["v1"], logs, configs,
                    lambda urls: ["--worker-urls", *urls, "--policy", "consistent_hash"], exe=exe) as (url, urls):
        yield url, urls


class _SessionClient(VllmClient):
    """A ``VllmClient`` to the router whose every ``generate`` carries ``session_id`` (sent as ``X-Session-ID``, the
    key ``consistent_hash`` hashes first). Without a session header vllm-router 0.1.17 keys a token-id prompt by its
    length, ``request:token_ids:<len>``, and ignores the body's ``user`` field, so the turns of a rollout, whose
    prompts grow, would scatter."""

    def __init__(self, router_url: str, session_id: str, **kwargs) -> None:
        super().__init__(router_url, **kwargs)
        self.session_id = session_id

    async def generate(self, *args, **options):
        options.setdefault("session_id", self.session_id)
        return await super().generate(*args, **options)


def _session_client(router_url: str, session_id: str) -> VllmClient:
    return _SessionClient(router_url, session_id, track_token_versions=False)


async def _serving_engine(engines: list[VllmClient], request_id: str, num_tokens: int) -> tuple[int, bytes]:
    """Index of the one engine holding ``request_id``'s routed-experts record, and the record's bytes.

    Each engine pops the record (``pop_routed_experts``); exactly one must have it, covering ``num_tokens - 1`` rows
    (the last token is never forwarded) with no row missing."""
    external = completion_external_id(request_id)
    found = []
    for i, e in enumerate(engines):
        (res,) = await e.collective_rpc("pop_routed_experts", [[external]])
        entry = (res or {}).get("records", {}).get(external, {}).get("0")
        if entry is not None:
            assert int(entry["length"]) == num_tokens - 1 and int(entry["missing_rows"]) == 0, entry
            found.append((i, base64.b64decode(entry["data"])))
    assert len(found) == 1, f"{request_id}: records on engines {[i for i, _ in found]}; expected exactly one"
    return found[0]


def test_token_is_forwarded_to_the_engines(fleet):
    router_url, _ = fleet
    body = {"model": "policy", "prompt": [1, 4, 5, 13], "max_tokens": 2, "temperature": 0.0}
    with httpx.Client(base_url=router_url, timeout=120, trust_env=False) as anon:
        assert anon.post("/v1/completions", json=body).status_code == 401
    with httpx.Client(base_url=router_url, timeout=120, trust_env=False, headers=auth_headers()) as authed:
        resp = authed.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        # the control routes are not for the router: it does not forward the token there (the engines refuse)
        assert authed.post("/collective_rpc", json={"method": "weight_version", "args": []}).status_code == 401


def test_ids_salt_experts_and_sticky_sessions_through_the_router(fleet):
    router_url, urls = fleet

    async def run() -> None:
        engines = [VllmClient(u, track_token_versions=False) for u in urls]
        via = _session_client(router_url, "rollout7")
        same_session = _session_client(router_url, "rollout7")
        try:
            for e in engines:
                await e.collective_rpc("enable_routed_experts_capture")
            # a 3-turn rollout: each turn's prompt is the previous prompt, its completion and 8 new tokens
            prompt = [1] + [3 + (7 * i) % 13 for i in range(2 * BLOCK + 5)]
            before = [_successes(u) for u in urls]
            served, hits = [], []
            for turn in range(3):
                rid = f"rollout7-turn{turn}"
                (c,), cached = await via.generate(prompt, 1, 8, 0.0, cache_salt="rollout7",
                                                  extra_body={"request_id": rid})
                num_tokens = len(prompt) + len(c.token_ids)
                engine, record = await _serving_engine(engines, rid, num_tokens)
                served.append(engine)
                hits.append((cached, len(prompt)))
                # the record equals a direct request's on the same engine (same weights, same greedy tokens)
                direct_id = f"direct-{turn}"
                (d,), _ = await engines[engine].generate(prompt, 1, 8, 0.0, cache_salt="direct",
                                                         extra_body={"request_id": direct_id})
                assert d.token_ids == c.token_ids
                assert (await _serving_engine(engines, direct_id, num_tokens)) == (engine, record)
                prompt = prompt + c.token_ids + [3 + (5 * turn + j) % 13 for j in range(8)]
            assert len(set(served)) == 1, f"the turns of one session ran on engines {served}"
            # from turn 1 on, the previous turns' full blocks are in that engine's cache under the same salt
            for cached, n in hits[1:]:
                assert cached >= BLOCK * ((n - 1) // BLOCK - 1), hits
            after = [_successes(u) for u in urls]
            delta = [a - b for a, b in zip(after, before, strict=True)]
            sticky = served[0]
            # 3 routed turns + 3 direct requests on the session's engine; nothing reached the other one
            assert delta[sticky] == 6 and delta[1 - sticky] == 0, delta
            # cache_salt survives the hop: the same prompt and session under another salt hits nothing
            last = prompt[: 3 * BLOCK + 1]
            _, warm = await via.generate(last, 1, 1, 0.0, cache_salt="rollout7")
            _, other = await same_session.generate(last, 1, 1, 0.0, cache_salt="another")
            assert warm >= 2 * BLOCK and other == 0, (warm, other)
        finally:
            for c in (*engines, via, same_session):
                await c.aclose()

    asyncio.run(run())


def test_engine_wide_calls_reach_every_engine(fleet, tiny_moe_dirs):
    router_url, urls = fleet

    async def run() -> None:
        fan = ProxiedClient(router_url, [(f"engine.{i}", u) for i, u in enumerate(urls)])
        engines = [VllmClient(u, track_token_versions=False) for u in urls]
        try:
            for e in engines:
                await e.collective_rpc("enable_routed_experts_capture")
            # sessions spread over both engines (the hash ring is fixed by the two URLs)
            prompt = [1, 4, 5, 13, 6, 7]
            sessions: dict[int, str] = {}
            for k in range(16):
                rid = f"probe-{k}"
                async with _session_client(router_url, f"s{k}") as via:
                    await via.generate(prompt, 1, 4, 0.0, extra_body={"request_id": rid})
                for i, e in enumerate(engines):
                    (res,) = await e.collective_rpc("pop_routed_experts", [[completion_external_id(rid)]])
                    if (res or {}).get("records", {}).get(completion_external_id(rid)):
                        sessions.setdefault(i, f"s{k}")
            assert sorted(sessions) == [0, 1], f"16 sessions all hashed to engines {sorted(sessions)}"
            old = (await engines[0].generate(prompt, 1, 4, 0.0))[0][0].token_ids
            await fan.update_weights(str(tiny_moe_dirs["v2"]), 1)
            assert await fan.weight_version() == 1
            assert [await e.weight_version() for e in engines] == [1, 1]
            new = (await engines[1].generate(prompt, 1, 4, 0.0))[0][0].token_ids
            assert new != old  # v2 has a new lm_head: the greedy tokens change
            for i, sid in sessions.items():  # whichever engine the router picks, it serves version 1
                async with _session_client(router_url, sid) as via:
                    (c,), _ = await via.generate(prompt, 1, 4, 0.0)
                assert c.token_ids == new, i
            await fan.pause()
            assert [await e.is_paused() for e in engines] == [True, True]
            await fan.resume()
            assert not await fan.is_paused()
            await fan.update_weights(str(tiny_moe_dirs["v1"]), 2)  # back to the start weights for later modules
            assert await fan.weight_version() == 2
        finally:
            await fan.aclose()
            for c in engines:
                await c.aclose()

    asyncio.run(run())


def test_per_token_versions_of_a_request_sent_through_the_router(fleet, tiny_moe_dirs):
    """A weight update lands on every engine while a request sent through the router decodes. The serving engine's
    reload report names the request by the client's id, so its per-token versions are exact: the tokens before the
    switch are the old weights' greedy tokens, the rest the new weights' greedy continuation (v1 -> v2 is
    KV-neutral, see ``conftest``)."""
    router_url, urls = fleet

    async def generated(url: str) -> float:
        resp = await asyncio.to_thread(httpx.get, f"{url}/metrics", headers=auth_headers(), timeout=30,
                                       trust_env=False)
        return sum(float(m.group(1)) for m in
                   re.finditer(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", resp.text, re.M))

    async def run() -> None:
        engines = [VllmClient(u) for u in urls]  # per-token versions tracked per engine
        via = _session_client(router_url, "versions")
        try:
            for e in engines:
                await e.collective_rpc("enable_routed_experts_capture")
                (info,) = await e.collective_rpc("start_token_versions")
                e.versions.start(int(info["version"]), int(info["seq"]))
            version = await engines[0].weight_version()
            assert await engines[1].weight_version() == version
            prompt, n = [1, 4, 5, 13, 6, 7, 8], 160
            weights = [tiny_moe_dirs["v1"], tiny_moe_dirs["v2"]]  # alternate; the engines serve v1 at the start
            split = None
            for attempt in range(4):
                new_w = weights[(attempt + 1) % 2]
                (ref,), _ = await engines[0].generate(prompt, 1, n, 0.0, extra_body={"ignore_eos": True})
                rid = f"versions-{attempt}"
                for e in engines:
                    e.versions.begin(rid)
                start = sum([await generated(u) for u in urls])
                task = asyncio.create_task(via.generate(prompt, 1, n, 0.0,
                                                        extra_body={"request_id": rid, "ignore_eos": True}))
                while not task.done() and sum([await generated(u) for u in urls]) - start < 16:
                    await asyncio.sleep(0.02)
                await asyncio.gather(*(e.update_weights(str(new_w), version + 1) for e in engines))
                version += 1
                (c,), _ = await task
                engine, _ = await _serving_engine(engines, rid, len(prompt) + n)
                segments = engines[engine].versions.segments(rid, 0, n)
                for e in engines:
                    e.versions.end(rid)
                assert segments is not None and segments[0] == (version - 1, 0), segments
                if len(segments) == 1:  # the update landed after the last token: try again
                    assert c.token_ids == ref.token_ids
                    continue
                assert len(segments) == 2 and segments[1][0] == version and 0 < segments[1][1] < n, segments
                k = segments[1][1]
                assert c.token_ids[:k] == ref.token_ids[:k]
                (cont,), _ = await engines[engine].generate(prompt + c.token_ids[:k], 1, n - k, 0.0,
                                                            extra_body={"ignore_eos": True})
                assert c.token_ids[k:] == cont.token_ids, k
                split = (attempt, k, new_w.name)
                break
            assert split is not None, "the update never landed while the request decoded (4 tries)"
            print(f"\nupdate landed on try {split[0]} after {split[1]} of {n} tokens")
            if split[2] != "v1":
                await asyncio.gather(*(e.update_weights(str(tiny_moe_dirs["v1"]), version + 1) for e in engines))
        finally:
            for c in (*engines, via):
                await c.aclose()

    asyncio.run(run())
