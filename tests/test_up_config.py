"""`kvharbor up`'s options, without starting anything: the engines' command lines, and the
tenants file it gives the gateway (a demo tenant, a user's file, the load test's tenants)."""

from __future__ import annotations

import shutil

import pytest
import yaml
from servers import write_tenants

from kvharbor.common.api_keys import hash_key
from kvharbor.common.config import ConfigError, load_config
from kvharbor.launch.loadtest_tenants import LOADTEST_TENANTS
from kvharbor.launch.up import Platform, UpConfig


@pytest.fixture
def platform_for():
    made: list[Platform] = []

    def build(**options) -> Platform:
        platform = Platform(load_config(UpConfig, env={}, overrides=options))
        platform.redis_url = "redis://127.0.0.1:1/0"  # never contacted: nothing starts here
        made.append(platform)
        return platform

    yield build
    for platform in made:
        shutil.rmtree(platform.tmp, ignore_errors=True)


def tenants_of(path: str) -> dict[str, dict]:
    return {row["name"]: row for row in yaml.safe_load(open(path).read())["tenants"]}


def engine_cmds(platform: Platform) -> list[list[str]]:
    return [child.cmd for child in platform._children() if child.name.startswith("engine-")]


def test_engines_size_their_pool_in_blocks_and_cap_their_context_by_default(platform_for):
    (cmd,) = engine_cmds(platform_for(engines=1, num_kv_blocks=256, dtype="float32"))
    assert cmd[cmd.index("--num-kv-blocks") + 1] == "256" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert "--max-model-len" not in cmd  # the engine serves the model's context, capped to its pool
    (cmd,) = engine_cmds(platform_for(engines=1, max_model_len=2048))
    assert cmd[cmd.index("--max-model-len") + 1] == "2048" and "--num-kv-blocks" not in cmd
    assert cmd[cmd.index("--quantization") + 1] == "none"


def test_engines_get_the_platforms_quantization(platform_for):
    (cmd,) = engine_cmds(platform_for(engines=1, dtype="float32", quantization="int8", kv_cache_dtype="int8"))
    assert cmd[cmd.index("--quantization") + 1] == "int8" and cmd[cmd.index("--kv-cache-dtype") + 1] == "int8"
    assert cmd[cmd.index("--batch-invariant") + 1] == "auto"
    (cmd,) = engine_cmds(platform_for(engines=1, batch_invariant="off"))
    assert cmd[cmd.index("--batch-invariant") + 1] == "off"


