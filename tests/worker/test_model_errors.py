"""A --model that names nothing loadable ends `worker` with one line on stderr and exit status 2.

The `worker` command runs as a subprocess where what the user sees is the point (exit status, stderr,
no traceback); the rest runs in-process. The hub tests run with HF_HUB_OFFLINE=1 and an empty HF_HOME:
without it, huggingface_hub retries an unreachable hub for about 25 seconds before it gives up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_tiny_checkpoint
from worker import cli
from worker.models import resolve
from worker.models.errors import ModelLoadError
from worker.models.loader import load_model
from worker.models.resolve import check_model_reference

DEAD_REDIS = "redis://127.0.0.1:1/0"  # never contacted: the model is refused first
HF_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
           "TRANSFORMERS_CACHE", "HF_ENDPOINT")  # fmt: skip


def run_worker(tmp_path: Path, model: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in HF_VARS}
    hf_home = tmp_path / "hf-home"  # empty: nothing is cached
    hf_home.mkdir(exist_ok=True)
    clean |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path), **env}
    cmd = [sys.executable, "-m", "worker.cli", "--model", model, "--redis-url", DEAD_REDIS]
    return subprocess.run(
        cmd, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=120, check=False
    )


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("model", ["./no-such-dir", "../no-such-dir/model", "/no/such/dir", "~/no-such-dir",
                                   "no-such-model.gguf"])  # fmt: skip
def test_a_missing_local_path_is_one_line_naming_the_path(tmp_path: Path, model: str) -> None:
    line = one_line(run_worker(tmp_path, model))
    assert line == (
        f"worker: model {model!r}: no such file or directory (a local checkpoint folder or .gguf file)"
    )


def test_a_hub_id_not_in_the_cache_offline_is_one_line_with_the_way_to_fetch_it(tmp_path: Path) -> None:
    line = one_line(run_worker(tmp_path, "someorg/somemodel"))
    cache = tmp_path / "hf-home" / "hub"
    assert line == (
        f"worker: model 'someorg/somemodel': not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 "
        "forbids downloading it; pre-fetch it with `hf download someorg/somemodel` where the hub is reachable, "
        "then copy that cache here or point HF_HOME at it"
    )


def test_a_reference_that_is_neither_a_path_nor_a_hub_id_is_one_line(tmp_path: Path) -> None:
    line = one_line(run_worker(tmp_path, "not a model"))
    assert line == (
        "worker: model 'not a model': no such file or directory, and not a valid Hugging Face hub id "
        "(org/name); expected a local checkpoint folder, a .gguf file, a hub id or the alias 'smollm2-135m'"
    )


def test_the_check_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    # The refusal comes before anything heavy: a bad --model costs a fraction of a second.
    probe = (
        "import sys\nfrom worker.cli import main\n"
        f"rc = main(['--model', './no-such-dir', '--redis-url', {DEAD_REDIS!r}])\n"
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.stdout.split() == ["2", "False", "False"], out.stdout + out.stderr


def test_an_unreachable_hub_says_it_could_not_download(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The online case without the hub's retries: the download fails as it does with no network.
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(*_: object, **__: object) -> str:
        raise LocalEntryNotFoundError("cannot reach the hub")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *_, **__: None)
    with pytest.raises(ModelLoadError) as e:
        check_model_reference("someorg/somemodel")
    assert str(e.value) == (
        f"model 'someorg/somemodel': not in the local Hugging Face cache ({tmp_path}) and could not be "
        "downloaded from the hub (offline?); pre-fetch it with `hf download someorg/somemodel` where the hub "
        "is reachable, then copy that cache here or point HF_HOME at it (HF_HUB_OFFLINE=1 uses only the cache, "
        "at once)"
    )


def test_a_hub_id_in_the_cache_passes_and_its_config_is_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    def cache(repo: str, config: dict[str, object]) -> None:
        snapshot = tmp_path / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config))
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    cache("someorg/llama", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    cache("someorg/gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    check_model_reference("someorg/llama")  # no network needed: found in the cache
    with pytest.raises(ModelLoadError, match=r"model 'someorg/gpt2': unsupported architecture 'gpt2'"):
        check_model_reference("someorg/gpt2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def copy_of(tiny: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in tiny.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_local_folders_and_files_that_are_no_checkpoint_are_refused_before_loading(
    tmp_path: Path, tiny: Path
) -> None:
    check_model_reference(str(tiny))  # a real checkpoint passes
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"'.*empty': the folder has no config.json"):
        check_model_reference(str(tmp_path / "empty"))
    bad_json = copy_of(tiny, tmp_path / "bad-json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"cannot read .*config.json: JSONDecodeError"):
        check_model_reference(str(bad_json))
    gpt2 = copy_of(tiny, tmp_path / "gpt2")
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(
        json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported architecture 'gpt2' .*not a decoder-only \*ForCausalLM; supported: gemma2, gemma3, "
        r"gemma3_text, gpt_oss, granite, llama, llava, mistral, mixtral, olmo2, phi3, qwen2, qwen2_5_vl, "
        r"qwen2_5_vl_text, qwen2_moe, qwen2_vl, qwen2_vl_text, qwen3, qwen3_moe, and other \*ForCausalLM models "
        r"through transformers",
    ):
        check_model_reference(str(gpt2))
    (tmp_path / "model.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match=r"model.gguf': not a GGUF file"):
        check_model_reference(str(tmp_path / "model.gguf"))


def test_a_checkpoint_that_cannot_be_read_raises_one_line_at_load(tmp_path: Path, tiny: Path) -> None:
    cpu = torch.device("cpu")
    torn = copy_of(tiny, tmp_path / "torn")
    weights = torn / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(torn), torch.float32, cpu)
    assert str(e.value) == (
        f"model {str(torn)!r}: cannot load its weights: {weights}: not a safetensors file (its header would "
        "run past the file's end)"
    )
    no_weights = copy_of(tiny, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"'.*no-weights': cannot load its weights: .*no-weights: no weights: "
                       r"none of model.safetensors, model.safetensors.index.json, pytorch_model.bin"):  # fmt: skip
        load_model(str(no_weights), torch.float32, cpu)
    bad_tok = copy_of(tiny, tmp_path / "bad-tokenizer")
    (bad_tok / "tokenizer.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match=r"cannot load its tokenizer: "):
        load_model(str(bad_tok), torch.float32, cpu)
    # Older callers caught OSError (a missing checkpoint) or ValueError (an unsupported architecture).
    assert isinstance(e.value, OSError) and isinstance(e.value, ValueError)


def test_the_cli_exits_2_on_a_load_error_and_keeps_a_bug_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny: Path
) -> None:
    import worker.service

    async def unreadable(_cfg: object) -> int:
        raise ModelLoadError(f"model {str(tiny)!r}: cannot load its weights: SafetensorError: torn")

    monkeypatch.setattr(worker.service, "serve", unreadable)
    assert cli.main(["--model", str(tiny), "--redis-url", DEAD_REDIS]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"worker: model {str(tiny)!r}: cannot load its weights: SafetensorError: torn"
    ]

    async def bug(_cfg: object) -> int:
        raise KeyError("model.layers.0.self_attn.q_proj.weight")

    monkeypatch.setattr(worker.service, "serve", bug)
    with pytest.raises(KeyError):
        cli.main(["--model", str(tiny), "--redis-url", DEAD_REDIS])


def test_resolve_checkpoint_passes_a_local_folder_through(tiny: Path) -> None:
    assert resolve.resolve_checkpoint(str(tiny)) == str(tiny)


def rewritten(tiny: Path, dest: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the tiny checkpoint whose model.safetensors `change` has edited."""
    from safetensors.torch import load_file, save_file

    folder = copy_of(tiny, dest)
    sd = load_file(folder / "model.safetensors")
    change(sd)
    save_file(sd, folder / "model.safetensors")
    return folder


