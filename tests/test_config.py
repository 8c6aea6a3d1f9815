"""Config loading: one name per option across YAML, KVHARBOR_* env and flags, with precedence."""

import argparse

import pytest

from kvharbor.common.config import ConfigError, add_arguments, leaves, load_config, parse_bytes
from kvharbor.engine.config import EngineConfig


def test_defaults_build_a_frozen_config():
    cfg = load_config(EngineConfig, env={})
    assert cfg.cache.block_size == 16
    with pytest.raises(AttributeError):
        cfg.cache.block_size = 32  # type: ignore[misc]


def test_precedence_file_then_env_then_flags(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("max-num-seqs: 8\nblock_size: 32\nenable_prefix_caching: false\n")
    env = {"KVHARBOR_MAX_NUM_SEQS": "12", "KVHARBOR_DTYPE": "float32", "UNRELATED": "x"}
    cfg = load_config(EngineConfig, file=path, env=env, overrides={"dtype": "bfloat16"})
    assert cfg.scheduler.max_num_seqs == 12  # env beats file
    assert cfg.cache.block_size == 32  # file beats default
    assert cfg.cache.enable_prefix_caching is False
    assert cfg.model.dtype == "bfloat16"  # flags beat env


def test_config_file_from_env(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_n: 3\n")
    assert load_config(EngineConfig, env={"KVHARBOR_CONFIG": str(path)}).limits.max_n == 3


def test_flags_are_generated_with_the_same_names():
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    args = parser.parse_args(["--max-num-seqs", "4", "--no-enable-prefix-caching"])
    cfg = load_config(EngineConfig, env={}, overrides=vars(args))
    assert cfg.scheduler.max_num_seqs == 4 and cfg.cache.enable_prefix_caching is False
    names = {leaf.name for leaf in leaves(EngineConfig)}
    assert {"max_num_seqs", "block_size", "dtype", "kv_cache_memory"} <= names


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"overrides": {"max_num_seq": 4}}, "did you mean 'max_num_seqs'"),
        ({"env": {"KVHARBOR_BLOCK_SIZE": "big"}}, "block_size='big' from the environment"),
        ({"overrides": {"block_size": 24}}, "power of two"),
        ({"overrides": {"dtype": "int3"}}, "must be one of"),
        ({"overrides": {"enable_prefix_caching": "maybe"}}, "true or false"),
        ({"overrides": {"kv_cache_memory": "lots"}}, "cannot read 'lots' as a size"),
        ({"overrides": {"max_num_seqs": 0}}, "max_num_seqs must be >= 1"),
    ],
)
def test_bad_values_say_what_is_wrong(kwargs, match):
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError, match=match):
        load_config(EngineConfig, **kwargs)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(EngineConfig, file=tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(EngineConfig, file=bad, env={})


@pytest.mark.parametrize(
    ("text", "value"), [("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("1000", 1000)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_every_command_shares_one_server_sub_config():
    from kvharbor.common.server_config import ListenConfig
    from kvharbor.engine.config import ServeConfig
    from kvharbor.gateway.config import GatewayConfig
    from kvharbor.kvcache_service.config import KVCacheServiceConfig
    from kvharbor.launch.up import UpConfig
    from kvharbor.operator.config import OperatorConfig

    shared = {"host", "port", "log_level", "log_json"}
    for root in (ServeConfig, GatewayConfig, KVCacheServiceConfig, OperatorConfig, UpConfig):
        assert shared <= {leaf.name for leaf in leaves(root)}, root
        with pytest.raises(ConfigError, match="port must be in"):
            load_config(root, env={}, overrides={"port": 70000})
    assert load_config(OperatorConfig, env={}, overrides={"port": 0}).server.port == 0  # its /healthz is optional
    with pytest.raises(ConfigError, match=r"port must be in 1\.\.65535"):
        load_config(GatewayConfig, env={}, overrides={"port": 0})
    assert issubclass(GatewayConfig.__dataclass_fields__["server"].default_factory, ListenConfig)


def test_the_gateway_drains_as_long_as_asked_on_sigterm():
    from kvharbor.gateway.config import GatewayConfig

    assert load_config(GatewayConfig, env={}).server.drain_timeout == 25.0  # inside Kubernetes' 30 s grace
    env = {"KVHARBOR_DRAIN_TIMEOUT": "40"}
    assert load_config(GatewayConfig, env=env).server.drain_timeout == 40.0
    with pytest.raises(ConfigError, match="drain_timeout must be >= 0"):
        load_config(GatewayConfig, env={}, overrides={"drain_timeout": -1})


def test_every_part_takes_one_redis_or_a_cluster_by_url_and_refuses_other_urls():
    from kvharbor.engine.config import ServeConfig
    from kvharbor.gateway.config import GatewayConfig
    from kvharbor.kvcache_service.config import KVCacheServiceConfig

    for root in (ServeConfig, GatewayConfig, KVCacheServiceConfig):
        for url in ("redis://10.0.0.1:6379/2", "redis+cluster://10.0.0.1:7000", "rediss+cluster://r.example:6380"):
            load_config(root, env={}, overrides={"redis_url": url})
        with pytest.raises(ConfigError, match="is not a Redis URL: use redis://host:port/db"):
            load_config(root, env={}, overrides={"redis_url": "http://10.0.0.1:6379"})
        with pytest.raises(ConfigError, match="a Redis Cluster has only database 0"):
            load_config(root, env={}, overrides={"redis_url": "redis+cluster://10.0.0.1:7000/3"})


def test_intake_ownership_must_be_renewed_before_it_lapses():
    from kvharbor.kvcache_service.config import KVCacheServiceConfig

    cfg = load_config(KVCacheServiceConfig, env={"KVHARBOR_OWNER_TTL": "6"}, overrides={"rebalance_interval": 1.5})
    assert (cfg.intake.owner_ttl, cfg.intake.rebalance_interval) == (6.0, 1.5)
    with pytest.raises(ConfigError, match=r"rebalance_interval must be > 0 and under owner_ttl / 3"):
        load_config(KVCacheServiceConfig, env={}, overrides={"owner_ttl": 3, "rebalance_interval": 1})


def test_the_gateways_pd_settings_come_from_env_and_refuse_negatives():
    from kvharbor.gateway.config import GatewayConfig

    routing = load_config(GatewayConfig, env={}).routing
    assert (routing.pd_min_gain_ms, routing.pd_transfer_trust_s) == (50.0, 10.0)
    env = {"KVHARBOR_PD_TRANSFER_TRUST_S": "0", "KVHARBOR_PD_MIN_GAIN_MS": "5"}
    routing = load_config(GatewayConfig, env=env).routing
    assert (routing.pd_min_gain_ms, routing.pd_transfer_trust_s) == (5.0, 0.0)
    with pytest.raises(ConfigError, match=r"pd_transfer_trust_s must be >= 0 \(0: trust a measured rate for good\)"):
        load_config(GatewayConfig, env={}, overrides={"pd_transfer_trust_s": -1})
    with pytest.raises(ConfigError, match="pd_transfer_trust_s must be >= 0"):  # NaN is no number of seconds
        load_config(GatewayConfig, env={"KVHARBOR_PD_TRANSFER_TRUST_S": "nan"})
    with pytest.raises(ConfigError, match="pd_min_gain_ms must be >= 0"):
        load_config(GatewayConfig, env={}, overrides={"pd_min_gain_ms": -1})
    routing = load_config(GatewayConfig, env={"KVHARBOR_PD_PREFILL_DEADLINE_S": "2.5"}).routing
    assert routing.pd_prefill_deadline_s == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ConfigError, match="pd_prefill_deadline_s must be > 0"):
            load_config(GatewayConfig, env={"KVHARBOR_PD_PREFILL_DEADLINE_S": bad})
