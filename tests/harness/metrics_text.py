"""One sample from a Prometheus text exposition (a /metrics body), read with prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample named `name` (e.g. `x_total`, `x_count`) whose labels include `labels`;
    None when there is none."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    return None
