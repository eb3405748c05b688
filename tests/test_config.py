"""Configuration: defaults, file, environment and flags, and start-up validation naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import (
    ConfigError,
    Settings,
    display_url,
    load_settings,
    settings_from_mapping,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "cachegate.example.toml"


def test_defaults_serve_a_local_user() -> None:
    s = load_settings(environ={})
    assert s.server.host == "127.0.0.1"
    assert s.server.port == 8787
    assert s.upstream.base_url == "https://api.openai.com/v1"
    assert s.logging.bodies == "full"
    assert s.compaction.enabled is False


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        '[server]\nport = 9001\nhost = "127.0.0.2"\n[upstream]\nbase_url = "http://a/v1"\n'
    )
    s = load_settings(str(f), {}, environ={"CACHEGATE_PORT": "9002"})
    assert (s.server.port, s.server.host, s.upstream.base_url) == (9002, "127.0.0.2", "http://a/v1")
    s = load_settings(
        None, {"port": "9003"}, environ={"CACHEGATE_CONFIG": str(f), "CACHEGATE_PORT": "9002"}
    )
    assert s.server.port == 9003
    assert s.server.host == "127.0.0.2"


def test_env_vars_for_every_option(tmp_path: Path) -> None:
    env = {
        "CACHEGATE_HOST": "0.0.0.0",
        "CACHEGATE_PORT": "1234",
        "CACHEGATE_UPSTREAM": "http://127.0.0.1:9/v1",
        "CACHEGATE_LOG_DIR": str(tmp_path),
        "CACHEGATE_STRICT_PAIRING": "1",
    }
    s = load_settings(environ=env)
    assert s.server.host == "0.0.0.0"
    assert s.server.port == 1234
    assert s.upstream.base_url == "http://127.0.0.1:9/v1"
    assert s.logging.dir == str(tmp_path)
    assert s.pairing.strict is True


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"server": {"prot": 1}}, "server.prot"),
        ({"sever": {}}, "sever"),
        ({"server": {"port": "eighty"}}, "server.port"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"logging": {"fsync": "always"}}, "logging.fsync"),
        ({"pairing": {"orphan_policy": "keep"}}, "pairing.orphan_policy"),
        ({"upstream": {"base_url": "api.openai.com"}}, "upstream.base_url"),
        ({"compaction": {"trigger_percent": 0}}, "compaction.trigger_percent"),
        ({"models": {"gpt-x": {"price_input": "cheap"}}}, 'models."gpt-x".price_input'),
        ({"models": {"gpt-x": {"context": 5}}}, 'models."gpt-x".context'),
        ({"cache": {"noise_floor_tokens": True}}, "cache.noise_floor_tokens"),
    ],
)
def test_bad_config_names_the_key(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(data)
    assert needle in str(info.value)


def test_missing_config_file_is_an_error() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings("/nonexistent/cachegate.toml", environ={})


def test_model_lookup_exact_prefix_and_fallback() -> None:
    s = settings_from_mapping({"models": {"my-model": {"context_window": 1000, "cache_ttl_s": 60}}})
    assert s.model("my-model")[0] == "my-model"
    assert s.model("gpt-4o-2024-08-06")[0] == "gpt-4o"
    assert s.model("gpt-4o-mini-2024")[0] == "gpt-4o-mini"
    assert s.model("unknown")[0] == "*"
    assert s.model(None)[0] == "*"
    assert s.model("my-model")[1].context_window == 1000


def test_example_config_is_valid_and_documents_every_key() -> None:
    import tomllib

    data = tomllib.loads(EXAMPLE.read_text())
    settings_from_mapping(data)
    defaults = Settings()
    for section in ("server", "upstream", "logging", "pairing", "cache", "compaction", "sessions"):
        documented = set(data.get(section, {}))
        fields = set(vars(getattr(defaults, section)))
        assert fields <= documented, f"[{section}] lacks {sorted(fields - documented)}"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://api.openai.com/v1", "https://api.openai.com/v1"),
        ("https://user:s3cret@gw.example.com:8443/v1", "https://gw.example.com:8443/v1"),
        ("http://token@127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://a:b@c@host/v1?x=@y", "http://host/v1?x=@y"),
        ("not a url", "not a url"),
        ("http://host?x=@y", "http://host?x=@y"),
    ],
)
def test_a_base_urls_credentials_are_not_shown(url: str, shown: str) -> None:
    assert display_url(url) == shown
