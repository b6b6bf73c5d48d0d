"""Constrained decoding with llguidance: JSON Schema and regex outputs, one token mask per step.

Why llguidance (`python benchmarks/grammar_bench.py` compares it with xgrammar): it compiles a schema
an order of magnitude faster than xgrammar, its masks cost a negligible share of a decode step, and it
needs no other package (xgrammar pulls in apache-tvm-ffi and triton). The engine fills and applies masks itself with plain
torch ops: llguidance.torch's helpers are torch.compile'd, and importing them loads torch's compiler
stack (which, among other things, takes Triton out of interpreter mode in the kernel tests).

A constraint's matcher is built once and cached (constructing an LLMatcher costs a thousand times its
deep copy): a 100,000-line batch with one schema compiles it once. Only constrained rows are masked, so
the step costs nothing extra for requests without a constraint. The vocabulary view (LLTokenizer, slow
to build) is made on first use; it also gives every token's exact bytes for logprobs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from torch import Tensor

from worker.engine.params import Constraint
from worker.engine.request import RequestError

CACHED_GRAMMARS = 256
_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass
class GrammarState:
    """One request's position in its grammar."""

    matcher: Any  # llguidance.LLMatcher
    vocab_size: int  # the grammar's vocabulary: the model's, or the tokenizer's where that is larger

    def advance(self, token: int) -> bool:
        """Feed the grammar a token; False when it refuses it."""
        return bool(self.matcher.consume_token(token))

    @property
    def complete(self) -> bool:
        """The grammar admits no further token."""
        return bool(self.matcher.is_stopped())


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        # A tokenizer may hold more tokens than the model's output layer (added special tokens):
        # the grammar's vocabulary covers both, and the rows are cut to the model's when applied.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos = list(eos_token_ids)
        self._lltok: Any = None
        self._templates: OrderedDict[Constraint, Any] = OrderedDict()
        self.compiled = 0  # grammars compiled since start (tests, stats)

    @property
    def lltok(self) -> Any:
        if self._lltok is None:
            self._lltok = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
            )
        return self._lltok

    def matcher(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for `constraint`. Raises RequestError (invalid_schema / invalid_regex)."""
        template = self._templates.get(constraint)
        if template is None:
            template = self._compile(constraint)
            self._templates[constraint] = template
            if len(self._templates) > CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        self._templates.move_to_end(constraint)
        return GrammarState(template.deep_copy(), self.vocab_size)

    def _compile(self, constraint: Constraint) -> Any:
        error_type = "invalid_schema" if constraint.kind == "json_schema" else "invalid_regex"
        try:
            if constraint.kind == "json_schema":
                # Compact JSON: no free whitespace, so a model cannot pad an answer with spaces forever.
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.spec, defaults={"whitespace_flexible": False}
                )
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(constraint.spec)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise RequestError(error_type, _cannot(constraint, str(exc))) from exc
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.lltok)
        if problem:
            raise RequestError(error_type, _cannot(constraint, problem))
        matcher = llguidance.LLMatcher(self.lltok, grammar)
        if matcher.is_error():
            raise RequestError(error_type, _cannot(constraint, matcher.get_error()))
        self.compiled += 1
        return matcher

    def token_bytes(self, token_id: int) -> bytes:
        return bytes(self.lltok.decode_bytes([token_id]))


def _cannot(constraint: Constraint, problem: str) -> str:
    """One line: llguidance's messages span lines (a Rust error with a caret diagram under the source);
    keep its `error:` line, or its first."""
    lines = [ln.strip() for ln in problem.strip().splitlines() if ln.strip()]
    reason = next((ln.removeprefix("error:").strip() for ln in lines if ln.startswith("error:")), None)
    reason = reason or (lines[0] if lines else "unknown error")
    what = "JSON Schema" if constraint.kind == "json_schema" else "regex"
    return f"cannot compile the {what}: {reason[:300]}"


def mask_logits(logits: Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set to -inf, in place, every token the row's grammar does not allow next. logits: [B, vocab]."""
    vocab = logits.shape[1]
    width = -(-states[0].vocab_size // 32)
    bitmask = torch.empty(len(rows), width, dtype=torch.int32)  # bit t of row r: token t allowed
    for i, state in enumerate(states):
        state.matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), width * 4)
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1  # [R, W, 32]
    allowed = bits.view(len(rows), -1)[:, :vocab].bool().to(logits.device)
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill_(~allowed, float("-inf"))
