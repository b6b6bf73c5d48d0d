"""Pure-Python stand-ins for engine tests that must not load a model."""

from __future__ import annotations

from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.params import GenerationParams
from worker.engine.sequence import Sequence


class CharTokenizer:
    """Token id = Unicode code point; ids below 3 are special (skipped when decoding)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        return "".join(chr(i) for i in ids if i >= 3 or not skip_special_tokens)


def make_seq(rid: str, prompt_len: int, max_new: int, **params: object) -> Sequence:
    return Sequence(
        request_id=rid,
        params=GenerationParams(max_new_tokens=max_new, **params),  # type: ignore[arg-type]
        prompt_ids=[65] * prompt_len,
        max_new_tokens=max_new,
        started_at=0.0,
        detokenizer=IncrementalDetokenizer(CharTokenizer()),
    )
