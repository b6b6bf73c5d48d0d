"""The inference engine, a library of its own: scheduler, block manager, model runner, sampler, stop rules.

It takes its own typed requests and knows nothing of Redis, arq or the JSONL contract. These names
import no torch; `worker.engine.engine.Engine` (sync) and `worker.engine.async_engine.AsyncEngine`
load the model.
"""

from worker.engine.params import GenerationParams
from worker.engine.request import EngineError, EngineRequest, EngineResult, EngineStats, FinishReason
from worker.engine_config import EngineConfig

__all__ = [
    "EngineConfig",
    "EngineError",
    "EngineRequest",
    "EngineResult",
    "EngineStats",
    "FinishReason",
    "GenerationParams",
]
