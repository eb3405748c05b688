import base64
import copy
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proxy.redact import (
    _SECRET,
    REDACTED,
    _may_hold_secret,
    _scans,
    line_may_hold_secret,
    redact,
    redact_text,
    sk_key_shaped,
)

OPENAI_KEY = "sk-abcdefghijklmnopqrstuvwxyz012345"
PROJECT_KEY = "sk-proj-Ab3_dEf-GhIjKlMnOpQrStUvWx"
ANTHROPIC_KEY = "sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWxYz-0123456789"
AWS_ID = "AKIAIOSFODNN7EXAMPLE"
GITHUB_TOKEN = "ghp_16C7e42F292c6912E7710c838347Ae178B4a"
GITHUB_PAT = "github_pat_11ABCDEFG0123456789_abcdefghijklmnop"
SLACK_TOKEN = "xoxb-1234567890-0987654321-AbCdEfGh"
STRIPE_KEY = "sk_live_51HxAbCdEfGhIjKlMnOpQr"
STRIPE_RESTRICTED = "rk_test_51HxAbCdEfGhIjKlMnOpQr"
GOOGLE_KEY = "AIzaSyA-AbCdEfGhIjKlMnOpQrStUvWxYz01234"
GITLAB_TOKEN = "glpat-AbCdEfGhIjKlMnOpQrSt"
HF_TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567"
GROQ_KEY = "gsk_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCdEfGhIjKlMnOp"
NPM_TOKEN = "npm_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
SLACK_APP_TOKEN = "xapp-1-A012ABCDEF-1234567890123-0123456789abcdef0123456789abcdef"
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ"
    ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)
PROVIDER_KEYS = [
    "xai-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0fGh3iJk6lMn9oPq2rSt5uVw8xYz1aBc4dEf7gHi0j",
    "pplx-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0fGh3iJk6l",
    "nvapi-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z-Ab7cDe0fGh3iJk6lMn9oPq2rSt5uVw8_xYz1",
    "csk-" + "ab3def6hij9klm2nop5qrs8tuv1wxy4zab7cde0fgh3ijk6l",
    "r8_" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7",
    "fw_" + "3ZAb3dEf6hIj9kLm2nOp5qRs",
    "lsv2_pt_" + "0123456789abcdef0123456789abcdef_0123456789",
    "SG." + "Ab3dEf6hIj9kLm2nOp5qRs" + "." + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0fGh3i",
    "dop_v1_" + "0123456789abcdef" * 4,
    "ya29." + "a0AfH6SMAb3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
    "ya29." + "c.c0ASRK0GZ7dXvPq3Lk9mNbVtYwRx2AbCdEfGhIjKlMnOpQrStUvWxYz0123456789-_abcd",
]
MORE_KEYS = [
    *PROVIDER_KEYS,
    STRIPE_KEY,
    STRIPE_RESTRICTED,
    GOOGLE_KEY,
    GITLAB_TOKEN,
    HF_TOKEN,
    GROQ_KEY,
    NPM_TOKEN,
    SLACK_APP_TOKEN,
    JWT,
]
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    "secret",
    [
        OPENAI_KEY,
        PROJECT_KEY,
        ANTHROPIC_KEY,
        AWS_ID,
        GITHUB_TOKEN,
        GITHUB_PAT,
        SLACK_TOKEN,
        *MORE_KEYS,
    ],
)
def test_each_kind_of_key_is_replaced_in_running_text(secret: str) -> None:
    text = f"export TOKEN={secret}\nthen run it"
    assert redact_text(text) == f"export TOKEN={REDACTED}\nthen run it"


@pytest.mark.parametrize(
    "secret",
    [OPENAI_KEY, PROJECT_KEY, ANTHROPIC_KEY, AWS_ID, GITHUB_TOKEN, GITHUB_PAT, SLACK_TOKEN, JWT],
)
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("\x1b[32m", "\x1b[0m"),
        ("\x1b[01;31m\x1b[KKEY=\x1b[m\x1b[K", ""),  # GNU grep --color=always
        ("\x1b[1;31mTOKEN=\x1b[m", ""),  # git grep --color=always
        ("\x1b[1;32m", "\x1b[m"),
        ("stdout='x\\n", "\\n'"),  # a repr's escapes, written out
        ("\\t", ""),
        ("?authorization=Bearer%20", "&x=1"),  # a URL's query
        ("%22", "%22"),
    ],
)
def test_a_key_after_an_escape_a_colour_or_an_encoded_byte_is_replaced(
    secret: str, before: str, after: str
) -> None:
    """The look-behind that keeps "task-…" from matching kept these too: what ends in a letter
    or a digit before a key in a tool's output (a colour code's "m", a repr's "\\n", "%20")."""
    text = f"{before}{secret}{after}"
    assert secret not in redact_text(text)
    assert redact_text(text).endswith(after)


@pytest.mark.parametrize(
    "text", ["the risk-assessment-for-the-new-feature-x", "task-abcdefghijklmnopqrstuvwxyz0"]
)
def test_a_word_that_ends_in_a_prefix_is_still_no_key(text: str) -> None:
    assert redact_text(text) == text


@pytest.mark.parametrize(
    "text",
    [
        "we use sk-learn-pipeline-debugging here",
        "pip install sk-learn-contrib-lightning-extras",
        "git checkout sk-feature-authentication-refactor",
        "the task-sk-planning-document-v2-final draft",
        '{"session": "sk-learn-pipeline-debugging"}',
    ],
)
def test_sk_names_are_no_keys(text: str) -> None:
    """Names that the generic ``sk-`` pattern matched (a session named so, which cachegate
    takes as a name, a branch, a package) were redacted in the log, the session's own name in
    its ``session_meta`` line too, and replayed as ``[REDACTED]``. A key has random letters and
    digits: a run of 16 or more with both, or three capitals and three small letters."""
    assert redact_text(text) == text
    for key in (
        "sk-3f2a9b8c7d6e5f4a3b2c1d0e9f8a7b6c",  # DeepSeek's: 32 hex digits
        "sk-proj-Ab3_dEf-GhIjKlMnOpQrStUvWx",
        "sk-aBcDeFgHiJkLmNoPqRsTuVwXyZ",  # (letters alone, mixed case)
        "sk-" + "qwertyuiopasdfghjklzxcvbnm" * 2,  # SiliconFlow's: 48 small letters
        "sk-ant-api03-ab1d2x9qkz",  # (a key wrapped right after its provider's prefix)
    ):
        assert redact_text(f"{key} {text}") == f"{REDACTED} {text}"
    # a URL's user name that begins so is no exception: its password goes
    for url in ("postgres://sk-app:hunter2hunter2@db:5432/app", "https://sk-bot:gh4x9Qw@git.x/y"):
        assert "hunter2" not in redact_text(url) and "gh4x9Qw" not in redact_text(url)


def test_a_schema_property_named_authentication_is_no_credential() -> None:
    """Only Azure's ``data_sources`` authentication object (its ``type`` one of Azure's) has
    every string a credential: a tool schema's property of that name keeps its words."""
    schema = {"authentication": {"type": "string", "description": "how to sign in"}}
    assert redact(schema) is schema
    azure = {"authentication": {"type": "connection_string", "connection_string": "Server=x"}}
    assert redact(azure)["authentication"]["connection_string"] == REDACTED


def test_bearer_token_keeps_the_scheme_and_loses_the_token() -> None:
    header = "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl"
    assert redact_text(header) == "Authorization: Bearer [REDACTED]"
    assert (
        redact_text("authorization: bearer abcdef0123456789") == "authorization: bearer [REDACTED]"
    )


JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJhZG1pbiIsImV4cCI6MTczNTY4OTYwMH0."
    "Xq3bW9cK2mZ8pL1vN4rT7yU0iO5aS6dF9gH2jK3lZ4x"
)
SENDGRID = "SG.ngeVfQFYQlKU0ufo8x5d1A.TwL2iGABf9DHoTf09kqeF8tAmbihYzrnopKc1s5cr"


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        (f"aws_secret_access_key = {AWS_SECRET}", "aws_secret_access_key = [REDACTED]"),
        (f'AWS_SECRET_ACCESS_KEY="{AWS_SECRET}"', 'AWS_SECRET_ACCESS_KEY="[REDACTED]"'),
        (
            "DATABASE_URL=postgres://app:hunter2@db:5432/x",
            "DATABASE_URL=postgres://[REDACTED]@db:5432/x",
        ),
        (
            "git clone https://bot:glpat-x@gitlab.example/r",
            "git clone https://[REDACTED]@gitlab.example/r",
        ),
        ("http://u:p@h", "http://[REDACTED]@h"),
        # a raw "@" in the password: all of it, to the host (most of it was left)
        (
            "postgres://admin:p@ssw0rd!@db.example.com/prod",
            "postgres://[REDACTED]@db.example.com/prod",
        ),
        # dotted values after lower-case names: a JWT's, a SendGrid key's parts are no
        # attribute chain (they were left whole)
        (f"access_token={JWT}", "access_token=[REDACTED]"),
        (f"token: {JWT}", "token: [REDACTED]"),
        (f"--api-key {SENDGRID}", "--api-key [REDACTED]"),
        ("api_key = settings.OPENAI_API_KEY", "api_key = settings.OPENAI_API_KEY"),  # code
        # long names with digits are code too when they are words joined by underscores
        ("password = settings.database_password_v2", "password = settings.database_password_v2"),
        ("token = tokens.special_tokens_map_v2.eos", "token = tokens.special_tokens_map_v2.eos"),
        # the host stays when a "?" or "#" after it holds an "@"
        ("https://user:pw@host?x=a@b", "https://[REDACTED]@host?x=a@b"),
        ("https://user:pw@host#frag@x", "https://[REDACTED]@host#frag@x"),
    ],
)
def test_named_secrets_and_url_passwords_lose_only_the_secret(text: str, redacted: str) -> None:
    assert redact_text(text) == redacted
    assert line_may_hold_secret(text.encode())


PEM = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "QyNTUxOQAAACBHK2Ow5bq0+Go1TfaJyE3K9Lh8hAB7GTSSVz6xlT1IawAAAJiXDLsulwy7\n"
    "-----END OPENSSH PRIVATE KEY-----"
)


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        # Authorization headers in text (a curl command in a tool's output), any scheme
        (
            'curl -H "Authorization: Basic dXNlcjpwYXNzd29yZA==" https://api.example.com',
            'curl -H "Authorization: Basic [REDACTED]" https://api.example.com',
        ),
        ("authorization: Token 9944b09199c62bcf9418ad84", "authorization: Token [REDACTED]"),
        ("Authorization: Bearer abcdefghijklmnop", "Authorization: Bearer [REDACTED]"),
        # .env lines an agent cats
        ("DATABASE_PASSWORD=hunter22xx\nDEBUG=1", "DATABASE_PASSWORD=[REDACTED]\nDEBUG=1"),
        ('SECRET_KEY="django-insecure-4f9x"', 'SECRET_KEY="[REDACTED]"'),
        ("JWT_SECRET=s3cr3tvalue", "JWT_SECRET=[REDACTED]"),
        ("TWILIO_AUTH_TOKEN=0123456789abcdef0123", "TWILIO_AUTH_TOKEN=[REDACTED]"),
        ("redis:\n  password: hunter2", "redis:\n  password: [REDACTED]"),
        # JSON inside a string: a tool call's arguments, an API's answer in a tool output
        ('{"api_key": "zz9aa8bb7cc6dd5ee", "n": 1}', '{"api_key": "[REDACTED]", "n": 1}'),
        ('{"client_secret": "abcDEF123456"}', '{"client_secret": "[REDACTED]"}'),
        ("https://x.example/cb?access_token=ya29.a0AfH6SMB&x=1", None),
        # other layouts: INI, a flag, .npmrc, a quoted value with spaces, escapes in JSON,
        # a YAML list item, an Authorization header with a bare token
        ("[db]\npassword = hunter2abc", "[db]\npassword = [REDACTED]"),
        ("psql --password=hunter2abc db", "psql --password=[REDACTED] db"),
        ("//registry.npmjs.org/:_authToken=npm_" + "aBcDeFgHiJ" * 3 + "abcdef", None),
        ('DB_PASSWORD="a b c d e f"', 'DB_PASSWORD="[REDACTED]"'),
        ('{"password": "ab\\"cd\\"efgh"}', '{"password": "[REDACTED]"}'),
        ('env:\n  - password: "aB3$x! 9#Qz"', 'env:\n  - password: "[REDACTED]"'),
        ("Authorization: 0123456789abcdef0123", "Authorization: [REDACTED]"),
        ('{"apikey": "abcdef123456", "x-api-key": "zyxwvu987654"}', None),
        # names that end in a credential's word, a version or a suffix
        ("OPENAI_KEY=hunter2hunter", "OPENAI_KEY=[REDACTED]"),
        ("SUPABASE_SERVICE_ROLE_KEY=eyJabc.def123", "SUPABASE_SERVICE_ROLE_KEY=[REDACTED]"),
        ("SECRET_KEY_BASE=abcdef123456", "SECRET_KEY_BASE=[REDACTED]"),
        ("WEBHOOK_SECRET_V2=abcdef123456", "WEBHOOK_SECRET_V2=[REDACTED]"),
        ("export JWT_TOKEN=eyJhbGciOi.eyJzdWIiOiIx.c2lnbmF0dXJl", "export JWT_TOKEN=[REDACTED]"),
        ("GOOGLE_TOKEN=ya29.xxxabcdef", "GOOGLE_TOKEN=[REDACTED]"),
        ("DB_PWD=hunter2abc", "DB_PWD=[REDACTED]"),
        ("DB_PASS=hunter2abc", "DB_PASS=[REDACTED]"),
        ("redis://:hunter2abc@localhost:6379/0", "redis://[REDACTED]@localhost:6379/0"),
        # a header in a command
        (
            "curl -H 'X-Api-Key: abc123def456' https://x",
            "curl -H 'X-Api-Key: [REDACTED]' https://x",
        ),
        ('-H "X-Auth-Token: abcdef123456"', '-H "X-Auth-Token: [REDACTED]"'),
        # a private key, whole or cut off
        (f"cat ~/.ssh/id_ed25519\n{PEM}\ndone", None),
        (PEM[:120], None),
        # cut off with text after it, as a tool truncates an output: its body ran on to it
        (PEM[:120] + "\n[output truncated]", None),
        (PEM[:120] + "\n(exit code 0)", None),
        (PEM[:120] + "... (truncated, 2,300 more characters)", None),
    ],
)
def test_credentials_named_in_text_lose_their_value(text: str, redacted: str | None) -> None:
    out = redact_text(text)
    if redacted is not None:
        assert out == redacted
    assert line_may_hold_secret(text.encode())
    assert redact_text(out) == out  # idempotent
    for secret in (
        "ya29.a0AfH6SMB",
        "b3BlbnNzaC1rZXkt",
        "QyNTUxOQAAACBHK2Ow5bq0",
        "npm_aBcDeFgHiJ",
        "abcdef123456",
        "zyxwvu987654",
    ):
        assert secret not in out
    if "PRIVATE KEY" in text:
        assert "-----BEGIN OPENSSH PRIVATE KEY-----[REDACTED]" in out


@pytest.mark.parametrize(
    "text",
    [
        "max_tokens: 1000",
        "prompt_tokens=12345678",  # a count: no letter
        "the tokenizer: bert-base-uncased",
        "the secret of a good cache is a stable prefix",
        "password_hash = bcrypt(password)",
        "Authorization: required",  # too short for a credential
        # code that names credentials without holding one
        "token = self.tokenizer.encode(text)",
        "password: Optional[str] = None",
        'api_key = os.environ["OPENAI_API_KEY"]',
        "authorization = authorization_header_value.strip()",
        "cache_key = make_key(request)",
        "export GITHUB_TOKEN=$TOKEN",
        "token=self.tokenizer",
        "tokenizer: bert-base-uncased",
        '"tokenizer_class": "LlamaTokenizerFast"',
        '"token_type": "Bearer"',
        '"prompt_cache_key": "session-abc123"',
        "primary_key: user_id_x",
        "secretName: db-credentials",
        "monkey = banana12345",
        "    key: pip-cache-v1",
        '{"Key": "uploads/2024/image.png"}',
        "    key=lambda x: x[1],",
        '{"pad_token": "<|endoftext|>", "mask_token": "[MASK]"}',
        "    token: TokenType",
        "    api_key: SecretStr",
        "self.password = password",
        'public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5"',
        '["token=self.tokenizer"]',
        "cache_key = abcdef123456",
        'if line.startswith("-----BEGIN PRIVATE KEY-----"):\n    return parse_pem(line)',
    ],
)
def test_text_that_only_mentions_credentials_is_left_alone(text: str) -> None:
    assert redact_text(text) is text


def test_several_secrets_in_one_string() -> None:
    text = f"a={OPENAI_KEY} b={AWS_ID} c={SLACK_TOKEN}"
    assert redact_text(text) == f"a={REDACTED} b={REDACTED} c={REDACTED}"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "short sk-abc",
        "the task-abcdefghijklmnopqrstuvwxyz finished",  # a word ending in "sk-"
        "AKIA is a prefix, AKIAshort is not a key",
        "the bearer of good news",
        "def f(x):\n    return x * 2  # ordinary code, nothing secret here at all",
        "see https://example.com/a:b and git@github.com:org/repo.git",  # no user:password@
        "the task_live_and_test_ cases and xAIza are words",
        "self.hf_model_name_for_this_run, the glpat- and gsk_ prefixes alone, a dask_live_ run",
        "fw_update_check_for_the_device, model_v1_final, xai-grok-4-fast-reasoning, r8_cache",
        "SG.config.load() and ya29.short and do_v1_things and lsv2_pt_ alone",
        "status = fw_GetFirmwareVersionString(dev); #define fw_maxretrycountforupdates 5",
        "/opt/firmware/fw_0123456789ABCDEF01234567.img",
        "SG.AllowAllOutboundTraffic.ConnectionsFromAnywhere",
        "a 40-character value alone: wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    ],
)
def test_ordinary_text_is_returned_unchanged_as_the_same_object(text: str) -> None:
    assert redact_text(text) is text


def test_redact_returns_the_same_object_when_nothing_changed() -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "hello there, how are you"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "n": 3}]},
    ]
    assert redact(messages) is messages


def test_redact_copies_only_the_changed_path_and_never_mutates_the_input() -> None:
    untouched = {"role": "system", "content": "You are a helpful assistant."}
    leaky = {"role": "user", "content": [{"type": "text", "text": f"my key is {OPENAI_KEY}"}]}
    event = {"type": "request", "appended": [untouched, leaky], "model": "gpt-4o"}
    before = copy.deepcopy(event)

    out = redact(event)

    assert event == before
    assert out == {
        "type": "request",
        "appended": [
            untouched,
            {"role": "user", "content": [{"type": "text", "text": f"my key is {REDACTED}"}]},
        ],
        "model": "gpt-4o",
    }
    assert out["appended"][0] is untouched
    assert list(out) == list(event)  # key order kept


def test_credential_fields_are_redacted_whatever_their_value() -> None:
    headers = {"Authorization": "Basic dXNlcjpwYXNz", "X-Api-Key": "abc", "accept": "json"}
    assert redact(headers) == {"Authorization": REDACTED, "X-Api-Key": REDACTED, "accept": "json"}


