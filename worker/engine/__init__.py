"""The inference engine: scheduler, block manager, model runner, sampler, stop rules, async front end."""

from worker.engine.config import EngineConfig
from worker.engine.request import EngineRequest, EngineResult, EngineStats

__all__ = ["EngineConfig", "EngineRequest", "EngineResult", "EngineStats"]