L0 = "model.layers.0."
TENSOR_FAULTS: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]] = {
    "missing": (
        lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"),
        "tensor 'model.layers.1.self_attn.k_proj.weight' is not in the checkpoint ({file})",
    ),
    "missing-qkv": (
        lambda sd: [sd.pop(f"{L0}self_attn.{n}_proj.weight") for n in "qkv"],
        f"tensor '{L0}self_attn.q_proj.weight' is not in the checkpoint ({{file}}), nor is "
        f"'{L0}self_attn.qkv_proj.weight'",
    ),
    "unexpected": (
        lambda sd: sd.update({"model.layers.2.mlp.up_proj.weight": sd[f"{L0}mlp.up_proj.weight"].clone()}),
        "tensor 'model.layers.2.mlp.up_proj.weight' in {file}: the model has no weight of that name",
    ),
    "wrong-shape": (
        lambda sd: sd.update({f"{L0}mlp.up_proj.weight": sd[f"{L0}mlp.up_proj.weight"][:100].clone()}),
        f"tensor '{L0}mlp.up_proj.weight' in {{file}}: shape [100, 64], expected [128, 64] (for rows 128:256 "
        "of the decoder's layers.0.mlp.gate_up_proj.weight)",
    ),
    "fused-and-split": (
        lambda sd: sd.update({f"{L0}mlp.gate_up_proj.weight": torch.zeros(256, 64)}),
        f"tensor '{L0}mlp.gate_up_proj.weight' in {{file}}: overlaps '{L0}mlp.gate_proj.weight' in the decoder's "
        "layers.0.mlp.gate_up_proj.weight",
    ),
    "quantised": (
        lambda sd: sd.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}),
        "tensor 'model.norm.weight' in {file}: dtype I8, not one of F64, F32, F16, BF16 (quantised checkpoints "
        "are not loaded natively)",
    ),
}


