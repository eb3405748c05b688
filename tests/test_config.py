"""Configuration: defaults, file, environment and flags, and start-up validation naming the key."""

from __future__ import annotations

import datetime
import itertools
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from proxy.config import (
    DEFAULT_MODELS,
    POSITIVE_KEYS,
    ConfigError,
    Settings,
    configured_model,
    display_url,
    load_settings,
    settings_from_mapping,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "cachegate.example.toml"


def test_the_default_body_limit_takes_a_part_of_the_sdks_chunked_upload() -> None:
    """``uploads.upload_file_chunked`` sends 64 MiB parts, each in a multipart body a few
    hundred bytes larger: the default limit of 64 MiB refused every part of a file past
    64 MiB with a 413, which went through directly."""
    from openai.resources.uploads.uploads import DEFAULT_PART_SIZE

    limit = Settings().server.max_body_bytes
    assert limit >= DEFAULT_PART_SIZE + 64 * 1024  # (the framing: boundaries, part headers)
    example = tomllib.loads(EXAMPLE.read_text())
    assert example["server"]["max_body_bytes"] == limit


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
        # a file's value must have its type (text is read as words and digits only from the
        # environment and flags)
        ({"server": {"port": "18110"}}, "server.port"),
        ({"logging": {"enabled": "off"}}, "logging.enabled"),
        ({"upstream": {"timeout_s": "30"}}, "upstream.timeout_s"),
        ({"upstream": {"timeout_s": float("inf")}}, "upstream.timeout_s"),
        ({"sessions": {"idle_ttl_s": float("nan")}}, "sessions.idle_ttl_s"),
        # zero where it would refuse, or wait forever on, every request
        ({"upstream": {"max_connections": 0}}, "upstream.max_connections"),
        ({"upstream": {"connect_timeout_s": 0}}, "upstream.connect_timeout_s"),
        ({"logging": {"queue_size": 0}}, "logging.queue_size"),
        ({"server": {"max_body_bytes": 0}}, "server.max_body_bytes"),
        ({"sessions": {"max_sessions": 0}}, "sessions.max_sessions"),
        ({"compaction": {"summary_timeout_s": 0}}, "compaction.summary_timeout_s"),
        ({"compaction": {"keep_recent": 0}}, "compaction.keep_recent"),  # every compaction failed
        # "" would listen on every interface, or write the logs into the working directory
        ({"server": {"host": ""}}, "server.host"),
        ({"server": {"host": "  "}}, "server.host"),
        ({"logging": {"dir": ""}}, "logging.dir"),
        # the route is appended to the base URL: a query would swallow it
        ({"upstream": {"base_url": "http://127.0.0.1:8788/v1?x=1"}}, "upstream.base_url"),
        ({"upstream": {"base_url": "http://127.0.0.1:8788/v1#top"}}, "upstream.base_url"),
    ],
)
def test_bad_config_names_the_key(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(data)
    assert needle in str(info.value)


@pytest.mark.parametrize("key", POSITIVE_KEYS)
@pytest.mark.parametrize("value", [-1, 0])
def test_a_key_that_must_be_positive_says_so_for_a_negative_value_too(key: str, value: int) -> None:
    """Told "non-negative" for -1, a user tried 0, which was then refused as not positive."""
    section, name = key.split(".")
    with pytest.raises(ConfigError) as info:
        settings_from_mapping({section: {name: value}})
    assert key in str(info.value) and "positive" in str(info.value)
    assert "negative" not in str(info.value)


def test_a_bounded_key_says_its_bounds_for_a_negative_value() -> None:
    for data, said in (
        ({"compaction": {"trigger_percent": -5}}, "must be in (0, 100], got -5"),
        ({"models": {"gpt-4o": {"context_window": -1}}}, "must be positive, got -1"),
        ({"cache": {"noise_floor_tokens": -1}}, "must not be negative, got -1"),  # 0 is fine
    ):
        with pytest.raises(ConfigError, match=re.escape(said)):
            settings_from_mapping(data)


@pytest.mark.parametrize("key", [k for k in POSITIVE_KEYS if k.endswith("_s")])
def test_a_duration_under_a_millisecond_is_refused(key: str) -> None:
    """``upstream.timeout_s = 1e-300`` was taken: every request a 504, the file not blamed."""
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=re.escape(f"'{key}': must be at least 0.001")):
        settings_from_mapping({section: {name: 1e-300}})
    assert getattr(getattr(settings_from_mapping({section: {name: 0.001}}), section), name)


def test_a_value_of_the_wrong_type_is_shown_as_the_file_spells_it() -> None:
    """``port = true`` was said to be ``True`` (Python's spelling, not TOML's)."""
    for data, said in (
        ({"server": {"port": True}}, "'server.port': expected an integer, got true"),
        ({"upstream": {"timeout_s": False}}, "'upstream.timeout_s': expected a number, got false"),
        ({"upstream": {"base_url": True}}, "'upstream.base_url': expected a string, got true"),
        # (a date or a table by its kind: ``datetime.date(1970, 1, 1)`` and ``{'x': 1}`` are
        # Python's)
        (
            {"server": {"port": datetime.date(1970, 1, 1)}},
            "'server.port': expected an integer, got a date or time",
        ),
        ({"server": {"port": {"x": 1}}}, "'server.port': expected an integer, got a table"),
    ):
        with pytest.raises(ConfigError, match=re.escape(said)):
            settings_from_mapping(data)


def test_a_key_pasted_where_any_value_goes_is_not_shown_in_the_refusal() -> None:
    """``timeout_s = "sk-…"``, ``bodies = "sk-…"``: the refusal quoted the value, a key of a
    known shape with it, on the terminal (only ``base_url`` and ``api_key_env`` hid it)."""
    key = "sk-proj-PASTEDKEYabcdefghij1234567890"
    for data in (
        {"upstream": {"timeout_s": key}},
        {"logging": {"bodies": key}},
        {"server": {"allowed_origins": key}},
    ):
        with pytest.raises(ConfigError) as refused:
            settings_from_mapping(data)
        assert key not in str(refused.value) and "[REDACTED]" in str(refused.value)