def test_secrets_in_keys_and_tuples_are_redacted() -> None:
    assert redact({OPENAI_KEY: 1}) == {REDACTED: 1}
    assert redact(("x", AWS_ID)) == ("x", REDACTED)
    assert redact(42) == 42


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)
_key_body = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789",
    min_size=20,
    max_size=48,
)


@settings(max_examples=200, deadline=None)
@given(
    before=_text, after=_text, body=_key_body, prefix=st.sampled_from(["sk-", "sk-proj-", "ghp_"])
)
def test_a_key_anywhere_never_survives(before: str, after: str, body: str, prefix: str) -> None:
    key = prefix + body
    # (an ``sk-`` run of letters alone or digits alone, 20 zeros, is a name's shape, no key's:
    # a key's random letters and digits have both, ``test_sk_names_are_no_keys``)
    assume(not key.startswith("sk-") or sk_key_shaped(key))
    out = redact_text(f"{before} {key} {after}")
    assert key not in out
    assert redact_text(out) == out  # idempotent


@given(
    st.text(alphabet=st.characters(codec="ascii"), max_size=40),
    st.sampled_from(
        [
            OPENAI_KEY,
            PROJECT_KEY,
            ANTHROPIC_KEY,
            AWS_ID,
            "ASIAIOSFODNN7EXAMPLE",
            GITHUB_TOKEN,
            GITHUB_PAT,
            SLACK_TOKEN,
            "gho_16C7e42F292c6912E7710c838347Ae178B4a",
            "Bearer abcdefghijklmnop",
            "BEARER abcdefghijklmnop",
            "bearer abcdefghijklmnop",
            *MORE_KEYS,
            f"aws_secret_access_key={AWS_SECRET}",
            "redis://default:s3cr3t@cache:6379",
            "Authorization: Basic dXNlcjpwYXNzd29yZA==",
            "DB_PASSWORD=hunter22xx",
            '"client_secret": "abcDEF123456"',
            "TWILIO_AUTH_TOKEN=0123456789abcdef0123",
            PEM,
        ]
    ),
    st.text(alphabet=st.characters(codec="ascii"), max_size=40),
)
def test_the_fast_prefilter_never_hides_a_secret_the_pattern_finds(
    before: str, secret: str, after: str
) -> None:
    text = f"{before} {secret} {after}"
    assert (_SECRET.search(text) is not None) <= _may_hold_secret(text)
    assert secret not in redact_text(text)


_values = st.recursive(
    st.one_of(
        st.none(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.text(max_size=30),
        st.sampled_from(
            [
                OPENAI_KEY,
                AWS_ID,
                GITHUB_TOKEN,
                SLACK_TOKEN,
                "Bearer abcdefghijklmnop",
                *MORE_KEYS,
                f"AWS_SECRET_ACCESS_KEY: {AWS_SECRET}",
                "amqp://guest:guest@rabbit/",
                "Authorization: Basic dXNlcjpwYXNzd29yZA==",
                "SMTP_PASSWORD=hunter22xx",
                '{"api_key": "zz9aa8bb7cc6dd5ee"}',
                PEM,
            ]
        ),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(
                st.text(max_size=8),
                st.sampled_from(["Authorization", "api_key", "X-Api-Key", "apikey", "content"]),
            ),
            children,
            max_size=4,
        ),
    ),
    max_leaves=12,
)


@given(_values)
def test_a_serialized_line_without_the_literals_needs_no_redaction(value: object) -> None:
    import orjson

    line = orjson.dumps(value)
    if not line_may_hold_secret(line):
        assert redact(value) == value


def test_every_credential_key_is_caught_by_the_line_prefilter_in_any_case() -> None:
    import orjson

    from proxy.redact import _SECRET_KEYS

    for key in _SECRET_KEYS:
        for spelling in (key, key.upper(), key.title()):
            line = orjson.dumps({"headers": {spelling: "x"}})
            assert line_may_hold_secret(line), spelling
            assert redact({spelling: "x"}) == {spelling: "[REDACTED]"}


def test_a_request_lines_parameters_do_not_send_it_down_the_slow_path() -> None:
    """``max_tokens`` is in nearly every request's parameters: the line prefilter looks for
    credential names as assigned names, not for the word anywhere."""
    import orjson

    line = orjson.dumps({"type": "request", "params": {"max_tokens": 1000, "top_p": 1}})
    assert not line_may_hold_secret(line)
    for named in ('{"token": "abcdef123"}', "TOKEN=abcdef123", '"client_secret"', "passwd"):
        assert line_may_hold_secret(orjson.dumps({"content": named})), named
    # a key named inside a JSON string (a tool call's arguments), any spelling
    for key in ("apikey", "x-api-key", "API_KEY"):
        arguments = orjson.dumps({key: "abcdef123456"}).decode()
        assert line_may_hold_secret(orjson.dumps({"arguments": arguments})), key
        assert "abcdef123456" not in redact_text(arguments), key


@pytest.mark.parametrize(
    "content",
    [
        "DB_PASSWORD=hunter2hunter\nX=1",  # a .env file a tool call writes
        '{"password": "hunter2hunter"}',  # a JSON file
        "db:\n  password: hunter2hunter\n",  # a YAML file
        "db:\n  password: hunter2hunter",  # ... that ends there
        "DB_PASSWORD=hunter2hunter",  # ... and a .env one
        "X=1\nAPI_KEY=hunter2hunter\n",  # not on its first line
        "[db]\npassword = hunter2hunter",  # INI
        'export PGPASSWORD="hunter2hunter"',  # quoted, so escaped in the arguments
        "-----BEGIN OPENSSH PRIVATE KEY-----\nhunter2hunterAAAA\n-----END OPENSSH PRIVATE KEY-----\n",
        "-----BEGIN OPENSSH PRIVATE KEY-----\nhunter2hunterAAAA",  # cut off
    ],
)
def test_a_file_a_tool_call_writes_loses_its_credentials(content: str) -> None:
    """The file is a string inside the call's ``arguments``, itself a JSON string: its line ends
    are ``\\n`` and its quotes ``\\"`` there."""
    import orjson

    arguments = orjson.dumps({"path": "app/.env", "content": content}).decode()
    event = {"appended": [{"role": "assistant", "tool_calls": [{"arguments": arguments}]}]}
    assert line_may_hold_secret(orjson.dumps(event))
    assert "hunter2hunter" not in orjson.dumps(redact(event)).decode()


@pytest.mark.parametrize(
    "text",
    [
        # an OpenAPI spec: "bearer" ends its line, the next line's key is no token
        "securitySchemes:\n  auth:\n    scheme: bearer\n    bearerFormat: JWT\n",
        # code an agent reads: a URL template's placeholders are no password
        'create_engine(f"postgresql://{user}:{password}@{host}/{db}")',
        'DATABASE_URL="mysql://${DB_USER}:${DB_PASS}@db:3306/app"',
        # a program's URL pattern: ``\w+`` is no user (a backslash there only as an escape's)
        'conn_re = re.compile(r"postgres://\\w+:\\w+@\\w+/\\w+")',
        "pattern: ^https?://\\w+:\\w+@example$",
        # an `env` listing: the shell's working directories are no password
        "HOME=/home/u\nPWD=/home/u/project\nOLDPWD=/home/u\nSHELL=/bin/bash\n",
    ],
)
def test_text_that_only_looks_like_a_credential_is_left_as_it_is(text: str) -> None:
    """Each of these lost text in the log (and in replay): a key name merged into the line
    before, a template cut to ``[REDACTED]@{host}``, ``PWD=[REDACTED]``."""
    assert redact_text(text) == text


def test_a_shell_directory_variable_does_not_shelter_a_password() -> None:
    text = "PWD=/home/u\nDB_PWD=hunter2abc\nMY_PWD=secretsecret\nX=1 OLDPWD=/tmp"
    assert redact_text(text) == (
        "PWD=/home/u\nDB_PWD=[REDACTED]\nMY_PWD=[REDACTED]\nX=1 OLDPWD=/tmp"
    )
    assert redact_text("postgres://bob:hunter2xyz@db/app") == "postgres://[REDACTED]@db/app"


def test_a_key_whose_slashes_a_json_encoder_escaped_is_redacted_whole() -> None:
    """Tool-call arguments written by an encoder that escapes "/" as "\\/" (PHP's, some
    models'): the value stopped at the backslash, and 30 of the secret's 40 characters were
    logged; a Bearer token so escaped was logged whole."""
    import orjson

    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    content = f"AWS_SECRET_ACCESS_KEY={secret}\nAuthorization: Bearer ab/cdefghijklmnopqrstu0123"
    arguments = orjson.dumps({"path": ".env", "content": content}).decode().replace("/", "\\/")
    assert "\\/K7MDENG\\/" in arguments
    event = {"appended": [{"role": "assistant", "tool_calls": [{"arguments": arguments}]}]}
    line = orjson.dumps(redact(event)).decode()
    for piece in ("K7MDENG", "bPxRfiCY", "cdefghijklmnop"):
        assert piece not in line


def test_overlapping_values_are_redacted_whole() -> None:
    text = '"secret": "abcdef PASSWORD=\'xyzxyz" tail tail\''
    out = redact_text(text)
    assert "xyzxyz" not in out and "abcdef" not in out


def test_many_names_before_a_secret_do_not_hide_it() -> None:
    assert "abcdef123456" not in redact_text("token " * 1001 + "\nAPI_KEY=abcdef123456")
    assert "abcdef123456" not in redact_text("OPENAI_API_KEY=abcdef123456\n" + "token " * 1001)


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        # a literal assigned to a credential's name in code, wherever the name stands
        ('const API_KEY = "hunter2hunter";', 'const API_KEY = "[REDACTED]";'),
        ("let token = 'hunter2hunter'", "let token = '[REDACTED]'"),
        ('String apiKey = "hunter2hunter";', 'String apiKey = "[REDACTED]";'),
        ('private static final String DB_PASSWORD = "hunter2hunter";', None),
        ('client = Client(api_key="hunter2hunter", timeout=3)', None),
        ('const cfg = { user: "bob", password: "hunter2hunter" };', None),
        ('token := "hunter2hunter"', 'token := "[REDACTED]"'),
        ('$password => "hunter2hunter"', '$password => "[REDACTED]"'),
        (':password => "hunter2hunter"', ':password => "[REDACTED]"'),
        # a quoted name: an index, a PHP array, a Python dict printed
        ('os.environ["OPENAI_API_KEY"] = "hunter2hunter"', None),
        ("config['db_password'] = 'hunter2hunter'", "config['db_password'] = '[REDACTED]'"),
        ("'password' => 'hunter2hunter',", "'password' => '[REDACTED]',"),
        ("{'api_key': 'hunter2hunter', 'model': 'gpt-4o'}", None),
        # a password of digits only, quoted
        ('{"password": "802519374650"}', '{"password": "[REDACTED]"}'),
        ('PIN_SECRET="80251937"', 'PIN_SECRET="[REDACTED]"'),
        # passwords given to commands without a name
        ("curl -u admin:hunter2hunter https://x", "curl -u admin:[REDACTED] https://x"),
        ("curl -s --user 'admin:hunter2hunter' https://x", None),
        ("curl -uadmin:hunter2hunter https://x", "curl -uadmin:[REDACTED] https://x"),
        ("curl -U proxyuser:hunter2hunter https://x", None),
        ("mysql -h db -uroot -phunter2hunter app", "mysql -h db -uroot -p[REDACTED] app"),
        ("mysqldump -u root -phunter2hunter app > a.sql", None),
        ("mysql -u root -p'hunter2hunter' app", "mysql -u root -p'[REDACTED]' app"),
        ('mysql -u root -p"hunter2hunter" app', 'mysql -u root -p"[REDACTED]" app'),
        ("docker login -u bob -p 'hunter2hunter' r.io", "docker login -u bob -p '[REDACTED]' r.io"),
        ("sshpass -p hunter2hunter ssh deploy@web1", "sshpass -p [REDACTED] ssh deploy@web1"),
        ("sshpass -p'hunter2hunter' scp a b:", "sshpass -p'[REDACTED]' scp a b:"),
        ("redis-cli -h cache -a hunter2hunter ping", "redis-cli -h cache -a [REDACTED] ping"),
        ("redis-cli --pass hunter2hunter info", "redis-cli --pass [REDACTED] info"),
        # a lower-case name given a value inside a command's line
        (
            "kubectl create secret generic db --from-literal=password=hunter2hunter",
            "kubectl create secret generic db --from-literal=password=[REDACTED]",
        ),
        (
            "helm upgrade app ./chart --set db.password=hunter2hunter --set image.tag=v2",
            "helm upgrade app ./chart --set db.password=[REDACTED] --set image.tag=v2",
        ),
        ("terraform apply -var 'db_password=hunter2hunter'", None),
        ("docker run -e db_password=hunter2hunter app:1", None),
        ("make seed && admin_token=hunter2hunter ./run.sh", None),
        ('psql "host=db user=app password=hunter2hunter dbname=app"', None),
        (
            'curl -d "client_secret=hunter2hunter&grant_type=client_credentials" https://x',
            'curl -d "client_secret=[REDACTED]&grant_type=client_credentials" https://x',
        ),
        ("x=$(kubectl get x --from-literal=password=hunter2hunter)", None),
        # (from a review: a quoted snake_case value, values in quotes with blanks or brackets,
        # names after a list's comma, a property's -D, Hydra's +, sed's /, in a subshell or in
        # a string inside a call; a second option of sshpass; ODBC's PWD; aws configure)
        ("docker run -e db_password='hunter2hunter_ok' app", None),
        ("x; db_password='hunter2hunter_ok' ./run", None),
        ("mysql -u root -p'hunter2hunter horse' app", "mysql -u root -p'[REDACTED]' app"),
        ("sshpass -p 'hunter2hunter horse' ssh x", "sshpass -p '[REDACTED]' ssh x"),
        ("sshpass -f ~/.pw -p hunter2hunter ssh x", "sshpass -f ~/.pw -p [REDACTED] ssh x"),
        ("redis-cli -a 'hunter2hunter horse'", "redis-cli -a '[REDACTED]'"),
        ("terraform apply -var 'db_password=hunter2hunter(3)x'", None),
        ("terraform apply -var 'db_password=hunter2hunter,prod'", None),
        ("helm install app ./c --set image.tag=v2,db.password=hunter2hunter", None),
        ("mvn -Dspring.datasource.password=hunter2hunter spring-boot:run", None),
        ("gradle publish -PsigningPassword=hunter2hunter", None),
        ("app -password=hunter2hunter -port=80", "app -password=[REDACTED] -port=80"),
        ("python train.py +db.password=hunter2hunter", None),
        ("sed -i 's/^db_password=.*/db_password=hunter2hunter/' .env", None),
        ("(cd infra && terraform apply -var db_password=hunter2hunter)", None),
        ('run(["kubectl", "create", "secret", "--from-literal=password=hunter2hunter"])', None),
        ("Driver={ODBC};Server=db;UID=sa;PWD=hunter2hunter;", None),
        # (from a second review: a quoted word's value read again to its first blank, a
        # setting after a ';' in it; quoted aws and curl values; ODBC's braced value)
        ("ssh deploy@web1 'token=hunter2hunter ./deploy.sh'", None),
        ("ssh db 'pwd=/srv/app; MYSQL_PWD=hunter2hunter mysql -uroot app'", None),
        ('sh -c "pwd=/srv/app;MYSQL_PWD=hunter2hunter mysql -uroot app"', None),
        ("ssh h 'gpg_key=hunter2hunter9Zk8Qw3 make release'", None),
        (
            'aws configure set aws_secret_access_key "hunter2hunterFEMI/K7MDENG/bPxRfiCYEXAMPL"',
            'aws configure set aws_secret_access_key "[REDACTED]"',
        ),
        (
            "curl -u 'admin:hunter2hunter horse battery' https://x",
            "curl -u 'admin:[REDACTED]' https://x",
        ),
        (
            'connect("DRIVER={ODBC Driver 18};SERVER=db;UID=sa;PWD={hunter2hunter};")',
            'connect("DRIVER={ODBC Driver 18};SERVER=db;UID=sa;PWD={[REDACTED]};")',
        ),
        ('{"password": "{hunter2hunter}"}', '{"password": "[REDACTED]"}'),
        # (from a third review: a literal in a call continued from an earlier line, or in a
        # string given to a call; templates that hold a literal; a literal $ in single quotes;
        # a format spec or ODBC's value with a colon; a variable's default, unquoted)
        ('c = psycopg2.connect(\n    host="db", password="hunter2hunter")', None),
        (
            'os.system("kubectl create secret generic db --from-literal=password=hunter2hunter")',
            None,
        ),
        (
            "OUT=$(docker run --rm "
            + "-v aaaaaaaaaa:bbbbbbbbbbbbbbbbbbbb " * 12
            + "-e db_password=hunter2hunter)",
            None,
        ),
        ("password: \"{{ 'hunter2hunter' | password_hash('sha512') }}\"", None),
        ("password: \"{{ db_password | default('hunter2hunter') }}\"", None),
        ("password: \"${{ 'hunter2hunter' }}\"", None),
        ("sshpass -p '{{ \"hunter2hunter\" }}' ssh host", None),
        ("mysql -uroot -p'$hunter' app", "mysql -uroot -p'[REDACTED]' app"),
        ('{"password": "{x:hunter2hunter}"}', '{"password": "[REDACTED]"}'),
        ("PWD={admin:hunter2hunter!};", "PWD={[REDACTED]};"),
        ("POSTGRES_PASSWORD: ${POSTGRES_PASSWORD:-hunter2hunter}", None),
        ("export DB_PASSWORD=${DB_PASSWORD:-hunter2hunter}", None),
        # (from a fourth review: a $( continued on the next line; a lookup's keyword literal;
        # a default in a URL, a command, quoted, Spring's; a braced value outside a format
        # string, JSX or C#'s interpolation)
        ("TOKEN=$(curl -s https://auth/token \\\n  -d client_secret=hunter2hunter)", None),
        (
            "db_password: \"{{ lookup('vault', 'db', username='admin',"
            " password='hunter2hunter') }}\"",
            None,
        ),
        ("- DATABASE_URL=postgres://app:${POSTGRES_PASSWORD:-hunter2hunter}@db/app", None),
        ('mysql -uroot -p"${MYSQL_ROOT_PASSWORD:-hunter2hunter}"', None),
        ('POSTGRES_PASSWORD: ${POSTGRES_PASSWORD:-"hunter2hunter"}', None),
        ("spring.datasource.password=${DB_PASSWORD:hunter2hunter}", None),
        ("Driver={ODBC};Server=db;Password={Hunter2hunterHorse};", None),
        ('password = "{Hunter2hunterHorse}"', None),
        # (from a fifth review: a braced value on a line with a tag, an apostrophe or a bash
        # $'…' before it; a tab-indented setting in a format string's literal)
        (
            '<add name="db" connectionString="Driver={ODBC};UID=sa;PWD={hunter2hunter};" />',
            '<add name="db" connectionString="Driver={ODBC};UID=sa;PWD={[REDACTED]};" />',
        ),
        ("export CONN=$'Driver={x};UID=sa;PWD={hunter2hunter}'", None),
        ("Jeff's DSN: Driver={ODBC};UID=sa;PWD={hunter2hunter};", None),
        ('cfg.write(f"\\ttoken = hunter2hunter\\n")', None),
        ('echo "' + "x" * 300 + ' -f" PWD={Hunter2hunterHorse};', None),
        # (from a seventh review: a literal in a field's subscript; a whole quoted value)
        ("Server=db;UID=sa;PWD={p[hunter2hunter!]};", None),
        ('{"db_password": "{pw[hunter2hunter-9]}"}', None),
        ('{"password": "{hunterhunter}"}', '{"password": "[REDACTED]"}'),
        (
            "aws configure set aws_secret_access_key hunter2hunterFEMI/K7MDENG/bPxRfiCYEXAMPL",
            "aws configure set aws_secret_access_key [REDACTED]",
        ),
        # a variable's default is a literal, as is a value that only starts like a variable
        ('DB_PASSWORD="${DB_PASSWORD:-hunter2hunter}"', 'DB_PASSWORD="[REDACTED]"'),
        ('password: "$hunter2hunter"', 'password: "[REDACTED]"'),
        # an Authorization header of any scheme
        ("Authorization: ApiKey hunter2hunter12", "Authorization: ApiKey [REDACTED]"),
        ('-H "Authorization: SSWS 00hunter2hunter-AB"', '-H "Authorization: SSWS [REDACTED]"'),
    ],
)
def test_credentials_assigned_in_code_or_given_to_commands_lose_their_value(
    text: str, redacted: str | None
) -> None:
    out = redact_text(text)
    if redacted is not None:
        assert out == redacted
    assert "hunter2hunter" not in out and "802519374650" not in out and "80251937" not in out
    assert redact_text(out) == out  # idempotent
    import orjson

    assert line_may_hold_secret(orjson.dumps({"content": text}))  # the writer's prefilter too
    # ... and in a file a tool call writes (quotes escaped inside the call's arguments)
    arguments = orjson.dumps({"path": "app/config.js", "content": text}).decode()
    event = {"appended": [{"role": "assistant", "tool_calls": [{"arguments": arguments}]}]}
    assert line_may_hold_secret(orjson.dumps(event))
    assert "hunter2hunter" not in orjson.dumps(redact(event)).decode()