@pytest.mark.parametrize("fault", sorted(TENSOR_FAULTS))
def test_a_tensor_the_model_cannot_take_is_one_line_naming_tensor_and_file(
    tmp_path: Path, tiny: Path, fault: str
) -> None:
    change, expected = TENSOR_FAULTS[fault]
    folder = rewritten(tiny, tmp_path / fault, change)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(folder), torch.float32, torch.device("cpu"))
    file = folder / "model.safetensors"
    assert str(e.value) == f"model {str(folder)!r}: cannot load its weights: " + expected.format(file=file)


def test_shards_that_do_not_fit_their_index_are_one_line(tmp_path: Path, tiny: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy_of(tiny, tmp_path / "sharded")
    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file(sd, folder / "a.safetensors")
    save_file({"model.norm.weight": sd["model.norm.weight"]}, folder / "b.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "b.safetensors", "x": "a.safetensors"}}))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(folder), torch.float32, torch.device("cpu"))
    assert str(e.value) == (
        f"model {str(folder)!r}: cannot load its weights: tensor 'model.norm.weight' is in both "
        f"{folder / 'a.safetensors'} and {folder / 'b.safetensors'}"
    )
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "c.safetensors"}}))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(folder), torch.float32, torch.device("cpu"))
    assert (
        str(e.value)
        == f"model {str(folder)!r}: cannot load its weights: {index} names c.safetensors, which is not in {folder}"
    )


def test_a_legacy_pytorch_model_bin_is_refused_in_one_line(tmp_path: Path, tiny: Path) -> None:
    from safetensors.torch import load_file

    folder = copy_of(tiny, tmp_path / "legacy")
    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(sd, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(folder), torch.float32, torch.device("cpu"))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(
        f"model {str(folder)!r}: cannot load its weights: {folder / 'pytorch_model.bin'}: cannot map it"
    )
    assert str(e.value).endswith("a checkpoint in torch.save's legacy format: convert it to safetensors")


def test_a_hub_id_in_the_cache_loads_its_weights_from_the_snapshot(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny: Path
) -> None:
    from huggingface_hub import constants
    from safetensors.torch import load_file, save_file

    snapshot = tmp_path / "models--someorg--tiny" / "snapshots" / ("0" * 40)
    snapshot.parent.mkdir(parents=True)
    copy_of(tiny, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    sd = load_file(snapshot / "model.safetensors")  # sharded, so the index's shards are found too
    (snapshot / "model.safetensors").unlink()
    names = sorted(sd)
    save_file({n: sd[n] for n in names[::2]}, snapshot / "a.safetensors")
    save_file({n: sd[n] for n in names[1::2]}, snapshot / "b.safetensors")
    weight_map = {n: "a.safetensors" if i % 2 == 0 else "b.safetensors" for i, n in enumerate(names)}
    (snapshot / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve.weights_folder("someorg/tiny") == snapshot
    loaded = load_model("someorg/tiny", torch.float32, torch.device("cpu"))
    ours = dict(loaded.model.named_parameters())
    assert torch.equal(ours["norm.weight"], sd["model.norm.weight"])
    (snapshot / "b.safetensors").unlink()  # a shard the cache lacks, with no hub to fetch it from
    with pytest.raises(ModelLoadError) as e:
        resolve.weights_folder("someorg/tiny")
    assert str(e.value) == (
        f"model 'someorg/tiny': its weights are not in the local Hugging Face cache ({tmp_path}) and "
        "HF_HUB_OFFLINE=1 forbids downloading them; pre-fetch them with `hf download someorg/tiny`"
    )
