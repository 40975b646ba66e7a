"""Measurement: request timelines, latency quantiles, Prometheus export, tail attribution.

``summarize(metrics)`` turns a list of ``RequestMetrics`` into a JSON-ready dict of
percentiles; ``render_table`` prints it; ``attribute_tail`` says where the tail comes from.
"""

from tailserve.metrics.attribution import TailAttribution, attribute_tail
from tailserve.metrics.quantiles import DEFAULT_PERCENTILES, StreamingQuantiles, percentiles
from tailserve.metrics.summary import render_table, summarize
from tailserve.metrics.timeline import RequestMetrics, RequestTimeline, StepStats

__all__ = [
    "DEFAULT_PERCENTILES", "RequestMetrics", "RequestTimeline", "StepStats", "StreamingQuantiles",
    "TailAttribution", "attribute_tail", "percentiles", "render_table", "summarize",
]