@pytest.mark.parametrize(
    "text",
    [
        'if password == "hunter2hunter":',  # a comparison, not an assignment
        'token = make_token("hunter2hunter")',  # code: a call
        'api_key = os.environ["OPENAI_API_KEY"]',
        'assert config["password"] != "hunter2hunter"',
        "mysql -h db -P 3306 -u root -p app",  # -p alone asks; -P is a port
        'curl -u "$USER" https://x',  # no password given
        "Authorization: Bearer tokens are supported",  # prose
        "the curl and mysql commands --user and -p flags",
        'mysql -u root -p"$MYSQL_ROOT_PASSWORD" app',  # a variable, quoted
        "redis-cli -a $REDIS_PASSWORD ping",
        "sshpass -e ssh deploy@web1",  # the password from $SSHPASS
        # a keyword argument in a call is code, as is a string that ends at the name's "="
        "conn = psycopg.connect(host=host, password=db_password_2024)",
        'query = "password=" + quote(secret_value_2024) + "&user=bob"',
        "kubectl create secret generic db --from-literal=password=$DB_PASSWORD",
        # a quoted value that only refers to the credential: a variable, a template's expression
        '      POSTGRES_PASSWORD: "${DB_PASSWORD}"',
        'export OPENAI_API_KEY="$AZURE_OPENAI_KEY"',
        'gh api --token "$GITHUB_TOKEN" /user',
        '{"db": {"password": "${DB_PASS}"}}',
        'api_key = "{{ vault_openai_api_key }}"',
        '  password: "{{ .Values.postgres.password }}"',
        # (a continued call's arguments: an attribute chain, a variable passed on; a setting's
        # digit or 20 characters are its own, not the next field's)
        "    request_token=request.resource_owner_key):",
        "    backup_id=backup_id, client_request_token=client_request_token",
        # (from a review: sshpass's -p only among its own options; comparisons; format fields)
        "sshpass -e ssh -p 2222 deploy@web1",
        "sshpass -e ssh deploy@web1 mkdir -p /srv/app/releases",
        "sshpass -e rsync -av -e 'ssh -p 2222' ./dist/ h:/srv/",
        "if password==password2:",
        "assert secret==expected_secret_value_x",
        "return password===confirmationPassword;",
        'print(f"password={password}")',
        "log.info(f'token={token!r}')",
        "PWD=/home/bob",
        # (from a second review: references in CI, Terraform, Helm and Ansible files; a call's
        # arguments continued on another line; format-string fields)
        'password: "${{ secrets.DB_PASSWORD }}"',
        'api_key = "${var.api_key}"',
        'password: "{{ .Values.db.password | b64enc }}"',
        'db_password: "{{ vault_db_password | default(omit) }}"',
        "token: \"{{ lookup('env', 'GITHUB_TOKEN') }}\"",
        'DB_PASSWORD="${DB_PASSWORD:?is not set}"',
        "db = Database(host=DB_HOST,\n    password=DB_PASSWORD_2)",
        "key = kms.create(\n    encrypted=True,kms_key_id='arn:aws:kms:us-east-1:123456789012:key/ab12')",
        'conn_str = f"host={host};password={password};"',
        'os.system(f"mysql -uroot -p{password} app")',
        "Server=tcp:db.example.com;Pwd={your_password_here};",
        # (from a third review: JSX's, C#'s and f-strings' fields of a name with no digit)
        '<StripeProvider apiKey={stripeKey} locale="en">',
        "<Api apiKey={process.env.REACT_APP_API_KEY} />",
        # (from a sixth review: a field in a format string with an escape, in a tool call's
        # escaped arguments, in a JSX line inside a string)
        'print(f"password={password}\\n")',
        '{"code": "print(f\\"password={password}\\")"}',
        'echo "<Provider apiKey={apiKey} />" > App.jsx',
        'println!("PWD={pwd};");',
        'format!("password={password:?}")',
        'format!("api_key={api_key:>width$}")',
        'logger.debug(f"secret={self._secretKey} ")',
        # (from a fourth review: format fields with an index or a spec; templates of no
        # literal; a default that is another variable or a path)
        'print(f"api_key={api_key[:6]} loaded")',
        'log.debug(f"password={password:*^10}")',
        "log.debug(f\"access_token={resp['access_token']}\")",
        "db_password: \"{{ hostvars['db1']['db_password'] }}\"",
        'ansible_password: "{{ vault_pw if use_vault else lookup_pw }}"',
        "password: '{{ .Values.password | default (randAlphaNum 16) | b64enc }}'",
        "GITHUB_TOKEN=${GITHUB_TOKEN:-${GH_TOKEN}}",
        "SSH_PRIVATE_KEY=${SSH_PRIVATE_KEY:-~/.ssh/id_ed25519}",
        # (from a fifth review: templates filled in later are format strings too)
        'msg = "password={password}".format(password=pw)',
        'let url = format!("redis://default@host?password={password}");',
        "aws cognito-idp x --token-validity-units AccessToken=minutes,IdToken=minutes,Days=1",
        "pip install -U requests; pytest -p no:cacheprovider",
        'nx.to_pandas_edgelist(G, edge_key="weight_attribute")',  # any lower-case *_key in code
        "config['sort_key'] = 'created_at'",
        'def sign(backend: "Backend", private_key: "RSAPrivateKey", data: bytes)',  # annotations
        # ... and alone on its line, where code and a setting look alike (all were redacted,
        # so a file the agent read or wrote was not the one in the log, nor in a replay)
        '    model_key = "gpt-4o"',
        '    translation_key = "errors.not_found"',
        '    storage_key = "uploads/avatars"',
        '    redis_key = "session:user"',
        'header_key = "content-type"\nargument_key = "arguments"\n',
        'field_key: "username"',
        '    storage_key = "/uploads/2024/avatars"',  # paths, with a date in them
        's3_key = "/exports/2025-01-31/report.csv"',
        "cache_dir_key: exports/2025-01-31/report.csv",
        'part_key = "data/2024/part-00001.parquet"',  # a Spark part file
    ],
)
def test_code_and_commands_that_give_no_credential_are_left_alone(text: str) -> None:
    assert redact_text(text) is text


LONG = "A1b2" * 450  # 1,800 characters: a JWT, an STS session token


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        # values of any length (they were cut at 512 characters: the rest, or all, leaked)
        (f"GITHUB_TOKEN={LONG}", "GITHUB_TOKEN=[REDACTED]"),
        (f'{{"access_token": "{LONG}"}}', '{"access_token": "[REDACTED]"}'),
        (f"Authorization: Token {LONG}", "Authorization: Token [REDACTED]"),
        (f"https://x/cb?access_token={LONG}&x=1", "https://x/cb?access_token=[REDACTED]&x=1"),
        # names that end in a count's word, but are no counts
        ("AWS_SESSION_TOKEN=IQoJb3JpZ2luX2VjEJr123", "AWS_SESSION_TOKEN=[REDACTED]"),
        ('{"SessionToken": "IQoJb3JpZ2luX2VjEJr123"}', '{"SessionToken": "[REDACTED]"}'),
        ("BACKEND_TOKEN=abc123def456", "BACKEND_TOKEN=[REDACTED]"),
        # a tab before the operator, CRLF line ends
        ("[client]\nuser\t= app\napi_key\t= 9f8e7d6c5b4a39281706\n", None),
        ("password: hunter2abc9\r\n", "password: [REDACTED]\r\n"),
        # a key whose name does not say which, alone on its line, when it looks like one
        ('sendgrid_key = "SG.abcdefgh12345678xyz"', 'sendgrid_key = "[REDACTED]"'),
        ("webhook_key: whsec_abc123def456ghi789\n", "webhook_key: [REDACTED]\n"),
        (  # base64 may start with "/": no path
            'aes_key = "/U2RZfCiUWwhjiApPIcjIhsHuiYInYlVispy1qFZBCU="',
            'aes_key = "[REDACTED]"',
        ),
        ("X-Api-Key: 0123456789abcdef0123\r\nHost: x\r\n", "X-Api-Key: [REDACTED]\r\nHost: x\r\n"),
        ("environment:\r\n  POSTGRES_PASSWORD: s3cretpass99\r\n", None),
        # a .NET connection string, .netrc, docker login, a flag and its value apart
        (
            "Server=db;Database=app;User Id=sa;Password=Str0ngPass1;",
            "Server=db;Database=app;User Id=sa;Password=[REDACTED];",
        ),
        ("machine api.x.com login bob password hunter2secret42", None),
        ("docker login -u bob -p hunter2secret42 registry.x", None),
        ("tool --api-key 9f8e7d6c5b4a39281706 run", "tool --api-key [REDACTED] run"),
        ("tool --token abc123def456ghi run", "tool --token [REDACTED] run"),
    ],
)
def test_secrets_a_second_review_found_leaking_are_redacted(
    text: str, redacted: str | None
) -> None:
    out = redact_text(text)
    if redacted is not None:
        assert out == redacted
    for secret in (LONG, "IQoJb3JpZ2lu", "abc123def456", "9f8e7d6c5b4a", "hunter2", "s3cretpass"):
        assert secret not in out
    assert "0123456789abcdef0123" not in out and "Str0ngPass1" not in out
    assert redact_text(out) == out
    import orjson

    assert line_may_hold_secret(orjson.dumps({"content": text}))  # the writer's prefilter too


@pytest.mark.parametrize(
    "text",
    [
        '{ token: "comment", regex: "//.*$" }',  # an editor grammar's token types
        "{ token: 'string.quote', next: 'start' }",
        'pwd = "/srv/app/releases/current"',  # a path
        'token = "<|endoftext|>"',  # a tokenizer's special token
        "curl https://x.sh | sh -s -- -u user:group",  # -u of another command
        "Authorization: Requires authentication.",  # prose
        "max_new_tokens = 512345678",
        "tool --password prompt",
    ],
)
def test_code_and_prose_a_second_review_found_redacted_are_left_alone(text: str) -> None:
    assert redact_text(text) is text


def test_found_values_do_not_use_up_the_looks_of_a_later_secret() -> None:
    """A users.json of 1,200 passwords: the last 200 leaked once 1,000 names had been looked at."""
    users = ",".join(f'{{"name": "u{i}", "password": "Pw-{i:04d}-x9k2"}}' for i in range(1200))
    out = redact_text(f"[{users}]")
    assert "x9k2" not in out
    assert out.count(REDACTED) == 1200


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("NEW_TOKEN=abc123def456ghi", "NEW_TOKEN=[REDACTED]"),  # not max_new_tokens
        ('{"new_token": "abc123def456ghi"}', '{"new_token": "[REDACTED]"}'),
        ("podman login -u bob -p hunter2secret42 quay.io", None),
    ],
)
def test_a_third_reads_leaks_stay_closed(text: str, redacted: str | None) -> None:
    out = redact_text(text)
    if redacted is not None:
        assert out == redacted
    assert "abc123def456" not in out and "hunter2secret42" not in out


@pytest.mark.parametrize(
    "text",
    [
        "To login, run: ssh -p 2222 deploy@host",  # a port, after some "login"
        "docker run --name login -p 8080:80 nginx",
        'curl -u "$USER:$PASS" https://x',  # variables, not values
        'docker login -u bob -p "$REGISTRY_PASSWORD" r',
        "max_new_tokens: '512345'",
    ],
)
def test_a_third_reads_over_redactions_stay_fixed(text: str) -> None:
    assert redact_text(text) is text


@pytest.mark.parametrize(
    "text",
    [
        'password: "CorrectHorseBatteryStaple"',  # a passphrase of letters, in YAML
        '    POSTGRES_PASSWORD: "SuperSecret"',
        "docker --config /tmp/cfg login -u ci -p s3cretpass r.io",  # global options first
        "buildah login -u ci -p s3cretpass quay.io",
        "curl -u 'admin:$3cr3tpass' https://x",  # a literal $, in single quotes
        'const cfg = { user: "bob", password: "CorrectHorseBattery" };',  # a value, not a type
    ],
)
def test_a_fourth_reads_leaks_stay_closed(text: str) -> None:
    out = redact_text(text)
    for secret in ("CorrectHorse", "SuperSecret", "s3cretpass", "3cr3tpass"):
        assert secret not in out


def test_an_image_or_file_in_base64_is_logged_as_it_is_and_costs_little() -> None:
    """A screenshot as a data URL (OpenAI's image_url) or bare base64 (Anthropic's source.data):
    its bytes can spell a key pattern by chance (an "/AIza…" run), which was cut out, spoiling
    the image in the log (and its scan took ~0.2 s of the interpreter per 2 MB: bench/NOTES.md)."""
    import base64
    import random

    rnd = random.Random(7)
    body = base64.b64encode(bytes(rnd.getrandbits(8) for _ in range(300_000))).decode()
    chance = body[:5000] + "/AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8" + body[5000:]
    for payload in (chance, "data:image/png;base64," + chance, chance + "=="):
        assert redact_text(payload) is payload  # not scanned: one check of its characters
    # the same run in text, or a short base64 string, is still looked at
    assert (
        redact_text("key AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8 here") == "key [REDACTED] here"
    )
    short = "/AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    assert "[REDACTED]" in redact_text("QUJD" + short)


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        (  # an Azure Storage connection string
            "DefaultEndpointsProtocol=https;AccountName=acme;"
            "AccountKey=Zm9vYmFyYmF6cXV4cXV1eDEyMzQ1Njc4OTA+/abcdEFGH==;"
            "EndpointSuffix=core.windows.net",
            "DefaultEndpointsProtocol=https;AccountName=acme;"
            f"AccountKey={REDACTED};EndpointSuffix=core.windows.net",
        ),
        (  # the Azure SDK's keyword
            'generate_blob_sas(account_name="acme", account_key="Zm9vYmFy0123456789==")',
            f'generate_blob_sas(account_name="acme", account_key="{REDACTED}")',
        ),
        (  # bare, pasted in a message
            f"the service answered 401 for {JWT}, why?",
            f"the service answered 401 for {REDACTED}, why?",
        ),
        (f"//registry.npmjs.org/ uses {NPM_TOKEN}", f"//registry.npmjs.org/ uses {REDACTED}"),
    ],
)
def test_a_fifth_reads_leaks_stay_closed(text: str, redacted: str) -> None:
    assert redact_text(text) == redacted


def test_a_structured_field_named_as_a_credential_loses_its_value() -> None:
    """A request's ``metadata`` (or any object logged) with a field named as a credential: a
    password's or a secret's value goes, as it would in JSON text, and a key's or a token's when
    it looks like one (a digit, 16 characters or more, no space, no path); what such names also
    name stays: a trace key, a cipher's name, a page's cursor word, a logprob's token."""
    fields = [  # (name, value, whether it goes)
        ("db_password", "hunter2hunter", True),
        ("client_secret", "letmeinplease", True),
        ("user", "bob", False),
        ("session_token", "a1b2c3d4e5f6a7b8c9d0", True),
        ("access_token", "abc123def456", True),  # (short, but its name says a credential)
        ("authToken", "zzzz9999", True),
        ("userAccessToken", "q1w2e3r4", True),
        ("paid_tokens", "1,024 used", False),  # (no id token)
        ("useraccesstoken", "abcDEF12", True),
        ("slackbottoken", "abcDEF12", True),
        ("refreshTokens", "rt-0a9f8e7d6c5b4a39", True),
        ("deploy_tokens", "glft-abc123def456ghi789", True),
        ("ssh_keys", "AAAAC3NzaC1lZDI1NTE5AAAAIG", True),
        ("trace_key", "run-2024-11", False),
        ("encryption_key", "aes-256-gcm", False),
        ("license_key", "community", False),
        ("music_key", "C-major-7", False),
        ("next_token", "page 2", False),
        ("storage_key", "uploads/2024/avatars/a.png", False),
    ]
    untouched = {
        "logprobs": [{"token": "Hello world", "logprob": -0.1}, {"token": "sha256", "logprob": -1}],
        "prompt_cache_key": "repo-1234567890abcdef",
        "max_tokens": 1000,
    }
    event = {
        "metadata": {name: value for name, value, _ in fields},
        **untouched,
        "k": {"token": "9f8e7d6c5b4a3f2e1d0c", "pwd": "/srv/app"},
    }
    assert redact(event) == {
        "metadata": {name: REDACTED if gone else value for name, value, gone in fields},
        **untouched,
        "k": {"token": REDACTED, "pwd": "/srv/app"},
    }
    # the writer's gate lets every such line through to the redaction
    line = orjson.dumps({"metadata": {"deploy_tokens": "glft-abc123def456ghi789"}})
    assert line_may_hold_secret(line)
    assert line_may_hold_secret(orjson.dumps({"metadata": {"ssh_keys": "AAAAC3NzaC1lZDI1NTE5"}}))
    assert line_may_hold_secret(orjson.dumps({"metadata": {"refreshTokens": "rt-0a9f8e7d6c5"}}))
    for name in ("ADMIN_TOKENS", "SERVICE_ACCOUNT_TOKENS", "HF_READ_TOKENS"):  # not counts
        text = f"{name}=Zq8v1234567890abcd"
        assert line_may_hold_secret(orjson.dumps({"content": text}))
        assert redact_text(text) == f"{name}={REDACTED}"
    for count in (
        "maxTokens",
        "maxOutputTokens",
        "accepted_prediction_tokens",
        "max_tokens",
        "prompt_cache_hit_tokens",  # DeepSeek's usage
        "budget_tokens",  # a thinking budget
        "min_tokens",
        "cache_write_tokens",
    ):
        assert not line_may_hold_secret(orjson.dumps({count: 100}))


def _b64(n: int, seed: int) -> str:
    import base64
    import random

    rnd = random.Random(seed)
    return base64.b64encode(bytes(rnd.getrandbits(8) for _ in range(n))).decode()


