"""Training metrics: throughput and MFU (throughput.py), and the sinks they are logged to
(config.py: [metrics]; sinks.py: the interface, JSONL; console.py; trackers.py: TensorBoard, W&B, MLflow)."""

from forja.metrics.config import MetricsConfig
from forja.metrics.sinks import Sink, SinkGroup, build_sinks
from forja.metrics.throughput import Throughput, memory_stats, peak_flops

__all__ = ["MetricsConfig", "Sink", "SinkGroup", "Throughput", "build_sinks", "memory_stats", "peak_flops"]
