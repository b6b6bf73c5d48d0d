"""The worker's queue side: the loop that claims arq jobs in bulk and renews their leases (loop.py), the thin
job (job_handler.py), where contract types meet engine types (adapter.py), the result cache's worker side,
the heartbeat and stall watchdog (health.py), Prometheus metrics, and the stand-in engine for queue-only
benchmarks and tests."""