def test_a_key_written_where_the_variables_name_goes_is_never_shown_whatever_its_type() -> None:
    """``api_key_env = ["sk-…"]`` (a key, in an array by mistake): the refusal printed the
    key on the terminal, where a key written as a string is never shown."""
    key = "SRVTOKENoaXmI63JozGw82KwD6rQJM9UayY20948VGZiHXJn"
    for value, kind in (([key], "an array"), ({"key": key}, "a table"), (12345678, "an integer")):
        with pytest.raises(ConfigError) as refused:
            settings_from_mapping({"upstream": {"api_key_env": value}})
        said = str(refused.value)
        assert said.endswith(f"'upstream.api_key_env': expected a string, got {kind}"), said
        assert key not in said and "12345678" not in said


def test_an_empty_log_dir_is_fine_when_logging_is_off() -> None:
    settings = settings_from_mapping({"logging": {"enabled": False, "dir": ""}})
    assert settings.logging.enabled is False


def test_an_empty_host_or_log_dir_from_a_flag_is_refused_too() -> None:
    for option, key in (("host", "server.host"), ("log_dir", "logging.dir")):
        with pytest.raises(ConfigError, match=key):
            load_settings(None, {option: ""}, environ={})


@pytest.mark.parametrize("name", ["gpt-4o ", "\tclaude-sonnet-4-5", "", " "])
def test_a_model_table_whose_name_has_white_space_around_it_is_refused(name: str) -> None:
    """``[models."gpt-4o "]`` was taken and never applied (a request names ``gpt-4o``): the
    prices or TTL set there silently did nothing."""
    with pytest.raises(ConfigError, match=r"\[models\..*white space around it, or is empty"):
        settings_from_mapping({"models": {name: {"price_input": 100.0}}})
    kept = settings_from_mapping({"models": {"gpt-4o": {"price_input": 100.0}}})
    assert kept.model("gpt-4o")[1].price_input == 100.0


@pytest.mark.parametrize("name", ["gpt-4o-mini ", "  ", "\tgpt-4o-mini"])
def test_a_summarizer_model_with_white_space_around_it_is_refused(name: str) -> None:
    """It was sent as the summary call's model as it was: a pasted space made every summary a
    model the provider does not know (each compaction fell back to the extractive summary), or
    one cachegate has no prices for (4,911 tokens billed at $0); blank, no model at all."""
    with pytest.raises(ConfigError, match=r"compaction.summarizer_model.*white space around it"):
        settings_from_mapping({"compaction": {"summarizer_model": name}})
    kept = settings_from_mapping({"compaction": {"summarizer_model": "gpt-4o-mini"}})
    assert kept.compaction.summarizer_model == "gpt-4o-mini"
    default = settings_from_mapping({"compaction": {"summarizer_model": ""}})
    assert default.compaction.summarizer_model == ""


def test_an_upstream_of_spaces_is_shown_as_given() -> None:
    """It said ``'' has white space in it``: the spaces, stripped before they were quoted."""
    with pytest.raises(ConfigError, match=r"'   ' has white space or a control character"):
        load_settings(None, {}, environ={"CACHEGATE_UPSTREAM": "   "})


def test_a_config_variable_of_spaces_is_said_so() -> None:
    """It said ``config file not found:  `` (a name of spaces, unseen); an empty one is unset."""
    with pytest.raises(ConfigError, match=r"^CACHEGATE_CONFIG: only spaces; give a TOML file"):
        load_settings(None, {}, environ={"CACHEGATE_CONFIG": "  "})
    assert load_settings(None, {}, environ={"CACHEGATE_CONFIG": ""}).server.port == 8787


def test_a_log_dir_of_spaces_is_refused_with_logging_off_too(tmp_path: Path) -> None:
    """With ``logging.enabled = false`` in the file, ``CACHEGATE_LOG_DIR`` of spaces was taken
    without a word, where the README says a variable of spaces alone is refused."""
    path = tmp_path / "off.toml"
    path.write_text("[logging]\nenabled = false\n")
    for environ, options in (({"CACHEGATE_LOG_DIR": "   "}, {}), ({}, {"log_dir": " "})):
        with pytest.raises(ConfigError, match=r"config key 'logging.dir': only spaces; give a"):
            load_settings(str(path), options, environ=environ)
    assert not load_settings(str(path), {}, environ={"CACHEGATE_LOG_DIR": ""}).logging.enabled


@pytest.mark.parametrize(
    ("variable", "value"),
    [("CACHEGATE_PORT", "8_787"), ("CACHEGATE_PORT", "\u0664\u0662"), ("CACHEGATE_PORT", "0x22")],
)
def test_a_number_from_a_variable_is_ascii_digits(variable: str, value: str) -> None:
    """Python's ``int()`` read ``8_787`` as 8787 and Arabic-Indic digits as theirs: a typo
    taken silently. A number from a variable or a flag is written as TOML writes one."""
    with pytest.raises(ConfigError, match=r"^CACHEGATE_PORT: .*expected an integer, got"):
        load_settings(None, {}, environ={variable: value})
    assert load_settings(None, {}, environ={variable: " 9000 "}).server.port == 9000


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ("[upstream]\ntransport = 1979-05-27\n", "got a date or time"),
        ('[logging]\nfsync = ["line"]\n', "got an array"),
        ("[upstream]\ntransport = 1\n", "got an integer"),
    ],
)
def test_a_choice_of_the_wrong_kind_is_named_as_toml_names_it(
    tmp_path: Path, toml: str, said: str
) -> None:
    """It said ``datetime.date(1979, 5, 27) is not one of 'native', 'httpx'``: Python's words."""
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=r"expected one of '.*', got ") as info:
        load_settings(str(path), environ={})
    assert said in str(info.value) and "datetime" not in str(info.value)


