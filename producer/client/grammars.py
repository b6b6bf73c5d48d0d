"""Submit-time checks of a request's output grammar (a JSON Schema or a regex): an uncompilable one is the
caller's fault and is refused on its line, with one line of reason, before anything is enqueued.

The workers compile the same grammars with llguidance (worker/engine/grammar.py) against their tokenizer;
compiling without a tokenizer here catches every error that does not depend on the vocabulary. llguidance
is a self-contained wheel (no torch); where it is not installed the check is skipped and a worker refuses
the request instead (error type invalid_schema / invalid_regex).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

try:
    import llguidance
except ImportError:  # pragma: no cover - a producer-only install without it
    llguidance = None  # type: ignore[assignment]

_CHECKED_MAX = 1024  # distinct grammars remembered per process: a batch repeats one schema on every line
_checked: dict[tuple[str, str], str | None] = {}
_ERROR_LINE = re.compile(r"^\s*error:\s*(.+)$", re.MULTILINE)


def grammar_problem(params: dict[str, Any]) -> tuple[str, str] | None:
    """(field, one-line reason) when the resolved wire `params` carry a grammar that cannot compile."""
    if llguidance is None:
        return None
    fmt = params.get("response_format")
    if fmt is not None and fmt.get("type") == "json_schema":
        spec = orjson.dumps(fmt["json_schema"]["schema"]).decode()
        problem = _check("json_schema", spec)
        return None if problem is None else ("response_format.json_schema.schema", problem)
    if params.get("regex") is not None:
        problem = _check("regex", params["regex"])
        return None if problem is None else ("regex", problem)
    return None


def _check(kind: str, spec: str) -> str | None:
    key = (kind, spec)
    if key in _checked:
        return _checked[key]
    problem = _compile(kind, spec)
    if len(_checked) >= _CHECKED_MAX:
        _checked.clear()
    _checked[key] = problem
    return problem


def _compile(kind: str, spec: str) -> str | None:
    matcher = llguidance.LLMatcher
    try:
        if kind == "json_schema":
            grammar = matcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        else:
            grammar = matcher.grammar_from_regex(spec)
        problem = matcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        problem = str(e)
    if not problem:
        return None
    what = "JSON Schema" if kind == "json_schema" else "regex"
    return f"cannot compile the {what}: {one_line(problem)}"


def one_line(message: str) -> str:
    """llguidance's messages span lines (a Rust error with a caret diagram): its `error:` line, or the
    first line, without the source excerpt."""
    m = _ERROR_LINE.search(message)
    line = m.group(1) if m else message.strip().splitlines()[0]
    line = re.sub(r"^at \d+\(\d+\):\s*", "", line.strip())
    return line[:300]
