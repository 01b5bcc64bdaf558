"""NodeMetrics keeps the device's per-batch figures until a render (or FLUSH_AT of them)."""

from __future__ import annotations

from services.metrics import FLUSH_AT, NodeMetrics


def test_device_figures_reach_prometheus_at_render_or_when_many() -> None:
    m = NodeMetrics(lambda: 0)
    m.batch(3, 5, 0.001, 0.002)
    m.queued(0.0005)
    assert m.registry.get_sample_value("moemesh_node_batches_total") == 0  # kept back
    text = m.render().decode()
    for line in ("moemesh_node_batches_total 1.0", "moemesh_node_items_total 5.0",
                 "moemesh_node_service_seconds_count 3.0",  # one per request of the batch
                 "moemesh_node_queue_seconds_count 1.0", "moemesh_node_load_seconds_count 1.0",
                 "moemesh_node_compute_seconds_sum 0.002"):
        assert line in text, line
    for _ in range(FLUSH_AT):
        m.queued(0.0)
    assert m.registry.get_sample_value("moemesh_node_queue_seconds_count") == 1 + FLUSH_AT
