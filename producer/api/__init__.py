"""The HTTP API: OpenAI's Files and Batches API over batchq (`producer serve`). Its batches go through the
same client as the CLI's (producer/client); it imports nothing of the CLI."""