_BASE64_LIKE = st.text(
    alphabet='AAzz09+/=-_:;.,"\\ data:image/png;base64,eyJxoxsk-', min_size=0, max_size=40
)


@given(st.lists(_BASE64_LIKE, min_size=1, max_size=4), st.integers(0, 3))
def test_is_binary_agrees_with_the_pattern_it_stands_for(pieces: list[str], seed: int) -> None:
    from proxy.redact import _BINARY, is_binary

    # long strings made of base64, a data URL's prefix, padding and what breaks them
    s = pieces[0] + _b64(800 + 100 * seed, seed) + "".join(pieces[1:])
    assert is_binary(s) == (_BINARY.fullmatch(s) is not None), s[:60]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["url", "data", "api_key", "content", "a" * 1100, "token"]),
            st.sampled_from(["bare", "data-url", "padded", "secret-inside", "quoted", "text"]),
            st.integers(0, 50),
        ),
        min_size=1,
        max_size=4,
    )
)
@settings(max_examples=60, deadline=None)
def test_a_long_line_with_base64_left_out_still_shows_every_secret(
    fields: list[tuple[str, str, int]],
) -> None:
    """The writer's prefilter leaves base64 payloads out of a long line (``blank_binary``): what
    it leaves must still show everything ``redact`` would change."""
    import orjson

    from proxy.redact import blank_binary

    secret = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
    value: dict[str, object] = {}
    for i, (key, shape, seed) in enumerate(fields):
        body = _b64(1500, seed)
        payload = {
            "bare": body,
            "data-url": "data:image/png;base64," + body,
            "padded": body.rstrip("=") + "==",
            "secret-inside": body[:900] + secret + body[900:],
            "quoted": 'say \\"' + body,
            "text": "see " + body + " " + secret,
        }[shape]
        value[f"{key}{i}" if key != "api_key" else key] = [{"text": payload}, payload]
    line = orjson.dumps(value)
    if not line_may_hold_secret(blank_binary(line)):
        assert redact(value) == value


def _fernet(n: int, seed: int, inside: str = "") -> str:
    """A Fernet token as the Responses API seals reasoning in (``encrypted_content``): version
    byte 0x80, a timestamp, then ``n`` random bytes, in URL-safe base64; ``inside`` put in its
    middle (URL-safe characters: what it may hold by chance)."""
    import base64
    import random
    import struct

    rnd = random.Random(seed)
    raw = b"\x80" + struct.pack(">Q", 1_764_990_000 + seed) + rnd.randbytes(n)
    token = base64.urlsafe_b64encode(raw).decode()
    middle = len(token) // 2
    return token[:middle] + inside + token[middle + len(inside) :]


@given(st.lists(_BASE64_LIKE, min_size=1, max_size=4), st.integers(0, 3))
def test_is_binary_agrees_with_the_pattern_it_stands_for_on_fernet_tokens(
    pieces: list[str], seed: int
) -> None:
    from proxy.redact import _BINARY, is_binary

    s = pieces[0] + _fernet(800 + 100 * seed, seed) + "".join(pieces[1:])
    assert is_binary(s) == (_BINARY.fullmatch(s) is not None), s[:60]


def test_sealed_reasoning_that_spells_a_key_by_chance_is_logged_as_it_is() -> None:
    """A reasoning or compaction item's ``encrypted_content`` (Codex CLI sends every one back
    each turn) is a Fernet token in URL-safe base64: one in ~1,200 of 4 KB holds ``-sk-`` and
    20 more characters by chance, and its log copy was cut there (replay gave back an item the
    provider cannot decrypt). A key beside it is still redacted, in a short line and a long one."""
    import orjson

    from proxy.redact import blank_binary

    chance = _fernet(3000, 1, inside="-sk-" + "Ab3" * 10)
    key = "sk-proj-" + "Zq9" * 16
    item = {"type": "reasoning", "summary": [], "encrypted_content": chance}
    assert redact(item) == item
    assert redact({"type": "compaction", "encrypted_content": chance}) == {
        "type": "compaction",
        "encrypted_content": chance,
    }
    said = {"type": "message", "role": "user", "content": f"use {key}"}
    out = redact([item, said])
    assert out[0] == item and key not in str(out) and "[REDACTED]" in out[1]["content"]
    # a URL-safe text that is no Fernet token is read as text, as before
    assert "[REDACTED]" in str(redact({"encrypted_content": "x" * 1100 + "-" + key}))
    # a long line (past 64 KB: its sealed items left out before it is looked through)
    items = [{**item, "encrypted_content": _fernet(3000, seed)} for seed in range(40)]
    items.append(item)
    line = orjson.dumps({"input": items})
    assert len(line) > 64 * 1024
    assert not line_may_hold_secret(blank_binary(line))
    with_key = orjson.dumps({"input": [*items, said]})
    assert line_may_hold_secret(blank_binary(with_key))
    assert redact({"input": [*items, said]})["input"][:-1] == items


def test_a_long_line_whose_base64_spells_a_key_pattern_by_chance_needs_no_redaction() -> None:
    """Random base64 holds "xox" or "eyJ" about every 250 KB: a history with screenshots in it,
    logged whole, was redacted field by field for that (~60 ms for 8 MB, plus ~200 ms of scans
    through the base64). A secret beside the screenshots is still seen."""
    import orjson

    from proxy.redact import blank_binary

    shots = [_b64(60_000, seed) for seed in range(30)]
    assert any("xox" in s or "eyJ" in s for s in shots)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what changed?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + s}},
            ],
        }
        for s in shots
    ] + [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": shots[0]}}]}]
    line = orjson.dumps({"type": "request", "messages": messages})
    assert len(line) > 2_000_000
    assert not line_may_hold_secret(line)
    messages.append({"role": "user", "content": "token xoxb-123456789012-abcdefABCDEF"})
    assert line_may_hold_secret(orjson.dumps({"type": "request", "messages": messages}))
    # a base64 string as an object's key stays in (a key's name may say credential); a value goes
    blanked = blank_binary(orjson.dumps({shots[1]: "v", "data": shots[2]}))
    assert shots[1].encode() in blanked and shots[2].encode() not in blanked


_STEMS = ["api_key", "apiKey", "auth_token", "authToken", "token", "client_key", "deploy_key",
          "session_token", "refresh_token", "db_pass", "db-pass", "x.pass", "pwd", "user_pwd",
          "password", "secret", "signing_key", "openai_key", "max_tokens", "deploy_tokens"]  # fmt: skip
_SUFFIXES = ["", "_v2", "V2", "-v3", "_id", "-id", "Id", "_hash", "-hash", "_base", "Base"]


@given(
    st.sampled_from(_STEMS),
    st.sampled_from(_SUFFIXES),
    st.sampled_from(["lower", "upper", "as is"]),
    st.sampled_from(["field", "env", "json-in-text", "yaml", "json-first-line", "json-tab"]),
)
@settings(max_examples=400, deadline=None)
def test_whatever_redact_removes_under_a_credential_name_the_line_prefilter_sees(
    stem: str, suffix: str, case: str, shape: str
) -> None:
    """A credential's name followed by a version, ``_base``, ``_id`` or ``_hash`` (the README's
    ``SECRET_KEY_BASE``, ``WEBHOOK_SECRET_V2``): ``redact`` removes its value, but the line
    prefilter (and ``redact_text``'s own) looked for ``key"``, ``token=`` and ``_pass=`` only,
    so ``OPENAI_KEY_V2=…`` in a tool output or ``"db-pass": …`` in metadata reached the log."""
    import orjson

    name = stem + suffix
    name = name.lower() if case == "lower" else name.upper() if case == "upper" else name
    value = "hunter2Hunter2hunter2x9"
    event: dict[str, object] = {
        "field": {"metadata": {name: value}},
        "env": {"content": f"$ cat .env\n{name}={value}\n"},
        "json-in-text": {"content": orjson.dumps({name: value}).decode()},
        "yaml": {"content": f"config:\n  {name}: {value}\n"},
        # a setting as JSON text (a tool call's arguments): first in its string, or after a
        # tab, which the log's line escapes twice (``\\t``)
        "json-first-line": {"content": orjson.dumps({"new_string": f"{name} = {value}"}).decode()},
        "json-tab": {"content": orjson.dumps({"content": f"x\n{name}\t= {value}\n"}).decode()},
    }[shape]
    if redact(event) != event:
        assert line_may_hold_secret(orjson.dumps(event)), (name, shape)


def test_a_credential_name_with_a_version_is_redacted_in_text_and_in_the_log(
    tmp_path: Path,
) -> None:
    from proxy.eventlog import EventLogWriter

    value = "abc123def456ghi789jkl"
    text = f"$ cat .env\nOPENAI_KEY_V2={value}\nexport DB_PASS_V2={value}\nDB_PWD_HASH={value}\n"
    assert value not in redact_text(text)
    w = EventLogWriter(tmp_path)
    w.start()
    w.emit("s", {"type": "error", "exchange": 1, "message": text})
    w.emit("s", {"type": "error", "exchange": 2, "metadata": {"db-pass": value, "pwd_hash": value}})
    assert w.close()
    assert value.encode() not in (tmp_path / "s.jsonl").read_bytes()


# Where hyperscan is installed with cachegate (pyproject.toml: where it has wheels).
_FAST_PLATFORM = (
    platform.python_implementation() == "CPython"
    and sys.version_info < (3, 16)
    and sys.platform in ("linux", "darwin")
    and platform.machine() in ("x86_64", "aarch64", "arm64")
)
# Pieces of every check's pattern and of what looks like them, in several cases, with what may
# stand between a credential's name and its value: lines made of them hit every check, alone
# and together, and miss them narrowly (a count key, a look-behind's other side).
_PIECES = [
    *("sk-", "xox", "xapp-", "npm_", "eyJ", "PRIVATE KEY", "PRIVATE", "private key"),
    *("ghp_", "gho_", "ghs_", "ghx_", "github_pat_", "glpat-", "GHP_", "g", "h"),
    *("AKIA", "ASIA", "AIza", "AKI", "akia", "aiza", "A"),
    *("k_live_", "k_test_", "gsk_", "gs", "k_", "K_LIVE_", "hf_", "HF_"),
    *("://", "://u:p@", "://:p@", ":// u:p@", "://u/x:p@", "@", "https"),
    *("authorization", "Authorization", "AUTHOR", "secret", "SECRET", "Secret", "passw"),
    *("PassW", "earer", "Bearer", "BEARER", "bear"),
    *("key", "keys", "KEY", "Key", "_key", "key_v2", "key-id", "keyhash", "KEYBASE"),
    *("token", "tokens", "Token", "TOKENS", "tokenbase", "token_v12", "deploy_tokens"),
    *("refreshTokens", "maxTokens", "max_tokens", "prompt_tokens", "_tokens", "atokens"),
    *('"max_tokens', '"deploy_tokens', '"cached_tokens', "pass", "PASS", "DB_PASS", ".pass"),
    *("-pass", "_pass", "pwd", "PWD", "pwd_hash", "Pwd", "--", "--api-key", "--token"),
    *("--Secret", "--my.pwd", "-u", "-U", "-p", "-P", "u", "curl", "CURL", "mysql", "MariaDB"),
    *("docker", "Podman", "helm", "nerdctl", "buildah", "skopeo", "sshpass", "redis-cli", "-a"),
    *('"', "'", '\\"', '\\\\\\"', "\\", "=", ":", " ", "\\t", "\t", "\x0b", "\x0c", "\r"),
    *("\n", "a", "x", "_", "-", ".", "1", "v", "v2", "id", "ids", "base", "hash", "\x85", "é"),
    *("\x1c", "\x1f"),  # (blanks to a text's \s, not to bytes')
    *("xai-", "pplx-", "nvapi-", "csk-", "r8_", "fw_", "lsv2_", "SG.", "_v1_", "ya29."),
]


def _one_pass() -> Callable[[bytes], bool]:
    from proxy.redact import _multi_scan

    scan = _multi_scan()
    if scan is None:
        if _FAST_PLATFORM:  # (installed with cachegate here)
            raise AssertionError(
                "no one-pass scan: hyperscan is not installed (pip install -e .), or its"
                " database could not be built"
            )
        pytest.skip("hyperscan has no wheel for this platform: the scans run one by one")
    return scan


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=14), st.binary(max_size=24), st.booleans())
def test_the_one_pass_scan_answers_as_the_scans_one_by_one(
    pieces: list[str], noise: bytes, noise_first: bool
) -> None:
    """The one pass finds a line that may hold a secret exactly when the scans one by one do:
    a line it missed would go to the log unredacted."""
    from proxy.redact import _scans

    scan = _one_pass()
    text = "".join(pieces).encode()
    line = noise + text if noise_first else text + noise
    assert scan(line) == _scans(line), line


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=14), st.text(max_size=12))
def test_a_text_is_suspect_by_the_one_pass_exactly_when_by_the_checks(
    pieces: list[str], noise: str
) -> None:
    """``redact_text`` returns a text the one pass finds nothing in as it is, and decodes only
    the JSON strings it finds something in: it must answer as the checks on the text do (the
    one pass looks at ASCII text only: other text goes to the checks)."""
    from proxy.redact import _lowered, _suspect, _suspect_text

    _one_pass()
    for text in ("".join(pieces) + noise, noise + "".join(pieces)):
        assert _suspect_text(text) == _suspect(text, _lowered(text)), text


def test_the_one_pass_scan_answers_as_the_scans_on_every_example_here() -> None:
    """Every credential and name this file tests, in a log line, and the lines that must pass."""
    import orjson

    from proxy.redact import _SECRET_KEYS, _scans

    scan = _one_pass()
    keys = [OPENAI_KEY, PROJECT_KEY, ANTHROPIC_KEY, AWS_ID, GITHUB_TOKEN, GITHUB_PAT, *MORE_KEYS]
    keys += [SLACK_TOKEN, GROQ_KEY, NPM_TOKEN, SLACK_APP_TOKEN, JWT, HF_TOKEN, GITLAB_TOKEN]
    lines = [orjson.dumps({"content": f"here: {key} ok"}) for key in keys]
    lines += [
        orjson.dumps({"headers": {spelling: "x"}})
        for key in _SECRET_KEYS
        for spelling in (key, key.upper(), key.title())
    ]
    lines += [
        orjson.dumps({"content": "curl -u admin:hunter2 https://example.com"}),
        orjson.dumps({"content": "postgres://app:hunter2@db:5432/x"}),
        orjson.dumps({"type": "request", "params": {"max_tokens": 1000, "top_p": 1}}),
        orjson.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 2}}),
        orjson.dumps({"content": "The quick brown fox jumps over the lazy dog."}),
    ]
    for line in lines:
        assert scan(line) == _scans(line) == line_may_hold_secret(line), line
    assert sum(map(scan, lines)) == len(lines) - 3  # all but the last three may hold one


