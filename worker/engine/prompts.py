"""From an EngineRequest to a Sequence: render, tokenise, truncate, check it can ever fit, and set up its
labels (`choices`) or its grammar (a JSON Schema or regex constraint).

Pure Python over the tokenizer (no torch). Every problem is the request's own and raises RequestError
with an error type and a message that names the numbers involved; the engine turns it into that
request's error result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.embedding import input_id
from worker.engine.params import Constraint
from worker.engine.reasoning import ReasoningMarkers, ReasoningState
from worker.engine.request import EngineRequest, RequestError
from worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from worker.engine.images import Images
    from worker.models.vision import PreparedImages
from worker.engine_config import Pooling

MAX_LABEL_TOKENS = 64  # a `choices` label longer than this (tokenised alone) is refused


class PromptBuilder:
    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        vocab_size: int,
        max_model_len: int,
        block_manager: BlockManager,
        matcher: Callable[[Constraint], Any] | None = None,
        reasoning: ReasoningMarkers | None = None,
        hidden_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.matcher = matcher  # a fresh grammar matcher for a constraint (grammar.Grammars.matcher)
        self.reasoning = reasoning  # the model's reasoning markers (chat requests are split by them)
        self.hidden_size = hidden_size  # an embedding's full width (None: not checked)
        self.images: Images | None = None  # a vision-language model's (engine/images.py)

    def sequence(self, req: EngineRequest, received: float) -> Sequence:
        """The request as a waiting Sequence; `received` (monotonic) starts its clock unless it has one."""
        params = req.params
        ids, prepared = self._with_images(req, self.tokenize(req))
        labels = self.label_ids(params.choices) if params.choices else None
        # A reasoning model's chat request thinks before it answers (vLLM applies its reasoning parsers to
        # chat requests alone); one whose template closed the thinking answers at once, like any other.
        reasoning = None
        if self.reasoning is not None and req.messages is not None:
            reasoning = self.reasoning.state(ids, params.max_reasoning_tokens)
        thinks = reasoning is not None and not reasoning.in_answer
        limit = self.max_model_len
        if (thinks or not labels) and params.max_new_tokens > limit:
            raise RequestError(
                "context_length_exceeded",
                f"max_new_tokens is {params.max_new_tokens}, but the model holds {limit} tokens in all "
                f"(prompt and output together; this prompt has {len(ids)})",
            )
        # A choices request scores each label, then EOS, after the prompt (and its thinking): its output is
        # reserved whole (output_parts); free text is cut at the context's end instead.
        parts = output_parts(params.max_new_tokens, reasoning if thinks else None, labels) if labels else []
        room = sum(n for _, n in parts) if labels else params.max_new_tokens
        if len(ids) >= limit or (labels and len(ids) + room > limit):
            if params.truncate_prompt == "error":
                raise RequestError("prompt_too_long", too_long(len(ids), parts, limit))
            keep = max(1, limit - room)  # leave room for the requested output
            ids = ids[-keep:] if params.truncate_prompt == "left" else ids[:keep]
        label_room = max(len(label) for label in labels) + 1 if labels else 0
        if labels and not thinks:
            max_new = 0  # its label and EOS are scored in its scratch blocks, not generated
        elif labels and parts[0][0] == "thinking budget":
            # the thinking the budget bounds, its close, the label and EOS: what it generates at most (so the
            # length rule never cuts the close), and what it reserves
            max_new = min(room, limit - len(ids))
        else:  # free text, or thinking up to max_new_tokens: cut where the context (less a label) ends
            max_new = min(params.max_new_tokens, limit - len(ids) - label_room)
        bm = self.block_manager
        # (a thinking choices request is scored after a context of a length not known yet: the longest tail)
        scratch = self._scratch_blocks(len(ids) if not thinks else bm.block_size, labels) if labels else 0
        # a generating sequence of a model windowed in every layer holds its window's blocks at most
        # (Scheduler.blocks_needed); a choices request rereads its prompt's blocks when it is scored
        context = len(ids) + max_new
        need = (bm.blocks_for(context) if labels else bm.held_bound(context)) + scratch
        if need > bm.num_blocks:
            what = f"{len(labels)} labels to score" if labels and not thinks else f"{max_new} new tokens"
            at_once = " at once" if bm.window is not None and not labels else ""
            raise RequestError(
                "kv_capacity",
                f"request needs {need} KV blocks{at_once} ({len(ids)} prompt tokens + {what}, "
                f"{bm.block_size} per block) but the whole pool has {bm.num_blocks} blocks",
            )
        if any(t >= self.vocab_size for t, _ in params.logit_bias):
            raise RequestError("invalid_request", f"logit_bias token ids must lie in [0, {self.vocab_size})")
        matcher = None
        if params.constraint.kind != "none":
            if self.matcher is None:
                raise RequestError("unsupported", "this engine cannot constrain outputs")
            matcher = self.matcher(params.constraint)
        seq = Sequence(
            request_id=req.request_id,
            params=params,
            prompt_ids=ids,
            max_new_tokens=max_new,
            started_at=req.started_at if req.started_at is not None else received,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            matcher=matcher,
            labels=None if thinks else labels,
            pending_labels=labels if thinks else None,
            scratch_blocks=scratch,
            reasoning=reasoning,
            reasoning_detokenizer=IncrementalDetokenizer(self.tokenizer) if reasoning is not None else None,
        )
        if prepared is not None:
            self._attach_images(seq, prepared)
        return seq

    def _with_images(self, req: EngineRequest, ids: list[int]) -> tuple[list[int], PreparedImages | None]:
        """The prompt with its images' tokens in place (engine/images.py), and the images processed."""
        if not req.images:
            return ids, None
        if self.images is None:
            raise RequestError("unsupported", f"model {self.model_name!r} takes no images")
        return self.images.expand(req, ids)

    def _attach_images(self, seq: Sequence, prepared: PreparedImages) -> None:
        assert self.images is not None
        self.images.attach(seq, prepared)

    def embedding_sequences(self, req: EngineRequest, received: float, pooling: Pooling) -> list[Sequence]:
        """An embedding request's inputs as waiting prefill-only sequences, one per input."""
        emb = req.embedding
        assert emb is not None
        dims, width = emb.dimensions, self.hidden_size
        if dims is not None and (dims < 1 or (width is not None and dims > width)):
            raise RequestError(
                "invalid_request",
                f"dimensions is {dims}, but the model's embeddings have {width} (ask for 1 to {width})",
            )
        if not emb.inputs:
            raise RequestError("invalid_request", "an embedding request needs at least one input")
        params, limit, bm = req.params, self.max_model_len, self.block_manager
        started = req.started_at if req.started_at is not None else received
        texts = all(isinstance(x, str) for x in emb.inputs)
        # texts are tokenised in one call (the fast tokenizers encode a list in parallel)
        tokenised = self.tokenizer(list(emb.inputs)).input_ids if texts else emb.inputs
        seqs = []
        for i, item in enumerate(tokenised):
            ids = list(item)
            if not texts and any(not 0 <= t < self.vocab_size for t in ids):
                raise RequestError(
                    "invalid_request", f"input {i}: token ids must lie in [0, {self.vocab_size})"
                )
            if not ids:
                raise RequestError("invalid_request", f"input {i} is empty after tokenisation")
            if len(ids) > limit:  # no token is generated: the whole context is the input's
                if params.truncate_prompt == "error":
                    raise RequestError(
                        "prompt_too_long",
                        f"input {i} has {len(ids)} tokens; the model context is {limit} "
                        "(set truncate_prompt to 'left' or 'right' to cut it)",
                    )
                ids = ids[-limit:] if params.truncate_prompt == "left" else ids[:limit]
            need = bm.held_bound(len(ids))
            if need > bm.num_blocks:
                raise RequestError(
                    "kv_capacity",
                    f"input {i} needs {need} KV blocks ({len(ids)} tokens, {bm.block_size} per block) but the "
                    f"whole pool has {bm.num_blocks} blocks",
                )
            seqs.append(
                Sequence(
                    request_id=input_id(req.request_id, i),
                    params=params,
                    prompt_ids=ids,
                    max_new_tokens=0,
                    started_at=started,
                    detokenizer=IncrementalDetokenizer(self.tokenizer),
                    pooling=pooling,
                    embedding_of=req.request_id,
                    embedding_index=i,
                    dimensions=dims,
                )
            )
        return seqs

    def label_ids(self, choices: tuple[str, ...]) -> list[list[int]]:
        """Each label tokenised alone, no special tokens."""
        out = []
        for label in choices:
            ids = list(self.tokenizer(label, add_special_tokens=False).input_ids)
            if not ids or len(ids) > MAX_LABEL_TOKENS:
                raise RequestError(
                    "invalid_choices",
                    f"label {label[:40]!r} is {len(ids)} tokens; labels must be 1 to {MAX_LABEL_TOKENS} tokens",
                )
            out.append(ids)
        return out

    def _scratch_blocks(self, prompt_len: int, labels: list[list[int]]) -> int:
        """Blocks the score step writes: per label, the prompt's last partial block again plus the label.

        Every label row reads the prompt's full blocks in place and recomputes the tail after them (at
        least the last prompt token, whose logits score each label's first token).
        """
        bs = self.block_manager.block_size
        tail = prompt_len - (prompt_len - 1) // bs * bs
        return sum(self.block_manager.blocks_for(tail + len(label)) for label in labels)

    def tokenize(self, req: EngineRequest) -> list[int]:
        return tokenize(self.tokenizer, req, self.vocab_size, self.model_name)


