"""Fixtures of the producer's tests: the console's stack (tests/producer/console_stack.py), one per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.producer.console_stack import Stack, start_stack


@pytest.fixture(scope="session")
def console_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from start_stack(tmp_path_factory.mktemp("console"))