def test_a_failing_one_pass_scan_leaves_the_answer_to_the_scans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one pass raising (an engine fault) never lets a line through unscanned."""
    import orjson

    from proxy import redact as module

    def broken(line: bytes) -> bool:
        raise RuntimeError("scratch space in use")

    monkeypatch.setattr(module, "_multi_scan", lambda: broken)
    assert line_may_hold_secret(orjson.dumps({"content": f"key {OPENAI_KEY}"}))
    assert not line_may_hold_secret(orjson.dumps({"content": "nothing to see"}))


_SETTING_LINES = [
    ("password = Hunter22xA", "Hunter22xA"),  # INI
    ("password\t= Tabbed22xB", "Tabbed22xB"),  # INI, a tab before "="
    ("- password: Hunter22xA", "Hunter22xA"),  # a YAML list item
    ('secret: "abcdef123456"', "abcdef123456"),  # YAML, quoted
    ("--api-key abcdef123456", "abcdef123456"),  # a flag, its value apart
    ('sendgrid_key = "SG.abcdefghijklmnop1234.abcdefghijklmnopqrstuvwxyz012345"', "SG.abcdef"),
    ("db_password = hunter2hunter2", "hunter2hunter2"),
    ("client_secret = abcdef123456", "abcdef123456"),
    ("api_key = 8f14e45fceea167a5a36dedd4bea2543", "8f14e45fceea167a5a36dedd4bea2543"),
    ("redis_password=hunter22xx", "hunter22xx"),
    ("db-pass = hunter2hunter2", "hunter2hunter2"),  # "pass" after "-" or "." (not only "_")
    ("smtp.pass=hunter2hunter2", "hunter2hunter2"),
    ('mysql-pass: "hunter2hunter2"', "hunter2hunter2"),
]


@pytest.mark.parametrize(("line", "secret"), _SETTING_LINES)
@pytest.mark.parametrize("where", ["first line", "later line", "tool output"])
def test_a_setting_in_json_text_loses_its_value_as_in_plain_text(
    line: str, secret: str, where: str
) -> None:
    """Tool-call arguments and JSON tool outputs are JSON text: a setting there is in a JSON
    string, its line ends ``\\n``, its tabs ``\\t`` and its quotes ``\\"``. Redacted as plain
    text, it was logged in clear as the first line of such a string (an editor's
    ``new_string``), with an escaped tab or quote on any line, and as a flag on a later line."""
    import orjson

    assert secret not in redact_text(line)  # (as plain text: the rule itself)
    if where == "first line":
        arguments = {"file_path": "app/settings.ini", "old_string": "x", "new_string": line}
    elif where == "later line":
        arguments = {"file_path": "app/settings.ini", "content": "[app]\n" + line + "\nport=1\n"}
    else:
        arguments = {"output": line + "\nport=5432\n", "metadata": {"exit_code": 0}}
    text = orjson.dumps(arguments).decode()
    event = {
        "appended": [
            {"role": "assistant", "tool_calls": [{"function": {"arguments": text}}]},
            {"role": "tool", "content": text},
        ]
    }
    assert line_may_hold_secret(orjson.dumps(event))
    assert secret not in orjson.dumps(redact(event)).decode()


@pytest.mark.parametrize(
    "line",
    [
        "password = password",  # code, no literal
        "sort_key = name",
        "self.password = password",
        "api_key = os.environ['API_KEY']",
        "max_tokens = 4096",
        "--password-file /run/secrets/db",
    ],
)
def test_code_in_json_text_is_left_alone_as_in_plain_text(line: str) -> None:
    import orjson

    assert redact_text(line) == line
    for arguments in ({"new_string": line}, {"content": "x\n" + line + "\n"}):
        text = orjson.dumps(arguments).decode()
        assert redact_text(text) == text


_FILES_WITH_SECRETS = [
    ("[github]\n\ttoken = tok123456789abcdef\n", "tok123456789abcdef"),  # git's own layout
    ("[server]\n\tpassword = Hunter33xB\n\tapi_key\t= abc123def456ghi789\n", "Hunter33xB"),
    ("[server]\n\tpassword = Hunter33xB\n\tapi_key\t= abc123def456ghi789\n", "abc123def456"),
    ("\tspring.datasource.password=Hunter22xA", "Hunter22xA"),
    ("a\n\t- password: Hunter22xA\n", "Hunter22xA"),
    ("[db]\r\npassword = x1234567\r\n\tsecret = abc123def456ghi789\r\n", "abc123def456"),
    ('mytool deploy --api-key "abc123def456ghi789"', "abc123def456"),
    ('curl -u "admin:Hunter22xA" https://api.example.com', "Hunter22xA"),
    ('{"headers": {"Authorization": "Basic YWRtaW46aHVudGVyMjJ4QQ=="}}', "YWRtaW46aHVudGVy"),
    ("db:\n  password: Hunter55xR\t# prod\n", "Hunter55xR"),
    ("x\ntoken: tok123456789abcdef\t\n", "tok123456789abcdef"),
    ("spring:\n  datasource:\n    password: Hunter44xQ\n", "Hunter44xQ"),
    ('import os\nopenai_api_key = "abc123def456ghi789"\n', "abc123def456"),
]


@pytest.mark.parametrize(("text", "secret"), _FILES_WITH_SECRETS)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_json_inside_json_is_redacted_as_its_text_at_any_depth(
    text: str, secret: str, depth: int
) -> None:
    """A Write call's arguments hold the file (depth 1); a shell tool's JSON output holds
    ``kubectl get cm -o json``, whose data holds a YAML file (2); a notebook's cells one more
    (3). Each level escapes the text again (``\\t``, ``\\\\t``, ``\\\\\\"``), and the rules for
    text missed settings a plain file loses: tab-indented ones (every ``.gitconfig``), a flag's
    quoted value, a YAML value before a comment, anything two levels down."""
    import orjson

    assert secret not in redact_text(text)  # (the rule, as plain text)
    value: object = text
    for level in range(depth):
        value = orjson.dumps({"path": f"f{level}", "content": value}).decode()
    event = {"appended": [{"role": "assistant", "tool_calls": [{"arguments": value}]}]}
    line = orjson.dumps(event)
    assert line_may_hold_secret(line)
    assert secret.encode() not in orjson.dumps(redact(event))


@pytest.mark.parametrize(
    "dumps",
    [
        lambda v: orjson.dumps(v).decode(),  # compact, as models write arguments
        lambda v: json.dumps(v),  # spaced, \u escapes (Python's default)
        lambda v: json.dumps(v, ensure_ascii=False, indent=2),  # a pretty-printed output
    ],
    ids=["compact", "spaced", "indented"],
)
def test_json_text_with_a_secret_keeps_its_layout_and_one_without_is_untouched(
    dumps: Callable[[object], str],
) -> None:
    value = {
        "file": "café.ini",
        "n": [1, 2.5, None, True],
        "body": "x\n\ttoken = tok123456789abc\n",
    }
    text = dumps(value)
    assert redact_text(text) == text.replace("tok123456789abc", REDACTED)
    clean = dumps({**value, "body": "x\n\ttoken = self.make()\n"})
    assert redact_text(clean) is clean


def test_a_string_of_quoted_names_costs_no_more_than_names_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``"secret:`` a hundred thousand times: each name, taken for the start of a JSON string,
    found the next as its value, and 1 MB took 0.4 s: a name with no value counts towards the
    looks' limit (``_MAX_HITS``, or a look per 16 characters of a longer text), one given a
    value does not."""
    from proxy import redact as module

    looks = []
    named_value = module._named_value

    def counted(s: str, start: int, end: int) -> tuple[int, int] | None:
        looks.append(start)
        return named_value(s, start, end)

    monkeypatch.setattr(module, "_named_value", counted)
    text = '"secret:' * 125_000
    assert redact_text(text) == text
    assert len(looks) <= max(module._MAX_HITS, len(text) // 16)


def test_a_value_redacted_before_a_closing_backtick_or_parenthesis_keeps_it() -> None:
    """openssl's ``pass:`` and a cookie's value took the Markdown's closing backtick or the
    prose's closing parenthesis with them: the inline code never closed."""
    for text, kept in (
        ("Run `openssl pkcs12 -export -passout pass:Zk8aQ2mP9x` then import.", "` then"),
        ("(openssl rsa -in k.pem -passin pass:Zk8aQ2mP9x)", "[REDACTED])"),
        ("(Cookie: sessionid=Zk8aQ2mP9xLwAbCdEf12)", "[REDACTED])"),
    ):
        out = redact_text(text)
        assert "Zk8aQ2mP9x" not in out and kept in out, out


def test_many_indented_data_blocks_are_read_in_linear_time() -> None:
    """``kubectl get secrets -A -o yaml``'s list indents every ``data:``: each looked for a
    diff's hunk back to the text's start (1 MB in 9.6 s)."""
    import time

    text = "kind: Secret\n" + "- x: 1\n  data:\n    a: b\n" * 40_000
    began = time.process_time()
    assert redact_text(text).count("[REDACTED]") == 40_000
    assert time.process_time() - began < 3.0  # (linear: ~0.3 s; before: ~10 s)


def test_another_object_named_data_beside_a_secrets_keeps_its_structure() -> None:
    """In a text that says ``kind: Secret``, a tool's ``{"data": {…}}`` lost its numbers and
    half an array (``"tags": [REDACTED], "prod"]``: no longer JSON), or its whole output."""
    secret = '{"kind": "Secret", "data": {"a": "Wms4YVEybVA5eFl5"}}\n'
    other = '{"data": {"tags": ["web", "prod"], "replicas": 3, "stdout": "deployed web"}}'
    out = redact_text(secret + other)
    assert "Wms4YVEybVA5eFl5" not in out and out.endswith("\n" + other)
    tool = {"data": {"exit_code": 0, "stdout": "kind: Secret\nmetadata:\n  name: x\n"}}
    import json

    assert json.loads(redact_text(json.dumps(tool))) == tool


def test_a_terraform_states_names_without_values_do_not_use_up_the_looks() -> None:
    """A 450 KB state names ``password`` three times a resource with no value given (a type's
    name, an output's, a sensitive attribute's path): after a thousand such looks the names
    after them were not looked at, and the 191st database's password was written."""
    block = (
        '{"type": "random_password", "name": "db"}, '
        '{"sensitive_attributes": [[{"type": "get_attr", "value": "password"}]]},\n'
    )
    text = block * 500 + '{"password": "Zk8aQ2mP9xYyLm3q"}\n'
    assert "Zk8aQ2mP9xYyLm3q" not in redact_text(text)


@pytest.mark.parametrize(
    "text",
    [
        '{"wei": 123456789012345678901234567890, "f": 1.10, "t": 1e5, "cfg": "[db]\\n\\tpassword'
        ' = Pw7Zs5abcd"}',
        '{"note": "keep me", "note": "\\tpassword = Pw7Zs5abcd"}',  # a duplicate key
        '{\n\t"a": 1,\n\t"cfg": "\\tpassword = Pw7Zs5abcd"\n}\n',  # tab-indented, a last newline
        '{"file_path":"a.json","content":"{\\"a\\": 1}\\n\\tpassword = Pw7Zs5abcd"}',
        '{"url": "https:\\/\\/x.io\\/a", "cfg": "\\tpassword = Pw7Zs5abcd"}',  # escaped slashes
        '{"file_path":"/h/.gitconfig","content":"[credential]\\n\\tpassword = Pw7Zs5abcd\\n\\th',
        '{"cfg": "[db]\\n\\tpassword = Pw7Zs5abcd"}\n(exit code 0)',  # output after the JSON
        'Exit code: 0\nOutput:\n{"cfg": "[db]\\n\\tpassword = Pw7Zs5abcd"}',
        '{"loss": NaN, "cfg": "[db]\\n\\tpassword = Pw7Zs5abcd"}',
        '{"a": "\\tpassword = Pw7Zs5abcd"}\n{"b": "\\tpassword = Pw7Zs5abcd"}\n',  # JSON Lines
    ],
    ids=[
        "numbers",
        "duplicate-key",
        "tabs",
        "quotes-inside",
        "slashes",
        "cut-off",
        "trailer",
        "header",
        "nan",
        "json-lines",
    ],
)
def test_json_text_loses_only_its_secret_whatever_surrounds_it(text: str) -> None:
    """A first version decoded the whole text and wrote it again: numbers past 64 bits became
    floats, 1.10 and 1e5 changed, a duplicate key and two keys redacted alike were merged, a
    tab indent and a last newline went, and text that was no JSON as a whole (cut off, output
    around it, NaN, one object a line) kept its secret. Only the strings that hold one change."""
    assert redact_text(text) == text.replace("Pw7Zs5abcd", REDACTED)


def test_two_keys_redacted_alike_stay_two() -> None:
    text = '{"sk-proj-AAAAbbbbCCCCddddEEEEffff1": {"o": "a"}, "sk-proj-ZZZZyyyyXXXXwwww2": 1}'
    assert redact_text(text) == '{"[REDACTED]": {"o": "a"}, "[REDACTED]": 1}'


@pytest.mark.parametrize(
    "text",
    ["     3→  password: abc123def9\n", "     2\t\tpassword = Zq8xW2pL9mN4\n"],
)
def test_a_file_read_with_its_line_numbers_loses_its_settings(text: str) -> None:
    """A coding agent's Read tool numbers the lines it returns: a YAML or INI setting was not
    alone on its line after the number, and kept its value."""
    assert "abc123def9" not in redact_text(text) and "Zq8xW2pL9mN4" not in redact_text(text)


def test_a_json_string_left_open_is_read_to_its_end_at_any_depth() -> None:
    """An interrupted Write call: its ``content`` string never closes, and the JSON file in it
    held a string whose escapes hid a setting; the strings in it were not looked into."""
    inner = '{\n  "cfg": "[db]\\n\\thost = x\\n\\tpassword = Pw7Zs5abcd9\\n"\n}'
    cut = orjson.dumps({"file_path": "/srv/a.json", "content": inner}).decode()[:-2]
    assert redact_text(cut) == cut.replace("Pw7Zs5abcd9", REDACTED)
    partial = '{"content":"[credential]\\n\\tpassword = Pw7Zs5abcd\\n\\th\\u00'  # (in an escape)
    assert redact_text(partial) == partial.replace("Pw7Zs5abcd", REDACTED)


def test_a_lone_surrogate_in_a_redacted_string_stays_escaped() -> None:
    """A string cut inside an emoji (``JSON.stringify`` writes ``\\ud83d``) among other text
    that is not ASCII: written anew with the surrogate raw, its log line could not be read
    back (``sessions show``: torn lines), and orjson refuses to write it."""
    text = '{"note": "café \\ud83d cut emoji\\n\\tpassword = Pw7Zs5abcd\\n"}'
    out = redact_text(text)
    assert "Pw7Zs5abcd" not in out and "\\ud83d" in out
    event = {"appended": [{"role": "tool", "content": text}]}
    assert orjson.loads(orjson.dumps(redact(event)))["appended"][0]["content"] == out


def test_a_diffs_added_lines_lose_their_settings_as_removed_ones_do() -> None:
    diff = "+password = Xq7Lm2Np9Rt\n+\tpassword = Xq7Lm2Np9Rt\n+  password: Xq7Lm2Np9Rt\n"
    assert "Xq7Lm2Np9Rt" not in redact_text(diff + "-password = Old123xyz9\n")


@pytest.mark.parametrize(
    "run",
    [
        *(" token=", " pwd=", " x_key=", " db.password=x1abcdefg", ":token=/x", " sshpass -f"),
        *(" password={", "API_KEY={{1 ", "x password={abc} ", " apiKey={stripeKey}"),
    ],
)
def test_a_name_repeated_in_one_long_value_is_looked_at_once(run: str) -> None:
    """A value looked at and not taken (``token=token=…``: no credential's) ran to its end for
    each name in it: 100 KB took 14 s, on the event loop where a model's name is redacted."""
    import time

    text = run * (100_000 // len(run))
    began = time.process_time()
    redact_text(text)
    assert time.process_time() - began < 2.0


def test_a_string_left_open_among_escaped_quotes_is_looked_at_once() -> None:
    """A cut JSON string full of escaped quotes: each of them was taken for a string's start
    and read to the line's end (32 KB took 3 s, holding the event loop through the writer's
    lock). One look: 400 KB take milliseconds; quadratic, they would take minutes."""
    import time

    text = 'api_key=abc123456 "' + '\\"' * 200_000
    began = time.process_time()
    assert redact_text(text) == text.replace("abc123456", REDACTED)
    assert time.process_time() - began < 2.0


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        # PHP's json_encode escapes slashes: the URL's password was not seen at all
        ('{"database":{"url":"mysql:\\/\\/wp:Xq7Lm2Np9Rt4@db.internal:3306\\/wp"}}', "Xq7Lm2Np9"),
        ('{"cache":"redis:\\/\\/:Xq7Lm2Np9Rt4@cache:6379\\/0"}', "Xq7Lm2Np9"),
        # a notebook cell's last line (no line end of its own), an element on a line of its own
        ('{\n "source": [\n  "db:\\n",\n  "  password: Sx9kP2mQ7vL4"\n ]\n}', "Sx9kP2mQ7vL4"),
        ('{"env": [\n  "PATH=/bin",\n  "db_password=Sx9kP2mQ7vL4"\n]}', "Sx9kP2mQ7vL4"),
        # Gson's HTML-safe JSON writes "=" as \u003d: a container's environment, a Java app's
        ('{"Env":["PATH=/bin","GITHUB_TOKEN\\u003dSx9kP2mQ7vL4"]}', "Sx9kP2mQ7vL4"),
        ('{"props":"stripe.api_key\\u003dSx9kP2mQ7vL4\\nport\\u003d80"}', "Sx9kP2mQ7vL4"),
        ('{"Env":["SENDGRID_KEY\\u003DSx9kP2mQ7vL4"]}', "Sx9kP2mQ7vL4"),
        # a URL's user written as an escape, in plain text (a repr, a log line): the password
        # was kept, the prefilter taking no backslash in the user
        ("DATABASE_URL=postgres://\\u0061pp:Xq7Lm2Np9Rt4@db/app", "Xq7Lm2Np9"),
        ("dsn = 'mysql://wp\\x2d1:Xq7Lm2Np9Rt4@db'", "Xq7Lm2Np9"),
        # a Windows domain's user (a SQL Server DSN, an SMB share)
        ("DATABASE_URL=mssql+pyodbc://CORP\\jdoe:Xq7Lm2Np9Rt4@sqlhost/db", "Xq7Lm2Np9"),
        ("smb://WORKGROUP\\alice:Xq7Lm2Np9Rt4@nas/share", "Xq7Lm2Np9"),
    ],
)
def test_json_a_tool_printed_loses_what_the_same_text_plain_would(text: str, secret: str) -> None:
    event = {"appended": [{"role": "tool", "content": text}]}
    assert line_may_hold_secret(orjson.dumps(event))
    assert secret not in orjson.dumps(redact(event)).decode()


_KEY_LINES = [
    "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun\n",
    "VTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK\n",
    "LxoS2tFczGkPLPgizskuemMghRniWaoLcyehkd3qqGElvW/VDL5AaWTg0nLVkjRo\n",
]


@pytest.mark.parametrize("indent", [1, None])
@pytest.mark.parametrize("cut", [False, True])
def test_a_private_key_a_notebook_printed_line_by_line_loses_its_body(
    indent: int | None, cut: bool
) -> None:
    """A notebook's output holds each line a JSON string of an array: the key's body lay between
    the strings' quotes, where the armour's pattern stopped, and was logged whole (when the
    notebook JSON was read as text by a tool, whole or cut off by the tool's limit)."""
    output = {
        "output_type": "stream",
        "name": "stdout",
        "text": [
            "-----BEGIN RSA PRIVATE KEY-----\n",
            *_KEY_LINES,
            "-----END RSA PRIVATE KEY-----\n",
        ],
    }
    notebook = {
        "cells": [
            {"cell_type": "code", "source": ["!cat ~/.ssh/id_rsa"], "outputs": [output]},
            {"cell_type": "markdown", "source": ["# Next step\n", "Train the model."]},
        ]
    }
    text = json.dumps(notebook, indent=indent)
    if cut:
        text = text[: text.index("LxoS2") + 20]
    event = {"appended": [{"role": "tool", "content": text}]}
    assert line_may_hold_secret(orjson.dumps(event))
    out = redact(event)["appended"][0]["content"]
    for line in _KEY_LINES:
        assert line[:12] not in out
    assert "-----BEGIN RSA PRIVATE KEY-----" in out  # the armour is kept
    if not cut:  # what follows the key stays
        assert json.loads(out)["cells"][1] == notebook["cells"][1]
        assert "!cat ~/.ssh/id_rsa" in out


def test_prose_that_names_a_key_in_a_notebook_stays() -> None:
    """A line of prose after an armour line, in a notebook's JSON: it was taken for the key's
    body (the next line gone, an END line written that never was)."""
    cell = {
        "cell_type": "markdown",
        "source": [
            "Your key starts with -----BEGIN OPENSSH PRIVATE KEY-----\n",
            "Paste the whole file, then run: make deploy\n",
            "## Next (below)\n",
        ],
    }
    text = json.dumps({"cells": [cell]}, indent=1)
    assert redact_text(text) == text
    printed = {
        "output_type": "stream",
        "text": ["-----BEGIN RSA PRIVATE KEY-----\n", *_KEY_LINES[:2], "Key loaded, 2048 bits.\n"],
    }
    out = redact_text(json.dumps({"outputs": [printed]}, indent=1))
    assert "MIIEow" not in out and "VTLw7o" not in out
    assert json.loads(out)["outputs"][0]["text"][-1] == "Key loaded, 2048 bits.\n"


@pytest.mark.parametrize("shape", ["encrypted", "crlf"])
def test_an_encrypted_or_crlf_key_a_notebook_printed_loses_its_body(shape: str) -> None:
    """An encrypted key's headers end in a blank line (a string of its own), a CRLF key's last
    short line in ``\\r\\n``: the body was kept whole after an END line the redaction made up."""
    head = ["-----BEGIN RSA PRIVATE KEY-----\n"]
    if shape == "encrypted":
        head += ["Proc-Type: 4,ENCRYPTED\n", "DEK-Info: AES-128-CBC,0123456789ABCDEF\n", "\n"]
    lines = [*head, *_KEY_LINES, "TxKt5g==\n", "-----END RSA PRIVATE KEY-----\n"]
    if shape == "crlf":
        lines = [line.replace("\n", "\r\n") for line in lines]
    text = json.dumps({"outputs": [{"text": lines}]}, indent=1)
    out = redact_text(text)
    for line in [*_KEY_LINES, "TxKt5g=="]:
        assert line[:8] not in out, shape
    assert out.count("-----END RSA PRIVATE KEY-----") == 1


_DOCKER_AUTH = base64.b64encode(b"deployer:Dk7pQz9wLmX2vR4s").decode()
_PEM = b"-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAq7BFUpkGp3Zx\n-----END RSA PRIVATE KEY-----\n"
_KEY_IN_BASE64 = base64.b64encode(_PEM).decode()
# (2.3 KB: a whole string of it is base64 a kilobyte long, a payload's look)
_LONG_KEY = base64.b64encode(_PEM[:32] + b"MIIEowIBAAKCAQEAq7BFUpkGp3Zx" * 80 + _PEM[-30:]).decode()


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        # an answer quoting settings in Markdown: a backtick or a parenthesis ends the value
        ("- `DB_PASSWORD=Mk4rkd0wnPw9zLq2` and", "Mk4rkd0wnPw9zLq2"),
        ("Set `STRIPE_WEBHOOK_SECRET=Wh00kS3cr3t9zLq2Mv7` before starting.", "Wh00kS3cr3t9zLq2Mv7"),
        ("The admin password is (ADMIN_PASSWORD=P4r3nAdm1n9zLq2).", "P4r3nAdm1n9zLq2"),
        ("- `password: X9kd8s7f6g5h`", "X9kd8s7f6g5h"),
        # and in a Markdown table: the name's cell first, its value's next
        ("| Variable | Value |\n|---|---|\n| JWT_SECRET | Jwt5ecr3tZk8aQ2 |\n", "Jwt5ecr3tZk8aQ2"),
        ("| `DB_PASSWORD` | `Tr0ub4dor&3xq` | the database's |", "Tr0ub4dor&3xq"),
        ("|api_key|Zk8aQ2mP9xLw|prod|", "Zk8aQ2mP9xLw"),
        ("| API_KEY\t| Zk8sJd93kLmQ2pXr |", "Zk8sJd93kLmQ2pXr"),  # (a tab: ``\t`` in the log)
        ("|**DB_PASSWORD**|Zk8sJd93kLmQ2pXr|", "Zk8sJd93kLmQ2pXr"),  # (bold)
        ("| DB_PASSWORD (prod) | `Zk8sJd93kLmQ2pXr` (rotated) |", "Zk8sJd93kLmQ2pXr"),
        ("| api | DB_PASSWORD | Zk8sJd93kLmQ2pXr |", "Zk8sJd93kLmQ2pXr"),  # (a later cell)
        ("| DB_PASSWORD | Zk8sJd93kLmQ2pXr\n", "Zk8sJd93kLmQ2pXr"),  # (no closing pipe)
        ('apiKey\tstring = "Zk8sJd93kLmQ2pXr"', "Zk8sJd93kLmQ2pXr"),  # (Go's, after a tab)
        # a Kubernetes Secret's data under any name, as kubectl prints it (data before kind)
        (
            "apiVersion: v1\ndata:\n  DATABASE_URL: cG9zdGdyZXM6Ly9hOmJAZGI=\nkind: Secret\n",
            "cG9zdGdyZXM6Ly9hOmJAZGI=",
        ),
        ("kind: Secret\nstringData:\n  config.yaml: |\n    pass: hunter2\n", "hunter2"),
        (
            '{\n  "data": {\n    "app.conf": "dXNlcjpodW50ZXIy"\n  },\n  "kind": "Secret"\n}',
            "dXNlcjpodW50ZXIy",
        ),
        # Terraform's sensitive output (``output -json``, its state) and random_password
        (
            '{\n  "conn": {\n    "sensitive": true,\n    "type": "string",\n    "value": '
            '"Tf0utVal9zLq2"\n  }\n}',
            "Tf0utVal9zLq2",
        ),
        (
            '"outputs": {"c": {"value": "St4t3Val9zLq", "type": "string", "sensitive": true}}',
            "St4t3Val9zLq",
        ),
        (
            '{"type": "random_password", "name": "db", "instances": [{"attributes": '
            '{"bcrypt_hash": "x", "length": 16, "result": "R4nd0mVal9zLq"}}]}',
            "R4nd0mVal9zLq",
        ),
        # a bare ``pass`` (nodemailer's SMTP auth, a TOML section's)
        ("  auth: { user: 'me@x.com', pass: 'Sm7pPassw0rdX' }", "Sm7pPassw0rdX"),
        ('[smtp]\npass = "Sm7pPassw0rdX"\n', "Sm7pPassw0rdX"),
        ('{"user": "me", "pass": "Sm7pPassw0rdX"}', "Sm7pPassw0rdX"),
        # ... as a tool printed the file: numbered, a diff's, grep -n's; a comment, a flow map
        (
            "     6\tdata:\n     7\t  DB_URL: cG9zdGdyZXM6Ly9hOmJAZGI=\n     8\tkind: Secret\n",
            "cG9zdGdyZXM6Ly9hOmJAZGI=",
        ),
        (
            "     6→data:\n     7→  DB_URL: cG9zdGdyZXM6Ly9hOmJAZGI=\n     8→kind: Secret\n",
            "cG9zdGdyZXM6Ly9hOmJAZGI=",
        ),
        (
            "+kind: Secret\n+data:\n+  DB_URL: cG9zdGdyZXM6Ly9hOmJAZGI=\n",
            "cG9zdGdyZXM6Ly9hOmJAZGI=",
        ),
        (
            "s.yaml:6:data:\ns.yaml:7:  DB_URL: cG9zdGdyZXM6Ly9hOmJAZGI=\ns.yaml:8:kind: Secret",
            "cG9zdGdyZXM6Ly9hOmJAZGI=",
        ),
        (
            "kind: Secret\ndata:   # base64\n  DB_URL: cG9zdGdyZXM6Ly9hOmJAZGI=\n",
            "cG9zdGdyZXM6Ly9hOmJAZGI=",
        ),
        (
            'kind: Secret\ndata: {"DB_URL": "cG9zdGdyZXM6Ly9hOmJAZGI="}\n',
            "cG9zdGdyZXM6Ly9hOmJAZGI=",
        ),
        # a second review's: a bare ``pass`` on a later line (``\\n`` in the log's line), a
        # table's note in French, a Secret's diff with its ``data:`` line as context, each of a
        # random_password's results, a flow map unquoted, openssl's ``pass:``, ``terraform show
        # -json``'s order, curl's ``-b`` after a line end
        ('[mail]\nuser = "bot"\npass = "Zk8pQ2mW9xL4"\n', "Zk8pQ2mW9xL4"),
        (
            "| API_KEY (clé générée côté serveur, à régénérer après déploiement) | Zk8pQ2mW9xL4 |",
            "Zk8pQ2mW9xL4",
        ),
        (
            "@@ -3,5 +3,5 @@ kind: Secret\n metadata:\n   name: db\n data:\n-  URL: b2xkb2xk\n"
            "+  URL: cG9zdGdyZXM6Ly9hcHA6cHdAZGIvYXBw\n",
            "cG9zdGdyZXM6Ly9hcHA6cHdAZGIvYXBw",
        ),
        (
            '{"type": "random_password", "instances": [{"attributes": {"result": "Kd8fJs1aPq6w"}},'
            ' {"attributes": {"result": "Mn4bVc7xZl2k"}}]}',
            "Mn4bVc7xZl2k",
        ),
        (
            "kind: Secret\ndata: {DATABASE_URL: cG9zdGdyZXM6Ly9hcHA6cHdAZGIvYXBw}\n",
            "cG9zdGdyZXM6Ly9hcHA6cHdAZGIvYXBw",
        ),
        ("openssl req -x509 -nodes -passout pass:Zk8pQ2mW9xL4 -out cert.pem", "Zk8pQ2mW9xL4"),
        (
            '{"outputs":{"pw":{"sensitive":true,"value":"Zk8pQ2mW9xL4","type":"string"}}}',
            "Zk8pQ2mW9xL4",
        ),
        (
            'curl https://api.example.com/me \\\n-b "sessionid=k2j3h4g5f6d7s8a9q0w1e2r3"\n',
            "k2j3h4g5f6d7s8a9q0w1e2r3",
        ),
        (
            '{\n  "name": "cookie",\n  "value": "_ga=GA1; sid=k2j3h4g5f6d7s8a9q0w1e2r3"\n}',
            "k2j3h4g5f6d7s8a9q0w1e2r3",
        ),
        (
            '"set-cookie": [\n    "sessionid=k2j3h4g5f6d7s8a9q0w1e2r3; Path=/"\n  ]',
            "k2j3h4g5f6d7s8a9q0w1e2r3",
        ),
        (
            "Set-Cookie: theme=dark; Path=/, session=k2j3h4g5f6d7s8a9q0w1e2r3; HttpOnly",
            "k2j3h4g5f6d7s8a9q0w1e2r3",
        ),
        # a third review's: a table's row as a tool printed the file (numbered, a diff's, a
        # quote's, grep -n's), a tab before its note
        ("     3\t| API_KEY | Zk8pQ2mW9xL4 |", "Zk8pQ2mW9xL4"),
        ("    12→| API_KEY | Zk8pQ2mW9xL4 |", "Zk8pQ2mW9xL4"),
        (
            "@@ -1,3 +1,4 @@\n | Name | Value |\n |---|---|\n+| JWT_SECRET | Zk8pQ2mW9xL4 |",
            "Zk8pQ2mW9xL4",
        ),
        ("> | API_KEY | Zk8pQ2mW9xL4 |", "Zk8pQ2mW9xL4"),
        ("README.md:14:| API_KEY | Zk8pQ2mW9xL4 |", "Zk8pQ2mW9xL4"),
        ("| API_KEY\t(server side) | Zk8pQ2mW9xL4 |", "Zk8pQ2mW9xL4"),
        # a table whose header names the value's column further on (a description between)
        (
            "| Variable | Description | Value |\n|---|---|---|\n"
            "| DB_PASSWORD | Database password | `Zk8pQ2mW9xL4` |\n",
            "Zk8pQ2mW9xL4",
        ),
        (
            "| Service | Var | Desc | Secret |\n|---|---|---|---|\n| api | JWT_SECRET | signing | Zk8pQ2mW9xL4 |",
            "Zk8pQ2mW9xL4",
        ),
        # a fifth review's: a value column's row after a row of ``---``, with a note, after an
        # escaped pipe; a partitioned cookie in an array, a Python dump of one
        (
            "| Variable | Description | Value |\n|---|---|---|\n| DEBUG | --- | --- |\n"
            "| DB_PASSWORD | the database password | Zk8mq2Lp9x |\n",
            "Zk8mq2Lp9x",
        ),
        (
            "| Variable | Description | Value |\n|---|---|---|\n"
            "| DB_PASSWORD | the database password | Zk8mq2Lp9x (prod) |\n",
            "Zk8mq2Lp9x",
        ),
        (
            "| Variable | Description | Value |\n|---|---|---|\n"
            "| DB_PASSWORD | set via `a \\| b` | Zk8mq2Lp9x |\n",
            "Zk8mq2Lp9x",
        ),
        (
            '{"cookies": [{"name": "a", "value": "x", "partitionKey": {"topLevelSite": '
            '"https://ex.com"}}, {"name": "sid", "value": "Zk8mq2Lp9xQ4rT7vW1yB"}]}',
            "Zk8mq2Lp9xQ4rT7vW1yB",
        ),
        ("{'cookies': [{'name': 'sid', 'value': 'Zk8mq2Lp9xQ4rT7vW1yB'}]}", "Zk8mq2Lp9xQ4rT7vW1yB"),
        # a regression check's: a value column's value with a quote, past 256 characters,
        # without its closing pipe before a CRLF, under a Key header; a cookie's brace
        (
            "| Variable | Description | Value |\n|---|---|---|\n"
            "| DB_PASSWORD | the db password | P@ss'w0rdZk8mq2Lp9xQ4 |\n",
            "P@ss'w0rdZk8mq2Lp9xQ4",
        ),
        (
            "| Variable | Description | Value |\n|---|---|---|\n| DB_PASSWORD | x | "
            + "A1b2" * 70
            + " |",
            "A1b2" * 70,
        ),
        (
            "| Variable | Description | Value |\n|---|---|---|\n| DB_PASSWORD | the db | Zk8mq2Lp9xQ4\r\n",
            "Zk8mq2Lp9xQ4",
        ),
        (
            "| Name | Description | Key |\n|---|---|---|\n| API_TOKEN | prod | Zk8mq2Lp9xQ4 |\n",
            "Zk8mq2Lp9xQ4",
        ),
        (
            '{"cookies": [{"name": "a", "value": "x}y"}, {"name": "sid", "value": "Zk8mq2Lp9xQ4rT7vW1yB"}]}',
            "Zk8mq2Lp9xQ4rT7vW1yB",
        ),
        # a fourth review's: a HAR's (or Playwright's) cookies array
        (
            '{"cookies": [{"name": "_ga", "value": "GA1.1.1"}, {"name": "sessionid", '
            '"value": "Zk8aQ2mP9xLwAbCdEf12", "path": "/"}]}',
            "Zk8aQ2mP9xLwAbCdEf12",
        ),
        # a fourth review's: a Terraform value's diff (state and output), both sides
        (
            '-      "value": "OldPassw0rd123",\n+      "value": "NewPassw0rd456",\n'
            '       "type": "string",\n       "sensitive": true\n',
            "OldPassw0rd123",
        ),
        (
            '   "sensitive": true,\n   "type": "string",\n-  "value": "OldPassw0rd123"\n'
            '+  "value": "NewPassw0rd456"\n',
            "OldPassw0rd123",
        ),
        # a session's cookie: curl -v's header lines, a -H, a JSON dump of headers
        ("> Cookie: theme=dark; session=k2j3h4g5f6d7s8a9qwerty12\n", "k2j3h4g5f6d7s8a9qwerty12"),
        ("< Set-Cookie: connect.sid=s%3AabcDEF123456.xyz789; Path=/", "s%3AabcDEF123456.xyz789"),
        ("curl -H 'Cookie: sid=Zk8aQ2mP9xLwAbCdEf12' localhost", "Zk8aQ2mP9xLwAbCdEf12"),
        ('{"headers": {"cookie": "sid=Zk8aQ2mP9xLwAbCdEf12"}}', "Zk8aQ2mP9xLwAbCdEf12"),
        # ... and as browsers, HAR files, requests and curl's -b give it; after a cookie the
        # rule could not read (empty, odd name, a comma), quoted
        (
            "curl 'https://x' -b '_ga=GA1.1.123; sessionid=Zk8aQ2mP9xLwAbCdEf12'",
            "Zk8aQ2mP9xLwAbCdEf12",
        ),
        ("curl --cookie 'sessionid=Zk8aQ2mP9xLwAbCdEf12' https://x", "Zk8aQ2mP9xLwAbCdEf12"),
        (
            "{'User-Agent': 'python-requests/2.31', 'Cookie': 'sid=Zk8aQ2mP9xLwAbCdEf12'}",
            "Zk8aQ2mP9xLwAbCdEf12",
        ),
        ('{"name": "Cookie", "value": "sessionid=Zk8aQ2mP9xLwAbCdEf12"}', "Zk8aQ2mP9xLwAbCdEf12"),
        (
            '{"set-cookie": ["a=b; Path=/", "sessionid=Zk8aQ2mP9xLwAbCdEf12; HttpOnly"]}',
            "Zk8aQ2mP9xLwAbCdEf12",
        ),
        ("> Cookie: _gat=; sessionid=Zk8aQ2mP9xLwAbCdEf12", "Zk8aQ2mP9xLwAbCdEf12"),
        ("> Cookie: cart[1]=2; PHPSESSID=Zk8aQ2mP9xLwAbCdEf12", "Zk8aQ2mP9xLwAbCdEf12"),
        ("> Cookie: prefs=a,b; PHPSESSID=Zk8aQ2mP9xLwAbCdEf12", "Zk8aQ2mP9xLwAbCdEf12"),
        ('> Cookie: sid="Zk8aQ2mP9xLwAbCdEf12"', "Zk8aQ2mP9xLwAbCdEf12"),
        # Kubernetes' env, ECS's and CloudFormation's name/value pairs
        (
            "        - name: DB_PASSWORD\n          value: K8sEnvPw9zLq2Mx\n",
            "K8sEnvPw9zLq2Mx",
        ),
        (
            '        - name: STRIPE_API_KEY\n          value: "K8sStr1p3K3y9zLq2"\n',
            "K8sStr1p3K3y9zLq2",
        ),
        ('[{"name": "DB_PASSWORD", "value": "EcsEnvPw9zLq2Mx"}]', "EcsEnvPw9zLq2Mx"),
        ('[{"name": "API_TOKEN", "value": "EcsT0k3n9zLq2Mv7Nw"}]', "EcsT0k3n9zLq2Mv7Nw"),
        ('{"ParameterKey": "DbPassword", "ParameterValue": "CfnPw9zLq2Mv7"}', "CfnPw9zLq2Mv7"),
        ('<add key="ApiSecret" value="XmlAppS3cr3t0zXq" />', "XmlAppS3cr3t0zXq"),
        ("<server>\n  <password>MvnS3tt1ngsPw9zLq2</password>\n</server>", "MvnS3tt1ngsPw9zLq2"),
        # base64: Docker's config.json, .npmrc's _auth, a private key (kubeconfig)
        (
            '{"auths": {"https://index.docker.io/v1/": {"auth": "' + _DOCKER_AUTH + '"}}}',
            _DOCKER_AUTH,
        ),
        (f"//artifactory.acme.com/:_auth={_DOCKER_AUTH}\n", _DOCKER_AUTH),
        (f"    client-key-data: {_KEY_IN_BASE64}\n", _KEY_IN_BASE64[20:60]),
        # a type declared between the name and the literal
        ('export const apiKey: string = "TsTyp3dK3y9zLq2Mv7Nw4";', "TsTyp3dK3y9zLq2Mv7Nw4"),
        ("const dbPassword: string = 'TsTyp3dPw9zLq2Mv';", "TsTyp3dPw9zLq2Mv"),
        ('const API_SECRET: &str = "RsS3cr3t9zLq2Mv7Nw4";', "RsS3cr3t9zLq2Mv7Nw4"),
        ('val apiKey: String = "KtK3y9zLq2Mv7Nw4abc"', "KtK3y9zLq2Mv7Nw4abc"),
        ('var apiKey string = "GoK3y9zLq2Mv7Nw4abc"', "GoK3y9zLq2Mv7Nw4abc"),
        # wp-config.php
        ("define( 'DB_PASSWORD', 'WpC0nf1gPw9zLq2' );", "WpC0nf1gPw9zLq2"),
        ("define( 'AUTH_KEY',         'x9#kL2@mQ7$vN4!pR8&sT1*wY5^zA3%b' );", "x9#kL2@mQ7$vN4!pR8"),
        # curl -v's headers sent and got
        ("> x-auth-token: CurlVT0k3n9zLq2Mv7Nw4\n> accept: */*", "CurlVT0k3n9zLq2Mv7Nw4"),
        # a review's variations: pretty-printed JSON, a field between, CloudFormation's YAML, a
        # blank after the name, elements named as keys, a key's base64 alone or wrapped, a Go
        # block, a space before define's parenthesis, a union type
        (
            '{\n  "environment": [\n    {\n      "name": "DB_PASSWORD",\n'
            '      "value": "Zq9Xw2Lm7Rt4Kp8V"\n    }\n  ]\n}',
            "Zq9Xw2Lm7Rt4Kp8V",
        ),
        (
            '{"name": "DB_PASSWORD", "type": "String", "value": "Zq9Xw2Lm7Rt4Kp8V"}',
            "Zq9Xw2Lm7Rt4Kp8V",
        ),
        (
            "  Environment:\n    - Name: DB_PASSWORD\n      Value: Zq9Xw2Lm7Rt4Kp8V\n",
            "Zq9Xw2Lm7Rt4Kp8V",
        ),
        ("- name: API_KEY \n  value: Zq9Xw2Lm7Rt4Kp8V", "Zq9Xw2Lm7Rt4Kp8V"),
        ("<apiKey>Zq9Xw2Lm7Rt4Kp8V</apiKey>", "Zq9Xw2Lm7Rt4Kp8V"),
        ("<token>Zq9Xw2Lm7Rt4Kp8V</token>", "Zq9Xw2Lm7Rt4Kp8V"),
        (_LONG_KEY, _LONG_KEY[20:60]),
        (
            "\n".join(_LONG_KEY[i : i + 76] for i in range(0, len(_LONG_KEY), 76)),
            _LONG_KEY[-90:-10],
        ),
        (
            'var (\n\tapiKey  string = "Zq9Xw2Lm7Rt4Kp8V"\n\tbaseURL string = "https://x"\n)',
            "Zq9Xw2Lm7Rt4Kp8V",
        ),
        ("define ('DB_PASSWORD', 'Zq9Xw2Lm7Rt4Kp8V')", "Zq9Xw2Lm7Rt4Kp8V"),
        ('let apiKey: string | undefined = "Zq9Xw2Lm7Rt4Kp8V";', "Zq9Xw2Lm7Rt4Kp8V"),
        # a second review's: a key as a data URL, a camelCase name given a token, SSM's path
        # and a field between in YAML, a "#" inside an unquoted value
        ("data:application/x-pem-file;base64," + _LONG_KEY, _LONG_KEY[20:60]),
        ("localStorage.setItem('authToken', 'a8f5f167f44f4964e6c998dee827110c');", "a8f5f167f44f"),
        (
            '"Name": "/prod/db/password", "Type": "SecureString", "Value": "Tr0ub4dor&3xyz"',
            "Tr0ub4dor&3xyz",
        ),
        ("  Name: DB_PASSWORD\n    Type: String\n    Value: Tr0ub4dor&3xyz\n", "Tr0ub4dor&3xyz"),
        ("- name: DB_PASSWORD\n  value: Tr0ub4dor#3xyz\n", "Tr0ub4dor#3xyz"),
        # a third review's: a value that opens with "!", a trailing comment, a wrapped key's
        # last line before a quote
        ('{"name": "DB_PASSWORD", "value": "!Open sesame 2024"}', "!Open sesame 2024"),
        ("- name: DB_PASSWORD\n    value: Xk9mq2LpZ7wq # from vault", "Xk9mq2LpZ7wq"),
        ('- name: DB_PASSWORD\n  value: "Xk9mq2LpZ7wq"  # from vault', "Xk9mq2LpZ7wq"),
        (
            "key = '"
            + "\n".join(_LONG_KEY[i : i + 76] for i in range(0, len(_LONG_KEY), 76))
            + "'",
            _LONG_KEY[-40:-4],
        ),
        # the README's audit: a setting quoted mid-sentence, a PGP key's armour
        ("Set `password: Sup3rS3cret99` in yaml", "Sup3rS3cret99"),
        ("Run with `password=Sup3rS3cret99`.", "Sup3rS3cret99"),
        (
            "-----BEGIN PGP PRIVATE KEY BLOCK-----\n\nlQOYBGQx1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6QAbCd"
            "EfGhIjKlMnOpQrStUvWxYz01\n=a1B2\n-----END PGP PRIVATE KEY BLOCK-----\n",
            "lQOYBGQx1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q",
        ),
        # a fourth review's: a slash or dots in a camelCase call's token (base64, SendGrid)
        (
            "os.environ.setdefault('aws_secret_access_key', 'wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY')",
            "wJalrXUtnFEMI/K7MDENG",
        ),
        ("config.set('apiKey', 'ak_live.Zk8Lm3Nq7Rs2Tv6Wx0Yz4Ab9')", "Zk8Lm3Nq7Rs2Tv6Wx0Yz4Ab9"),
        # a fifth review's: a JSON string that starts with the name (an argv's header, an
        # edit of a .properties file), a pair's value with a no-break space
        ('{"args": ["-H", "X-Api-Key:abcdef0123456789abcdef"]}', "abcdef0123456789abcdef"),
        ('{"q": "password: Zk8a9Q2m, user: bob"}', "Zk8a9Q2m"),
        ('{"new_string": "spring.datasource.password=p@ss(w0rd)"}', "p@ss(w0rd)"),
        ('subprocess.run(["curl", "-H", "X-Api-Key:Zk8a9Q2mP0xxYYzz", url])', "Zk8a9Q2mP0xxYYzz"),
        ("env:\n- name: DB_PASSWORD\n  value: pass\xa0word123\n", "word123"),
        # a sixth review's: a dotted passphrase, a key before a subscript, a key ending as a
        # type's name does
        ("config.set('password', 'Correct.Horse.Battery9')", "Correct.Horse.Battery9"),
        ('{"new_string": "api_key: Zk8a9Q2mP0xxYYzzT7[0]"}', "Zk8a9Q2mP0xxYYzzT7"),
        ("Use `token: Q8vNz2LpRt5YkWmXc3BsHdString`", "Q8vNz2LpRt5YkWmXc3BsHd"),
        # a seventh review's: a password shaped like a type's name outside a declaration, a
        # dotted token at a JSON string's start
        ("password: Xk9Value", "Xk9Value"),
        ("mysql --password=Summer24Set -h db", "Summer24Set"),
        ("Server=db;Database=app;User Id=sa;Password=Summer24Set;", "Summer24Set"),
        ('{"new_string": "password: Zk8a9Q2mP.xxYYzzT7"}', "Zk8a9Q2mP.xxYYzzT7"),
        ('{"content": "password=s3cr3t.pw(1)"}', "s3cr3t.pw"),
        # AWS Secrets Manager's secret as ``get-secret-value`` prints it, Terraform's state of
        # its version (``secret_string``), a binary one
        (
            '{\n    "Name": "prod/db",\n    "VersionId": "a1b2",\n'
            '    "SecretString": "Sup3rS3cretDbPassw0rd",\n    "VersionStages": ["AWSCURRENT"]\n}',
            "Sup3rS3cretDbPassw0rd",
        ),
        ('"attributes": {"secret_id": "x", "secret_string": "Tf5ecretStr1ng"}', "Tf5ecretStr1ng"),
        ('{"SecretBinary": "U3VwM3JTM2NyZXRCaW5hcnk="}', "U3VwM3JTM2NyZXRCaW5hcnk="),
        ("secret-binary: U3VwM3JTM2NyZXRCaW5hcnk=", "U3VwM3JTM2NyZXRCaW5hcnk="),
        # a session's cookie in code: set, sent, assigned, in a dict; a Netscape cookie file
        ('document.cookie = "sid=Xk29fLq8ZpW3nR7tY1uV; path=/";', "Xk29fLq8ZpW3nR7tY1uV"),
        (
            'res.setHeader("Set-Cookie", "connect.sid=s%3AQw8rT5yU2iO9pL3kJ6hG; Path=/");',
            "s%3AQw8rT5yU2iO9pL3kJ6hG",
        ),
        ("headers['Cookie'] = 'sessionid=q8f7a6s5d4f3g2h1j0k9'", "q8f7a6s5d4f3g2h1j0k9"),
        ('req.Header.Set("Cookie", "session=q8f7a6s5d4f3g2h1j0k9")', "q8f7a6s5d4f3g2h1j0k9"),
        (
            'requests.get(url, cookies={"csrftoken": "x", "sessionid": "q8f7a6s5d4f3g2h1j0k9"})',
            "q8f7a6s5d4f3g2h1j0k9",
        ),
        ('{"cookies": {\n  "sessionid": "q8f7a6s5d4f3g2h1j0k9"\n}}', "q8f7a6s5d4f3g2h1j0k9"),
        (
            'response.set_cookie("session", "q8f7a6s5d4f3g2h1j0k9", httponly=True)',
            "q8f7a6s5d4f3g2h1j0k9",
        ),
        (
            "s.cookies.set('sessionid', 'q8f7a6s5d4f3g2h1j0k9', domain='x.com')",
            "q8f7a6s5d4f3g2h1j0k9",
        ),
        ('res.cookie("sid", "q8f7a6s5d4f3g2h1j0k9", { httpOnly: true })', "q8f7a6s5d4f3g2h1j0k9"),
        ("setcookie('PHPSESSID', 'q8f7a6s5d4f3g2h1j0k9', time() + 3600);", "q8f7a6s5d4f3g2h1j0k9"),
        (
            "# Netscape HTTP Cookie File\n"
            "#HttpOnly_.example.com\tTRUE\t/\tTRUE\t1767225600\tsid\tq8f7a6s5d4f3g2h1j0k9\n",
            "q8f7a6s5d4f3g2h1j0k9",
        ),
        # a review's: a session's cookie as MozillaCookieJar saves it (no expiry); dicts as tools
        # print them, past a number; calls over lines, by keyword, signed, Next.js's, by index,
        # ASP.NET's; a template; a Set-Cookie array
        (
            "# Netscape HTTP Cookie File\n.example.com\tTRUE\t/\tFALSE\t\tsessionid\t"
            "s3ssi0nT0kenABCDEF123456\n",
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            "localhost\tFALSE\t/\tFALSE\t-1\tsid\ts3ssi0nT0kenABCDEF123456",
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            '     1\t{\n     2\t  "cookies": {\n     3\t    "sessionid": "s3ssi0nT0kenABCDEF123456"\n',
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            '+    cookies = {\n+        "sessionid": "s3ssi0nT0kenABCDEF123456",\n+    }',
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            '{"cookies": {"secure": true, "n": 1, "sessionid": "s3ssi0nT0kenABCDEF123456"}}',
            "s3ssi0nT0kenABCDEF123456",
        ),
        ('session_cookies = {"sessionid": "s3ssi0nT0kenABCDEF123456"}', "s3ssi0nT0kenABCDEF123456"),
        (
            'response.set_cookie(\n    "sessionid",\n    "s3ssi0nT0kenABCDEF123456",\n)',
            "s3ssi0nT0kenABCDEF123456",
        ),
        ('set_cookie(key="session", value="s3ssi0nT0kenABCDEF123456")', "s3ssi0nT0kenABCDEF123456"),
        ('set_signed_cookie("sessionid", "s3ssi0nT0kenABCDEF123456")', "s3ssi0nT0kenABCDEF123456"),
        ("cookies().set('session', 's3ssi0nT0kenABCDEF123456')", "s3ssi0nT0kenABCDEF123456"),
        ('cookies[:sid] = "s3ssi0nT0kenABCDEF123456"', "s3ssi0nT0kenABCDEF123456"),
        ('s.cookies["sessionid"] = "s3ssi0nT0kenABCDEF123456"', "s3ssi0nT0kenABCDEF123456"),
        ('Response.Cookies.Append("sid", "s3ssi0nT0kenABCDEF123456")', "s3ssi0nT0kenABCDEF123456"),
        ('res.cookie("sid", "Zk8aQ2mP9x/LwAbCdEf12+q==")', "Zk8aQ2mP9x/LwAbCdEf12+q=="),  # (base64)
        ('res.cookie("sid", "Zk8aQ2mP9x/LwAbCdEfgh")', "Zk8aQ2mP9x/LwAbCdEfgh"),
        (
            'res.cookie("sid", "Uzm1/631BlaBUshkuzEfu6Ro8djner45rVgS.ULpgFA")',
            "Uzm1/631BlaBUshkuzEfu6Ro8djner45rVgS.ULpgFA",
        ),
        ('cookies = {"sid": "k/tVahV9H5Q0vY24cD9Ln.j9CkOmkP"}', "k/tVahV9H5Q0vY24cD9Ln.j9CkOmkP"),
        ('res.cookie("sid", "/LGUF2JEvwa47T1s7KluTvYMO4")', "/LGUF2JEvwa47T1s7KluTvYMO4"),
        ('set_cookie("session", "sess_9f8e7d6c/user_token12")', "sess_9f8e7d6c/user_token12"),
        (
            'cookies["connect.sid"] = "s:XM_GCAGk8s36XF82FYbZo9ihUM3u1wpN.2jrATNwII8GO9Wtcd4EGRy"',
            "XM_GCAGk8s36XF82FYbZo9ihUM3u1wpN",
        ),
        ("document.cookie = `sid=s3ssi0nT0kenABCDEF123456; path=/`", "s3ssi0nT0kenABCDEF123456"),
        (
            'res.setHeader("Set-Cookie", ["sid=s3ssi0nT0kenABCDEF123456; HttpOnly"])',
            "s3ssi0nT0kenABCDEF123456",
        ),
        # a cookie's object given by code: Selenium, Playwright (Python and JavaScript),
        # Puppeteer, Go's net/http
        (
            'driver.add_cookie({"name": "sessionid", "value": "s3ssi0nT0kenABCDEF123456"})',
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            'context.add_cookies([{"name": "sid", "value": "s3ssi0nT0kenABCDEF123456", "path": "/"}])',
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            "await context.addCookies([\n  { name: 'theme', value: 'dark' },\n"
            "  { name: 'sid', value: 's3ssi0nT0kenABCDEF123456', domain: 'localhost' },\n]);",
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            "await page.setCookie({name: 'sid', value: 's3ssi0nT0kenABCDEF123456'});",
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            'http.SetCookie(w, &http.Cookie{Name: "session_id", Value: "s3ssi0nT0kenABCDEF123456"})',
            "s3ssi0nT0kenABCDEF123456",
        ),
        # a Go slice of them (one object of objects: only its first value was read), and
        # comments with an apostrophe in them (a quote that never closed hid the object)
        (
            'jar.SetCookies(u, []*http.Cookie{{Name: "theme", Value: "dark"},'
            ' {Name: "session", Value: "s3ssi0nT0kenABCDEF123456"}})',
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            'http.SetCookie(w, &http.Cookie{\n\tName:  "session",\n'
            '\tValue: "s3ssi0nT0kenABCDEF123456", // the user\'s token\n})',
            "s3ssi0nT0kenABCDEF123456",
        ),
        (
            "driver.add_cookie({\n    'name': 'sessionid',  # Django's session\n"
            "    'value': 's3ssi0nT0kenABCDEF123456',\n})",
            "s3ssi0nT0kenABCDEF123456",
        ),
    ],
)
def test_a_fifth_reads_leaks_are_redacted_in_text_and_in_json_text(text: str, secret: str) -> None:
    """Credentials in the forms agents see (an answer in Markdown, ``kubectl get -o yaml``, an
    ECS task, Docker's and npm's config, a kubeconfig, typed code, wp-config.php, ``curl -v``)
    were logged in clear; so were they in a tool call's JSON arguments and in a log line."""
    import json

    import orjson

    from proxy.redact import line_may_hold_secret

    assert secret not in redact_text(text)
    escaped = json.dumps({"path": "notes.md", "content": text})
    assert secret not in redact_text(escaped)
    assert line_may_hold_secret(orjson.dumps({"content": text}))  # (the log's prefilter too)


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "DB_HOST", "value": "db.internal.acme"}]',  # no credential's name
        "- name: api\n  value: postgres",
        "- name: DB_PASSWORD\n  valueFrom:\n    secretKeyRef:\n      name: db-creds\n",
        '{"auth": "oauth2", "auth_method": "token"}',
        '"auth": "dGVzdGluZw=="',  # base64 of no user and password
        "<key>CFBundleName</key>\n<string>Acme</string>",
        "db = Database(host=DB_HOST,\n    password=DB_PASSWORD_2)",
        "    request_token=request.resource_owner_key):",
        'const tokenType: string = "bearer";',
        "See `README.md` (the Configuration chapter).",
        "    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUM=",
        # a review's over-redactions: a label's default, references, booleans, a bare token
        "<?php esc_html_e( 'Password', 'woocommerce' ); ?>",
        "{t('auth.password', 'Password')}",
        "<password>${env.MAVEN_PASSWORD}</password>",
        '<add key="ClientSecret" value="$(ClientSecret)" />',
        '<add key="ClientSecret" value="#{ClientSecret}#" />',
        "- name: ENABLE_TOKEN\n  value: true",
        '{"name": "token", "value": "string"}',
        # a cookie's object whose value is no token
        'driver.add_cookie({"name": "theme", "value": "dark"})',
        'http.Cookie{Name: "lang", Value: "en-US", Path: "/"}',
        "await context.addCookies([{ name: 'consent', value: 'accepted-all' }]);",
        # a second review's: CloudFormation's references, the lines after a wrapped key
        "- Name: API_KEY\n  Value: !Ref ApiKeyParameter",
        "- Name: API_KEY\n  Value: !GetAtt Secret.Arn",
        "route('resetPassword', '/api/v1/users/reset-password')",
        "mocker.patch('app.auth.get_token', 'tests.fixtures.token_v2')",
        # the README's audit: code that only names credentials at a JSON string's start (an
        # edit's arguments), as in plain text
        '{"old_string": "password: Optional[str] = None", "new_string": "token: TokenType"}',
        '{"content": "password=config.database_password_v2"}',
        '{"content": "password=Correct.Horse9"}',
        # a fifth review's: a type in backticks, a path, a setting's dotted name
        "The keypair has `secretKey: Uint8Array` and `publicKey: Uint8Array`.",
        "Pass `password: bytes32` to it.",
        "load('privateKey', 'keys/private_2024.pem')",
        # a sixth review's: code at a JSON string's start (an edit's new line)
        '{"new_string": "secretKey: Uint8Array"}',
        '{"content": "authToken: this.authService.token\\n"}',
        '{"new_string": "password=self.password,\\n        host=self.host,"}',
        '{"new_string": "api_key=os.getenv(\'OPENAI_API_KEY\'),"}',
        '{"content": "password=os.environ[\'PW\']"}',
        # a Markdown table's rows that describe settings, or give no value of their own
        "| API_KEY | string | Required. The key |",
        "| SECRET_KEY | ${SECRET_KEY} |",
        "| DB_PASSWORD | <your-password-1> |",
        "| TOKEN_TTL_2 | 3600 |",
        "| OPENAI_API_KEY | v1.2.3 |",
        "| PORT | 8080 | the password's 8080 |",
        # a schema's or an API's table: the types in a column that says so, or shaped as types
        "| Column | Type | Constraints |\n|---|---|---|\n| password_hash | VARCHAR(255) | NOT NULL |"
        "\n| api_key | CHAR(64) | UNIQUE |\n",
        "| Field | Type |\n| --- | --- |\n| encryption_key | AES-256-GCM |\n",
        "| `secretKey` | `Uint8Array` | 32-byte secret key |",
        # a Secret's templated or referenced data (a Helm chart); a ConfigMap's
        'kind: Secret\ndata:\n  p: {{ .Values.password | b64enc }}\n  q: "${DB_PW}"\n',
        "kind: ConfigMap\ndata:\n  LOG_LEVEL: debug\n  APP_SECRET_NAME: app-creds\n",
        # a bare ``pass`` that is no credential: a count, a result, a keyword, a reference
        "Pass: 142\nFail: 3\n",
        '{"status": "pass", "pass": 12, "result": {"pass": "passed"}}',
        "try:\n    run()\nexcept OSError:\n    pass\n",
        "pass: process.env.SMTP_PASS",
        'bypass: "Zk8aQ2mP9xLw"',
        # Terraform's output that is not sensitive
        '{"url": {"sensitive": false, "type": "string", "value": "https://app.example.com"}}',
        # a second review's: a Secret's metadata, a test's status, a fixture's "pass"
        '{"kind": "Secret", "metadata": {"name": "db-creds", "uid": "9f1c2d3e-aaaa"}}',
        "PASS: test_base64\nPASS: tests/test-sha256\nFAIL: test_parser2\n",
        "| Status | Test |\n|---|---|\n| PASS | test_login_v2 |\n",
        '{"content": "{\\"test\\": \\"login\\", \\"pass\\": \\"failed\\"}"}',
        "openssl rsa -passin env:KEY_PASSWORD_VAR -in key.pem",
        "Set-Cookie: a=1; Expires=Thu, 01 Jan 1970 00:00:00 GMT, b=2",
        # a third review's: a code review's and a test report's tables (places, measures,
        # times, commits, a test's error), a table of a Secret's rotations
        "| Function | Location |\n|---|---|\n| `validate_api_key` | `auth/utils.py:88` |\n",
        "| Symbol | Defined in |\n|---|---|\n| JWT_SECRET | config.py:12 |\n",
        "| Test | Duration |\n|---|---|\n| test_expired_token | 120.50ms |\n",
        "| Test | Error |\n|---|---|\n| test_api_key | AssertionError2 |\n",
        "| Change | Commit |\n|---|---|\n| `rotate_secret` | `a1b2c3d4` |\n",
        "| Migration | Revision |\n|---|---|\n| add_password_hash | 0042_auto |\n",
        "| Secret | Last rotated | Owner |\n|---|---|---|\n| JWT_SECRET | 2024-03-01T10:00 | team2 |",
        "     1\t| Field | Type |\n     2\t|---|---|\n     3\t| api_key | AES-256-GCM |\n",
        # a fifth review's: a Key column's shortcut, a Value column's constants and names
        "| Command | Description | Key |\n|---|---|---|\n"
        "| bitwarden.copyPassword | Copy the password | Ctrl+Shift+F9 |\n",
        "| Constant | Description | Value |\n|---|---|---|\n"
        "| ERR_BAD_PASSWORD | Wrong password | AUTH_E1002 |\n"
        "| auth.token_expired_v2 | Expired | auth.errors.token_v2 |\n",
        # a fourth review's: a YAML key after ``authorization:`` on the next line
        "authorization:\n      credentials_file: /etc/prometheus/api-token",
        # a cookie that is no token, a Set-Cookie's attributes, a cookie named in prose
        "> Cookie: theme=dark; lang=en-GB; tz=Europe/London\n",
        "< Set-Cookie: a=1; Expires=Wed, 21 Oct 2026 07:28:00 GMT; Max-Age=31536000000",
        "The cookie: it sets a=b on login; document.cookie: 'x=1'",
        "mycookie: name=Zk8aQ2mP9xLwAbCdEf12",
        # cookies in code that hold no token: short, a template, a variable, a comparison
        'document.cookie = "theme=dark; path=/; max-age=31536000";',
        "res.cookie('lang', 'en-GB', { maxAge: 900000 });",
        "response.set_cookie('remember_me', '1', max_age=2592000)",
        'if (cookie == "sessionid=abc") {',
        "document.cookie = `sid=${token}; path=/`;",
        "cookies.set('sid', '${SESSION_ID_FROM_ENV_12345}')",
        '{"cookies": {"enabled": true, "max_age_s": 3600}}',
        "id\tTRUE\tfoo\tFALSE\t42\tbar\tbaz",
        # a review's: a cookie banner's texts, a cookie's own attributes, a flash message, a list
        # of settings; a table of seven columns with TRUE and FALSE in it; names a tokenizer's,
        # or the README's names no credentials', with _string
        '{"cookies": {"title": "Cookie settings", "body": "We use 3 kinds of cookies on this site."}}',
        '"cookies": {"expires": "2026-01-01T00:00:00Z", "domain": "app2.example-cdn.com"}',
        '"cookies": {"name": "__Secure-session-v2", "sameSite": "Lax"}',
        'res.cookie("flash", "Saved 3 items successfully")',
        'setcookie("prefs", "layout=grid; columns=4; density=compact")',
        "build-linux\tTRUE\tubuntu-22.04\tFALSE\t312\tmain\t9fceb02d0ae598e95dc970b74767f19372d61af8",
        "u_42\tTRUE\tAlice Smith\tFALSE\t3\talice\t550e8400-e29b-41d4-a716-446655440000",
        'public_key_string = "MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEAu1SU1LfVLPHCozMxH2Mo"',
        'cache_key_string = "user:1234:profile:v2abc"',
        '{"token_string": "Hello_world_2024_x", "token_id": 15043}',
        # a second review's: a cookie read or cleared (a default, a path), a path or URL set
        'theme = self.get_cookie("theme", "solarized-dark-2024")',
        'self.clear_cookie("sid", "/admin/v2/settings")',
        'lang = getCookie("locale", "en_US_POSIX_2024")',
        'deleteCookie("auth", "/app/v2/dashboard")',
        'cookies["redirect_to"] = "/dashboard/projects/123/issues"',
        'cookies["next"] = "https://example.com/callback?step=2"',
        # a corpus check's: a relative path, a Windows one, a time in ISO 8601
        'res.cookie("asset", "static/js/main.3f9a8b7c.js")',
        'response.set_cookie("last_file", "src/components/Header2.tsx")',
        "setcookie('dir', 'C:\\\\Users\\\\dev\\\\project2024')",
        'cookies = {"session_file": "sessions/abc123def456ghi789.json"}',
        'res.cookie("since", "2024-01-15T10:30:00Z")',
    ],
)
def test_what_the_fifth_reads_rules_must_leave_alone_is_left(text: str) -> None:
    assert redact_text(text) is text