def test_the_fallback_model_table_applies_wherever_the_file_puts_it(tmp_path: Path) -> None:
    for order in (("my-model", "*"), ("*", "my-model")):
        tables = {
            "my-model": '[models."my-model"]\ncontext_window = 8192\n',
            "*": '[models."*"]\nprice_input = 1.0\n',
        }
        path = tmp_path / "cachegate.toml"
        path.write_text("".join(tables[name] for name in order))
        model = load_settings(str(path), environ={}).models["my-model"]
        assert (model.price_input, model.context_window) == (1.0, 8192), order


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "cachegate.toml"
    path.write_bytes("\ufeff[server]\nport = 9999\n".encode())  # as Windows editors save it
    assert load_settings(str(path), environ={}).server.port == 9999


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


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("gpt-4o-2024-08-06", "gpt-4o"),  # a dated snapshot: the same model
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
        ("gpt-5-chat-latest", "gpt-5"),
        ("gpt-5-codex", "gpt-5"),
        ("gpt-5.2-codex", "gpt-5.2"),  # Codex CLI's models: gpt-5.2's prices
        ("gpt-5.1-codex-max", "gpt-5.1-codex-max"),  # (not gpt-5.1, "max" a variant)
        ("gpt-5.3-codex", "gpt-5.3-codex"),
        ("claude-sonnet-4-20250514", "claude-sonnet-4"),
        ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
        ("claude-sonnet-4-0", "claude-sonnet-4-0"),  # Anthropic's alias of claude-sonnet-4
        ("claude-opus-4-0", "claude-opus-4-0"),
        ("o3-mini-2025-01-31", "o3-mini"),
        ("gpt-5.4-nano-2026-03-17", "gpt-5.4-nano"),
        # Variants and versions are other models at other prices: never a longer name's price.
        ("gpt-5-nano", "gpt-5-nano"),
        ("gpt-4.1-nano", "gpt-4.1-nano"),
        ("o4-mini", "o4-mini"),
        ("gpt-5-pro", None),  # not gpt-5 ($1.25 in): $15
        ("o3-pro", None),
        ("gpt-5.9", None),  # not gpt-5: a version of its own
        ("claude-opus-4-9", None),  # not claude-opus-4 ($15 in)
        ("claude-opus-5-5", None),  # not claude-opus-5 (another version)
        ("claude-opus-4-7", "claude-opus-4-7"),  # (its own: $5 in)
        # DeepSeek's V3 models by OpenRouter's names (164K windows): not what deepseek-chat
        # names now (V4 Flash: a 1M window, whose compaction never started for them)
        ("deepseek-chat-v3.1", None),
        ("deepseek/deepseek-chat-v3-0324", None),
        ("deepseek-chat-v3", None),
        # Bedrock's ids of models with no date in their name: the version after it is its own
        ("anthropic.claude-opus-4-6-v1", "claude-opus-4-6"),
        ("us.anthropic.claude-sonnet-4-6-v1:0", "claude-sonnet-4-6"),
        ("claude-opus-4-6-20260205", "claude-opus-4-6"),
        ("gpt-4o-audio-preview", None),
        # a gateway's spelling of a provider's model: its vendor or route prefix, Bedrock's
        # region and vendor, OpenRouter's dotted Claude versions
        ("openai/gpt-4o", "gpt-4o"),
        ("openai/gpt-5.4-mini", "gpt-5.4-mini"),
        ("anthropic/claude-sonnet-4.5", "claude-sonnet-4-5"),
        ("anthropic/claude-opus-4.1", "claude-opus-4-1"),
        ("anthropic/claude-sonnet-4.5:thinking", "claude-sonnet-4-5"),
        ("us.anthropic.claude-sonnet-4-5-20250929-v1:0", "claude-sonnet-4-5"),
        ("bedrock/anthropic.claude-haiku-4-5-20251001-v1:0", "claude-haiku-4-5"),
        ("vertex_ai/claude-opus-4-5@20251101", "claude-opus-4-5"),
        ("anthropic/claude-3.7-sonnet", None),  # no entry for it
        ("openai/gpt-5-pro", None),  # still a variant
        ("my.anthropic.claude-sonnet-4-5", None),  # no Bedrock region
        # OpenRouter's catalog variants are other prices: ":free" costs nothing, ":extended"
        # more; its routing variants are the base model, at its prices and window
        ("deepseek/deepseek-chat:free", None),
        ("openai/gpt-4o:extended", None),
        ("anthropic/claude-sonnet-4.5:nitro", "claude-sonnet-4-5"),
        ("openai/gpt-5:exacto", "gpt-5"),
        ("openai/gpt-4o:floor", "gpt-4o"),
        ("openai/gpt-4o:online", "gpt-4o"),
        ("claude-3-5-haiku-20241022", "claude-3-5-haiku"),
        ("anthropic/claude-3.5-haiku", "claude-3-5-haiku"),
        ("claude-3-haiku-20240307", "claude-3-haiku"),
        # DeepSeek's open weights on another host (NVIDIA NIM's lower case): not its API's
        ("deepseek-ai/deepseek-v4-pro", None),
        ("together_ai/deepseek-ai/deepseek-v4-flash", None),
        ("deepseek/deepseek-v4-pro", "deepseek-v4-pro"),  # (OpenRouter's route to DeepSeek)
    ],
)
def test_a_model_name_is_priced_by_its_own_entry_or_a_snapshot_of_one(
    name: str, entry: str | None
) -> None:
    """Longest-prefix matching priced gpt-5-nano as gpt-5 (25x its price), o3-mini and o3-pro as
    o3, and gpt-5.4 as gpt-5."""
    assert configured_model(name, DEFAULT_MODELS) == entry
    assert Settings().model(name)[0] == (entry or "*")


def test_a_configured_name_wins_over_a_gateways_spelling() -> None:
    # a table named as OpenRouter spells the model past its vendor, dots and all
    dotted = settings_from_mapping({"models": {"claude-3.5-sonnet": {"price_input": 3.0}}})
    assert dotted.model("anthropic/claude-3.5-sonnet")[0] == "claude-3.5-sonnet"
    s = settings_from_mapping({"models": {"openai/gpt-4o": {"price_input": 9.0}}})
    assert s.model("openai/gpt-4o") == ("openai/gpt-4o", s.models["openai/gpt-4o"])
    assert s.model("openai/gpt-4o")[1].price_input == 9.0
    assert s.model("azure/gpt-4o")[0] == "gpt-4o"


def test_a_configured_local_model_covers_its_tags() -> None:
    models = {"qwen2.5-coder": {"context_window": 32768}, "llama3": {"context_window": 8192}}
    s = settings_from_mapping({"models": models})
    assert s.model("qwen2.5-coder:7b")[1].context_window == 32768
    assert s.model("qwen2.5-coder:14b-instruct-q4_K_M")[0] == "qwen2.5-coder"
    assert s.model("llama3.1")[0] == "*"  # another model
    assert s.model("qwen2.5-coder:1.5b")[0] == "qwen2.5-coder"  # a size, after the tag's colon


def test_example_config_is_valid_and_documents_every_key() -> None:
    import tomllib

    data = tomllib.loads(EXAMPLE.read_text())
    settings_from_mapping(data)
    defaults = Settings()
    for section in ("server", "upstream", "logging", "pairing", "cache", "compaction", "sessions"):
        documented = set(data.get(section, {}))
        fields = set(vars(getattr(defaults, section)))
        assert fields <= documented, f"[{section}] lacks {sorted(fields - documented)}"