def test_every_engine_serves_the_platforms_lora_adapters_and_the_demo_tenant_may_use_them(platform_for):
    cmds = engine_cmds(platform_for(engines=2, lora=["sql=/a/sql", "chat=/a/chat"], max_loras=2))
    for cmd in cmds:
        assert [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--lora"] == ["sql=/a/sql", "chat=/a/chat"]
        assert cmd[cmd.index("--max-loras") + 1] == "2"
    platform = platform_for(lora=["sql=/a/sql"])
    assert tenants_of(platform._tenants())["demo"]["adapters"] == ["*"]
    assert "adapters" not in tenants_of(platform_for()._tenants())["demo"]
    assert all("--lora" not in cmd for cmd in engine_cmds(platform_for()))


def test_without_a_tenants_file_a_demo_tenant_gets_a_fresh_key(platform_for):
    platform = platform_for()
    rows = tenants_of(platform._tenants())
    assert list(rows) == ["demo"] and rows["demo"]["api_keys"] == [hash_key(platform.demo_key)]
    assert platform.demo_key.startswith("sk-demo-")


def test_loadtest_tenants_join_the_demo_tenant_or_a_users_file(platform_for, tmp_path):
    rows = tenants_of(platform_for(loadtest_tenants=True)._tenants())
    assert set(rows) == {"demo", *LOADTEST_TENANTS}
    for name, (key, priority) in LOADTEST_TENANTS.items():
        assert rows[name]["api_keys"] == [hash_key(key)] and rows[name]["priority"] == priority
    own = tmp_path / "tenants.yaml"
    write_tenants(own, [{"name": "acme", "key": "sk-acme"}, {"name": "chat", "key": "sk-mine"}])
    assert platform_for(tenants_file=str(own))._tenants() == str(own)  # as it is: the gateway follows edits
    merged = tenants_of(platform_for(tenants_file=str(own), loadtest_tenants=True)._tenants())
    assert set(merged) == {"acme", *LOADTEST_TENANTS}
    assert merged["chat"]["api_keys"] == [hash_key("sk-mine")]  # the user's own tenant of that name wins


def test_loadtest_tenants_are_refused_on_a_reachable_address():
    with pytest.raises(ConfigError, match=r"public API keys: serve them on 127\.0\.0\.1"):
        load_config(UpConfig, env={}, overrides={"loadtest_tenants": True, "host": "0.0.0.0"})


def test_an_unreadable_tenants_file_is_explained(platform_for, tmp_path):
    with pytest.raises(RuntimeError, match="cannot read the tenants file"):
        platform_for(tenants_file=str(tmp_path / "missing.yaml"), loadtest_tenants=True)._tenants()


def test_every_part_gets_the_platforms_log_settings_and_traces(platform_for):
    children = platform_for(engines=1, log_level="debug", log_json=False, otlp_endpoint="http://c:4318/v1/traces")
    for child in children._children():
        cmd = child.cmd
        assert cmd[cmd.index("--log-level") + 1] == "debug" and "--no-log-json" in cmd, child.name
        assert ("--otlp-endpoint" in cmd) == (child.name != "kvcache"), child.name  # kvcache has no spans


def test_pd_topology_gives_each_engine_its_role_and_own_cpu(platform_for):
    import os

    cmds = engine_cmds(platform_for(prefill_engines=1, decode_engines=2, pin_cpus=True))
    assert [cmd[cmd.index("--role") + 1] for cmd in cmds] == ["prefill", "decode", "decode"]
    cpus = sorted(os.sched_getaffinity(0))
    assert [cmd[cmd.index("--cpu-affinity") + 1] for cmd in cmds] == [str(cpus[i % len(cpus)]) for i in range(3)]
    (cmd, _) = engine_cmds(platform_for())  # default: two colocated engines, unpinned
    assert cmd[cmd.index("--role") + 1] == "both" and "--cpu-affinity" not in cmd
    with pytest.raises(ConfigError, match="needs decode_engines"):
        load_config(UpConfig, env={}, overrides={"prefill_engines": 1})


@pytest.mark.slow  # starts three redis-servers
def test_up_can_run_an_embedded_redis_cluster_and_hands_its_url_to_every_part():
    from kvharbor.common.redis_client import connect_sync

    platform = Platform(load_config(UpConfig, env={}, overrides={"embedded_redis": "cluster"}))
    try:
        platform._start_redis()
        url = platform.redis_url
        assert url.startswith("redis+cluster://127.0.0.1:")
        client = connect_sync(url, timeout=2)
        assert client.ping() and len(client.get_primaries()) == 3
        client.close()
        for child in platform._children():
            # Through the environment: a password on a command line shows in ps.
            assert child.env["KVHARBOR_REDIS_URL"] == url and "--redis-url" not in child.cmd
    finally:
        if platform.redis is not None:
            platform.redis.stop()
        shutil.rmtree(platform.tmp, ignore_errors=True)


def test_embedded_redis_takes_single_or_cluster_only():
    with pytest.raises(ConfigError, match="embedded_redis"):
        load_config(UpConfig, env={}, overrides={"embedded_redis": "sentinel"})


@pytest.mark.slow  # starts small processes that crash
def test_a_crash_looping_part_is_marked_failed_and_the_rest_runs_on_unless_it_is_the_gateway(tmp_path, capsys):
    import sys
    import time

    from kvharbor.launch.up import Child

    platform = Platform(
        load_config(UpConfig, env={}, overrides={"crash_limit": 3, "crash_window": 60, "restart_backoff": 0.05})
    )
    platform.redis_url = "redis://127.0.0.1:1/0"

    def child(name: str, code: str) -> Child:
        cmd = [sys.executable, "-c", code]
        return Child(name, cmd, "http://127.0.0.1:9", "/ready", tmp_path / f"{name}.log", "nothing")

    crasher = child("engine-0", "import sys; print('boom: the weights are corrupt'); sys.exit(3)")
    gateway = child("gateway", "import time; time.sleep(120)")
    platform.children = [crasher, gateway]

    def supervise_until(done) -> int | None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            code = platform._supervise_once(time.monotonic())
            if code is not None or done():
                return code
            time.sleep(0.02)
        raise AssertionError("supervision did not get there in 30 s")

    try:
        for ch in platform.children:
            ch.start()
        assert supervise_until(lambda: crasher.failed) is None  # the rest runs on
        assert crasher.restarts == 2 and len(crasher.failures) == 3 and crasher.state == "failed"
        assert gateway.exited() is None
        err = capsys.readouterr().err
        assert "marked failed, not restarted" in err and "boom: the weights are corrupt" in err
        assert [line.split()[-1] for line in err.splitlines() if line.startswith(("engine-0 ", "gateway "))] == [
            "failed",
            "starting",
        ]
        for _ in range(5):  # a failed part stays down
            assert platform._supervise_once(time.monotonic()) is None and crasher.exited() is not None
        gateway.stop(0)  # now the gateway dies and keeps dying: nothing can be served
        gateway.cmd = [sys.executable, "-c", "import sys; sys.exit(1)"]
        assert supervise_until(lambda: False) == 1
        assert "the gateway cannot run" in capsys.readouterr().err
    finally:
        for ch in platform.children:
            ch.stop(0)
        shutil.rmtree(platform.tmp, ignore_errors=True)


def test_an_embedding_model_gets_its_own_engine_and_the_gateway_a_models_file_with_both(platform_for):
    from kvharbor.gateway.discovery import StaticDiscovery

    platform = platform_for(engines=2, embedding_model="/models/qwen3-embedding")
    children = {child.name: child for child in platform._children()}
    embed = children["embed-0"].cmd
    assert embed[embed.index("--task") + 1] == "embed"
    assert embed[embed.index("--model") + 1] == "/models/qwen3-embedding"
    gateway = children["gateway"].cmd
    assert "--engines" not in gateway
    specs = StaticDiscovery.from_file(gateway[gateway.index("--models-file") + 1], 2000, 200).models()
    assert [(s.files, s.task, len(s.engines)) for s in specs] == [(None, "generate", 2),
                                                                 ("/models/qwen3-embedding", "embed", 1)]  # fmt: skip
    assert specs[1].engines == (children["embed-0"].url,)
    without = {child.name for child in platform_for(engines=1)._children()}
    assert "embed-0" not in without
    with pytest.raises(ConfigError, match="embedding_model"):
        load_config(UpConfig, env={}, overrides={"embedding_model": "/m", "engine_kind": "vllm", "vllm_python": "/p"})
