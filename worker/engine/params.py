"""What one request asks of the engine: fully resolved generation parameters, no "unset" values.

The engine's own type: it knows nothing of the JSONL contract. The worker translates a wire request
into these in one place (worker/queue/adapter.py); a library caller builds them directly. The defaults are
the neutral values (no filtering, no penalty, no stop strings, no timeout); only max_new_tokens must
always be given.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

TruncateSide = Literal["error", "left", "right"]
SEED_LIMIT = 2**63
MAX_TOP_LOGPROBS = 20
MAX_SAMPLES = 128  # n and best_of: OpenAI's cap on n


@dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar the output must follow: a JSON Schema (its JSON text) or a regular expression."""

    kind: Literal["none", "json_schema", "regex"] = "none"
    spec: str = ""


NO_CONSTRAINT = Constraint()


def random_seed() -> int:
    return random.getrandbits(63)


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Sampling, stop and time limits of one request. Validated on construction (ValueError)."""

    max_new_tokens: int  # hard cap on generated tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1.0: off
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off (HF/vLLM: divides positive logits of prompt + output tokens)
    presence_penalty: float = 0.0  # OpenAI: minus this from every token already generated once or more
    frequency_penalty: float = 0.0  # OpenAI: minus this times the number of times a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI: (token id, bias in [-100, 100]) added to logits
    seed: int = field(default_factory=random_seed)  # same seed, same tokens, whatever shares the batch
    stop: tuple[str, ...] = ()  # text is cut before the first match
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    timeout_s: float = math.inf  # wall-clock budget from the request's start
    truncate_prompt: TruncateSide = "error"  # a prompt longer than the context: fail, or cut a side
    choices: tuple[str, ...] = ()  # the answer is exactly one of these labels, each scored
    constraint: Constraint = NO_CONSTRAINT  # the output follows this grammar
    logprobs: bool = False  # report each generated token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives
    # A reasoning model's thinking budget: after this many generated tokens of thinking its close is forced
    # (reasoning.py); None: no budget of its own (max_new_tokens still bounds thinking and answer together)
    max_reasoning_tokens: int | None = None
    n: int = 1  # samples returned (worker/engine/samples.py)
    best_of: int | None = None  # samples generated (None: n); the n of highest cumulative logprob return

    def __post_init__(self) -> None:
        checks = {
            "max_new_tokens": self.max_new_tokens >= 1,
            "temperature": math.isfinite(self.temperature) and self.temperature >= 0.0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "top_k": self.top_k >= 0,
            "min_p": 0.0 <= self.min_p < 1.0,
            "repetition_penalty": math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "presence_penalty": -2.0 <= self.presence_penalty <= 2.0,
            "frequency_penalty": -2.0 <= self.frequency_penalty <= 2.0,
            "logit_bias": all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias)
            and len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
            "seed": 0 <= self.seed < SEED_LIMIT,
            "stop": all(isinstance(s, str) and s for s in self.stop),
            "stop_token_ids": all(t >= 0 for t in self.stop_token_ids),
            "timeout_s": self.timeout_s > 0.0,
            "truncate_prompt": self.truncate_prompt in ("error", "left", "right"),
            "choices": len(self.choices) != 1 and all(isinstance(c, str) and c for c in self.choices),
            "constraint": self.constraint.kind in ("none", "json_schema", "regex")
            and (self.constraint.kind == "none") == (self.constraint.spec == "")
            and not (self.choices and self.constraint.kind != "none"),
            "top_logprobs": 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS
            and (self.logprobs or self.top_logprobs == 0),
            "max_reasoning_tokens": self.max_reasoning_tokens is None or self.max_reasoning_tokens >= 0,
            "n": 1 <= self.n <= MAX_SAMPLES,
            "best_of": self.best_of is None or self.n <= self.best_of <= MAX_SAMPLES,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                "invalid generation parameter(s): " + ", ".join(f"{k}={getattr(self, k)!r}" for k in bad)
            )

    @property
    def samples(self) -> int:
        """How many samples the engine generates: best_of, or n."""
        return self.n if self.best_of is None else self.best_of