def test_the_example_config_prices_priority_answers_as_the_built_in_entries_do() -> None:
    """The example sets ``priority_factor = 0`` ("built in"): every model keeps the ratio it has
    without the file (gpt-4o's 1.7 became 2)."""
    from proxy.config import ModelSettings, priority_factor

    example = settings_from_mapping(tomllib.loads(EXAMPLE.read_text()))
    for name in ("gpt-4o", "gpt-4o-2024-08-06", "gpt-4o-mini", "gpt-5", "o4-mini", "my-model"):
        want = priority_factor(name, Settings().model(name)[1])
        assert priority_factor(name, example.model(name)[1]) == want, name
    assert priority_factor("gpt-4o", example.model("gpt-4o")[1]) == 1.7
    assert priority_factor("gpt-4o-2024-08-06", ModelSettings()) == 1.7  # a table of one's own
    assert priority_factor("house", ModelSettings(priority_factor=3)) == 3
    assert priority_factor("house", ModelSettings()) == 0.0  # (cache.tier_factor's 2 then)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://api.openai.com/v1", "https://api.openai.com/v1"),
        ("https://user:s3cret@gw.example.com:8443/v1", "https://gw.example.com:8443/v1"),
        ("http://token@127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://a:b@c@host/v1?x=@y", "http://host/v1"),  # (no query shown: it may hold a key)
        ("not a url", "not a url"),
        ("http://host?x=@y", "http://host"),
        ("https://api.example.com/v1?key=sk-QUERYSECRET#f", "https://api.example.com/v1"),
        ("http://u:Secr3t@[::1/v1", "http://[::1/v1"),  # unparseable: user info still out
        ("https://user:p ss@[::1/v1", "https://[::1/v1"),  # (a space in it: none of it shown)
        ("https:/user:pa/ss@host/v1", "https:/host/v1"),  # a "/" in it, the scheme mistyped
        ("user:pa/ss@api.example.com/v1", "api.example.com/v1"),
        ("http//user:pa?ss@host/v1", "http//host/v1"),
        (
            "https:/api.example.com:8443/v1/models/claude@2024",
            "https:/api.example.com:8443/v1/models/2024",
        ),
        ("localhost:8080/v1/publishers/x@2024", "localhost:8080/v1/publishers/2024"),
        ("https:/[::1]:8080/v1/models/x@2024", "https:/[::1]:8080/v1/models/2024"),
        ("https:/user:p@ss@host/v1", "https:/host/v1"),  # an "@" in the password
        ("user:p@ss@api.example.com/v1", "api.example.com/v1"),
        ("https:/admin:2024/s3cret@host/v1", "https:/host/v1"),  # digits, then a "/"
        ("admin:1234/5678@api.example.com/v1", "api.example.com/v1"),
        ("https:/sk-ab/cd@host/v1", "https:/host/v1"),  # a token alone
        ("user:s3cret@api.example.com/v1", "api.example.com/v1"),  # no scheme
        ("https:/user:s3cret@host/v1", "https:/host/v1"),
        ("http//user:s3cret@host/v1", "http//host/v1"),
    ],
)
def test_a_base_urls_credentials_are_not_shown(url: str, shown: str) -> None:
    assert display_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "htps://admin:Sup3rSecretPw@api.example.com/v1",
        "http://admin:Sup3rSecretPw@[::1/v1",
        "https:/admin:Sup3rSecretPw@api.example.com/v1",
        "admin:Sup3rSecretPw@api.example.com/v1",
    ],
)
def test_a_mistyped_base_url_is_refused_without_showing_its_password(url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        settings_from_mapping({"upstream": {"base_url": url}})
    assert "Sup3rSecretPw" not in str(refused.value)
    assert "upstream.base_url" in str(refused.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("host", "http://bob:Sup3rSecretPw@127.0.0.1:8787/v1"),
        ("allowed_origins", "http://bob:Sup3rSecretPw@127.0.0.1:8787"),
        ("allowed_hosts", "http://bob:Sup3rSecretPw@gateway.internal"),
        ("allowed_origins", ["http://bob:Sup3rSecretPw@127.0.0.1:8787"]),
        ("allowed_hosts", "https://bob:Sup3r@SecretPw@gateway.internal"),  # (an "@" in it)
        ("allowed_hosts", "bob:Sup3rSecretPw@gateway.internal"),  # (no scheme)
        ("allowed_origins", "https://bob:Sup3r/SecretPw@gateway.internal"),  # (a "/" in it)
    ],
)
def test_a_url_with_a_password_in_another_setting_is_refused_without_showing_it(
    key: str, value: Any
) -> None:
    """A base URL pasted in the listening address's or an allow-list's place: the refusal
    printed it whole, its password with it (as upstream.base_url's never does)."""
    with pytest.raises(ConfigError) as refused:
        settings_from_mapping({"server": {key: value}})
    assert "Sup3rSecretPw" not in str(refused.value)
    assert f"server.{key}" in str(refused.value)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (["https://bob:Sup3rSecretPw@llm.internal.example/v1"], "expected a string, got an"),
        ("sk-proj-Ab3dEf6hIj9kL0mN1oP2qR3sT4uV5wX6yZ7aB8cD9eSup3rSecretPw", "no URL but a 63"),
        ("Xk9fQ2mZ7LpA4vB8nR3tY6wSup3rSecretPw", "no URL but a 36-character token"),  # Mistral's
        ("Xk9fQ2mZ7LpA4vB8nR3tY6wSup3rSecretPw ", "no URL but a 36-character token"),  # a space
        ('"Xk9fQ2mZ7LpA4vB8nR3tY6wSup3rSecretPw"', "no URL but a 36-character token"),  # quoted
        ("0123456789abcdef0123456789abcdef.Sup3rSecretPwAbC", "no URL but a 49-character"),
        ('" Xk9fQ2mZ7LpA4vB8nR3tY6wSup3rSecretPw"', "no URL but a 36-character"),  # (inside)
        ("Xk9fQ2mZ7LpA4vB8nR3tY6wSup3rSecretPw.", "no URL but a 36-character"),  # a full stop
        ("\u201cXk9fQ2mZ7LpA4vB8nR3tY6wSup3rSecretPw\u201d", "no URL but a 36"),  # typographic
        ("`Xk9fQ2mZ7LpA4vB8nR3tY6wSup3rSecretPw`,", "no URL but a 36"),  # Markdown, a comma
        ("\u00a0Xk9fQ2mZ7LpA4vB8nR3tY6wSup3rSecretPw\u2009", "no URL but a 36"),  # from a page
        ("pplx-Ab3dEf6hIj9kL0mN1oP2qR3sT4uV5wX6yZ7aB8cSup3rSecretPw", "no URL but a"),  # hyphens
        ("api.example.com/v1?k=sk-proj-Ab3dEf6hIj9kL0mN1oP2qR3sT4uSup3rSecretPw", "must start"),
    ],
)
def test_a_base_url_in_an_array_or_a_key_in_its_place_is_refused_without_showing_it(
    value: Any, said: str
) -> None:
    """Written in an array by mistake, the URL was shown whole with its password; a key pasted
    into the setting was printed as the URL it is not."""
    with pytest.raises(ConfigError) as refused:
        settings_from_mapping({"upstream": {"base_url": value}})
    assert "Sup3rSecretPw" not in str(refused.value) and said in str(refused.value)
    assert "upstream.base_url" in str(refused.value)


