"""From an EngineRequest to a Sequence: render, tokenise, truncate, and check it can ever fit.

Pure Python over the tokenizer (no torch). Every problem is the request's own and raises RequestError
with an error type and a message that names the numbers involved; the engine turns it into that
request's error result.
"""

from __future__ import annotations

from typing import Any

from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.request import EngineRequest
from worker.engine.sequence import Sequence


class RequestError(ValueError):
    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class PromptBuilder:
    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        vocab_size: int,
        max_model_len: int,
        block_manager: BlockManager,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_manager = block_manager

    def sequence(self, req: EngineRequest, received: float) -> Sequence:
        """The request as a waiting Sequence; `received` (monotonic) starts its clock unless it has one."""
        params = req.params
        ids = self.tokenize(req)
        limit = self.max_model_len
        if len(ids) >= limit:
            if params.truncate_prompt == "error":
                raise RequestError(
                    "prompt_too_long",
                    f"prompt has {len(ids)} tokens; the model context is {limit} "
                    "(set truncate_prompt to 'left' or 'right' to cut it)",
                )
            keep = max(1, limit - params.max_new_tokens)  # leave room for the requested output
            ids = ids[-keep:] if params.truncate_prompt == "left" else ids[:keep]
        max_new = min(params.max_new_tokens, limit - len(ids))
        bm = self.block_manager
        need = bm.blocks_for(len(ids) + max_new)
        if need > bm.num_blocks:
            raise RequestError(
                "kv_capacity",
                f"request needs {need} KV blocks ({len(ids)} prompt + {max_new} new tokens, "
                f"{bm.block_size} per block) but the whole pool has {bm.num_blocks} blocks",
            )
        return Sequence(
            request_id=req.request_id,
            params=params,
            prompt_ids=ids,
            max_new_tokens=max_new,
            started_at=req.started_at if req.started_at is not None else received,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
        )

    def tokenize(self, req: EngineRequest) -> list[int]:
        return tokenize(self.tokenizer, req, self.vocab_size, self.model_name)


def tokenize(tokenizer: Any, req: EngineRequest, vocab_size: int, model_name: str) -> list[int]:
    """The prompt's token ids: a raw prompt as the tokenizer encodes it, messages through the chat
    template (generation prompt added), token ids checked against the vocabulary."""
    given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
    if sum(given) != 1:
        raise RequestError("invalid_request", "exactly one of prompt, messages, prompt_token_ids is required")
    if req.prompt_token_ids is not None:
        ids = list(req.prompt_token_ids)
        if any(not 0 <= t < vocab_size for t in ids):
            raise RequestError("invalid_request", f"prompt_token_ids must lie in [0, {vocab_size})")
    elif req.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("invalid_request", f"model {model_name!r} has no chat template")
        try:
            text = tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template error is the request's fault, not the engine's
            raise RequestError("invalid_request", f"chat template failed: {exc}") from exc
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(req.prompt).input_ids
    if not ids:
        raise RequestError("invalid_request", "the prompt is empty after tokenisation")
    return list(ids)
