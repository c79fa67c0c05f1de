"""The weight-sync time model (moe_rl.weights.sync_model): its limits and scaling laws, in closed form.

Every expected value is the model's formula worked by hand for a small layout; comparisons use math.isclose
with rel_tol=1e-12 (a handful of float64 additions and divisions).
"""

from __future__ import annotations

import math

import pytest

from moe_rl.weights.sync_model import (
    INF,
    TRANSPORTS,
    LinkParams,
    SyncLayout,
    SyncOptions,
    binomial_broadcast_s,
    chain_broadcast_s,
    estimate,
    estimate_all,
    fp8_wire_ratio,
    moe_layout,
)

MIB = 2**20
GB = 1e9


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


def _pair(w: float, same_node: bool = True) -> SyncLayout:
    return SyncLayout((0,), (w,), (0 if same_node else 1,), (w,))


def test_one_engine_p2p_is_one_bucketed_message_and_equals_the_chain():
    w, b = 256 * MIB, 64 * MIB
    links = LinkParams(intra_bw=2 * GB, intra_latency=1e-3)
    opts = SyncOptions(bucket_bytes=b)
    p2p = estimate("p2p", _pair(w), links, opts)
    assert close(p2p.total_s, 4 * 1e-3 + w / (2 * GB))  # Hockney: ceil(w/b) a + w/B
    assert close(estimate("broadcast", _pair(w), links, opts).total_s, p2p.total_s)  # P = 2 chain = one pipe
    assert close(chain_broadcast_s(w, 2, 2 * GB, 1e-3, b), p2p.total_s)


def test_infinite_bandwidth_leaves_latencies_only():
    links = LinkParams(intra_bw=INF, intra_latency=1e-4, fs_latency=0.01)
    opts = SyncOptions(bucket_bytes=64 * MIB, files_per_rank=2)
    layout = SyncLayout((0, 0), (128 * MIB, 128 * MIB), (0,), (256 * MIB,))
    est = estimate_all(layout, links, opts)
    assert close(est["p2p"].total_s, 2 * 2 * 1e-4)  # the engine receives 2 x 2 buckets
    assert close(est["filesystem"].total_s, 2 * 0.01 + 2 * 0.01)  # 2 files written per rank, 2 files read
    assert est["p2p"].blocking_s == 0.0 and close(est["broadcast"].blocking_s, est["broadcast"].total_s)


def test_chain_broadcast_formula_and_binomial_rounds():
    # (P + k - 2)(a + m/k/B): P = 5, m = 4 segments of 1 MB at 1 GB/s, a = 1 ms
    assert close(chain_broadcast_s(4e6, 5, GB, 1e-3, 1e6), 7 * (1e-3 + 1e-3))
    # gloo's schedule: the root posts its sends to ranks 1 and 2 at once; rank 1 forwards to 3 when it has the
    # message. P = 4 on a 1.5 GB/s node: the root's two sends share it (0.75 GB/s each), then 1 -> 3 alone at B
    assert close(binomial_broadcast_s(1e9, 4, GB, 1e-3, 1.5 * GB), 2e-3 + 1.0 / 0.75 + 1.0)
    # P = 3: the root's two sends at once, one step, not two rounds: m/B unshared, 2m/node_bw when shared
    assert close(binomial_broadcast_s(1e9, 3, GB, 0.0), 1.0)
    assert close(binomial_broadcast_s(1e9, 3, GB, 1e-3, 1.5 * GB), 1e-3 + 2.0 / 1.5)
    # P = 8: 0 -> {1, 2, 4}, then 1 -> {3, 5} and 2 -> 6, then 3 -> 7: three hops unshared; on a 2 GB/s node
    # the first two steps run three transfers at 2/3 GB/s each, the last one alone
    assert close(binomial_broadcast_s(1e9, 8, GB, 0.0), 3.0)
    assert close(binomial_broadcast_s(1e9, 8, GB, 0.0, 2 * GB), 1.5 + 1.5 + 1.0)
    assert close(binomial_broadcast_s(1e9, 2, GB, 1e-3), 1e-3 + 1.0)
    assert binomial_broadcast_s(1e9, 1, GB, 1e-3) == 0.0
    # across nodes a sender's transfers share its link: the root's two sends of P = 3 take 2m/B, as in a chain
    assert close(binomial_broadcast_s(1e9, 3, GB, 0.0, math.inf, GB), 2.0)
    # unbounded bandwidths and a latency much larger than a transfer finish (no float step is lost)
    assert binomial_broadcast_s(1e9, 4, math.inf, 0.0) == 0.0
    assert close(binomial_broadcast_s(1, 4, 1e12, 1e6), 2e6)
    # a float overflow of the clock ends the simulation with inf (it cannot make progress past it)
    assert binomial_broadcast_s(1.0, 8, 1e10, 1e308) == math.inf
    assert binomial_broadcast_s(1e300, 4, 1e-10, 0.0) == math.inf
    for bad, match in ((dict(nbytes=math.nan), "nbytes"), (dict(nbytes=math.inf), "nbytes"), (dict(ranks=0), "ranks"),
                       (dict(ranks=4.0), "ranks"), (dict(bw=0.0), "bw"), (dict(latency=-1.0), "latency"),
                       (dict(node_bw=-1.0), "node_bw"), (dict(nbytes=10**400), "nbytes")):
        with pytest.raises(ValueError, match=match):
            binomial_broadcast_s(**{**dict(nbytes=1e9, ranks=4, bw=GB, latency=0.0), **bad})