def test_no_base64_session_token_in_a_cookie_set_by_code_is_taken_for_a_path() -> None:
    """A path is kept where code sets a cookie to one; a token in base64 has ``/`` in it too,
    and one in forty was taken for a path (a part of letters between two ``/``, or a ``/``
    first) and written in clear."""
    import base64
    import random

    draw = random.Random(7)
    for _ in range(2000):
        token = base64.b64encode(draw.randbytes(draw.randint(18, 48))).decode().rstrip("=")
        if draw.random() < 0.5:  # (a signature after a dot)
            token += "." + base64.b64encode(draw.randbytes(draw.randint(3, 6))).decode().rstrip("=")
        if "/" not in token or not any(c.isdigit() for c in token):
            continue
        for form in (
            'res.cookie("sid", "{}")',
            'cookies = {{"sessionid": "{}"}}',
            "cookies['sid'] = '{}'",
        ):
            assert token not in redact_text(form.format(token)), form.format(token)


def test_a_cookie_file_nested_deep_in_json_is_found_by_the_prefilter_too() -> None:
    """Five levels of JSON inside a message put ~31 backslashes before each tab: the
    prefilter's bounded run missed the cookie file's line that the redaction reads (written in
    clear)."""
    import orjson

    text = ".example.com\tTRUE\t/\tFALSE\t1700000000\tsid\ta8f3k2m9x7q1w5e4r6t0y2u8\n"
    for _ in range(6):
        text = orjson.dumps({"cell": text}).decode()
        assert "a8f3k2m9x7q1w5e4r6t0y2u8" not in redact_text(text)
        assert line_may_hold_secret(orjson.dumps({"content": text}))


