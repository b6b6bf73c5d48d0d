"""The worker's one config tree: defaults < --config TOML < flags, each bad setting named with its source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from worker.cli import build_parser
from worker.config import ConfigError, WorkerConfig, load_config
from worker.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "worker.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "w.toml"
    path.write_text(text)
    return path


def test_the_example_file_lists_exactly_the_defaults() -> None:
    from_file = load_config(EXAMPLE, {})
    assert from_file == WorkerConfig(redis_url=from_file.redis_url, worker_id=from_file.worker_id)
    listed = {
        line.split("=")[0].strip().lstrip("# ") for line in EXAMPLE.read_text().splitlines() if "=" in line
    }
    every = set(WorkerConfig.model_fields) - {"engine", "redis_url", "worker_id"} | set(
        EngineConfig.model_fields
    )
    assert every <= listed, f"settings missing from {EXAMPLE.name}: {every - listed}"


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, 'queue = "q1"\nlease_s = 5.0\n[engine]\nmax_num_seqs = 8\ndtype = "float32"\n')
    cfg = load_config(path, {"max_num_seqs": 16, "lease_s": None, "queue": "q2"})
    assert (cfg.queue, cfg.lease_s, cfg.engine.max_num_seqs, cfg.engine.dtype) == ("q2", 5.0, 16, "float32")
    assert cfg.engine.block_size == EngineConfig().block_size
    assert cfg.max_jobs == 16 + 8


def test_an_unknown_key_names_the_key_its_table_and_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[engine]\nmax_num_seq = 8\n")
    with pytest.raises(
        ConfigError, match=rf"{path}: \[engine\] max_num_seq: unknown setting \(known: .*max_num_seqs"
    ):
        load_config(path, {})
    path = write(tmp_path, "leese_s = 8\n")
    with pytest.raises(ConfigError, match=rf"{path}: leese_s: unknown setting"):
        load_config(path, {})


def test_a_bad_value_names_the_key_the_value_and_the_rule(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\nkv_watermark = 1.5\ndevice = "tpu"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, {})
    msg = str(e.value)
    assert f"{path}: [engine] kv_watermark = 1.5: Input should be less than or equal to 1" in msg
    assert f"{path}: [engine] device = 'tpu': Input should be 'auto', 'cpu' or 'cuda'" in msg
    path = write(tmp_path, 'max_tries = "3"\n')  # TOML types are kept: a string is not a count
    with pytest.raises(ConfigError, match=rf"{path}: max_tries = '3': Input should be a valid integer"):
        load_config(path, {})


def test_a_bad_flag_value_names_the_flag(tmp_path: Path) -> None:
    path = write(tmp_path, "[engine]\nblock_size = 32\n")
    with pytest.raises(ConfigError, match=r"--block-size = 0: Input should be greater than or equal to 1"):
        load_config(path, {"block_size": 0})
    with pytest.raises(ConfigError, match=r"--lease-s = -1.0: Input should be greater than 0"):
        load_config(None, {"lease_s": -1.0})


def test_a_rule_across_settings_names_both(tmp_path: Path) -> None:
    path = write(tmp_path, "[engine]\nmax_num_seqs = 128\n")
    with pytest.raises(
        ConfigError,
        match=rf"{path}: \[engine\]: max_num_batched_tokens \(64\) must be >= max_num_seqs \(128\)",
    ):
        load_config(path, {"max_num_batched_tokens": 64})


def test_missing_or_broken_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml", {})
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "queue = \n"), {})


def test_every_setting_has_one_flag_of_its_type() -> None:
    parser = build_parser()
    ns = parser.parse_args(["--max-num-seqs", "3", "--kv-watermark", "0.5", "--device", "cpu", "--no-cuda-graphs",
                            "--burst", "--prefetch", "0", "--queue", "q"])  # fmt: skip
    cfg = load_config(None, {k: v for k, v in vars(ns).items() if k not in ("config", "check", "verbose")})
    assert (cfg.engine.max_num_seqs, cfg.engine.kv_watermark, cfg.engine.device) == (3, 0.5, "cpu")
    assert (cfg.engine.cuda_graphs, cfg.burst, cfg.prefetch, cfg.queue) == (False, True, 0, "q")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])


def test_the_worker_reads_no_config_from_the_working_directory(tmp_path: Path) -> None:
    # A stray configs/worker.toml where the worker starts must not change (or break) it: only --config does.
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "worker.toml").write_text("not_a_setting = 1\n")
    cmd = [sys.executable, "-m", "worker.cli", "--check", "--redis-url", "redis://127.0.0.1:1/0"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 1 and "redis unreachable" in out.stdout, out.stdout + out.stderr
    bad = subprocess.run([*cmd, "--config", "configs/worker.toml"], cwd=tmp_path, capture_output=True, text=True,
                         check=False, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "not_a_setting: unknown setting" in bad.stderr