def test_p2p_scales_with_what_engines_serve_broadcast_does_not():
    """E engines of one EP replica each serve W/E: p2p receive time falls as 1/E, broadcast stays >= W/B."""
    w = 8 * GB
    links = LinkParams(intra_bw=INF, inter_bw=50 * GB)
    opts = SyncOptions(bucket_bytes=INF)
    times = {}
    for e in (1, 2, 4, 8):
        lay = moe_layout(dense_bytes=0, expert_bytes=w, trainer_ranks=64, trainer_ranks_per_node=8,
                         engine_groups=[(e, e)], engine_ranks_per_node=8)
        est = estimate_all(lay, links, opts)
        times[e] = (est["p2p"].total_s, est["broadcast"].total_s)
        assert close(est["p2p"].total_s, w / e / (50 * GB))  # receiver link: W/E bytes
        assert est["p2p"].bottleneck == "receiver link"
        # one chain of K = 64 owner segments through P = e + 1 ranks: (P + K - 2) (W/K) / B >= W/B
        assert close(est["broadcast"].total_s, (e + 1 + 64 - 2) * (w / 64) / (50 * GB))
    assert times[8][1] / times[8][0] > 8 * times[1][1] / times[1][0]


def test_replicated_weights_make_p2p_owner_bound():
    """Every engine serves everything: each owner sends its shard to all E engines (sender link E W / T)."""
    w, e, t = 4 * GB, 16, 4
    lay = moe_layout(dense_bytes=w, expert_bytes=0, trainer_ranks=t, trainer_ranks_per_node=4,
                     engine_groups=[(e, 1)], engine_ranks_per_node=8)
    est = estimate("p2p", lay, LinkParams(intra_bw=INF, inter_bw=GB), SyncOptions(bucket_bytes=INF))
    assert est.bottleneck == "sender link" and close(est.total_s, e * w / t / GB)


def test_node_aggregate_cap_binds_concurrent_transfers():
    """Two owners -> two engines on one node, each engine needs all W: 2W bytes inside the node."""
    w = 1 * GB
    lay = SyncLayout((0, 0), (w / 2, w / 2), (0, 0), (w, w))
    free = estimate("p2p", lay, LinkParams(intra_bw=GB), SyncOptions(bucket_bytes=INF))
    capped = estimate("p2p", lay, LinkParams(intra_bw=GB, node_bw=1.5 * GB), SyncOptions(bucket_bytes=INF))
    assert close(free.total_s, 1.0) and free.bottleneck in ("sender link", "receiver link")
    assert close(capped.total_s, 2 * w / (1.5 * GB)) and capped.bottleneck == "node aggregate"


def test_wire_ratio_scales_bandwidth_terms_only():
    lay = moe_layout(dense_bytes=20 * GB, expert_bytes=700 * GB, trainer_ranks=16, trainer_ranks_per_node=8,
                     engine_groups=[(16, 16)], engine_ranks_per_node=8)
    links = LinkParams(intra_bw=300 * GB, inter_bw=50 * GB, fs_write_bw=2 * GB, fs_read_bw=4 * GB)
    full = estimate_all(lay, links, SyncOptions(bucket_bytes=INF))
    half = estimate_all(lay, links, SyncOptions(bucket_bytes=INF, wire_ratio=0.5))
    for t in TRANSPORTS:
        assert close(half[t].total_s, 0.5 * full[t].total_s), t
        assert close(half[t].bytes_moved, 0.5 * full[t].bytes_moved), t


