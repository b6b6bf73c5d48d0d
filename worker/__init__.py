"""batchq worker: arq worker, inference engine (scheduler, block manager, model runner, sampler, stop rules)."""
