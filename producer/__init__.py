"""batchq producer: JSONL parsing and validation, submit, status, wait, results, cancel. Imports no torch."""