def test_filesystem_is_write_then_read_with_aggregate_caps():
    w = 8 * GB
    lay = SyncLayout((0, 0, 0, 0), (w / 4,) * 4, (1, 2), (w, w / 2))
    links = LinkParams(intra_bw=INF, fs_write_bw=1 * GB, fs_read_bw=2 * GB, fs_aggregate_write_bw=2 * GB)
    est = estimate("filesystem", lay, links)
    # writers: 2 GB each at min(1 GB/s, 2 GB/s / 4) -> aggregate 8/2 = 4 s; readers: 8 GB at 2 GB/s = 4 s
    assert close(est.phases["write"], 4.0) and close(est.phases["read"], 4.0) and close(est.total_s, 8.0)
    assert est.bottleneck == "write: aggregate write bandwidth; read: per-reader bandwidth"
    sync = estimate("filesystem", lay, links, SyncOptions(async_publish=False))
    assert close(sync.blocking_s, 4.0) and est.blocking_s == 0.0


def test_staging_blocks_the_trainer_and_precedes_the_pull():
    lay = _pair(4 * GB, same_node=False)
    links = LinkParams(intra_bw=INF, inter_bw=4 * GB, stage_bw=8 * GB)
    est = estimate("p2p", lay, links, SyncOptions(bucket_bytes=INF))
    assert close(est.blocking_s, 0.5) and close(est.total_s, 1.5)
    mc = estimate("mooncake", lay, links, SyncOptions(bucket_bytes=INF))
    assert close(mc.blocking_s, 0.5) and close(mc.total_s, 1.5)


def test_moe_layout_and_fp8_ratio():
    lay = moe_layout(dense_bytes=10.0, expert_bytes=64.0, trainer_ranks=16, trainer_ranks_per_node=8,
                     engine_groups=[(4, 4), (8, 8)], engine_ranks_per_node=4)
    assert lay.trainer_nodes == (0,) * 8 + (1,) * 8
    assert lay.engine_nodes == (2,) * 4 + (3,) * 4 + (4,) * 4
    assert lay.served == (26.0,) * 4 + (18.0,) * 8 and close(lay.total, 74.0)
    assert close(lay.x(3, 5), 18.0 / 16)
    assert close(fp8_wire_ratio(1.0), (1 + 4 / 128**2) / 2) and fp8_wire_ratio(0.0) == 1.0


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match=r"LinkParams: intra_bw = -1 must be a number > 0"):
        LinkParams(intra_bw=-1)
    with pytest.raises(ValueError, match=r"owned has 1 entries for 2 trainer ranks"):
        SyncLayout((0, 0), (1.0,), (0,), (1.0,))
    with pytest.raises(ValueError, match=r"traffic column 0 sums to 1 bytes, served\[0\] is 2"):
        SyncLayout((0,), (2.0,), (0,), (2.0,), traffic=((1.0,),))
    with pytest.raises(ValueError, match=r"transport = 'nccl' must be one of"):
        estimate("nccl", _pair(1.0), LinkParams(intra_bw=1.0))
    with pytest.raises(ValueError, match=r"ranks % ep == 0"):
        moe_layout(dense_bytes=1, expert_bytes=1, trainer_ranks=1, trainer_ranks_per_node=1,
                   engine_groups=[(6, 4)], engine_ranks_per_node=8)
    with pytest.raises(ValueError, match=r"broadcast_algorithm = 'tree' must be"):
        SyncOptions(broadcast_algorithm="tree")


def test_broadcast_across_nodes_respects_the_node_aggregate():
    """8 engine ranks on one node each take in the whole 8 GB: 64 GB into the node at node_bw = 25 GB/s is a
    2.56 s floor for any broadcast; the links alone allow 2.24 s (binomial at 25 GB/s) or 1.28 s (chain at 50)."""
    w = 8 * GB
    lay = SyncLayout((0,), (w,), (1,) * 8, (w,) * 8)
    opts = {alg: SyncOptions(bucket_bytes=INF, broadcast_algorithm=alg) for alg in ("binomial", "chain")}
    # binomial, P = 9 at 25 GB/s: the root's four sends share its link (4 x 0.32 s), then rank 1's two sends
    # (2 x 0.32 s; 2 -> 6 alongside), then 3 -> 7 (0.32 s): 2.24 s. Chain at 50 GB/s, one segment: 8 hops x 0.16 s
    for alg, inter, links_only in (("binomial", 25 * GB, 1.28 + 0.64 + 0.32), ("chain", 50 * GB, 8 * w / (50 * GB))):
        free = estimate("broadcast", lay, LinkParams(intra_bw=450 * GB, inter_bw=inter), opts[alg])
        capped = estimate("broadcast", lay, LinkParams(intra_bw=450 * GB, inter_bw=inter, node_bw=25 * GB), opts[alg])
        assert close(free.total_s, links_only) and free.bottleneck == "inter-node link", alg
        assert close(capped.total_s, 8 * w / (25 * GB)) and capped.bottleneck == "node aggregate", alg
    # a generous node aggregate does not bind and is not named
    roomy = estimate("broadcast", lay, LinkParams(intra_bw=450 * GB, inter_bw=25 * GB, node_bw=400 * GB),
                     opts["binomial"])
    assert close(roomy.total_s, 2.24) and roomy.bottleneck == "inter-node link"


