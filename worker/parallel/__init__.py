"""Running one model across several processes: a tensor-parallel group's collectives (group.py), below the
models that call them and the engine that starts the ranks."""