@pytest.mark.parametrize(
    "host",
    [
        "generativelanguage.googleapis.com/v1",
        "gateway-internal-prod.corp-network-zone1",  # (labels of 16 characters and more)
        "llmgatewayinternalprod",  # an intranet name of one label
        "vllm-h100-node-07",  # digits in it
        "llm-gateway-prod-01",
        "llama-3-1-70b-instruct-predictor-00001",  # a long Kubernetes service name
    ],
)
def test_a_host_name_without_its_scheme_is_shown_not_taken_for_a_key(host: str) -> None:
    """A key is refused by its length, unshown; a host name is no key: the user sees what
    they wrote, to fix it."""
    with pytest.raises(ConfigError) as refused:
        settings_from_mapping({"upstream": {"base_url": host}})
    assert f"'{host}' must start with http" in str(refused.value)


def test_a_base_url_with_a_key_in_its_query_is_refused_without_showing_it() -> None:
    """Some providers take their key as ``?key=…``: the error printed the whole URL."""
    with pytest.raises(ConfigError) as refused:
        settings_from_mapping({"upstream": {"base_url": "https://api.example.com/v1?key=sk-QS1"}})
    assert "sk-QS1" not in str(refused.value) and "has a query" in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/v1 ",
        " http://127.0.0.1:9/v1",
        "https://exa mple.com/v1",
        "http://h/v1\r\nX: 1",
    ],
)
def test_a_base_url_with_white_space_in_it_is_refused(url: str) -> None:
    """A space pasted with the URL went into every request line: each request a 400 from the
    provider that said nothing of why."""
    with pytest.raises(ConfigError, match="white space or a control character"):
        settings_from_mapping({"upstream": {"base_url": url}})


@pytest.mark.parametrize(
    "host", ["localhost:8787", "[::1]:8787", "http://localhost", "127.0.0.1/", "[localhost]"]
)
def test_a_host_with_a_port_or_a_scheme_is_refused_naming_its_source(host: str) -> None:
    """``--host localhost:8787`` failed once listening, exit 1, with "cannot listen on
    [localhost:8787]:8787: Name or service not known", naming no setting."""
    for given in ({"options": {"host": host}}, {"environ": {"CACHEGATE_HOST": host}}):
        with pytest.raises(ConfigError) as refused:
            load_settings(
                None,
                given.get("options"),  # type: ignore[arg-type]
                environ=given.get("environ", {}),  # type: ignore[arg-type]
            )
        source = "--host" if "options" in given else "CACHEGATE_HOST"
        assert str(refused.value) == (
            f"{source}: config key 'server.host': {host!r} is not an address: give the address"
            " alone, without a scheme or a port (the port is server.port, --port)"
        )
    for fine in ("::1", "[::1]", "::", "0.0.0.0", "localhost", "fd00::1"):
        assert load_settings(None, {"host": fine}, environ={}).server.host == fine


def test_text_values_are_read_from_the_environment_and_flags_only(tmp_path: Path) -> None:
    env = {"CACHEGATE_PORT": "18110", "CACHEGATE_STRICT_PAIRING": "on"}
    s = load_settings(None, environ=env)
    assert (s.server.port, s.pairing.strict) == (18110, True)
    assert load_settings(None, {"port": "18111"}, environ={}).server.port == 18111
    config = tmp_path / "c.toml"
    config.write_text('[server]\nport = "18110"\n')
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_settings(str(config), environ={})


