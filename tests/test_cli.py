"""The `kvharbor` command: --help and --version everywhere, clear errors, options from flags, env
and YAML, and a real generation. Most run the CLI's main() in this process; one test runs the
real command in a subprocess, as a user does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvharbor.common import __version__
from kvharbor.launch.cli import main

KVHARBOR = [sys.executable, "-m", "kvharbor.launch.cli"]
COMMANDS = ("generate", "chat", "serve", "up", "gateway", "kvcache", "operator")


def cli(capsys, *args) -> tuple[int, str, str]:
    """main(args) in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("KVHARBOR_")]:
        monkeypatch.delenv(name)


def test_version_and_help(capsys):
    assert cli(capsys, "--version")[:2] == (0, f"kvharbor {__version__}\n")
    for command in COMMANDS:
        assert cli(capsys, command, "--version")[:2] == (0, f"kvharbor {__version__}\n"), command
        code, out, _ = cli(capsys, command, "--help")
        assert code == 0 and f"kvharbor {command}" in out and "--version" in out, command
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and all(command in out for command in COMMANDS)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_subcommand_help_lists_every_engine_option_with_its_env_name(capsys, command):
    code, out, _ = cli(capsys, command, "--help")
    assert code == 0
    for flag, env in [
        ("--max-num-seqs", "KVHARBOR_MAX_NUM_SEQS"),
        ("--block-size", "KVHARBOR_BLOCK_SIZE"),
        ("--dtype", "KVHARBOR_DTYPE"),
        ("--num-kv-blocks", "KVHARBOR_NUM_KV_BLOCKS"),
        ("--temperature", None),
    ]:
        assert flag in out
        if env:
            assert env in out


def test_unknown_command_and_bad_values_fail_with_a_message(capsys):
    assert cli(capsys, "frobnicate")[0] == 2
    code, _, err = cli(capsys, "generate", "hi", "--block-size", "24")
    assert code == 2 and "power of two" in err
    code, _, err = cli(capsys, "generate", "hi", "--model", "/nonexistent/model.gguf")
    assert code == 2 and "does not exist" in err and "never downloads" in err


def test_a_model_folder_without_tokenizer_is_explained(capsys, tiny_llama):
    code, _, err = cli(capsys, "generate", "hi", "--model", str(tiny_llama.loaded.path), "--dtype", "float32")
    assert code == 2 and "no tokenizer" in err


def test_options_come_from_env_and_yaml_too(capsys, monkeypatch, tmp_path, tiny_chat_model):
    config = tmp_path / "engine.yaml"
    config.write_text(f"model: {tiny_chat_model}\nmax_model_len: 64\nnum_kv_blocks: 8\n")
    monkeypatch.setenv("KVHARBOR_DTYPE", "float32")
    code, _, err = cli(capsys, "generate", "x " * 80, "--config", str(config), "--max-tokens", "4")
    # The 80-token prompt does not fit the 64-token context set in the YAML file.
    assert code == 2 and "context is 64" in err
    assert "in float32" in err  # the dtype came from the environment


# The README's first example, at the default dtype (auto: bfloat16 on AMX machines and GPUs,
# float32 elsewhere) and in bfloat16 on every CPU (emulated where it has no native support): on an
# AMX machine bfloat16 once answered "L'Étoile, la Marseillaise, la femme," (logits rounded to
# bfloat16 tied "The" with "L").
@pytest.mark.slow  # the real command, in a subprocess, with SmolLM2
@pytest.mark.parametrize("dtype", [(), ("--dtype", "bfloat16")], ids=["auto", "bfloat16"])
def test_chat_generates_with_the_default_model_and_reports_progress(dtype):
    version = subprocess.run([*KVHARBOR, "--version"], capture_output=True, text=True)
    assert version.stdout == f"kvharbor {__version__}\n"
    out = subprocess.run(
        [*KVHARBOR, "chat", "What is the capital of France?", "--max-tokens", "20", "--num-kv-blocks", "64",
         *dtype],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The capital of France is Paris."
    for phase in ("loading model", "KV pool", "capped to 1024 tokens", "warming up", "ready in", "finish reason: stop"):
        assert phase in out.stderr
