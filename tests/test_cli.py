"""The `kvharbor` command: --help and --version everywhere, clear errors, and a real generation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvharbor.common import __version__

KVHARBOR = [sys.executable, "-m", "kvharbor.common.cli"]


def run(*args, **kw):
    return subprocess.run([*KVHARBOR, *args], capture_output=True, text=True, timeout=300, **kw)


def test_version_and_help():
    assert run("--version").stdout.strip() == f"kvharbor {__version__}"
    for command in ("generate", "chat", "serve", "up", "gateway", "kvcache", "operator"):
        out = run(command, "--version")
        assert out.returncode == 0 and out.stdout.strip() == f"kvharbor {__version__}", command
    top = run("--help")
    assert top.returncode == 0 and "generate" in top.stdout and "chat" in top.stdout


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_subcommand_help_lists_every_engine_option_with_its_env_name(command):
    out = run(command, "--help")
    assert out.returncode == 0
    for flag, env in [
        ("--max-num-seqs", "KVHARBOR_MAX_NUM_SEQS"),
        ("--block-size", "KVHARBOR_BLOCK_SIZE"),
        ("--dtype", "KVHARBOR_DTYPE"),
        ("--temperature", None),
    ]:
        assert flag in out.stdout
        if env:
            assert env in out.stdout


def test_unknown_command_and_bad_values_fail_with_a_message():
    assert run("frobnicate").returncode == 2
    bad = run("generate", "hi", "--block-size", "24")
    assert bad.returncode == 2 and "power of two" in bad.stderr
    missing = run("generate", "hi", "--model", "/nonexistent/model.gguf")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "never downloads" in missing.stderr


def test_a_model_folder_without_tokenizer_is_explained(tiny_llama):
    out = run("generate", "hi", "--model", str(tiny_llama.loaded.path), "--dtype", "float32")
    assert out.returncode == 2 and "no tokenizer" in out.stderr


def test_chat_generates_with_the_default_model_and_reports_progress():
    out = run(
        "chat",
        "What is the capital of France?",
        "--max-tokens",
        "20",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The capital of France is Paris."
    for phase in ("loading model", "KV pool", "warming up", "ready in", "finish reason: stop"):
        assert phase in out.stderr


def test_options_come_from_env_and_yaml_too(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text("max_model_len: 64\nkv_cache_memory: 16MiB\n")
    env = {"KVHARBOR_DTYPE": "float32", "PATH": "/usr/bin:/bin"}
    out = run("generate", "x " * 80, "--config", str(config), "--max-tokens", "4", env=env)
    # The 80-token prompt does not fit the 64-token context set in the YAML file.
    assert out.returncode == 2 and "context is 64" in out.stderr
