"""Redis with a password (a real redis-server with requirepass): every part that is given the
wrong password, or none, stops at once with an error that says what to fix and never shows the
password; the right one works. (A wrong password used to leave `kvharbor up` retrying, silent.)"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from servers import KVCacheServiceProcess, free_port, write_tenants

from kvharbor.common.redis_client import RedisAuthError, check_credentials, credentials_refused, redact
from kvharbor.launch.embedded_redis import EmbeddedRedis

pytestmark = pytest.mark.slow  # a real redis-server and the real CLIs

SECRET = "s3cret-pw"


@pytest.fixture(scope="module")
def protected(tmp_path_factory):
    with EmbeddedRedis(workdir=tmp_path_factory.mktemp("redis-auth"), password=SECRET) as server:
        yield server


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvharbor.launch.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_credentials_are_checked_and_the_advice_names_no_secret(protected):
    check_credentials(protected.url)  # right: no error
    wrong = f"redis://:not-{SECRET}@127.0.0.1:{protected.port}/0"
    for url in (wrong, f"redis://127.0.0.1:{protected.port}/0"):
        with pytest.raises(RedisAuthError, match="refused the credentials") as err:
            check_credentials(url)
        assert SECRET not in str(err.value) and "redis://USER:PASSWORD@host:port/0" in str(err.value)
    check_credentials(f"redis://:{SECRET}@127.0.0.1:{free_port()}/0")  # nobody there: not an error at start
    assert redact(wrong) == f"redis://:***@127.0.0.1:{protected.port}/0" and redact("redis://h:1/0") == "redis://h:1/0"


def test_the_start_up_check_says_why_and_refuses_only_wrong_credentials(protected, capsys):
    wrong = f"redis://:not-{SECRET}@127.0.0.1:{protected.port}/0"
    assert credentials_refused(wrong, "kvharbor x") is True
    err = capsys.readouterr().err
    assert err.startswith("kvharbor x: error: Redis at 127.0.0.1") and SECRET not in err
    for fine in (protected.url, None, "", f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"):  # right, none, not up
        assert credentials_refused(fine, "kvharbor x") is False
    assert capsys.readouterr().err == ""


def test_every_part_stops_at_once_on_a_wrong_password(protected, tmp_path, tiny_chat_model):
    wrong = f"redis://:wrong-{SECRET}@127.0.0.1:{protected.port}/0"
    tenants = tmp_path / "tenants.yaml"
    write_tenants(tenants, [{"name": "acme", "key": "sk-acme"}])
    runs = {
        "kvcache": cli("kvcache", "--redis-url", wrong, "--port", str(free_port())),
        "gateway": cli(
            "gateway", "--redis-url", wrong, "--engines", "http://127.0.0.1:9", "--tenants-file", str(tenants),
            "--port", str(free_port()),
        ),
        "serve": cli("serve", "--model", str(tiny_chat_model), "--redis-url", wrong, "--port", str(free_port())),
        "up": cli("up", "--model", str(tiny_chat_model), "--redis-url", wrong, "--port", str(free_port())),
        "operator": cli("operator", "--redis-url", wrong, "--port", str(free_port())),
    }
    for part, run in runs.items():
        out = run.stdout + run.stderr
        assert run.returncode != 0, f"{part}: {out[-2000:]}"
        assert "refused the credentials" in out, f"{part}: {out[-2000:]}"
        assert f"wrong-{SECRET}" not in out, f"{part} printed the password"


def test_the_right_password_serves(protected, tmp_path):
    with KVCacheServiceProcess(tmp_path, protected.url) as svc:
        assert httpx.get(svc.url + "/ready", timeout=10).status_code == 200
        banner = svc.log_path.read_text()
        assert SECRET not in banner and "***" in banner
