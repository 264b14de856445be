"""The serving engine: request pool, admission, and the iteration loop.

The package, in the order one iteration runs (each phase a module; adaserve/engine/
contracts.py names what they hand each other):

    admission   intake: the inbox, deadlines, admission by priority and due time
    planner     which requests draft and how deep, which prompts get a chunk (no torch)
    drafting    candidate trees from each request's source (model, EAGLE, n-gram)
    prepare     context cut, selection within the budget, grammar pruning, KV fit
    (target)    one forward verifies the trees and prefills the chunks
    output      accepted tokens committed, stop checks, streamed; finished retired
    telemetry   what the iteration teaches the estimates, and the metrics

beside `state` (request state and pool), `estimates` (the learned costs), `lifecycle`
(finishing, failing, retiring a request) and `recovery` (failure isolation). `core`
holds the `Engine`: its state, its public API and the loop.
"""

from adaserve.engine.contracts import IterationReport
from adaserve.engine.core import (
    FLOOR_HYSTERESIS,
    Engine,
    EngineDraining,
    EngineFull,
    EngineInfo,
    EngineStats,
    SLOUnattainable,
)
from adaserve.stream import RequestStream

__all__ = [
    "FLOOR_HYSTERESIS",
    "Engine",
    "EngineDraining",
    "EngineFull",
    "EngineInfo",
    "EngineStats",
    "IterationReport",
    "RequestStream",
    "SLOUnattainable",
]
