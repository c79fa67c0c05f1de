"""RoutedClient exposes the routed-experts attributes the orchestrator reads (summed over its engines)."""

from moe_rl.inference import RequestRouter, RoutedClient, RouterConfig, VllmClient


def test_routed_experts_attributes_aggregate_engines():
    clients = [VllmClient("http://127.0.0.1:1", return_routed_experts=True) for _ in range(2)]
    clients[0].routed_experts_counts["complete"] = 3
    clients[1].routed_experts_counts.update(complete=2, absent=1)
    rc = RoutedClient(clients, RequestRouter(RouterConfig(), num_engines=2))
    assert rc.return_routed_experts is True
    assert rc.routed_experts_counts == {"complete": 5, "incomplete": 0, "absent": 1, "recovered_rows": 0}
    clients[1].return_routed_experts = False
    assert rc.return_routed_experts is False
