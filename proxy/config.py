"""Settings: built-in defaults, overridden by a TOML file, overridden by CACHEGATE_* variables and flags.

Everything is validated when it is loaded, so a typo or a bad value stops start-up with a message
naming the key instead of failing at the first request.
"""

from __future__ import annotations

import datetime
import difflib
import functools
import ipaddress
import json
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Final, Literal, get_args, get_origin
from urllib.parse import urlsplit, urlunsplit

from proxy.browser import check_host_entry, check_origin_entry


class ConfigError(ValueError):
    """A configuration key is unknown or its value is unusable; the message names the key
    (``key``, when one value is at fault: who set it is then said with it)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __str__(self) -> str:
        # A key pasted where a value goes (``timeout_s = "sk-…"``) is quoted by the message:
        # said on the terminal without it, as every error cachegate says.
        from proxy.redact import redact_text

        return redact_text(super().__str__())


# Keys whose 0 would refuse, or wait forever on, every request: a negative value is refused as
# not positive (not as "negative", which would have its user try 0 next).
MIN_SECONDS: Final = 0.001  # the least a duration among ``POSITIVE_KEYS`` may be
# The largest integer a key takes, a 64-bit one: beyond it a value overflowed a float or a C call.
MAX_INT: Final = 2**63 - 1
POSITIVE_KEYS: Final = (
    "upstream.timeout_s",
    "upstream.connect_timeout_s",
    "upstream.max_connections",
    "server.max_body_bytes",
    "logging.queue_size",
    "compaction.summary_timeout_s",
    "compaction.keep_recent",  # (the latest message)
    "sessions.max_sessions",
    "sessions.idle_ttl_s",
)


def _not_negative(key: str, finite: bool = False) -> str:
    """The rule a key's value breaks when it is negative (or, with ``finite``, not finite): its
    own where 0 is no better, so that the user is not sent from one refusal to the next."""
    if key in POSITIVE_KEYS or key.endswith(".context_window"):
        return "must be a finite positive number" if finite else "must be positive"
    if key == "server.port":
        return "must be a TCP port, 1 to 65535"
    if key == "compaction.trigger_percent":
        return "must be in (0, 100]"
    return "must be a finite non-negative number" if finite else "must not be negative"


def _bad(key: str, problem: str) -> ConfigError:
    return ConfigError(f"config key '{key}': {problem}", key)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8787
    # 65 MiB: the openai SDK's chunked upload sends 64 MiB parts, in a multipart body a few
    # hundred bytes larger (a 64 MiB limit refused each part of a file past 64 MiB)
    max_body_bytes: int = 65 * 1024 * 1024
    # Web pages (by origin, comma-separated) allowed to call cachegate besides loopback ones.
    allowed_origins: str = ""
    # Host names (comma-separated) accepted besides loopback ones while bound to loopback.
    allowed_hosts: str = ""


@dataclass(frozen=True)
class UpstreamSettings:
    base_url: str = "https://api.openai.com/v1"
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_connections: int = 1000
    max_keepalive_connections: int = 200
    request_usage: bool = True  # ask for stream usage when the client did not, and hide that event
    transport: Literal["native", "httpx"] = "native"  # the upstream connection pool


@dataclass(frozen=True)
class LoggingSettings:
    enabled: bool = True
    dir: str = "./cachegate-logs"
    bodies: Literal["full", "metadata"] = "full"
    fsync: Literal["none", "line", "interval"] = "none"
    redact_secrets: bool = True
    max_age_days: float = 0.0  # 0: keep forever
    max_total_mb: float = 0.0  # 0: no size cap
    queue_size: int = 10000


@dataclass(frozen=True)
class PairingSettings:
    repair: bool = True
    strict: bool = False
    orphan_policy: Literal["downgrade", "drop"] = "downgrade"
    interrupted_note: str = ""  # empty: the built-in note


@dataclass(frozen=True)
class CacheSettings:
    noise_floor_tokens: int = 1024


@dataclass(frozen=True)
class CompactionSettings:
    enabled: bool = False
    trigger_percent: float = 75.0
    keep_recent: int = 8
    max_anchor_chars: int = 40000
    summarizer_model: str = ""
    summary_timeout_s: float = 120.0


@dataclass(frozen=True)
class SessionSettings:
    max_sessions: int = 10000
    max_memory_mb: int = 512  # estimated memory sessions hold, parsed bodies included; 0: none
    idle_ttl_s: float = 6 * 3600.0  # must outlive the longest cache TTL it judges


@dataclass(frozen=True)
class ModelSettings:
    context_window: int = 128000
    cache_ttl_s: float = 0.0  # 0: the provider's documented default, by model family (cache.py)
    price_input: float = 0.0
    price_cached_input: float = 0.0
    price_cache_write: float = 0.0
    price_output: float = 0.0
    dialect: Literal["openai", "deepseek", "anthropic", "mistral", "gemini"] = "openai"
    cache_min_tokens: int = 0  # the shortest prefix the provider caches (0: no minimum of its own)
    # what an answer billed at OpenAI's "priority" processing tier costs, as a multiple of the
    # prices above (0: the built-in model's documented ratio, else 2); "flex" costs half
    priority_factor: float = 0.0
    # a prompt of more than this many tokens is billed at the model's long-context rates: its
    # input, cached input and cache writes at twice the prices above, its output at 1.5 times
    # (Claude Sonnet 4 and 4.5 past 200K, GPT-5.4 past 272K); 0: none
    long_context_tokens: int = 0
    # an audio model's audio input and output tokens (0: priced as text)
    price_audio_input: float = 0.0
    price_audio_output: float = 0.0


# Public list prices (USD per 1M tokens) as documented by the providers; override in the config file.
_DEEPSEEK_V4_FLASH = ModelSettings(1000000, 3600, 0.14, 0.0028, 0.0, 0.28, "deepseek")
_CLAUDE_SONNET = ModelSettings(
    200000, 300, 3.00, 0.30, 3.75, 15.00, "anthropic", long_context_tokens=200000
)
_CLAUDE_OPUS_4 = ModelSettings(200000, 300, 15.00, 1.50, 18.75, 75.00, "anthropic")
_CLAUDE_OPUS_1M = ModelSettings(1000000, 300, 5.00, 0.50, 6.25, 25.00, "anthropic")
_CLAUDE_OPUS_1M_4096 = replace(_CLAUDE_OPUS_1M, cache_min_tokens=4096)
DEFAULT_MODELS: dict[str, ModelSettings] = {
    # (``priority_factor``: OpenAI's priority prices over these: gpt-4o $4.25 / $17 a million)
    "gpt-4o": ModelSettings(128000, 600, 2.50, 1.25, 0.0, 10.00, priority_factor=1.7),
    "gpt-4o-mini": ModelSettings(128000, 600, 0.15, 0.075, 0.0, 0.60, priority_factor=5 / 3),
    "gpt-4.1": ModelSettings(1047576, 600, 2.00, 0.50, 0.0, 8.00, priority_factor=1.75),
    "gpt-4.1-mini": ModelSettings(1047576, 600, 0.40, 0.10, 0.0, 1.60, priority_factor=1.75),
    "gpt-4.1-nano": ModelSettings(1047576, 600, 0.10, 0.025, 0.0, 0.40, priority_factor=2.0),
    "gpt-5": ModelSettings(400000, 600, 1.25, 0.125, 0.0, 10.00, priority_factor=2.0),
    "gpt-5-mini": ModelSettings(400000, 600, 0.25, 0.025, 0.0, 2.00, priority_factor=1.8),
    "gpt-5-nano": ModelSettings(400000, 600, 0.05, 0.005, 0.0, 0.40),
    "gpt-5.1": ModelSettings(400000, 600, 1.25, 0.125, 0.0, 10.00),
    "gpt-5.1-codex-mini": ModelSettings(400000, 600, 0.25, 0.025, 0.0, 2.00),
    "gpt-5.1-codex-max": ModelSettings(400000, 600, 1.25, 0.125, 0.0, 10.00),
    "gpt-5.2": ModelSettings(400000, 600, 1.75, 0.175, 0.0, 14.00),
    "gpt-5.3-codex": ModelSettings(400000, 600, 1.75, 0.175, 0.0, 14.00),
    "gpt-5.4": ModelSettings(1050000, 600, 2.50, 0.25, 0.0, 15.00, long_context_tokens=272000),
    "gpt-5.4-mini": ModelSettings(400000, 600, 0.75, 0.075, 0.0, 4.50),
    "gpt-5.4-nano": ModelSettings(400000, 600, 0.20, 0.02, 0.0, 1.25),
    "gpt-5.5": ModelSettings(1050000, 600, 5.00, 0.50, 0.0, 30.00, long_context_tokens=272000),
    "o3": ModelSettings(200000, 600, 2.00, 0.50, 0.0, 8.00, priority_factor=1.75),
    "o3-mini": ModelSettings(200000, 600, 1.10, 0.55, 0.0, 4.40),
    "o4-mini": ModelSettings(200000, 600, 1.10, 0.275, 0.0, 4.40, priority_factor=20 / 11),
    # DeepSeek's V4 (its page since 2026-04-26): the old names are V4 Flash's, without and with
    # thinking (retired by DeepSeek after 2026-07-24, still sent by clients configured so)
    "deepseek-v4-flash": _DEEPSEEK_V4_FLASH,
    "deepseek-chat": _DEEPSEEK_V4_FLASH,
    "deepseek-reasoner": _DEEPSEEK_V4_FLASH,
    "deepseek-v4-pro": ModelSettings(1000000, 3600, 0.435, 0.003625, 0.0, 0.87, "deepseek"),
    "claude-sonnet-4": _CLAUDE_SONNET,
    "claude-sonnet-4-0": _CLAUDE_SONNET,
    "claude-sonnet-4-5": _CLAUDE_SONNET,
    "claude-opus-4": _CLAUDE_OPUS_4,
    "claude-opus-4-0": _CLAUDE_OPUS_4,
    "claude-opus-4-1": _CLAUDE_OPUS_4,
    # (Anthropic caches nothing shorter than 4,096 tokens for these two)
    "claude-opus-4-5": ModelSettings(200000, 300, 5.00, 0.50, 6.25, 25.00, "anthropic", 4096),
    "claude-haiku-4-5": ModelSettings(200000, 300, 1.00, 0.10, 1.25, 5.00, "anthropic", 4096),
    # (the Haiku 3 models: nothing shorter than 2,048 tokens is cached)
    "claude-3-5-haiku": ModelSettings(200000, 300, 0.80, 0.08, 1.00, 4.00, "anthropic", 2048),
    "claude-3-haiku": ModelSettings(200000, 300, 0.25, 0.03, 0.30, 1.25, "anthropic", 2048),
    # The 4.6 models and later: a 1M window at the standard prices (since 2026-03-13, no
    # long-context rates); Opus caches nothing shorter than 4,096 tokens
    "claude-sonnet-4-6": ModelSettings(1000000, 300, 3.00, 0.30, 3.75, 15.00, "anthropic"),
    "claude-opus-4-6": _CLAUDE_OPUS_1M_4096,
    "claude-opus-4-7": _CLAUDE_OPUS_1M_4096,
    "claude-opus-4-8": _CLAUDE_OPUS_1M,
    "claude-opus-5": _CLAUDE_OPUS_1M,
    "*": ModelSettings(),
}

# Words that make a name another, differently priced model than the configured name it extends:
# gpt-5-nano is not gpt-5, nor o3-pro o3.
_VARIANT_WORDS: Final = frozenset(
    {
        "mini",
        "nano",
        "micro",
        "pro",
        "lite",
        "turbo",
        "max",
        "audio",
        "realtime",
        "search",
        "research",
        "transcribe",
        "tts",
        "image",
        # OpenRouter's catalog variants, other prices (":free" costs nothing, ":extended" more);
        # its routing variants (":nitro", ":floor", ":exacto", ":online") are the base model
        "free",
        "extended",
    }
)
_SNAPSHOT_OF: Final = re.compile(
    r"(?:(?:[-_](?!\d{1,3}(?:[-_.]|$))|[@:/])"  # a separator; no version number after - or _
    r"[A-Za-z0-9._@:/-]*)?"  # (-5, -4.5); a tag after : may be a size (qwen3:0.6b)
)
_WORDS: Final = re.compile(r"[^a-z]+")
# A "v" version anywhere past the configured name: another model (deepseek-chat-v3.1, -v3-0324,
# -v3:latest are DeepSeek's V3 models, 164K windows, not what deepseek-chat names now; Ollama's
# deepseek-coder-v2:16b is not deepseek-coder), but for a first version at the very end, as
# Bedrock writes its ids' own (meta.llama3-1-70b-instruct-v1:0 is that model)
_OTHER_VERSION: Final = re.compile(r"[-_][vV](?!1(?::\d+)?\Z)\d")


def priority_factor(name: str | None, entry: ModelSettings) -> float:
    """What an answer at OpenAI's priority tier costs over ``entry``'s prices: its
    ``priority_factor``, or where that is 0, the built-in ratio of the model ``name`` resolves to
    among ``DEFAULT_MODELS`` (a table the user wrote, for ``gpt-4o`` or a snapshot of it, with
    the example's ``priority_factor = 0``: its answers were priced at 2 where OpenAI bills 1.7),
    else 0 (``cache.tier_factor``'s default)."""
    if entry.priority_factor or not name:
        return entry.priority_factor
    builtin = configured_model(name, DEFAULT_MODELS)
    return DEFAULT_MODELS[builtin].priority_factor if builtin is not None else 0.0


def configured_model(name: str, configured: Iterable[str]) -> str | None:
    """The configured model entry a request's model ``name`` resolves to, or None ("*").

    The exact name, else the longest configured name that ``name`` extends as a snapshot or tag
    of the same model: past a separator (``-2024-08-06``, ``-20250514``, ``-latest``,
    ``:7b``), with no word of a variant (``-mini``, ``-pro``, …, ``_VARIANT_WORDS``) and no short
    version number (``claude-opus-4`` does not cover ``claude-opus-4-5``, nor ``gpt-5``
    ``gpt-5.4``: other models, other prices). Failing that, the same for its
    ``gateway_aliases`` (``anthropic/claude-sonnet-4.5`` is ``claude-sonnet-4-5``). A name
    nothing covers is priced by ``"*"``.
    """
    names = configured if isinstance(configured, Mapping | frozenset | set) else set(configured)
    found = _configured(name, names)
    if found is None:
        for alias in gateway_aliases(name):
            found = _configured(alias, names)
            if found is not None:
                break
    return found


# Bedrock's model ids: a cross-region inference profile's region, then the vendor
# (``us.anthropic.claude-sonnet-4-5-20250929-v1:0``).
_BEDROCK_PREFIX: Final = re.compile(r"\A(?:(?:us|eu|apac|global|us-gov|jp|au|ca)\.)?anthropic\.")
# Another vendor's cross-region profile (``us.meta.llama3-1-70b-instruct-v1:0``): its region
# off, the model's own id (``meta.llama3-1-70b-instruct-v1:0``) is what a table names
_BEDROCK_REGION: Final = re.compile(r"\A(?:us|eu|apac|global|us-gov|jp|au|ca)\.(?=[a-z][\w-]*\.)")
_DOTTED_VERSION: Final = re.compile(r"(?<=\d)\.(?=\d)")
_BEDROCK_VERSION: Final = re.compile(r"-v\d+(?::\d+)?\Z")


def gateway_aliases(name: str) -> tuple[str, ...]:
    """``_aliases``, memoized for a name of up to 256 characters (a request's model, looked up
    several times a request; a client's name may be as long as its body: not kept)."""
    return _cached_aliases(name) if len(name) <= 256 else _aliases(name)


@functools.lru_cache(maxsize=1024)
def _cached_aliases(name: str) -> tuple[str, ...]:
    return _aliases(name)


def _aliases(name: str) -> tuple[str, ...]:
    """``name`` as the provider itself may spell it, when a gateway wrote it its own way, most
    literal first (not ``name`` itself): without a vendor or route prefix (OpenRouter's and
    LiteLLM's ``anthropic/…``, ``openai/…``) or Bedrock's (``us.anthropic.…``), then with a
    Claude version in dashes (OpenRouter's ``claude-sonnet-4.5`` is ``claude-sonnet-4-5``).
    None for a name under DeepSeek's Hugging Face organization (``deepseek-ai/deepseek-v4-pro``
    on NVIDIA NIM, Together): open weights another host serves, at its prices and under its
    cache's rules, not DeepSeek's API's model."""
    head, _, last = name.rpartition("/")
    if head.rpartition("/")[2].lower() == "deepseek-ai":
        return ()
    bare = _BEDROCK_PREFIX.sub("", last)
    # a Bedrock id of Claude: its version after the model's off too ("-v1:0"); another's: its
    # region off
    bare = _BEDROCK_VERSION.sub("", bare) if bare != last else _BEDROCK_REGION.sub("", last)
    out = [bare] if bare != name else []
    if bare.startswith("claude-"):
        dashed = _DOTTED_VERSION.sub("-", bare)
        if dashed != bare:
            out.append(dashed)
    return tuple(out)


def gateway_alias(name: str) -> str:
    """The provider's own spelling of ``name`` (``gateway_aliases``' last), else ``name``."""
    aliases = gateway_aliases(name)
    return aliases[-1] if aliases else name


def _configured(name: str, names: Iterable[str]) -> str | None:
    if name in names:
        return name
    best = ""
    for key in names:
        if key == "*" or len(key) <= len(best) or not name.startswith(key):
            continue
        rest = name[len(key) :]
        if (
            _SNAPSHOT_OF.fullmatch(rest)
            and _VARIANT_WORDS.isdisjoint(_WORDS.split(rest.lower()))
            and _OTHER_VERSION.search(rest) is None
        ):
            best = key
    return best or None


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    pairing: PairingSettings = field(default_factory=PairingSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    sessions: SessionSettings = field(default_factory=SessionSettings)
    models: dict[str, ModelSettings] = field(default_factory=lambda: dict(DEFAULT_MODELS))

    def model(self, name: str | None) -> tuple[str, ModelSettings]:
        """The configured entry for ``name`` (``configured_model``), else "*"."""
        if name:
            key = configured_model(name, self.models)
            if key is not None:
                return key, self.models[key]
        return "*", self.models.get("*", ModelSettings())


# Upstreams that send a stream's usage whether or not it was asked for (OpenRouter: "always
# included", ``stream_options.include_usage`` has no effect): cachegate neither asks nor hides.
ALWAYS_SEND_USAGE: Final = ("openrouter.ai",)


def sends_usage_unasked(base_url: str) -> bool:
    """Whether the upstream at ``base_url`` streams usage to every client (``ALWAYS_SEND_USAGE``)."""
    try:
        host = (urlsplit(base_url).hostname or "").rstrip(".")
    except ValueError:
        return False
    return any(host == name or host.endswith("." + name) for name in ALWAYS_SEND_USAGE)


# What may be a URL's user:password@ where no authority could be told apart (the first "@" ends it)
_USER_INFO: Final = re.compile(r"[^/?#@]+@")  # (white space too: a pasted password)
_SCHEME_START: Final = re.compile(r"https?:/*|https?//", re.IGNORECASE)  # (mistyped too)


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets (once)."""
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else bare


def display_url(url: str) -> str:
    """``url`` as it may be shown or logged: without the ``user:password@`` a base URL can
    carry, nor a query or fragment (``?key=…``: a base URL has none, and its error says so)."""
    return _without_query(_without_user_info(url))


def _without_query(url: str) -> str:
    cut = min((at for at in (url.find("?"), url.find("#")) if at >= 0), default=len(url))
    return url[:cut]


def _without_user_info(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:  # unparseable: still no user info shown
        return _USER_INFO.sub("", url)
    if not parts.netloc:  # a mistyped scheme (https:/…, http//…, none): no authority found
        if "@" not in url:
            return url
        start = _SCHEME_START.match(url)
        begin = start.end() if start else 0
        first = url.find("@", begin)
        if first < 0:
            return url
        # Up to the first "@" it may be a host (a name with a dot, localhost, an [IPv6]) with
        # a port: the "@" is then in the path. Anything else is taken for user info, however
        # it looks (hiding a path is no harm, showing a password is), up to the last "@"
        # before the next "/" (a password may hold "@", "/" and "?").
        name, colon, port = url[begin:first].partition("/")[0].rpartition(":")
        if not colon:
            name, port = port, ""
        if (not port or port.isdigit()) and (
            "." in name or name.lower() == "localhost" or name.startswith("[")
        ):
            return _USER_INFO.sub("", url)
        slash = url.find("/", first)
        cut = url.rfind("@", first, slash if slash >= 0 else len(url))
        return url[:begin] + url[cut + 1 :]
    if "@" not in parts.netloc:
        # a password with "/", "?" or "#" in it ends the authority early: "user:pa/ss@host"
        rest = url[len(parts.scheme) + 3 :]
        if "@" in rest and ":" in rest.partition("@")[0]:
            return url[: len(parts.scheme) + 3] + rest.rpartition("@")[2]
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


# Command-line options and their CACHEGATE_<OPTION> variables, mapped to config keys.
OPTION_KEYS: dict[str, str] = {
    "host": "server.host",
    "port": "server.port",
    "upstream": "upstream.base_url",
    "log_dir": "logging.dir",
    "strict_pairing": "pairing.strict",
}


def _section_keys() -> list[tuple[str, Any]]:
    """Each config key of the sections (``server.port``; not the models' table) with its
    default value."""
    defaults = Settings()
    return [
        (f"{section.name}.{key.name}", getattr(getattr(defaults, section.name), key.name))
        for section in fields(Settings)
        if section.name != "models"
        for key in fields(getattr(defaults, section.name))
    ]


# A line that sets a key to a bare word, address or URL (``host = 127.0.0.1``): TOML reads
# text only in quotes
_UNQUOTED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*=\s*([^\s\"'\[{#][^#]*?)\s*(?:#.*)?")


def _unquoted_hint(raw: bytes, exc: Exception) -> str:
    """Where the TOML error ``exc`` is on a line that sets a key to text without quotes,
    what to write instead (tomllib says only ``Expected newline or end of document after a
    statement``, or ``Invalid value``); else ""."""
    found = re.search(r"at line (\d+)", str(exc))
    if found is None:
        return ""
    lines = raw.decode("utf-8", "replace").splitlines()
    at = int(found.group(1)) - 1
    if not 0 <= at < len(lines):
        return ""
    line = _UNQUOTED.fullmatch(lines[at])
    if line is None:
        return ""
    key, value = line.groups()
    # (the keys whose values are text: a bare number or word for another is no text)
    texts = {
        name.partition(".")[2] for name, default in _section_keys() if isinstance(default, str)
    }
    if key.rpartition(".")[2] not in texts:
        return ""
    return f" (text goes in quotes: {key} = {json.dumps(value, ensure_ascii=False)})"


def unknown_variable_notes(env: Mapping[str, str]) -> list[str]:
    """A line for each ``CACHEGATE_*`` variable set in ``env`` that cachegate does not read
    (``CACHEGATE_LOGDIR``): a mistyped name was ignored without a word, as a file's unknown key
    is not."""
    known = {"CACHEGATE_CONFIG", *(f"CACHEGATE_{option.upper()}" for option in OPTION_KEYS)}
    # A config key written as a variable, ``CACHEGATE_SERVER_PORT`` for ``server.port`` (the
    # names a user builds from the keys' table): the variable that sets it, or the file
    variables = {key: f"CACHEGATE_{option.upper()}" for option, key in OPTION_KEYS.items()}
    keys = {name.replace(".", "_").upper(): name for name, _ in _section_keys()}
    notes = []
    for name in sorted(env):
        if name.upper().startswith("CACHEGATE_") and name not in known and env[name]:
            # (the names after the prefix they share, which would make every one look close;
            # an empty variable counts as unset, as the known ones do)
            suffixes = sorted(k.removeprefix("CACHEGATE_") for k in known)
            asked = name.upper().removeprefix("CACHEGATE_")
            close = difflib.get_close_matches(asked, [*suffixes, *keys], n=1)
            hint = ""
            if close and close[0] in keys:
                key = keys[close[0]]
                section, _, field_name = key.partition(".")
                if key in variables:
                    hint = f" (did you mean {variables[key]}? it sets {key})"
                else:
                    hint = (
                        f" ({key} has no variable: set {field_name} under [{section}] in the"
                        " config file, --config)"
                    )
            elif close:
                hint = f" (did you mean CACHEGATE_{close[0]}?)"
            elif "KEY" in asked:  # (CACHEGATE_API_KEY, CACHEGATE_OPENAI_KEY)
                hint = (
                    " (the key cachegate adds is read from OPENAI_API_KEY, or the variable"
                    " upstream.api_key_env names)"
                )
            notes.append(f"{name} is set, but cachegate reads no such variable{hint}")
    return notes


# How a boolean is written in a CACHEGATE_* variable (and X-Cachegate-Strict), lower-cased.
TRUE_WORDS: frozenset[str] = frozenset({"1", "true", "yes", "on"})
# A number written as text (a variable, a flag): ASCII digits, as TOML writes them (Python's
# int() and float() also read "4_2" and other scripts' digits, "٤٢": a typo taken as 42)
INTEGER_TEXT: Final = re.compile(r"\s*[+-]?[0-9]+\s*")
NUMBER_TEXT: Final = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")
FALSE_WORDS: frozenset[str] = frozenset({"0", "false", "no", "off"})


def strict_pairing(settings: Settings, headers: Mapping[str, str]) -> bool:
    """Whether a request's tool pairing is judged in strict mode: ``pairing.strict``, or its
    ``X-Cachegate-Strict`` header says a true word."""
    return (
        settings.pairing.strict
        or headers.get("x-cachegate-strict", "").strip().lower() in TRUE_WORDS
    )


def _coerce(key: str, value: Any, tp: Any, text: bool = False) -> Any:
    """``value`` as the type ``tp``; ``text``: it came as text (an environment variable, a flag),
    so words and digits are read (a file's value must have its type: ``port = "8787"`` is
    refused, as the README says)."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            if not isinstance(value, str):  # (a date, an array: said as TOML calls them)
                raise ConfigError(
                    f"config key '{key}': expected one of {allowed}, got {_kind_of(value)}"
                )
            raise ConfigError(f"config key '{key}': {value!r} is not one of {allowed}")
        return value
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"config key '{key}': unsupported type")
    if tp is bool:
        if isinstance(value, bool):
            return value
        word = value.strip().lower() if text and isinstance(value, str) else None
        if word is not None and word in TRUE_WORDS | FALSE_WORDS:  # ("true " from a .env file)
            return word in TRUE_WORDS
        raise ConfigError(f"config key '{key}': expected true or false, got {_shown(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected an integer, got {_shown(value)}")
        try:
            result = (
                int(value)
                if isinstance(value, int)
                or (text and isinstance(value, str) and INTEGER_TEXT.fullmatch(value))
                else None
            )
        except ValueError:
            result = None
        if result is None:
            raise ConfigError(f"config key '{key}': expected an integer, got {_shown(value)}")
        if result < 0:
            raise ConfigError(f"config key '{key}': {_not_negative(key)}, got {_number(result)}")
        if result > MAX_INT:  # (past what a count, a size or a C integer holds: it overflowed)
            raise ConfigError(
                f"config key '{key}': must be at most {MAX_INT}, got {_number(result)}"
            )
        return result
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected a number, got {_shown(value)}")
        if not (
            isinstance(value, int | float)
            or (text and isinstance(value, str) and NUMBER_TEXT.fullmatch(value))
        ):
            raise ConfigError(f"config key '{key}': expected a number, got {_shown(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer past a double's range: as infinite as 1e400
            number = math.inf if int(value) > 0 else -math.inf
        except (TypeError, ValueError):
            raise ConfigError(
                f"config key '{key}': expected a number, got {_shown(value)}"
            ) from None
        if not 0 <= number < math.inf:  # NaN, inf and negatives
            rule = _not_negative(key, finite=True)
            raise ConfigError(f"config key '{key}': {rule}, got {_number(value)}")
        # (as for an integer key: a duration of 2^63 seconds, 1e300 too, is a typo, not a
        # setting; an integer compared as it is, which its double may round past the bound)
        if (value > MAX_INT) if isinstance(value, int) else (number > MAX_INT):
            raise ConfigError(
                f"config key '{key}': must be at most {MAX_INT}, got {_number(value)}"
            )
        return number
    if tp is str:
        if not isinstance(value, str):
            # (a key written in a variable's name's place, in an array by mistake: its kind,
            # never its value, as for a string that reads as no variable's name)
            # (a base URL with its password, or a key pasted in its place, in an array or a
            # table likewise)
            secret = key == "upstream.api_key_env" or (
                isinstance(value, list | dict)
                and (key == "upstream.base_url" or "@" in repr(value))  # (a URL's user@)
            )
            got = _kind_of(value) if secret else _shown(value)
            raise ConfigError(f"config key '{key}': expected a string, got {got}")
        return value
    raise ConfigError(f"config key '{key}': unsupported type")  # pragma: no cover


# Zhipu's id.secret key; other keys are judged by ``_token_like``
_ID_SECRET: Final = re.compile(r"[0-9a-fA-F]{32}\.[A-Za-z0-9]{16}")
_KEY_RUN: Final = re.compile(r"[A-Za-z0-9_-]+")


def _token_like(value: str) -> bool:
    """Whether ``value`` is a key rather than a host name typed without its scheme: one run of
    a key's characters with a piece between hyphens of 20 letters and digits or more, a digit
    among them (Mistral's, Together's, xAI's ``xai-…``; a host name's labels are short:
    ``llama-3-1-70b-instruct-predictor-00001``, ``vllm-h100-node-07``), or Zhipu's id.secret."""
    if _ID_SECRET.fullmatch(value):
        return True
    if not _KEY_RUN.fullmatch(value):
        return False
    return any(len(p) >= 20 and any(c.isdigit() for c in p) for p in value.split("-"))


def shown_url(url: str) -> str:
    """A base URL as cachegate's own messages say it (start-up, a refusal, the upstream's
    warnings): without its user name and password, and a key in it (``…/sk-proj-…/v1``, a
    gateway's key in the path) or pasted in its place redacted, as the log's lines have it."""
    from proxy.redact import redact_text  # (its patterns: only when a URL is refused)

    return redact_text(display_url(url))


def _number(value: Any) -> str:
    """A refused number as given, but an integer of hundreds of digits by its length."""
    if isinstance(value, int) and not -(10**20) < value < 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _kind_of(value: Any) -> str:
    """What TOML calls a value's type, with an article: ``an array``, ``a table``."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    return "a date or time"


def _shown(value: Any) -> str:
    """A configured value as the file spells it: TOML's ``true`` and ``false``, not Python's;
    a date or a table by its kind (``datetime.date(1970, 1, 1)`` is no TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (Mapping, datetime.date, datetime.time)):
        return _kind_of(value)
    return repr(value)


def _build(cls: Any, data: Mapping[str, Any], prefix: str, base: Any, text: bool = False) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"config key '{prefix}': expected a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    for key in data:
        if key not in names:
            owners = _owners(key)
            if prefix.startswith("models.") and isinstance(data[key], Mapping):
                # [models.gpt-4.1]: TOML reads the dot as a table in a table
                name = f"{prefix[8:-1]}.{key}"
                inner = data[key]
                while len(inner) == 1 and isinstance(next(iter(inner.values())), Mapping):
                    part, inner = next(iter(inner.items()))  # [models.gpt-4.1.mini]
                    name += f".{part}"
                # (where the name was quoted already, [models."gpt-4o".extra], a model's table
                # has no table in it: said as such, the quoting advice for the other case)
                hint = (
                    f" (a model's table holds no table; quote a model name with a dot in it"
                    f' whole: [models."{name}"])'
                    if any(not isinstance(v, Mapping) for v in data.values())
                    else f' (quote a model name with a dot in it: [models."{name}"])'
                )
            elif owners:  # (another table's key exactly: said before a guess at a spelling)
                hint = f" (it goes under {' or '.join(owners)})"
            elif prefix == "upstream" and key.lower().replace("-", "_") in _KEY_NAMES:
                # (not "did you mean 'api_key_env'": followed, the key went in its place, a
                # variable's name, and requests went without one)
                hint = (
                    " (cachegate reads no key from its config file: put the key in"
                    " OPENAI_API_KEY, or in another variable named by upstream.api_key_env)"
                )
            else:
                hint = _did_you_mean(key, names)
            raise ConfigError(f"unknown config key '{prefix}.{key}'{hint}")
    changes = {k: _coerce(f"{prefix}.{k}", v, hints[k], text) for k, v in data.items()}
    return replace(base, **changes)


# A secret in base64 (an AWS secret access key: 40 characters, ``/`` and ``+`` among them, which
# no host name has)
_BASE64_KEY: Final = re.compile(r"(?=.*[/+])[A-Za-z0-9+/=_-]{30,}")


def host_problem(listen: str, port: str = "server.port, --port") -> str | None:
    """What is wrong with ``listen`` as an address to listen on (``server.host``, the
    simulator's ``--host``), or None."""
    # (the socket layer reads "" as every interface, and "[]" once its brackets are off)
    if not listen.strip(" []"):
        said = "empty" if not listen else "only spaces" if not listen.strip() else f"{listen!r}"
        return f"{said}; give an address (127.0.0.1, or 0.0.0.0 to listen on every interface)"
    if _token_like(listen.strip()) or _BASE64_KEY.fullmatch(listen.strip()):
        # (a key pasted in its place: not printed by a bind error, nor by the messages below)
        return (
            f"is no address but a {len(listen.strip())}-character token (not shown: a key"
            " pasted in its place?); give an address, 127.0.0.1"
        )
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in listen):
        # ("127.0.0.1 " from a .env file: the resolver's "Name or service not known" named no
        # setting; a NUL was cut off by the socket layer and printed)
        return f"{listen!r} has white space or a control character in it (a space pasted with it?)"
    bare = listen[1:-1] if listen.startswith("[") and listen.endswith("]") else listen
    if "/" in listen or ((":" in listen or "[" in listen or "]" in listen) and not _is_ipv6(bare)):
        # (localhost:8787, http://localhost: the resolver's "Name or service not known", exit
        # 1, named no setting, and the address was shown as [localhost:8787]:8787)
        return (
            f"{display_url(listen)!r} is not an address: give the address alone, without a"
            f" scheme or a port (the port is {port})"
        )
    return None


def _check(settings: Settings) -> None:
    if not 0 < settings.server.port < 65536:
        raise _bad("server.port", f"{settings.server.port} is not a TCP port (1 to 65535)")
    problem = host_problem(settings.server.host)
    if problem is not None:
        raise _bad("server.host", problem)
    if settings.logging.enabled and not settings.logging.dir.strip():  # "": the working dir
        said = "only spaces" if settings.logging.dir else "empty"
        raise _bad("logging.dir", f"{said}; give a directory (or set logging.enabled = false)")
    if "\0" in settings.logging.dir:  # (no path can hold it: a traceback once listening)
        raise _bad("logging.dir", f"{settings.logging.dir!r} has a NUL character in it")
    url = settings.upstream.base_url
    key = "upstream.base_url"
    # (as pasted: in quotes of any kind, backquotes, brackets, a BOM, with a comma after it)
    bare = (
        url.strip()
        .strip("\ufeff\u200b'\"\u201c\u201d\u2018\u2019\u00ab\u00bb\u201e`<>()[]{},;:!?./")
        .strip()
    )
    if _token_like(bare):  # (a key of a pattern the redaction does not know)
        raise _bad(
            key,
            f"is no URL but a {len(bare)}-character token (not shown: a key pasted in its"
            " place?); give the provider's base URL, https://…",
        )
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        # (it goes into each request line as it is: a trailing space pasted with it made every
        # request a 400 from the provider)
        raise _bad(
            key,
            f"{(shown_url(url).strip() or url)!r} has white space or a control character in"
            " it (a space pasted with it?); percent-encode one that belongs there (%20)",
        )
    if not url.startswith(("http://", "https://")):
        raise _bad(key, f"{shown_url(url)!r} must start with http:// or https://")
    host: str | None = None
    why = ""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:
        why = f" ({exc})"
    if not host:
        raise _bad(key, f"{shown_url(url)!r} names no host{why}")
    if "@" in url[len(parts.scheme) + 3 + len(parts.netloc) :]:
        # a user:password whose password holds "/", "?" or "#" ends the host early: the rest
        # would be taken for a path (or the password's start for a port); the URL may hold a
        # password, so none of it is shown
        raise _bad(
            key,
            "has an '@' after its host; a user name or password in the URL must have / ? # @"
            " percent-encoded (%2F %3F %23 %40), and an '@' in its path too (%40)",
        )
    if "?" in url or "#" in url:  # the route is appended to the URL: ".../v1?x=1/chat/completions"
        raise _bad(
            key,
            f"{shown_url(url)!r} has a query or fragment (not shown: it may hold a key); give"
            " the base URL alone (a client's query string is passed on with each request)",
        )
    try:
        port = parts.port  # (not said: a password with "/" in it is read as host and port)
    except ValueError:
        port = 0
    if port == 0:
        raise _bad(key, f"{shown_url(url)!r}: its port is not a number from 1 to 65535")
    for option, check in (
        ("allowed_origins", check_origin_entry),
        ("allowed_hosts", check_host_entry),
    ):
        for entry in getattr(settings.server, option).split(","):
            problem = check(entry) if entry.strip() else None
            if problem:
                raise _bad(f"server.{option}", problem)
    if not 0 < settings.compaction.trigger_percent <= 100:
        raise _bad("compaction.trigger_percent", "must be in (0, 100]")
    for key in POSITIVE_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(settings, section), name)
        if value <= 0:  # 0 would refuse, or wait forever on, every request
            raise _bad(key, f"must be positive, got {value:g}")
        if name.endswith("_s") and value < MIN_SECONDS:  # (1e-300: every request a 504)
            raise _bad(key, f"must be at least {MIN_SECONDS:g} (a millisecond), got {value:g}")
    for name, model in settings.models.items():
        if model.context_window <= 0:
            raise _bad(f'models."{name}".context_window', "must be positive")
    summarizer = settings.compaction.summarizer_model
    if summarizer and (not summarizer.strip() or summarizer != summarizer.strip()):
        # (sent as the summary call's model as it is: a pasted space made every summary call
        # a model the provider does not know, or one priced at nothing)
        raise _bad(
            "compaction.summarizer_model",
            f"{summarizer!r} has white space around it (a space pasted with it?); give the"
            " model's name, or \"\" for the request's own model",
        )


def settings_from_mapping(
    data: Mapping[str, Any], base: Settings | None = None, text: bool = False, check: bool = True
) -> Settings:
    """Apply a nested mapping (a parsed TOML file) over ``base`` and validate every key;
    ``text``: the values came as text (``_coerce``); ``check``: also check the settings as a
    whole (``load_settings`` does once every source is applied: a flag may mend a file)."""
    settings = base or Settings()
    changes: dict[str, Any] = {}
    for section, value in data.items():
        if section == "models":
            if not isinstance(value, Mapping):
                raise ConfigError("config key 'models': expected a table of model tables")
            models = dict(settings.models)
            # "*" first, wherever the file puts it: the tables that start from it see it all
            for name, table in sorted(value.items(), key=lambda item: item[0] != "*"):
                if not name.strip() or name != name.strip():
                    # (a request names its model without the space: the table never applied)
                    raise ConfigError(
                        f"config table [models.{json.dumps(name)}]: the model name has white"
                        " space around it, or is empty (a space pasted with it?); no request"
                        " names a model so, so its settings would never apply"
                    )
                start = models.get(name, models.get("*", ModelSettings()))
                models[name] = _build(ModelSettings, table, f'models."{name}"', start, text)
            changes["models"] = models
            continue
        current = getattr(settings, section, None)
        if current is None or not is_dataclass(current):
            if isinstance(value, Mapping):  # a table: a misspelt section
                hint = _did_you_mean(section, {f.name for f in fields(Settings)})
            else:  # a key above every [section]
                where = " or ".join(_owners(section)) or "a section such as [server]"
                hint = f" (keys go under a section: put it under {where})"
            raise ConfigError(f"unknown config section '{section}'{hint}")
        changes[section] = _build(type(current), value, section, current, text)
    settings = replace(settings, **changes)
    if check:
        settings = _normalized(settings)
        _check(settings)
    return settings


def _normalized(settings: Settings) -> Settings:
    """The upstream URL's scheme in lower case (``HTTPS://``, as some docs print it, is the
    same URL: RFC 3986 3.1), as the rest of cachegate reads it."""
    url = settings.upstream.base_url
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in ("http", "https") and scheme != scheme.lower():
        upstream = replace(settings.upstream, base_url=f"{scheme.lower()}://{rest}")
        return replace(settings, upstream=upstream)
    return settings


def _owners(key: str) -> list[str]:
    """The tables a key belongs in (``[upstream]``), for a key put in the wrong one."""
    defaults = Settings()
    owners = [
        f"[{f.name}]"
        for f in fields(Settings)
        if is_dataclass(section := getattr(defaults, f.name))
        and key in {k.name for k in fields(section)}
    ]
    if key in {f.name for f in fields(ModelSettings)}:  # a model's own key
        owners.append('[models."<model name>"]')
    return owners


# Keys a user writes to put the provider's key itself in the file
_KEY_NAMES: Final = frozenset(
    {"api_key", "key", "openai_api_key", "apikey", "token", "api_token", "bearer", "secret"}
)


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _nest(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in flat.items():
        section, key = dotted.split(".", 1)
        nested.setdefault(section, {})[key] = value
    return nested


def load_settings(
    config_file: str | None = None,
    options: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Defaults < config file < CACHEGATE_* variables < command-line ``options`` (None = not given)."""
    env = os.environ if environ is None else environ
    if config_file is not None and not config_file.strip():  # (an unset shell variable's "$X")
        raise ConfigError("--config: empty; give a TOML file, or leave the flag out")
    path = config_file or env.get("CACHEGATE_CONFIG") or None
    if path is not None and not path.strip():  # (set to spaces: no file, said as such)
        raise ConfigError("CACHEGATE_CONFIG: only spaces; give a TOML file, or unset it")
    settings = Settings()
    if path:
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
            # a byte-order mark, as Windows editors save UTF-8, is no TOML: read past it
            data = tomllib.loads(raw.decode("utf-8").removeprefix("\ufeff"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}{_unquoted_hint(raw, exc)}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path}: not UTF-8 text ({exc.reason})") from None
        except ValueError as exc:  # an integer of more than 4,300 digits
            reason = str(exc).partition(":")[0]  # (not Python's advice after it)
            raise ConfigError(f"config file {path}: a value cannot be read ({reason})") from None
        except RecursionError:  # arrays or inline tables nested thousands deep
            raise ConfigError(f"config file {path}: a value is nested too deep to read") from None
        except OSError as exc:  # a directory, no permission
            raise ConfigError(
                f"config file {path}: cannot read it: {exc.strerror or exc}"
            ) from None
        try:
            settings = settings_from_mapping(data, settings, check=False)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (config file {path})", exc.key) from None
    # One variable, then one flag, at a time: an error names the one the user set.
    set_by: dict[str, str] = {}  # a key, and the variable or flag that set it last
    flags = options or {}
    for option, key in OPTION_KEYS.items():
        variable = f"CACHEGATE_{option.upper()}"
        if env.get(variable) and flags.get(option) is None:  # (a flag's value replaces it:
            # a stale variable that cannot be read is mended by the flag, as a file's value)
            settings = _apply_one(settings, key, env[variable], variable)
            set_by[key] = variable
    for option, value in (options or {}).items():
        if value is not None and option in OPTION_KEYS:
            flag = "--" + option.replace("_", "-")
            settings = _apply_one(settings, OPTION_KEYS[option], value, flag)
            set_by[OPTION_KEYS[option]] = flag
    settings = _normalized(settings)
    try:
        _check(settings)  # the whole, as it will run: a flag's port mends a file's port = 0
    except ConfigError as exc:
        source = set_by.get(exc.key or "")
        if source is not None:
            raise ConfigError(f"{source}: {exc}", exc.key) from None
        if path:
            raise ConfigError(f"{exc} (config file {path})", exc.key) from None
        raise
    home = os.path.expanduser(settings.logging.dir)  # "~/logs" in a file or a variable
    if home != settings.logging.dir:
        settings = replace(settings, logging=replace(settings.logging, dir=home))
    return settings


def _apply_one(settings: Settings, key: str, value: Any, source: str) -> Settings:
    if key == "logging.dir" and isinstance(value, str) and not value.strip():  # (logs on or off)
        said = "only spaces" if value else "empty"
        raise ConfigError(f"{source}: config key 'logging.dir': {said}; give a directory", key)
    try:
        text = isinstance(value, str)
        return settings_from_mapping(_nest({key: value}), settings, text=text, check=False)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}", exc.key) from None