def test_a_log_directory_under_the_home_directory_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dir = "~/logs"`` made a directory named ``~`` in the working directory (the shell
    expands a flag's ``~``, not a file's or a variable's)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    f = tmp_path / "c.toml"
    f.write_text('[logging]\ndir = "~/cg-logs"\n')
    assert load_settings(str(f), {}, environ={}).logging.dir == str(tmp_path / "cg-logs")
    from_env = load_settings(None, {}, environ={"CACHEGATE_LOG_DIR": "~/other"})
    assert from_env.logging.dir == str(tmp_path / "other")


def test_a_mistyped_cachegate_variable_is_named_with_the_one_meant() -> None:
    """``CACHEGATE_LOGDIR=/tmp/x`` was ignored without a word (a file's unknown key is refused
    with a suggestion)."""
    from proxy.config import unknown_variable_notes

    env = {
        "CACHEGATE_LOGDIR": "/tmp/x",
        "CACHEGATE_PROT": "9000",
        "CACHEGATE_PORT": "9000",
        "CACHEGATE_CONFIG": "c.toml",
        "CACHEGATE_WHATEVER_ELSE": "1",
        "CACHEGATE_EMPTY": "",  # an empty variable counts as unset
        "CACHEGATE_upstream": "http://u:pw@x/v1",  # (the value is never said)
        "HOME": "/root",
    }
    assert unknown_variable_notes(env) == [
        "CACHEGATE_LOGDIR is set, but cachegate reads no such variable"
        " (did you mean CACHEGATE_LOG_DIR?)",
        "CACHEGATE_PROT is set, but cachegate reads no such variable"
        " (did you mean CACHEGATE_PORT?)",
        "CACHEGATE_WHATEVER_ELSE is set, but cachegate reads no such variable",
        "CACHEGATE_upstream is set, but cachegate reads no such variable"
        " (did you mean CACHEGATE_UPSTREAM?)",
    ]
    known = ("CONFIG", "HOST", "PORT", "UPSTREAM", "LOG_DIR", "STRICT_PAIRING")
    assert unknown_variable_notes({f"CACHEGATE_{name}": "x" for name in known}) == []


def test_a_config_key_written_as_a_variable_is_named_with_what_sets_it() -> None:
    """Names built from the keys' table (``server.port`` as ``CACHEGATE_SERVER_PORT``) got no
    hint, or a wrong one: ``CACHEGATE_UPSTREAM_TIMEOUT_S`` was told to be
    ``CACHEGATE_UPSTREAM``, which then refused ``1200`` as no URL."""
    from proxy.config import unknown_variable_notes

    def hint(name: str) -> str:
        (note,) = unknown_variable_notes({name: "1"})
        assert note.startswith(f"{name} is set, but cachegate reads no such variable")
        return note.removeprefix(f"{name} is set, but cachegate reads no such variable")

    assert hint("CACHEGATE_SERVER_PORT") == " (did you mean CACHEGATE_PORT? it sets server.port)"
    assert hint("CACHEGATE_PAIRING_STRICT") == (
        " (did you mean CACHEGATE_STRICT_PAIRING? it sets pairing.strict)"
    )
    assert hint("CACHEGATE_UPSTREAM_TIMEOUT_S") == (
        " (upstream.timeout_s has no variable: set timeout_s under [upstream] in the config"
        " file, --config)"
    )
    assert hint("CACHEGATE_TIMEOUT_S") == hint("CACHEGATE_UPSTREAM_TIMEOUT_S")
    assert hint("CACHEGATE_API_KEY") == (
        " (the key cachegate adds is read from OPENAI_API_KEY, or the variable"
        " upstream.api_key_env names)"
    )


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/v1", "http://127.0.0.1:80a/v1"])
def test_an_upstream_url_with_no_usable_port_is_refused_at_start(url: str) -> None:
    """It was accepted, and every request then got a 502 "invalid answer (ValueError)"."""
    with pytest.raises(ConfigError) as refused:
        load_settings(None, {"upstream": url}, environ={})
    assert str(refused.value) == (
        f"--upstream: config key 'upstream.base_url': '{url}': its port is not a number from 1"
        " to 65535"
    )


@pytest.mark.parametrize(
    "url",
    [
        "https://user:s3cr/tSecretword@gw.example.com/v1",  # read as host "user", port "s3cr"
        "http://admin:2024/Secretword@gw.example.com/v1",  # read as port 2024: it passed
        "https://user:pa?Secretword@gw.example.com/v1",
        "https://u:pa#Secretword@h/v1",
        "https://sk-proj-abc/Secretword@h/v1",  # a key as the user name, with a "/"
    ],
)
def test_a_password_the_url_cannot_hold_as_written_is_refused_and_not_shown(url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        settings_from_mapping({"upstream": {"base_url": url}})
    message = str(refused.value)
    assert "Secretword" not in message and "s3cr" not in message and "2024" not in message
    assert message == (
        "config key 'upstream.base_url': has an '@' after its host; a user name or password in"
        " the URL must have / ? # @ percent-encoded (%2F %3F %23 %40), and an '@' in its path"
        " too (%40)"
    )
    encoded = "https://user:s3cr%2FtSecretword@gw.example.com/v1"
    assert settings_from_mapping({"upstream": {"base_url": encoded}}).upstream.base_url == encoded


def test_a_flag_or_variable_mends_a_value_of_the_file_it_overrides(tmp_path: Path) -> None:
    """defaults < file < variables < flags: a file's unusable value that a flag or variable
    replaces no longer stops ``serve`` (the file was checked alone, before them)."""
    config = tmp_path / "c.toml"
    config.write_text('[server]\nport = 0\n[logging]\ndir = ""\n')
    settings = load_settings(
        str(config), {"port": "18112"}, environ={"CACHEGATE_LOG_DIR": str(tmp_path / "logs")}
    )
    assert (settings.server.port, settings.logging.dir) == (18112, str(tmp_path / "logs"))
    # not mended: the file's value is refused, naming the file
    with pytest.raises(ConfigError) as refused:
        load_settings(str(config), {"port": "18112"}, environ={})
    assert str(refused.value) == (
        "config key 'logging.dir': empty; give a directory (or set logging.enabled = false)"
        f" (config file {config})"
    )
    # a flag's own unusable value is named by the flag
    with pytest.raises(ConfigError) as refused:
        load_settings(None, {"port": "0"}, environ={})
    assert (
        str(refused.value) == "--port: config key 'server.port': 0 is not a TCP port (1 to 65535)"
    )


def test_a_flag_mends_a_variable_that_cannot_be_read(tmp_path: Path) -> None:
    """A stale ``CACHEGATE_PORT=abc`` (a Docker ``environment:`` entry) stopped ``serve
    --port 18113`` with the variable's error: a flag replaces a variable, as a file's value."""
    env = {"CACHEGATE_PORT": "abc", "CACHEGATE_STRICT_PAIRING": "maybe"}
    settings = load_settings(None, {"port": "18113", "strict_pairing": True}, environ=env)
    assert (settings.server.port, settings.pairing.strict) == (18113, True)
    with pytest.raises(ConfigError) as refused:  # (no flag for it: the variable is named)
        load_settings(None, {"port": "18113"}, environ=env)
    assert str(refused.value).startswith("CACHEGATE_STRICT_PAIRING: config key")


def test_a_true_or_false_word_is_read_past_white_space_as_a_number_is() -> None:
    """``CACHEGATE_PORT=' 18114 '`` was read (Python's int() strips it), and
    ``CACHEGATE_STRICT_PAIRING='true '`` (a .env file's trailing space) refused."""
    env = {"CACHEGATE_PORT": " 18114 ", "CACHEGATE_STRICT_PAIRING": "true "}
    settings = load_settings(None, None, environ=env)
    assert (settings.server.port, settings.pairing.strict) == (18114, True)


def test_a_key_pasted_as_the_host_is_refused_without_being_shown() -> None:
    """A key in ``server.host`` reached the bind error in clear ("cannot listen on
    sk-proj-…:8787: Name or service not known"), on stderr, journald's and Docker's logs."""
    for key, given in itertools.product(
        ("sk-proj-abcDEF1234567890abcdefXYZ1234567890", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
        ({"options": {"host": "@"}}, {"environ": {"CACHEGATE_HOST": "@"}}),
    ):
        given = {k: {n: key for n in v} for k, v in given.items()}
        with pytest.raises(ConfigError) as refused:
            load_settings(
                None,
                given.get("options"),  # type: ignore[arg-type]
                environ=given.get("environ", {}),  # type: ignore[arg-type]
            )
        assert key not in str(refused.value)
        assert f"is no address but a {len(key)}-character token" in str(refused.value)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        # tomllib's own ValueError and RecursionError: tracebacks and exit 1
        ("a = " + "9" * 5000, "a value cannot be read (Exceeds the limit (4300 digits)"),
        ("a = " + "[" * 5000 + "]" * 5000, "a value is nested too deep to read"),
    ],
    ids=["5000-digits", "5000-deep"],
)
def test_a_file_tomllib_cannot_hold_is_refused_naming_it(
    tmp_path: Path, text: str, said: str
) -> None:
    message = _refusal_of_file(tmp_path, text)
    assert message.startswith(f"config file {tmp_path / 'c.toml'}: {said}")
    assert "sys.set_int_max_str_digits" not in message  # (Python's advice, not ours)


def test_text_written_without_quotes_is_refused_with_how_to_write_it(tmp_path: Path) -> None:
    """``host = 127.0.0.1`` was refused in tomllib's words alone (``Expected newline or end of
    document after a statement``), which say nothing of the quotes text needs in TOML."""
    for line, quoted in (
        ("host = 127.0.0.1", 'host = "127.0.0.1"'),
        (
            "base_url = http://localhost:11434/v1  # ollama",
            'base_url = "http://localhost:11434/v1"',
        ),
        ("dir = ~/logs", 'dir = "~/logs"'),
    ):
        message = _refusal_of_file(tmp_path, "[server]\n" + line)
        assert message.endswith(f" (text goes in quotes: {quoted})"), message
    # a key whose value is no text gets no such advice
    assert "quotes" not in _refusal_of_file(tmp_path, "[server]\nport = 8787x")
    assert "quotes" not in _refusal_of_file(tmp_path, '[server]\nhost = "a" b')


def _refusal_of_file(tmp_path: Path, text: str) -> str:
    """What loading a config file that holds ``text`` is refused with."""
    config = tmp_path / "c.toml"
    config.write_text(text + "\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(str(config), environ={})
    return str(refused.value)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        # an integer past a double's range, which TOML reads (up to 4,300 digits): a traceback
        # (OverflowError) and exit 1 for a duration or a price
        ("[upstream]\ntimeout_s = 1" + "0" * 400, "must be a finite positive number"),
        ('[models."m"]\nprice_input = 1' + "0" * 400, "must be a finite non-negative number"),
        ("[compaction]\ntrigger_percent = 1" + "0" * 400, "must be in (0, 100]"),
        # an integer key took it, and compaction then failed every request (OverflowError)
        ('[models."m"]\ncontext_window = 1' + "0" * 400, "must be at most 9223372036854775807"),
        ("[server]\nmax_body_bytes = 1" + "0" * 30, "must be at most 9223372036854775807"),
        # a key that takes a fraction took an integer past 64 bits, as the README says it may not
        ("[upstream]\ntimeout_s = 1" + "0" * 30, "must be at most 9223372036854775807"),
        ("[logging]\nmax_total_mb = 1" + "0" * 20, "must be at most 9223372036854775807"),
    ],
    ids=["duration", "price", "percent", "context-window", "body-size", "duration-64", "size-64"],
)
def test_a_number_too_large_for_any_use_is_refused_naming_the_key(
    tmp_path: Path, text: str, said: str
) -> None:
    message = _refusal_of_file(tmp_path, text)
    key = ".".join(part.strip("[]") for part in text.split(" = ")[0].split("\n"))
    assert message.startswith(f"config key '{key}': {said}, got an integer of ")
    assert "0000000000" not in message  # its length, not its 400 digits


