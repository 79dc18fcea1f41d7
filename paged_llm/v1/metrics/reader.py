"""Mirrors `vllm.v1.metrics.reader`."""

from paged_llm.metrics import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
