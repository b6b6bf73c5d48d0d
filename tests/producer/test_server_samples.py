"""n > 1 through the OpenAI-compatible API (`producer serve`): a batch of n and best_of lines comes back
with a choice per sample in OpenAI's types, and a file with best_of < n is refused naming line and field."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.producer.test_server import chat_line, client, jsonl, stack, wait_done

pytestmark = pytest.mark.slow
__all__ = ["stack"]  # the module's API stack (Redis, a worker, two servers) for the tests here


def test_n_and_best_of_lines_answer_with_a_choice_per_sample(stack: dict[str, Any]) -> None:
    tag = uuid.uuid4().hex
    lines = [
        chat_line("chat", f"hello {tag}", n=3, temperature=0.8, seed=1),
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": f"Once {tag}", "max_tokens": 5, "n": 2, "best_of": 4, "seed": 3,
                  "temperature": 1.0}},
    ]  # fmt: skip
    with client(stack) as c:
        f = c.files.create(file=("n.jsonl", jsonl(lines[:1])), purpose="batch")
        chat_batch = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        g = c.files.create(file=("t.jsonl", jsonl(lines[1:])), purpose="batch")
        text_batch = c.batches.create(input_file_id=g.id, endpoint="/v1/completions", completion_window="24h")
        chat_out, text_out = (
            [orjson.loads(x) for x in c.files.content(b.output_file_id).read().splitlines()]  # type: ignore[arg-type]
            for b in (wait_done(c, chat_batch.id), wait_done(c, text_batch.id))
        )
    chat = ChatCompletion.model_validate(chat_out[0]["response"]["body"])
    assert [ch.index for ch in chat.choices] == [0, 1, 2] and len(
        {ch.message.content for ch in chat.choices}
    ) > 1
    text = Completion.model_validate(text_out[0]["response"]["body"])
    assert [ch.index for ch in text.choices] == [0, 1]
    assert chat.usage is not None and text.usage is not None
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_a_file_with_best_of_below_n_is_refused_naming_line_and_field(stack: dict[str, Any]) -> None:
    bad = jsonl([chat_line("ok", "fine"), chat_line("b", "x", n=4, best_of=2)])
    with client(stack) as c, pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("bad.jsonl", bad), purpose="batch")
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "file"
    assert "line 2: body.best_of: best_of must be >= n: best_of is 2, n is 4" in err["message"]