def test_the_largest_integer_a_key_takes_is_a_64_bit_one() -> None:
    top = 2**63 - 1
    settings = settings_from_mapping({"models": {"m": {"context_window": top}}})
    assert settings.models["m"].context_window == top


def test_values_no_socket_or_path_can_take_are_refused_naming_their_source(
    tmp_path: Path,
) -> None:
    """A host with a space from a .env file failed once listening, naming no setting; a log
    directory with a NUL, with a traceback; ``--config ""`` (an unset shell variable) was
    ignored where ``--port ""`` is refused."""
    cases = [
        (
            {"environ": {"CACHEGATE_HOST": "127.0.0.1 "}},
            "CACHEGATE_HOST: config key 'server.host': '127.0.0.1 ' has white space or a control"
            " character in it (a space pasted with it?)",
        ),
        (
            {"options": {"host": "127.0.0.1\x00x"}},
            "--host: config key 'server.host': '127.0.0.1\\x00x' has white space or a control"
            " character in it (a space pasted with it?)",
        ),
        (
            {"options": {"log_dir": "/tmp/a\x00b"}},
            "--log-dir: config key 'logging.dir': '/tmp/a\\x00b' has a NUL character in it",
        ),
        ({"config_file": ""}, "--config: empty; give a TOML file, or leave the flag out"),
        (
            {"options": {"port": "-1"}},
            "--port: config key 'server.port': must be a TCP port, 1 to 65535, got -1",
        ),
    ]
    for given, said in cases:
        with pytest.raises(ConfigError) as refused:
            load_settings(
                given.get("config_file"),  # type: ignore[arg-type]
                given.get("options"),  # type: ignore[arg-type]
                environ=given.get("environ", {}),  # type: ignore[arg-type]
            )
        assert str(refused.value) == said


def test_an_upstream_scheme_in_upper_case_is_the_same_url() -> None:
    """``HTTPS://…`` was refused as not starting with https://."""
    settings = load_settings(None, {"upstream": "HTTPS://api.example.com/v1"}, environ={})
    assert settings.upstream.base_url == "https://api.example.com/v1"
    settings = settings_from_mapping({"upstream": {"base_url": "Http://127.0.0.1:9/v1"}})
    assert settings.upstream.base_url == "http://127.0.0.1:9/v1"


