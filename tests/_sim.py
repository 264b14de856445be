"""A small simulator workload shared by the simulator tests."""

from __future__ import annotations

from adaserve.sim.workload import Workload

LLAMA = "llama-3.1-70b-tp4-a100"


def small_workload(**kw) -> Workload:
    data = {
        "name": "small",
        "profile": LLAMA,
        "rps": 3.0,
        "duration_s": 8.0,
        "seed": 3,
        "classes": {
            "coding": {
                "weight": 0.6,
                "slo": {"baseline_scale": 1.2},
                "prompt_tokens": {"dist": "lognormal", "mean": 120, "sigma": 0.3},
                "output_tokens": {"dist": "lognormal", "mean": 40, "sigma": 0.3, "max": 80},
                "draft": {"top1_alpha": 3.0, "top1_beta": 0.75},
            },
            "chat": {
                "weight": 0.2,
                "slo": {"tpot_ms": 50},
                "prompt_tokens": {"dist": "lognormal", "mean": 40, "sigma": 0.3},
                "output_tokens": {"dist": "lognormal", "mean": 30, "sigma": 0.3, "max": 80},
            },
            "summarization": {
                "weight": 0.2,
                "slo": {"tpot_ms": 150},
                "prompt_tokens": {"dist": "lognormal", "mean": 600, "sigma": 0.3},
                "output_tokens": {"dist": "lognormal", "mean": 30, "sigma": 0.3, "max": 80},
            },
        },
        "settings": {"engine": {"max_running": 16}, "scheduler": {"budget": 64}},
    }
    data.update(kw)
    return Workload(**data)
