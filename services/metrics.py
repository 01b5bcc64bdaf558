"""Prometheus metrics of one node, in a registry of its own (several nodes share a process in
tests and in the `local` runtime, so nothing goes into the global default registry)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .looplag import LAG_BUCKETS

__all__ = ["CONTENT_TYPE_LATEST", "NodeMetrics"]

# 50 µs .. 20 s: loopback answers to paper-scale loads under time dilation.
TIME_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 20.0,
)


class NodeMetrics:
    def __init__(self, queue_depth: Callable[[], float]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "moemesh_node_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint", ["endpoint"],
                                registry=r)
        self.forward_requests = self.requests.labels("forward")  # the hot path's child
        self.errors = Counter(p + "errors", "error answers by HTTP status and code",
                              ["status", "code"], registry=r)
        self.items = Counter(p + "items", "expert executions on one row each", registry=r)
        self.batches = Counter(p + "batches", "device batches run", registry=r)
        self.bytes_in = Counter(p + "bytes_in", "forward request bytes received", registry=r)
        self.bytes_out = Counter(p + "bytes_out", "forward answer bytes sent", registry=r)
        self.cache_hits = Counter(p + "cache_hits", "CPU-tier experts found in the GPU cache",
                                  registry=r)
        self.cache_misses = Counter(p + "cache_misses", "CPU-tier experts loaded to the GPU",
                                    registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "forward requests waiting for the device",
                                 registry=r)
        self.queue_depth.set_function(queue_depth)
        self.queue_seconds = Histogram(p + "queue_seconds", "wait before the device starts",
                                       buckets=TIME_BUCKETS, registry=r)
        self.load_seconds = Histogram(p + "load_seconds", "host-to-device load time per batch",
                                      buckets=TIME_BUCKETS, registry=r)
        self.compute_seconds = Histogram(p + "compute_seconds", "compute time per batch",
                                         buckets=TIME_BUCKETS, registry=r)
        self.service_seconds = Histogram(p + "service_seconds", "load + compute per request",
                                         buckets=TIME_BUCKETS, registry=r)
        self.loop_lag_seconds = Histogram(
            "moemesh_loop_lag_seconds", "how late the node's event loop woke a 10 ms timer "
            "(services.looplag)", buckets=LAG_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
