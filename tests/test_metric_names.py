"""The engine's series under vLLM's names (adaserve/metrics.py VLLM_NAMES), and
docs/METRICS.md's mapping for a vLLM user's dashboards."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adaserve import metrics
from tests._serving import REPO


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_vllm_names_repeat_the_engines_series_with_a_model_label() -> None:
    metrics.num_running.set(5)
    metrics.spec_accepted_per_pos.labels("0").inc(3)
    metrics.ttft_seconds.labels("chat").observe(0.3)
    registry = CollectorRegistry()
    metrics.export_vllm_names("SmolLM2", registry)
    ours = _samples(generate_latest().decode())
    theirs = _samples(generate_latest(registry).decode())
    assert theirs[("vllm:num_requests_running", (("model_name", "SmolLM2"),))] == 5
    for vllm_name, (_, adaserve_name) in metrics.VLLM_NAMES.items():
        mine = {k: v for k, v in ours.items() if k[0].startswith(adaserve_name)}
        assert mine, adaserve_name
        for (name, labels), value in mine.items():
            renamed = vllm_name + name[len(adaserve_name) :]
            key = (renamed, tuple(sorted((*labels, ("model_name", "SmolLM2")))))
            assert theirs[key] == value, key


def test_the_metrics_doc_maps_every_exported_vllm_name() -> None:
    doc = (REPO / "docs" / "METRICS.md").read_text()
    for vllm_name, (_, adaserve_name) in metrics.VLLM_NAMES.items():
        rows = re.findall(rf"^\|[^\n]*`{re.escape(adaserve_name)}[^\n]*$", doc, re.MULTILINE)
        assert any(f"`{vllm_name}" in row for row in rows), (adaserve_name, vllm_name)
