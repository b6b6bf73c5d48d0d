"""Reading and validating JSONL input, one line at a time, in bounded memory.

Each non-blank line becomes either the fields of a `Request` (with params resolved against the batch defaults) or a
`LineError` naming line, field and reason. Nothing here touches Redis.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, get_args

import orjson
from pydantic import AliasChoices, BaseModel, ValidationError

from producer.wire.input_lines import (
    CHAT_URL,
    EMBEDDINGS_URL,
    EmbeddingFields,
    EmbeddingLine,
    OpenAIBatchLine,
    OpenAIBody,
    OpenAIEmbeddingLine,
    PromptLine,
)
from producer.wire.request_params import SamplingParams, check_samples, defaults_base, field_loc, field_path

# A line longer than this is refused without being held in memory: generous for long-context prompts
# (a 10 MB prompt is accepted), small enough that a file with no newlines cannot exhaust memory.
MAX_LINE_BYTES = 32 * 1024 * 1024
_CHUNK = 1024 * 1024
_BOM = b"\xef\xbb\xbf"
_OPENAI_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True, slots=True)
class LineError:
    line_no: int
    field: str  # "" when the error is about the whole line
    reason: str
    id: str | None = None

    def __str__(self) -> str:
        where = f"line {self.line_no}" + (f": {self.field}" if self.field else "")
        return f"{where}: {self.reason}"


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a setattr call per field
class ParsedLine:
    line_no: int
    index: int  # 0-based among non-blank lines
    record: dict[str, Any]  # a Request's fields (params resolved), ready to serialise; see parse_line
    chat: bool  # OpenAI output needs to know chat.completion vs text_completion
    body_model: str | None = None  # OpenAI body.model as written (before --model-alias)
    fields_at: str = ""  # where the line's request fields sit: "body." on an OpenAI line
    embedding: bool = False  # an embeddings request (OpenAI output: an embedding list)
    unset: tuple[str, ...] = ()  # the REPORTED_DEFAULTS the line left to the batch's or built-in defaults
    images: bool = False  # a chat request with image parts (validate.py checks and stores its images)


# The parameters whose defaults `producer submit` reports having applied (a line that sets none of them
# samples at temperature 1 and stops at 256 new tokens).
REPORTED_DEFAULTS = ("temperature", "max_new_tokens")
_UNSET = {  # (temperature unset, max_new_tokens unset) -> ParsedLine.unset, without a loop per line
    (t, m): tuple(k for k, u in zip(REPORTED_DEFAULTS, (t, m), strict=True) if u)
    for t in (False, True)
    for m in (False, True)
}


def read_lines(stream: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """Yield (1-based line number, raw bytes) per line; None for a line longer than MAX_LINE_BYTES.

    A UTF-8 byte-order mark at the start of the file is dropped silently (editors on Windows add one).
    """
    line_no = 0
    while True:
        raw = stream.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        line_no += 1
        if line_no == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := stream.readline(_CHUNK)) and not rest.endswith(b"\n"):
                pass  # skip to the end of the over-long line without keeping it
            yield line_no, None
            continue
        yield line_no, raw


def _field_errors(
    e: ValidationError, line_no: int, prefix: str = "", model: type[BaseModel] | None = None
) -> list[LineError]:
    """One LineError per pydantic error; an unknown field of `model` (the class validated) gets the name
    it is a near miss of, if any ("temprature": did you mean temperature?)."""
    out = []
    for err in e.errors(include_url=False):
        loc = field_path(err["loc"])
        reason = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "extra_forbidden" and model is not None:
            near = _near_miss(model, field_loc(err["loc"]))
            reason += f" (did you mean {near}?)" if near else ""
        if err["type"] == "missing":
            reason = "required field is missing"
        out.append(LineError(line_no, prefix + loc, reason.removeprefix("Value error, ")))
    return out


def _near_miss(model: type[BaseModel], loc: tuple[str | int, ...]) -> str | None:
    """The known field name closest to the unknown one at `loc` (a path into `model`: "body",
    "messages", 0, ...), where one is close (difflib's ratio >= 0.6), aliases included; else None."""
    models: tuple[type[BaseModel], ...] = (model,)
    for part in loc[:-1]:
        if isinstance(part, int):  # a list's item: the models inside the list's annotation are already found
            continue
        annotation = next((a for m in models if (a := _accepted_names(m).get(part)) is not None), None)
        if annotation is None:
            return None
        models = _models_in(annotation)
    name = loc[-1] if loc else None
    if not isinstance(name, str):
        return None
    known = sorted({n for m in models for n in _accepted_names(m)})
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.65)  # (0.6 offers "lora" for "colour")
    return match[0] if match else None


