"""The Python client: `from producer.client import BatchqClient`. Submit (two passes: validate, then
enqueue), retry, results and the OpenAI output format; the CLI and the HTTP API both go through it."""

from producer.client.batchq_client import BatchqClient, WaitTimeout

__all__ = ["BatchqClient", "WaitTimeout"]