def output_parts(
    max_new_tokens: int, reasoning: ReasoningState | None, labels: list[list[int]]
) -> list[tuple[str, int]]:
    """A `choices` request's output, reserved in full before it runs, part by part: where it thinks, its
    thinking (the budget and the close it forces, where that ends the thinking before max_new_tokens does;
    else max_new_tokens), then its longest label and EOS."""
    parts = []
    if reasoning is not None:
        bound = reasoning.close_bound()
        if bound is not None and sum(bound) < max_new_tokens:
            parts = [("thinking budget", bound[0]), ("close", bound[1])]
        else:
            parts = [("thinking up to max_new_tokens", max_new_tokens)]
    return [*parts, ("longest label", max(len(label) for label in labels)), ("EOS", 1)]


def too_long(prompt: int, parts: list[tuple[str, int]], limit: int) -> str:
    """The prompt_too_long message: the prompt, and a `choices` request's reserved output part by part."""
    cut = "(set truncate_prompt to 'left' or 'right' to cut it)"
    if not parts:
        return f"prompt has {prompt} tokens; the model context is {limit} {cut}"
    room = sum(n for _, n in parts)
    each = " + ".join(f"{what} {n}" for what, n in parts)
    return (
        f"prompt {prompt} tokens + reserved output {room} tokens ({each}) = {prompt + room} > the model "
        f"context {limit} {cut.replace('cut it', 'cut the prompt')}"
    )


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
            text = tokenizer.apply_chat_template(
                req.messages, tokenize=False, add_generation_prompt=True, **(req.chat_template_kwargs or {})
            )
        except Exception as exc:  # a template error is the request's fault, not the engine's
            raise RequestError("invalid_request", f"chat template failed: {exc}") from exc
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(req.prompt).input_ids
    if not ids:
        raise RequestError("invalid_request", "the prompt is empty after tokenisation")
    return list(ids)
