"""Model code: a lean Llama-family decoder over packed tokens with paged KV, and its loader."""