def test_a_long_run_of_backslashes_is_looked_through_in_linear_time() -> None:
    """The prefilter's patterns that start with a run of backslashes (an escaped line end or
    tab before ``pass``, ``-b``, a cookie file's ``TRUE``) were tried at each of the run's
    places, each to its end: 40,000 backslashes after a character no ASCII took 18 s of the
    log writer's thread (the scan without hyperscan, 55 s)."""
    import time

    text = "é" + "\\" * 40_000
    began = time.process_time()
    redact_text(text)
    _scans(text.encode())  # (the checks hyperscan stands in for)
    assert time.process_time() - began < 2.0  # (linear: ~20 ms; quadratic: ~18 s)


def test_the_lines_after_a_wrapped_key_in_base64_are_kept() -> None:
    """A key's base64 wrapped at 64 columns with no padding: the rule for its lines ate the
    start of any line after it made of 20 characters of base64's alphabet (a path, a name)."""
    wrapped = "\n".join(_LONG_KEY[i : i + 64] for i in range(0, len(_LONG_KEY), 64))
    for after in ("/etc/ssl/private/server_key.pem written", "ConfigurationManagerDefaults loaded"):
        out = redact_text(wrapped.rstrip("=") + "\n" + after)
        assert out.endswith("\n" + after) and _LONG_KEY[100:140] not in out


