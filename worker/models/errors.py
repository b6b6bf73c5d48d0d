"""ModelLoadError, the one-line refusal of a model reference or checkpoint, and how other faults become it.

No torch here: `worker` imports it (through resolve.py) to refuse a bad --model before anything heavy loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ModelLoadError(OSError, ValueError):
    """The model reference names nothing loadable, or its checkpoint cannot be read: a fault in the
    user's input, told in one line (the `worker` command exits with status 2), not a traceback.

    Both an OSError and a ValueError, as io.UnsupportedOperation is: callers that caught what these
    faults raised before it existed (transformers' OSError for a missing or unreadable checkpoint, our
    ValueError for an unsupported architecture) still catch them."""


class CheckpointError(ModelLoadError):
    """A checkpoint's files or tensors are not what the model needs, said in one line that names the file
    and the tensor; `reading` adds the model's name."""


def one_line(e: BaseException) -> str:
    """The exception as one line: its type, and its message with the lines joined, cut at 300 chars."""
    text = " ".join(str(e).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# What transformers and safetensors raise for a checkpoint they cannot read: a missing or malformed
# file (OSError, ValueError incl. JSON errors, safetensors' header errors) or weights that do not fit
# the config (RuntimeError). Only the calls that read the user's files are guarded by it.
def _read_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (OSError, ValueError, RuntimeError, SafetensorError)


@contextlib.contextmanager
def reading(model: str, what: str) -> Iterator[None]:
    """Turn what reading `what` of `model` raises into one ModelLoadError line."""
    try:
        yield
    except CheckpointError as e:
        raise ModelLoadError(f"model {model!r}: cannot load {what}: {e}") from e
    except ModelLoadError:
        raise
    except _read_errors() as e:
        raise ModelLoadError(f"model {model!r}: cannot load {what}: {one_line(e)}") from e