def test_broadcast_bottleneck_names_the_node_only_when_it_binds():
    w = 1 * GB
    lay = SyncLayout((0,), (w,), (0, 0), (w, w))  # P = 3 on one node: the root's two sends at once
    opts = SyncOptions(bucket_bytes=INF, broadcast_algorithm="binomial")
    loose = estimate("broadcast", lay, LinkParams(intra_bw=GB, node_bw=100 * GB), opts)
    tight = estimate("broadcast", lay, LinkParams(intra_bw=GB, node_bw=1.5 * GB), opts)
    assert close(loose.total_s, 1.0) and loose.bottleneck == "intra-node link"
    assert close(tight.total_s, 2.0 / 1.5) and tight.bottleneck == "node aggregate (binomial rounds)"
    # chain, one segment: two hops of 1 s; the node moves 2 GB inside it: 1.33 s at 1.5 GB/s, 2.5 s at 0.8 GB/s
    chain = {bw: estimate("broadcast", lay, LinkParams(intra_bw=GB, node_bw=bw), SyncOptions(bucket_bytes=INF))
             for bw in (1.5 * GB, 0.8 * GB)}
    assert close(chain[1.5 * GB].total_s, 2.0) and chain[1.5 * GB].bottleneck == "intra-node link"
    assert close(chain[0.8 * GB].total_s, 2.5) and chain[0.8 * GB].bottleneck == "node aggregate"


def test_an_owner_with_no_bytes_costs_nothing():
    w, a = 1 * GB, 1e-3
    links = LinkParams(intra_bw=GB, intra_latency=1e-4, collective_latency=a)
    one = SyncLayout((0,), (w,), (0, 0), (w, w))
    two = SyncLayout((0, 0), (0.0, w), (0, 0), (w, w))  # a second owner with 0 bytes
    for alg in ("binomial", "chain"):
        opts = SyncOptions(bucket_bytes=w / 4, broadcast_algorithm=alg)
        base = estimate("broadcast", one, links, opts).total_s
        assert close(estimate("broadcast", two, links, opts).total_s, base), alg
        assert base > 4 * a  # four buckets, each with its collective latency
    for t in ("p2p", "mooncake"):
        assert close(estimate(t, two, links).total_s, estimate(t, one, links).total_s), t


def test_an_inter_node_estimate_needs_inter_bw():
    lay = _pair(GB, same_node=False)
    links = LinkParams(intra_bw=GB)  # inter_bw left at its default, inf
    for t in ("broadcast", "p2p", "mooncake"):
        with pytest.raises(ValueError, match=rf"{t}: the layout moves bytes between nodes \[0, 1\] but "
                                             r"LinkParams.inter_bw = inf .*set LinkParams\(inter_bw=\.\.\.\)"):
            estimate(t, lay, links)
    assert close(estimate("filesystem", lay, LinkParams(intra_bw=GB, fs_write_bw=GB, fs_read_bw=GB)).total_s, 2.0)
    assert close(estimate("p2p", _pair(GB), links, SyncOptions(bucket_bytes=INF)).total_s, 1.0)  # one node: fine
    # an engine that needs nothing from an owner on another node moves no inter-node byte
    local = SyncLayout((0, 1), (GB, 0.0), (0,), (GB,))
    assert close(estimate("p2p", local, links, SyncOptions(bucket_bytes=INF)).total_s, 1.0)


def test_non_finite_bytes_and_options_are_refused():
    import math

    from moe_rl.weights.sync_model import SyncLayout, SyncOptions

    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(ValueError, match=r"SyncLayout: owned\[0\] = .* must be a finite number >= 0"):
            SyncLayout(trainer_nodes=(0,), owned=(bad,), engine_nodes=(0,), served=(1.0,))
        with pytest.raises(ValueError, match=r"SyncLayout: served\[0\] = .* must be a finite number >= 0"):
            SyncLayout(trainer_nodes=(0,), owned=(1.0,), engine_nodes=(0,), served=(bad,))
    with pytest.raises(ValueError, match=r"wire_ratio = inf must be a finite number"):
        SyncOptions(wire_ratio=math.inf)
    for bad in (1e-300, 0.5):
        with pytest.raises(ValueError, match=r"bucket_bytes = .* must be >= 1"):
            SyncOptions(bucket_bytes=bad)
    assert SyncOptions(bucket_bytes=math.inf).bucket_bytes == math.inf  # one message