@pytest.mark.parametrize(
    ("data", "said"),
    [
        # TOML reads [models.gpt-4.1] as table "1" in table "gpt-4"
        (
            {"models": {"gpt-4": {"1": {"price_input": 2.0}}}},
            """unknown config key 'models."gpt-4".1' (quote a model name with a dot in it:"""
            """ [models."gpt-4.1"])""",
        ),
        (
            {"server": {"timeout_s": 5}},
            "unknown config key 'server.timeout_s' (it goes under [upstream])",
        ),
        (
            {"server": {"price_input": 5}},
            """unknown config key 'server.price_input' (it goes under [models."<model name>"])""",
        ),
        (
            {"upstream": {"time_out_s": 5}},  # a misspelling keeps its own hint
            "unknown config key 'upstream.time_out_s' (did you mean 'timeout_s'?)",
        ),
        # another table's key exactly, where a spelling is close too (max_total_mb, transport)
        (
            {"logging": {"max_memory_mb": 5}},
            "unknown config key 'logging.max_memory_mb' (it goes under [sessions])",
        ),
        (
            {"upstream": {"port": 5}},
            "unknown config key 'upstream.port' (it goes under [server])",
        ),
        # the key itself in the file: "did you mean 'api_key_env'?", followed, put the key in
        # the place of a variable's name, and requests went without one
        (
            {"upstream": {"api_key": "sk-proj-abcdefghijklmnop1234567890ABCDEF"}},
            "unknown config key 'upstream.api_key' (cachegate reads no key from its config"
            " file: put the key in OPENAI_API_KEY, or in another variable named by"
            " upstream.api_key_env)",
        ),
        (
            {"models": {"gpt-4": {"1": {"mini": {"price_input": 2.0}}}}},
            """unknown config key 'models."gpt-4".1' (quote a model name with a dot in it:"""
            """ [models."gpt-4.1.mini"])""",
        ),
        # a table inside a model's own table ([models."gpt-4o".extra] under its prices): the
        # name was quoted, and the advice to quote it was all that was said
        (
            {"models": {"gpt-4o": {"price_input": 2.0, "extra": {"x": 1}}}},
            """unknown config key 'models."gpt-4o".extra' (a model's table holds no table;"""
            """ quote a model name with a dot in it whole: [models."gpt-4o.extra"])""",
        ),
    ],
)
def test_a_key_in_the_wrong_table_says_where_it_goes(data: dict, said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        settings_from_mapping(data)
    assert str(refused.value) == said


def test_an_error_in_the_config_file_names_the_file(tmp_path: Path) -> None:
    """In the Docker image the file comes from $CACHEGATE_CONFIG, which the user may not know
    was read."""
    config = tmp_path / "c.toml"
    config.write_text('[server]\nport = "8787"\n')
    with pytest.raises(ConfigError) as refused:
        load_settings(str(config), environ={})
    assert str(refused.value) == (
        f"config key 'server.port': expected an integer, got '8787' (config file {config})"
    )


def test_a_fraction_key_refuses_a_number_past_64_bits_written_as_a_float() -> None:
    """``timeout_s = 2**63`` was refused but ``1e300`` (the same typo, in a float's notation)
    was taken, where the README says a number past 2^63-1 stops ``serve``."""
    for given in (1e300, 9.3e18):
        with pytest.raises(ConfigError) as refused:
            settings_from_mapping({"upstream": {"timeout_s": given}})
        said = f"config key 'upstream.timeout_s': must be at most {2**63 - 1}, got {given!r}"
        assert str(refused.value) == said
    top = settings_from_mapping({"upstream": {"timeout_s": 2**63 - 1}})
    assert top.upstream.timeout_s == float(2**63 - 1)  # (taken, as an integer key takes it)
    assert settings_from_mapping({"upstream": {"timeout_s": 1e18}}).upstream.timeout_s == 1e18


def test_the_readmes_table_of_built_in_models_is_the_one_cachegate_prices_by() -> None:
    """Each row of the README's built-in table (USD a million tokens) holds what the entries of
    its names say, and every built-in entry has a row: a price changed in one place only
    misleads every cost figure a reader checks against the manual."""
    from proxy.config import DEFAULT_MODELS

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    head = "| model | context_window | cache_ttl_s | input | cached input | cache write | output |"
    rows = readme[readme.index(head) :].split("\n\n", 1)[0].splitlines()[2:]
    seen: set[str] = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        window, ttl, *prices, dialect, long = cells[1:]
        for name in names:
            entry = DEFAULT_MODELS[name]
            assert entry.context_window == int(window), name
            if name != "*":
                assert entry.cache_ttl_s == int(ttl), name
            listed = (entry.price_input, entry.price_cached_input, entry.price_cache_write)
            assert (*listed, entry.price_output) == tuple(float(p) for p in prices), name
            assert entry.dialect == dialect, name
            assert entry.long_context_tokens == (0 if long == "—" else int(long)), name
            seen.add(name)
    assert seen == set(DEFAULT_MODELS)


def test_a_bedrock_version_after_a_users_table_name_is_still_that_model() -> None:
    """A "v" version after a name is another model (DeepSeek's V3 names were read as
    ``deepseek-chat``, now V4 Flash's), but not Bedrock's own suffix: a table written for
    ``meta.llama3-1-70b-instruct`` prices ``meta.llama3-1-70b-instruct-v1:0``."""
    table = {"price_input": 0.72, "price_output": 0.72}
    settings = settings_from_mapping({"models": {"meta.llama3-1-70b-instruct": table}})
    for sent in ("meta.llama3-1-70b-instruct-v1:0", "meta.llama3-1-70b-instruct-v1"):
        assert settings.model(sent)[0] == "meta.llama3-1-70b-instruct", sent
    assert settings.model("meta.llama3-1-70b-instruct-v2")[0] == "*"
    # a cross-region profile of it is it too, as Claude's are (it went to "*": $0)
    for sent in ("us.meta.llama3-1-70b-instruct-v1:0", "apac.meta.llama3-1-70b-instruct-v1:0"):
        assert settings.model(sent)[0] == "meta.llama3-1-70b-instruct", sent
    assert settings.model("my.meta.llama3-1-70b-instruct-v1:0")[0] == "*"  # no region
    assert settings.model("us.meta.llama3-1-70b-instruct-v2:0")[0] == "*"
    # ... whatever tag follows the other version, and whatever shorter table is there
    tables = {"deepseek-coder": table, "deepseek": table, "deepseek-chat": table}
    settings = settings_from_mapping({"models": tables})
    for sent in ("deepseek-coder-v2", "deepseek-coder-v2:16b", "deepseek-chat-v3:latest"):
        assert settings.model(sent)[0] == "*", sent
