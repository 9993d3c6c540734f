"""Reading a service's /metrics page in the tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape_samples(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}}."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def scrape(url: str) -> dict[str, float]:
    """Every sample, summed over labels, keyed by sample name ("..._total", "..._count")."""
    return {name: sum(values.values()) for name, values in scrape_samples(url).items()}
