"""producer.wire.contract is the wire's public face: one import for every public name of the modules that
define the contract (request parameters, results, input lines), so code written against it keeps working."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import producer.wire.contract as contract

DEFINING = ("producer.wire.request_params", "producer.wire.results", "producer.wire.input_lines")


def public_names(module: str) -> set[str]:
    """The names a module defines at its top level (classes, functions, constants, type aliases), read
    from its source: imported names are not its own."""
    path = Path(importlib.import_module(module).__file__ or "")
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            found.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                found.update(e.id for e in elts if isinstance(e, ast.Name))
    return {n for n in found if not n.startswith("_")}


def test_contract_re_exports_every_public_name_of_the_defining_modules() -> None:
    defined = {name: module for module in DEFINING for name in public_names(module)}
    assert len(defined) == sum(len(public_names(m)) for m in DEFINING)  # no name defined twice
    assert sorted(contract.__all__) == sorted(defined)
    for name, module in defined.items():
        assert getattr(contract, name) is getattr(importlib.import_module(module), name), name


def test_the_names_contract_had_before_the_split_are_still_there() -> None:
    before = {
        "BUILTIN_DEFAULTS", "CHAT_URL", "CHOICES_TEMPERATURE", "COMPLETIONS_URL", "EMBEDDINGS_URL",
        "MAX_CHOICES", "MAX_EMBEDDING_INPUTS", "MAX_ID_CHARS", "MAX_LABEL_CHARS", "MAX_LOGIT_BIAS",
        "MAX_SAMPLES", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS", "MIN_CHOICES", "OPENAI_IGNORED",
        "OPENAI_UNSUPPORTED", "RESERVED_TEMPLATE_KWARGS", "BatchState", "BatchStatus", "ChatMessage",
        "ChoiceLogprobs", "Completion", "CompletionTokensDetails", "EmbeddingFields", "EmbeddingLine",
        "EmbeddingRequest", "EncodingFormat", "ErrorInfo", "FinishReason", "JsonSchemaFormat", "LabelScore",
        "OpenAIBatchLine", "OpenAIBody", "OpenAIEmbeddingBody", "OpenAIEmbeddingLine", "PromptLine",
        "PromptTokensDetails", "ReasoningEffort", "Request", "ResponseFormat", "Result", "SamplingParams",
        "StructuredOutputs", "Timing", "TokenLogprob", "TopLogprob", "TruncateSide", "Usage", "UserId",
        "check_samples", "defaults_base",
    }  # fmt: skip
    assert before <= set(contract.__all__)