@functools.cache
def _accepted_names(model: type[BaseModel]) -> dict[str, Any]:
    """Every name a user may write for a field of `model` (its aliases too) -> the field's annotation."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        names = [] if name.endswith("_") else [name]  # schema_ is written "schema" (its alias)
        va = info.validation_alias
        if isinstance(va, AliasChoices):
            names += [c for c in va.choices if isinstance(c, str)]
        elif isinstance(va, str):
            names.append(va)
        if info.alias:
            names.append(info.alias)
        for n in names:
            out[n] = info.annotation
    return out


def _models_in(annotation: Any) -> tuple[type[BaseModel], ...]:
    """The pydantic models an annotation holds (X, X | None, list[X], ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return (annotation,)
    return tuple(m for a in get_args(annotation) for m in _models_in(a))


def _user_id(obj: dict[str, Any], key: str) -> str | None:
    v = obj.get(key)
    return v if isinstance(v, str) and v else None


def _json_error(raw: bytes, line_no: int, e: orjson.JSONDecodeError) -> LineError:
    """Where the JSON goes wrong, as a 1-based character column of the line (orjson counts a line's final
    newline as the start of a second line: a line cut short read as "column 1")."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as u:
        return LineError(line_no, "", f"not valid UTF-8 (byte {u.start} of the line)")
    body = text.rstrip("\r\n")
    at = e.pos  # orjson's position counts characters
    if at >= len(body.rstrip()):
        return LineError(
            line_no,
            "",
            f"invalid JSON: the line ends at column {len(body) + 1} inside a JSON value (cut short?)",
        )
    return LineError(line_no, "", f"invalid JSON at column {at + 1}: {e.msg}")


# Line fields that only a chat request can honour (a batch default of them leaves prompt lines alone)
CHAT_ONLY = ("chat_template_kwargs", "reasoning_effort", "max_reasoning_tokens")


def _shape_error(
    line: PromptLine | OpenAIBody, openai: bool, line_no: int, uid: str | None
) -> LineError | None:
    """What is wrong with a line's input: not exactly one of prompt / messages, an empty one, or a raw prompt
    with CHAT_ONLY fields (it has no chat template and no reasoning split: vLLM's rule too)."""
    prompt, messages = line.prompt, line.messages
    if (prompt is None) == (messages is None):
        return LineError(line_no, "", "exactly one of 'prompt' or 'messages' is required", uid)
    if prompt == "":
        return LineError(line_no, "", "prompt must be non-empty", uid)
    if messages == []:
        return LineError(line_no, "", "messages must be a non-empty list", uid)
    chat_only = [name for name in CHAT_ONLY if getattr(line, name) is not None] if prompt is not None else []
    if chat_only:
        where = "body." if openai else ""
        return LineError(line_no, where + chat_only[0], "applies to chat requests (messages) only", uid)
    return None


def parse_line(
    raw: bytes | None,
    line_no: int,
    index: int,
    *,
    batch_id: str,
    defaults: SamplingParams | None,
    model: str | None,
    base: dict[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> ParsedLine | list[LineError]:
    """Validate one non-blank line. Returns the parsed line, or every error found on it.

    `model`: the batch's model (--model), for lines that name none; an OpenAI line's body.model names its
    own, and the two must agree. `aliases` map model names to the name workers serve (--model-alias).
    `base`: defaults_base(defaults), computed once per file by the caller (else once per line).
    """
    if raw is None:
        return [LineError(line_no, "", f"line is longer than {MAX_LINE_BYTES} bytes")]
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return [_json_error(raw, line_no, e)]
    if not isinstance(obj, dict):
        return [LineError(line_no, "", f"expected a JSON object, got {type(obj).__name__}")]
    openai = not _OPENAI_KEYS.isdisjoint(obj)
    uid = _user_id(obj, "custom_id" if openai else "id")
    if (obj.get("url") == EMBEDDINGS_URL) if openai else "input" in obj:
        base = base if base is not None else defaults_base(defaults)
        return _embedding_line(obj, openai, line_no, index, uid, batch_id, base, model, aliases)
    shape_model = OpenAIBatchLine if openai else PromptLine
    try:
        line: PromptLine | OpenAIBody
        if openai:
            whole = OpenAIBatchLine.model_validate(obj)
            line, src, chat = whole.body, obj["body"], whole.url == CHAT_URL
            metadata = whole.metadata if whole.metadata is not None else line.metadata
            body_model = line.model
        else:
            line = PromptLine.model_validate(obj)
            src, chat = obj, line.messages is not None
            metadata, body_model = line.metadata, None
    except ValidationError as e:
        errors = _field_errors(e, line_no, model=shape_model)
        return [LineError(le.line_no, le.field, le.reason, uid) for le in errors]
    prompt, messages = line.prompt, line.messages
    shape = _shape_error(line, openai, line_no, uid)
    if shape is not None:
        return [shape]
    asked = _model_asked(body_model, model, aliases, line_no, uid)
    if isinstance(asked, LineError):
        return [asked]
    # The fields of a Request, built without validating a Request: every part already passed validation
    # once, and a second and third pydantic pass per line were most of submit's time. The messages go out
    # as written (strict, extra="forbid" validation proved them exact); the worker validates the Request.
    params = line.params_over(base if base is not None else defaults_base(defaults))
    if line.n is not None or line.best_of is not None:  # the batch's defaults may give the other one
        try:
            check_samples(params.get("n"), params.get("best_of"))
        except ValueError as e:
            where = "best_of" if line.best_of is not None else "n"
            return [
                LineError(line_no, ("body." if openai else "") + where, f"{e} (with the batch defaults)", uid)
            ]
    record = {
        "batch_id": batch_id,
        "id": uid or str(line_no),
        "index": index,
        "prompt": prompt,
        "messages": src["messages"] if messages is not None else None,
        "params": params,
        "metadata": metadata,
        "model": asked,
    }
    if (
        isinstance(line, PromptLine) and line.lora is not None
    ):  # (absent otherwise, as it was before adapters)
        record["lora"] = aliases.get(line.lora, line.lora) if aliases else line.lora
    unset = _UNSET[line.temperature is None, line.max_new_tokens is None]
    # The bytes first: a line without the word shows no image (unless it spells it with \u escapes), so
    # text-only chat lines skip a Python walk over their messages (a tenth of pass 1's profile).
    images = (
        messages is not None
        and (b"image_url" in raw or b"\\u" in raw)
        and any(m.has_images for m in messages)
    )
    return ParsedLine(
        line_no, index, record, chat, body_model, "body." if openai else "", unset=unset, images=images
    )


def _model_asked(
    body_model: str | None,
    model: str | None,
    aliases: Mapping[str, str] | None,
    line_no: int,
    uid: str | None,
) -> str | LineError | None:
    """The model a line is for: its body.model (mapped by `aliases`), else the batch's `model`; an error
    where the two differ."""
    if body_model is None:
        return model
    asked = aliases.get(body_model, body_model) if aliases else body_model
    if model is not None and asked != model:
        mapped = f" (mapped to {asked!r})" if asked != body_model else ""
        return LineError(
            line_no, "body.model",
            f"{body_model!r}{mapped} differs from the batch's model {model!r}; leave --model out to "
            f"run each line on its own model, or map the name: --model-alias {body_model}={model}",
            uid,
        )  # fmt: skip
    return asked


# What an embedding request takes of the batch's defaults: a time limit and the truncation rule. The
# sampling and labeling defaults of a mixed batch are the generation lines'.
_EMBEDDING_DEFAULTS = ("timeout_s", "truncate_prompt")


def _embedding_line(
    obj: dict[str, Any],
    openai: bool,
    line_no: int,
    index: int,
    uid: str | None,
    batch_id: str,
    base: dict[str, Any],
    model: str | None,
    aliases: Mapping[str, str] | None,
) -> ParsedLine | list[LineError]:
    """An embeddings line (OpenAI's to /v1/embeddings, or batchq's with `input`) as a Request's fields."""
    shape_model = OpenAIEmbeddingLine if openai else EmbeddingLine
    try:
        line: EmbeddingLine | OpenAIEmbeddingLine
        fields: EmbeddingFields
        if openai:
            line = OpenAIEmbeddingLine.model_validate(obj)
            fields, body_model = line.body, line.body.model
            metadata = line.metadata if line.metadata is not None else line.body.metadata
        else:
            line = EmbeddingLine.model_validate(obj)
            fields, body_model, metadata = line, None, line.metadata
    except ValidationError as e:
        errors = _field_errors(e, line_no, model=shape_model)
        return [LineError(le.line_no, le.field, le.reason, uid) for le in errors]
    asked = _model_asked(body_model, model, aliases, line_no, uid)
    if isinstance(asked, LineError):
        return [asked]
    params: dict[str, Any] = {"max_new_tokens": 1}  # (the queue orders by it; nothing is generated)
    for k in _EMBEDDING_DEFAULTS:
        v = getattr(fields, k)
        if v is not None or k in base:
            params[k] = v if v is not None else base[k]
    record = {
        "batch_id": batch_id,
        "id": uid or str(line_no),
        "index": index,
        "prompt": None,
        "messages": None,
        "embedding": fields.embedding(),
        "params": params,
        "metadata": metadata,
        "model": asked,
    }
    if isinstance(line, EmbeddingLine) and line.lora is not None:
        record["lora"] = aliases.get(line.lora, line.lora) if aliases else line.lora
    return ParsedLine(line_no, index, record, False, body_model, "body." if openai else "", embedding=True)
