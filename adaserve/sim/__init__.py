"""Trace-driven simulation of adaserve serving units.

The real engine loop and the real selection code run against a virtual clock; only the
drafter and the target (verifier) are modelled: a hardware profile gives their latency
(`costmodel`), an acceptance model decides which drafted tokens the target keeps
(`acceptance`). Workloads (`workload`) are YAML files; `driver.simulate` replays one and
`summary.summarize` reports the papers' metrics.
"""