def test_a_long_run_of_blanks_in_a_pair_s_value_costs_what_its_length_does() -> None:
    """A Kubernetes pair's value with 16,000 blanks inside: each run was tried at each of its
    places, quadratic, 12.5 s of the log writer's thread (the interpreter's lock with it)."""
    import time

    text = "env:\n- name: DB_PASSWORD\n  value: x" + " " * 16_000 + "y\n"
    began = time.process_time()
    assert "[REDACTED]" in redact_text(text)
    assert time.process_time() - began < 2.0  # (linear: ~1 ms; quadratic: ~12 s)


def test_a_secrets_long_lines_are_read_in_linear_time() -> None:
    """A Secret's value with a long run of blanks inside, and a long key: a value's pattern
    tried each place of the run (20,000 blanks: 3 s); read by hand, to the line's end."""
    import time

    began = time.process_time()
    for line in ("  a: x" + " " * 100_000 + "y", "  a" + " " * 100_000 + "y: z"):
        redact_text("kind: Secret\ndata:\n" + line + "\n")
    assert time.process_time() - began < 2.0  # (linear: ~5 ms; quadratic: ~75 s)
    # a staircase of blocks, each inside the one before: each walked the rest again
    stairs = "".join("  " * i + "data:\n" + "  " * i + "  k: |\n" for i in range(1445))
    began = time.process_time()
    redact_text("kind: Secret\n" + stairs)
    assert time.process_time() - began < 2.0  # (linear: ~0.35 s for 4 MB; quadratic: ~40 s)


def test_a_tables_header_far_above_its_rows_is_not_read_from_the_texts_start() -> None:
    """A table whose header row starts more than the look back above a row: the header was
    taken from the text's first line (copied and split whole for each row: 1 MB in 27 s), so
    a settings table after a schema's took the schema's ``Type`` column and kept its values."""
    import time

    rows = "| API_KEY | Zk8pQ2mW9xL4 |\n" * 150
    text = ("|" + "a|" * 1900 + "\n|---|\n" + rows) * 40
    began = time.process_time()
    assert "Zk8pQ2mW9xL4" not in redact_text(text)
    assert time.process_time() - began < 2.0  # (~0.3 s; before: ~25 s)
    schema = "| Column | Type | Null |\n|---|---|---|\n| id | bigint | no |\n\n"
    settings = (
        "| Variable | Value | Notes on rotation and ownership in production |\n|---|---|---|\n"
    )
    settings += "".join(
        f"| SERVICE_{j}_TOKEN | tokjx9Zk8pQ2mW9xL{j:03d} | n |\n" for j in range(120)
    )
    assert "tokjx9Zk8pQ2mW9xL" not in redact_text(schema + settings)


def test_a_long_tables_value_column_is_read_on_every_row() -> None:
    """A table of 90 settings (5 KB): its rows past the first 4 KB lost their header, and with it
    the column that holds the values."""
    rows = "".join(
        f"| S_{j}_TOKEN | the token of service {j} | tokjx9Zk8pQ2mW9xL{j:03d} |\n"
        for j in range(90)
    )
    text = "| Variable | Description | Value |\n|---|---|---|\n" + rows
    out = redact_text(text)
    assert "tokjx9Zk8pQ2mW9xL" not in out and out.count("[REDACTED]") == 90
    assert "the token of service 89" in out


@pytest.mark.parametrize("prefix", ["{i:6d}\u2192", "{i:6d}\t", "+", "> ", "README.md:{i}:"])
def test_a_second_printed_tables_header_is_its_own(prefix: str) -> None:
    """Two tables as a tool printed them (numbered, a diff's, quoted, grep -n's), no blank line
    between: the second's rows took the first's header, and its values were written."""
    first = (
        "| Variable | Notes | Description |\n|---|---|---|\n| DB_PASSWORD | x | rotated monthly9 |"
    )
    second = "| Variable | Description | Value |\n|---|---|---|\n| API_TOKEN | the token | Zk8mq2Lp9xQ4 |"
    lines = (first + "\n\n" + second).splitlines()
    text = "\n".join(prefix.format(i=i) + line for i, line in enumerate(lines, 1))
    assert "Zk8mq2Lp9xQ4" not in redact_text(text)


def test_a_tables_header_is_never_taken_from_another_string() -> None:
    """A string freed and the next of the same length made at its address: the header kept
    from the first was taken for the second's, and its value written."""
    import orjson

    from proxy.redact import redact

    def body(header: str) -> bytes:
        text = f"| Variable | Description | {header} |\n|---|---|---|\n| API_TOKEN | x | Zk8mq2Lp9xQ4 |\n"
        return orjson.dumps({"messages": [{"role": "user", "content": text}]})

    for _ in range(20):
        orjson.dumps(redact(orjson.loads(body("Notes"))))
        assert b"Zk8mq2Lp9xQ4" not in orjson.dumps(redact(orjson.loads(body("Value"))))


def test_a_row_that_found_no_header_does_not_speak_for_the_next() -> None:
    """A row inside a JSON string's line, a ``---`` before it on that line, found no header:
    that was kept, and the next row of the table, which finds the header, took none."""
    text = (
        "| Variable | Description | Value |\n|---|---|---|\n"
        '{"sep": "---", "row": "| DB_PASSWORD | x | y |"}\n'
        "| API_TOKEN | the api token | Zk8mq2Lp9xQ4 |\n"
    )
    assert "Zk8mq2Lp9xQ4" not in redact_text(text)


def test_a_rule_line_at_the_texts_start_has_no_header() -> None:
    """A tool's output that starts at a table's ``|---|`` line: the header was read from the
    text's last line (a later table's ``Description``), and the value kept."""
    text = (
        "|---|---|---|\n| API_TOKEN | Zk8mq2Lp9xQ4 | main service |\n\n"
        "See the table below.\n| Name | Description | Notes |\n"
    )
    assert "Zk8mq2Lp9xQ4" not in redact_text(text)


def test_a_value_columns_header_is_found_past_many_rows_of_dashes() -> None:
    rows = "".join(f"| LOG_LEVEL_{i} | --- | --- |\n" for i in range(100))
    text = "| Variable | Description | Value |\n|---|---|---|\n" + rows
    assert "Zk8mq2Lp9xQ4" not in redact_text(text + "| DB_PASSWORD | the db | Zk8mq2Lp9xQ4 |\n")


@pytest.mark.parametrize(
    "cell",
    ["'${API_TOKEN_2}'", '"<your-token-1>"', "os.environ['DB_PASSWORD2']", 'env("API_KEY_V2")'],
)
def test_a_value_columns_quoted_placeholder_or_lookup_stays(cell: str) -> None:
    text = f"| Variable | Description | Value |\n|---|---|---|\n| DB_PASSWORD | the db | {cell} |\n"
    assert redact_text(text) == text


def test_a_tables_rows_of_dashes_are_read_in_linear_time() -> None:
    """Rows that write "none" as ``---``: each credential's row looked back through every
    ``---`` above it for the table's rule (18 s a MB)."""
    import time

    rows = "".join(f"| SERVICE_{i}_TOKEN | --- | rotated monthly |\n" for i in range(22_000))
    began = time.process_time()
    redact_text("| Variable | Value | Notes |\n|---|---|---|\n" + rows)
    redact_text("| DB_PASSWORD | --- | --- |\n" * 40_000)
    redact_text("| DB_PASSWORD | a | b |\n---\n" * 45_000)  # (a rule line after each row)
    redact_text(("| DB_PASSWORD | " + "--- | " * 9 + "\n\n") * 12_000)  # (each a table)
    assert time.process_time() - began < 6.0  # (~1.7 s; before: ~25 s)


def test_credential_names_between_pipes_are_read_in_linear_time() -> None:
    """``pwd||`` a MB long: each name was tried as a table's cell, its row's start looked for
    over 256 characters of pipes (2.6 s a MB)."""
    import time

    began = time.process_time()
    for text in ("pwd||" * 200_000, "api_key |  " * 90_000):
        redact_text(text)
    assert time.process_time() - began < 3.0  # (~0.8 s; before: ~4 s)


def test_cookies_in_cookies_are_read_in_linear_time() -> None:
    """A header whose value names the header again and again: each was read as a header of its
    own, its value to 4 KB (1 MB in 15 s)."""
    import time

    began = time.process_time()
    redact_text("Cookie: a=" + "cookie:a=" * 100_000)
    redact_text("Set-Cookie: a=" + "set-cookie:a=" * 80_000)
    redact_text("> Cookie: a=1\n" * 80_000)
    redact_text("\t-b\ta=1;" * 16_000)  # (each unquoted argument read to 16 KB: 76 s a MB)
    redact_text('add_cookie([{"value": "' * 20_000)  # (a cookie's object given by code)
    # quotes that never close in one long line: each was read to the line's end (a minute)
    redact_text("await page.setCookie(" + '{\\"name\\": \\"k\\", \\"value\\": \\"v\\"}, ' * 5_000)
    redact_text('"cookies": [{' + '"a\\' * 20_000)
    # code written by a tool call: thousands of calls on one JSON-escaped line (two minutes)
    calls = "".join(
        f'await page.setCookie({{"name": "c{i}", "value": "v{i}"}});\n' for i in range(8000)
    )
    redact_text(json.dumps({"path": "cookies.js", "content": calls}))
    redact_text('http.Cookie{Value: "a' * 20_000)
    assert time.process_time() - began < 3.0  # (linear: ~0.5 s; before: ~25 s)


def test_a_long_value_given_to_a_call_is_read_in_linear_time() -> None:
    """A two-string call's value is asked whether it is a dotted name; that reading was
    ambiguous in each part (its letters before or after its digits): 100 KB took seconds of the
    log writer's thread."""
    import time

    text = "localStorage.setItem('authToken', '" + "a" * 100_000 + "1!')"
    began = time.process_time()
    redact_text(text)
    assert time.process_time() - began < 2.0  # (linear: milliseconds; quadratic: ~8 s)


def test_a_provider_key_alone_in_prose_is_taken_out() -> None:
    """Not after a name (``TOKEN=``) or ``Bearer``: a key a tool printed alone, ``gcloud auth
    print-access-token`` run as a service account (``ya29.c.…``), an ``echo $XAI_API_KEY``."""
    for key in PROVIDER_KEYS:
        assert redact_text(f"the output was:\n{key}\n(done)") == (
            f"the output was:\n{REDACTED}\n(done)"
        ), key


@pytest.mark.parametrize(
    ("key", "at"),
    [
        ("ghp_UESCGHPwX6yZ8aB0cD2eF4gH6iJ8kL0mN2p", 0),
        ("AKIAIOSFODNN7EXAMPLE", 0),
        ("ghp_UESCGHPwX6yZ8aB0cD2eF4gH6iJ8kL0mN2p", 3),  # (its "_")
        ("sk-proj-ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", 2),  # (its "-")
        ("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", 2),
    ],
)
def test_a_key_with_a_character_escaped_in_json_inside_a_string_is_taken_out(
    key: str, at: int
) -> None:
    """A tool call's arguments hold JSON whose escapes stay as text: ``\\u0067hp_…`` is a GitHub
    token, but the check for a secret's literals found none in it, and the line was written
    as it was (an escape further in was found by the literal before it)."""
    escaped = f"{key[:at]}\\u{ord(key[at]):04x}{key[at + 1 :]}"
    arguments = '{"t": "' + escaped + '"}'
    assert json.loads(arguments) == {"t": key}
    assert redact_text(arguments) == '{"t": "[REDACTED]"}'
    line = orjson.dumps({"type": "request", "arguments": arguments})
    assert line_may_hold_secret(line)
    # text in other scripts, and HTML characters as Go's JSON escapes them, are no key; nor a
    # regex's escaped digits, in a text or in a JSON string
    plain = '{"t": "caf\\u00e9 \\u003cb\\u003e in a longer text than a key"}'
    assert redact_text(plain) is plain
    for text in ("match [\\u0030-\\u0039]+ in a line", '{"re": "[\\u0030-\\u0039]+ in a line"}'):
        assert redact_text(text) is text
