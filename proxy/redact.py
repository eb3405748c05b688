"""Secret-looking strings replaced by ``[REDACTED]`` before anything reaches a log (pure).

Agents paste keys into prompts, tool results echo environment variables, and error bodies quote
headers. The audit log must never keep them, so every string of an event goes through one
precompiled pattern. Most strings hold no secret: they are skipped when too short to hold a key,
and a string or container without a match is returned as the very same object (no copy).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Final

REDACTED: Final = "[REDACTED]"

# A private key's body: base64, the encrypted form's header lines, line ends (escaped too), and
# the end of one JSON string of an array and the start of the next (a notebook's output lines),
# where the next holds a line of the key: base64 (a last short one before the armour's end), the
# armour's end, an encrypted key's header, a line cut off by the text's end (not prose: "Paste
# the whole file, …").
# (a line's end, CRLF too, and the next string's start)
_NEXT_STRING = r'(?:\\r)?\\n"[ \t\r\n]*,[ \t\r\n]*"'
_PEM_LINES = (
    _NEXT_STRING + r"(?=(?:" + _NEXT_STRING + r")?(?:[A-Za-z0-9+/]{40}|-----END"
    r"|Proc-Type:|DEK-Info:|[A-Za-z0-9+/]{1,40}=*" + _NEXT_STRING + r"-----END"
    r"|[A-Za-z0-9+/]{1,40}=*\\?\Z))"
)
_PEM_BODY = _PEM_LINES + r"|[A-Za-z0-9+/=\s:,.\\]|-(?!----)"  # (the lines first: they go on)
# Each alternative names one family of credentials. The leading look-behind keeps words that merely
# end in one of the prefixes ("task-…", "ask-…") from matching.
_SK_KEY = r"sk-[A-Za-z0-9_-]{20,}"  # OpenAI (sk-, sk-proj-), Anthropic (sk-ant-), and look-alikes
SK_KEY: Final = re.compile(r"(?<![A-Za-z0-9])" + _SK_KEY)  # (alone: names match it too)
_KEYS = (
    r"(?:"
    + _SK_KEY
    + r"|(?:AKIA|ASIA)[0-9A-Z]{16}"  # AWS access key ids (long-lived and temporary)
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|github_pat_[A-Za-z0-9_]{20,}"  # GitHub fine-grained tokens
    r"|glpat-[A-Za-z0-9_-]{20,}"  # GitLab personal access tokens
    r"|hf_[A-Za-z0-9]{30,}"  # Hugging Face tokens
    r"|gsk_[A-Za-z0-9]{40,}"  # Groq keys
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"  # Slack tokens
    r"|xapp-[0-9]-[A-Za-z0-9-]{10,}"  # Slack app-level tokens
    r"|npm_[A-Za-z0-9]{36}"  # npm access tokens
    # JSON Web Tokens: a JSON header and payload (base64url of '{"'), then a signature
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{16,}"
    # Authorization: Bearer <token>, on its line (an OpenAPI spec's "scheme: bearer" is followed
    # by a key on the next; a word of 12 letters after it, "bearer authentication", is taken
    # for a token: a token of letters alone would otherwise go unseen)
    r"|(?P<bearer>[Bb]earer|BEARER)[ \t]+(?:[A-Za-z0-9._~+/=-]|\\/){12,}"
    r"|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"  # Stripe secret and restricted keys
    r"|AIza[0-9A-Za-z_-]{35,}"  # Google API keys
    r"|ya29\.[A-Za-z0-9._-]{30,}"  # Google OAuth access tokens (a service account's: ya29.c.…)
    # other model providers' and tools' keys: a prefix, then a run no identifier has (a
    # snake_case name, fw_update_check, breaks it; keys are letters and digits)
    r"|xai-[A-Za-z0-9]{40,}"  # xAI
    r"|pplx-[A-Za-z0-9]{40,}"  # Perplexity
    r"|nvapi-[A-Za-z0-9_-]{40,}"  # NVIDIA
    r"|csk-[A-Za-z0-9]{40,}"  # Cerebras
    r"|r8_[A-Za-z0-9]{30,}"  # Replicate
    # Fireworks: small and capital letters and a digit, as a random key has (fw_GetVersionString,
    # fw_maxretrycount, fw_0123ABCD… are names)
    r"|fw_(?=[A-Za-z0-9]*?[a-z])(?=[A-Za-z0-9]*?[A-Z])(?=[A-Za-z0-9]*?[0-9])[A-Za-z0-9]{20,}"
    r"|lsv2_(?:pt|sk)_[A-Za-z0-9_]{30,}"  # LangSmith
    # SendGrid: two random parts, a digit in them (SG.AllowAllOutbound.ConnectionsFromAnywhere
    # is a name)
    r"|SG\.(?=[A-Za-z0-9_.-]*?[0-9])[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}"
    r"|do[opr]_v1_[a-f0-9]{64}"  # DigitalOcean
    # AWS secret access keys, by their name (the value alone looks like any base64)
    # (or a blank: ``aws configure set aws_secret_access_key …``)
    r"|(?P<awsname>(?i:aws_secret_access_key)(?:[\s\"']*[=:][\s\"']*|[ \t]+(?:[\"']|\\\")?))"
    r"[A-Za-z0-9/+=]{40}"
    r")"
)
_SECRET = re.compile(
    r"(?<![A-Za-z0-9])"
    + _KEYS
    # a URL's user:password (its scheme and host kept), to the last "@" before the host (a
    # password written with a raw "@" in it)
    # (not a template's placeholders: f"postgresql://{user}:{password}@{host}", ${USER})
    + r"|(?<=://)(?![{$])[^\s/:@\"']*:(?![{$])[^\s/?#\"']+(?=@[^\s/?#@\"']+)"
    # (or a variable's default: postgres://app:${DB_PASSWORD:-Sup3r…}@db/app)
    r"|(?<=://)[^\s/:@\"']*:\$\{[A-Za-z_][A-Za-z0-9_]*:?[-=+][^}\s\"'@]{1,512}\}(?=@)"
    # a private key's PEM block, whole or cut off (its armour lines kept): base64 and the
    # encrypted form's header lines only, so a parser's source that names the armour is no block
    # (a body's dashes never run to five: scanning stops at the next armour line, so text with
    # thousands of BEGIN lines costs no more than its length; escaped line ends are body too)
    # (a notebook's output holds it a line a JSON string: ``"…\n",\n  "…`` is body too)
    # a private key's PEM block in base64 (kubeconfig's client-key-data, a Kubernetes
    # secret's tls.key): its armour line encoded, RSA, PKCS#8, EC, OpenSSH, DSA, encrypted, PGP
    r"|LS0tLS1CRUdJTiB(?:SU0EgUFJJVkFURSBLRVk|QUklWQVRFIEtFWS|FQyBQUklWQVRFIEtFWS"
    r"|PUEVOU1NIIFBSSVZBVEUgS0VZ|EU0EgUFJJVkFURSBLRVk|FTkNSWVBURUQgUFJJVkFURSBLRVk"
    r"|QR1AgUFJJVkFURSBLRVkgQkxPQ0s)[A-Za-z0-9+/]*+"
    # (wrapped at 64 or 76 columns: each line of base64 alone, to its end, a quote or padding)
    r"(?:(?:\\?\r)?(?:\n|\\n)[A-Za-z0-9+/]{20,}+(?=[=\"'`<,)\]\r\n\\]|\Z))*+=*"
    # (PGP's armour says PRIVATE KEY BLOCK)
    r"|-----BEGIN (?P<pem>[A-Z0-9 ]*)(?P<armour>PRIVATE KEY(?: BLOCK)?)-----(?:(?:"
    + _PEM_BODY
    + ")*"
    r"-----END (?P=pem)(?P=armour)-----|(?:" + _PEM_BODY + r"){16,}(?=\Z|\")"
    # cut off with text after it (a tool's "[output truncated]", "(exit code 0)"): its lines of
    # base64 (40 characters or more: no prose), and the part of a line it was cut in
    r"|(?:" + _PEM_BODY + r")*?[A-Za-z0-9+/]{40,}=*"
    r"(?:(?:\s|\\[rn]|" + _PEM_LINES + r")+[A-Za-z0-9+/]{40,}=*)*"
    r"(?:(?:\s|\\[rn]|" + _PEM_LINES + r")+[A-Za-z0-9+/]+=*)?)"
)

# The shortest string any alternative can match (a URL's "://:p@"), so anything shorter cannot
# hold a secret.
_MIN_SECRET_LEN: Final = 6

# Fields whose whole value is a credential, whatever it looks like.
_SECRET_KEYS: Final = frozenset(
    {"authorization", "proxy-authorization", "api_key", "api-key", "x-api-key", "apikey"}
)


# The same keys where what comes before them ends in a letter or a digit but is no word: an escape
# written out (a repr's "\n", "\t"), a percent-encoded byte ("%20", "%22": a URL's query) and a
# terminal's colour or erase codes (GNU grep's --color=always writes "\x1b[01;31m\x1b[K…\x1b[m\x1b[K",
# git's "\x1b[m"). (Such a key was logged as it was.) A second pattern, searched only in a text
# with one of them (``_AFTER_MARKS``): in one pattern, the look-behinds took every position of
# every text ~30% longer.
_SECRET_AFTER = re.compile(
    r"(?:(?<=\\[nrt])|(?<=%[0-9A-Fa-f]{2})|(?<=\x1b\[[mK])|(?<=\x1b\[[0-9][mK])"
    r"|(?<=[0-9;][0-9][mK]))" + _KEYS
)
_AFTER_MARKS: Final = ("\\", "%", "\x1b")


def sk_key_shaped(match: str) -> bool:
    """Whether a match of the generic ``sk-`` pattern is shaped like a key: a provider's own
    prefix (``sk-proj-``, ``sk-ant-``, ``sk-svcacct-``, ``sk-admin-``: a key wrapped right after
    it too), a run of 32 letters and digits or more (SiliconFlow's 48 small letters), one of 16
    or more with both in it, or three capitals and three small letters or more after the
    ``sk-`` (OpenAI's, Anthropic's, DeepSeek's keys all are); ``sk-learn-pipeline-debugging``,
    ``sk-feature-authentication-refactor`` are names."""
    if match.startswith(_SK_PREFIXES):
        return True
    tail = match[3:]
    if sum(c.isupper() for c in tail) >= 3 and sum(c.islower() for c in tail) >= 3:
        return True
    return any(
        len(run) >= 32 or (len(run) >= 16 and not run.isalpha() and not run.isdigit())
        for run in _ALNUM_RUNS.findall(tail)
    )


_ALNUM_RUNS: Final = re.compile(r"[A-Za-z0-9]+")
_SK_PREFIXES: Final = ("sk-proj-", "sk-ant-", "sk-svcacct-", "sk-admin-", "sk-or-")
_SK_ALONE: Final = re.compile(_SK_KEY)


def _replace(match: re.Match[str]) -> str:
    """A match of ``_SECRET`` or ``_SECRET_AFTER`` (which has no PEM block) replaced; a name
    the ``sk-`` pattern matched (``sk_key_shaped``) left as it is."""
    found = match.group(0)
    if (
        found.startswith("sk-")
        and _SK_ALONE.fullmatch(found) is not None  # (not a URL's sk-user:password)
        and not sk_key_shaped(found)
    ):
        return found
    bearer = match.group("bearer")
    if bearer:
        return f"{bearer} {REDACTED}"
    pem = match.group("pem") if "pem" in match.re.groupindex else None
    if pem is not None:
        armour = match.group("armour")
        return f"-----BEGIN {pem}{armour}-----{REDACTED}-----END {pem}{armour}-----"
    name = match.group("awsname")
    return f"{name}{REDACTED}" if name else REDACTED


# Values named as credentials in text (an .env line, a JSON object inside a string such as a tool
# call's arguments, a URL's query, a YAML line) and Authorization headers in text (a curl command).
# Found by their names with plain substring searches, each hit then checked by an anchored match:
# one pattern able to start anywhere cost ~0.5 ms per 3 KB of text, and a name alone says little
# (``token = self.tokenizer.encode(text)`` is code, ``JWT_SECRET=4f…`` is not).
# ("pass" finds "password" and "passwd" too, and "pass" after any separator: ``DB_PASS``,
# ``db-pass``, ``smtp.pass``)
_NAME_WORDS: Final = ("pass", "secret", "token", "key", "pwd")
# A credential's name (lower-cased) ends in one of these: "password", "secret" or "token" after
# anything (``authToken``, ``client_secret``), "key(s)" after a separator or a known prefix
# (``OPENAI_KEY``, ``apiKey``; not ``monkey``), maybe then a version, ``_base``, ``_id`` or
# ``_hash`` (``SECRET_KEY_BASE``, ``WEBHOOK_SECRET_V2``); a secret's ``_string`` or ``_binary``
# too (AWS Secrets Manager's ``SecretString``; a ``token_string`` is a tokenizer's).
_NAMED_KEY = (
    r"(?:api|auth|access|private|priv|secret|master|signing|encryption|client|app|service"
    r"|license|deploy|ssh|anon|account)[_-]?keys?"
)
_NAME_END = r"(?:[_-]?(?:v\d+|base|id|hash))?\Z"
_CREDENTIAL_NAME = re.compile(
    r"(?:passw(?:or)?d|pwd|secrets?|secret[_-]?(?:string|binary)|tokens?|(?:\A|[_.-])pass|[_.-]keys?|"
    + _NAMED_KEY
    + ")"
    + _NAME_END
)
# In code, where any ``…_key`` may be named so (``edge_key="weight"``, ``sort_key=…``), a name in
# lower or mixed case must say more: a password, secret or token, ``pass`` after a separator, or
# a key with a known prefix (``api_key``, ``apiKey``, ``private_key``); ``OPENAI_KEY`` in upper
# case is a constant and counts.
_CODE_CREDENTIAL_NAME = re.compile(
    r"(?:passw(?:or)?d|pwd|secrets?|secret[_-]?(?:string|binary)|tokens?|(?:\A|[_.-])pass|"
    + _NAMED_KEY
    + ")"
    + _NAME_END
)
# ...but these are no credentials' names.
# (Each word starts the name or follows a separator: ``n_tokens`` is a count, ``session_token``
# and ``AWS_SESSION_TOKEN`` are not; a camelCase name is read with its words separated.)
_HARMLESS_NAME = re.compile(
    r"(?:\A|[_.-])(?:"
    r"(?:cache|primary|foreign|sort|partition|idempotency|row|hash|range|lookup|dict|map|object"
    r"|group|dedup|cursor|public|publishable)[_-]?keys?"
    r"|(?:pad|eos|bos|unk|mask|sep|cls|special|start|end|stop)[_-]?tokens?"
    r"|(?:page|max|max[_-]?new|completion|prompt|input|output|total|reasoning|cached|num|n)"
    r"[_-]?tokens?"
    r")\Z"
    r"|\Atoken[_-]?(?:type|count|limit|usage)\Z"
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_IDENT: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_IDENT_RUN = re.compile(r"[A-Za-z0-9_.-]*")
_MAX_NAME = 64  # longer runs are no names (and a run is looked at once: no quadratic walks)
# Values: a quoted one holds anything but its closing quote (escapes inside JSON); an unquoted one
# is a literal, stops at a backslash (an escaped line end inside a JSON string: a file a tool call
# writes) and, but for upper-case names, is no code (a call, an index, an attribute chain:
# ``self.tokenizer.encode(…)``). A value is taken whole however long (a JWT, an STS session token:
# thousands of characters), possessively: it is consumed, and looked at once; the checks before
# it look at most 512 characters on.
_JSON_VALUE = re.compile(r'\s*:\s*"(?=(?:[^"\\\n]|\\.){0,512}?[A-Za-z0-9])((?:[^"\\\n]|\\.){6,}+)"')
_ESCAPED_JSON_VALUE = re.compile(  # \"name\": \"value\" inside a JSON string
    r'\\"\s*:\s*\\"(?=[^"\\]{0,512}[A-Za-z0-9])([^"\\]{6,}+)\\"'
)
_QUOTED = (
    r"""(?:"(?=[^"\n\\]{0,512}[A-Za-z0-9])([^"\n\\]{6,}+)"|'(?=[^'\n\\]{0,512}[A-Za-z0-9])"""
    r"""([^'\n\\]{6,}+)')"""
)
_LITERAL = (
    # (a "\\/" is a slash as a JSON encoder may escape it, in a tool call's arguments)
    r"(?=[^\s\"'`\\]{0,512}[A-Za-z])([^\s\"'`$(){}\[\]<>,;\\](?:[^\s\"'`(){}\[\]<>,;\\]|\\/){5,}+)"
    # (its end: a blank, a separator, a quote, or Markdown's backtick or a parenthesis around
    # it, as an answer quotes a setting: ``DB_PASSWORD=…``, "(ADMIN_PASSWORD=…)")
    r"(?![^\s,;\\\"`)])"
)
# (a part of 17 characters or more with a digit in it and no underscore is no name: a token's,
# a JWT's or a SendGrid key's dotted parts; ``database_password_v2`` is one)
_CODE_PART = (
    r"(?:[A-Za-z_][A-Za-z0-9_]{0,15}|[A-Za-z_][A-Za-z_]{16,64}"
    r"|(?=[A-Za-z0-9_]{0,64}_)[A-Za-z_][A-Za-z0-9_]{16,64})(?![A-Za-z0-9_])"
)
# A type's name, as an answer quotes a field's declaration in backticks: ``Uint8Array``,
# ``Int64Value``, ``Base64String``, Solidity's ``uint256`` and ``bytes32``
_TYPE_NAME = re.compile(  # (words, each a capital and small letters, a type's width maybe)
    r"(?:[A-Z][a-z]++(?:8|16|32|64|128|256)?+)+(?:Array|Value|String|Type|Buffer|Int|Id|Map"
    r"|List|Set)|u?int(?:8|16|32|64|128|256)|bytes\d{1,2}|float(?:16|32|64)|UUIDv\d"
)
_CHAIN = re.compile(_CODE_PART + r"(?:\." + _CODE_PART + r"){1,8}")  # (``config.db_password``)
_NOT_CODE = r"(?!" + _CODE_PART + r"(?:\." + _CODE_PART + r"){1,8}(?![^\s,;\\\"`)]))"
# Where code is as likely as a setting (INI, YAML: ``token: TokenType``, ``self.password =
# password``), an unquoted value must hold a digit or be 20 characters or more.
_SETTING = r"(?:(?=[^\s\"'`\\]{0,512}[0-9])|(?=[^\s\"'`\\]{20}))" + _NOT_CODE + _LITERAL
_ESCAPED_QUOTED = r'\\"(?=[^"\\]{0,512}[A-Za-z0-9])([^"\\]{6,}+)\\"'  # \"…\" in a JSON string
# A value given on a command's line (``--from-literal=password=…``): unquoted, it ends at white
# space, a quote, a parenthesis (``$(…)``) or an ``&`` that starts another field (a form's
# ``client_secret=…&grant_type=``); the digit or the 20 characters a setting needs are its own.
_FIELD_AMP = r"&(?![A-Za-z_][\w.-]{0,64}=)"  # (an & that starts no other field: a form's)
_INLINE_CHARS = r"[^\s\"'`(){}\[\]<>,;\\&]"
_INLINE_END = r"(?![^\s,;\\\"'&)`])"
_INLINE_LITERAL = (
    f"(?={_INLINE_CHARS}{{0,512}}[A-Za-z])"
    r"([^\s\"'`$(){}\[\]<>,;\\&](?:"
    + _INLINE_CHARS
    + r"|\\/|"
    + _FIELD_AMP
    + r"){5,}+)"
    + _INLINE_END
)
_INLINE_SETTING = (
    f"(?:(?={_INLINE_CHARS}{{0,512}}[0-9])|(?={_INLINE_CHARS}{{20}}))"
    # (no attribute chain, ended as such a value may end: ``request.owner_key)``)
    + f"(?!{_CODE_PART}(?:\\.{_CODE_PART}){{1,8}}{_INLINE_END})"
    + _INLINE_LITERAL
)
_SNAKE_NAME = re.compile(r"[a-z]+(?:_[a-z]+)+")  # (no digit: a name, not a passphrase)
# ODBC's quoted value, ``PWD={pa;ss}}word};`` (a ``}`` doubled inside), ending the setting
_BRACED_VALUE = re.compile(r"""=\{((?:[^}\n\\]|\}\}){1,512}+)\}(?=[;"'\s]|\\|\Z)""")
_INLINE_QUOTED = re.compile(r"=(?:" + _QUOTED + "|" + _ESCAPED_QUOTED + ")")
_INLINE_UNQUOTED = re.compile("=" + _INLINE_SETTING)
_NO_VARIABLE = r"(?!\$[A-Za-z_{(])"
# ...and where the name opens a quoted word: in single quotes, to the closing quote; in double
# quotes, to it or a blank (libpq's ``"password=… dbname=app"``)
_INLINE_IN_SINGLE = re.compile(
    "=" + _NO_VARIABLE + r"(?=[^'\n\\&]{0,512}[A-Za-z0-9])"
    r"((?:[^'\n\\&]|" + _FIELD_AMP + r"){6,}+)(?='|&)"
)
_INLINE_IN_DOUBLE = re.compile(
    "=" + _NO_VARIABLE + r'(?=[^"\s\\&;]{0,512}[A-Za-z0-9])'
    r'((?:[^"\s\\&;]|' + _FIELD_AMP + r'){6,}+)(?=["\s\\&;])'
)
# (what may stand before such a name: a blank, the ``=`` of a flag, a quote, a list's comma,
# a flag's dash, Hydra's ``+``, sed's ``/``)
_INLINE_BEFORE: Final = frozenset(" \t='\"-,+/")
# Blanks around an operator: a tab is ``\t`` in JSON text (a tool call's arguments, a JSON
# tool output), where a quote is ``\"``.
_BLANKS = r"(?:[ \t]|\\t)*"
# A variable's default or alternative, unquoted: ``${DB_PASSWORD:-Sup3r…}`` (docker-compose)
# (Spring's ``${DB_PASSWORD:Sup3r…}`` too; not another variable, ``${A:-${B}}``, nor a path)
_DEFAULTED = (
    r"\$\{[A-Za-z_][A-Za-z0-9_.]{0,64}(?::[-=+]?|[-=+])(?![-=+?$~/])"
    r"(?:\"([^\"\n\\}]{4,512}+)\"|'([^'\n\\}]{4,512}+)'|([^}\s\"'\\]{4,512}+))\}"
)
# A setting's value: a variable's default, quoted, escaped-quoted, or a literal of a setting's
_SETTING_VALUE = "(?:" + _DEFAULTED + "|" + _QUOTED + "|" + _ESCAPED_QUOTED + "|" + _SETTING + ")"
_ASSIGN_VALUE = re.compile(_BLANKS + "=" + _BLANKS + _SETTING_VALUE)
# The shell's working directories (``env`` prints them): PWD is no password there.
_SHELL_DIRECTORY: Final = re.compile(r"(?<![A-Z0-9_;])(?:OLD)?PWD=")  # (;PWD= is ODBC's)
_ENV_VALUE = re.compile(
    r"=(?:" + _DEFAULTED + "|" + _QUOTED + "|" + _ESCAPED_QUOTED + "|" + _LITERAL + ")"
)
_HEADER_VALUE = re.compile(r":[ \t]*([A-Za-z0-9._~+/=-]{8,}+)(?![(])")
_QUERY_VALUE = re.compile(r"=(?=[^&\s#\"'\\]{0,512}[A-Za-z])([^&\s#\"'\\]{6,}+)")
# A flag and its value, apart: ``--api-key VALUE`` (a digit in it, or 20 characters: not a word).
_FLAG_VALUE = re.compile(r"[ \t]+(?:" + _QUOTED + "|" + _SETTING + ")")
# After a colon in code, a quoted type name is an annotation: ``def sign(private_key:
# "RSAPrivateKey")`` (alone on its line it reads as a YAML setting, whose value may be a
# passphrase of letters: redacted there).
_NO_ANNOTATION = r"""(?![ \t]*\\?["'][A-Z_][A-Za-z_.\[\], |]{0,512}\\?["'])"""
_YAML_VALUE = re.compile(
    _BLANKS + r":(?:[ \t]|\\t)+" + _SETTING_VALUE + r"[ \t]*(?:#[^\n\\]*)?"
    # the line's end, escaped or not, the end of a JSON string, or Markdown's backtick
    r"(?=\r|\n|\\n|\\r|\"|`|\Z)"
)
_AUTHORIZATION = re.compile(  # a scheme, or a header's colon and a token alone (no code)
    r"""(?i:authorization)["']?\s*(?:[:=]\s*["']?(?:(?i:basic|bearer|token|digest)[ \t]+"""
    r"""([A-Za-z0-9._~+/=:-]{12,}+)"""
    # another scheme (ApiKey, SSWS, AWS4-HMAC-SHA256): its credential has a digit (no prose)
    r"""|[A-Za-z][A-Za-z0-9_-]{0,31}[ \t]+(?=[A-Za-z0-9._~+/=:-]{0,512}?[0-9])"""
    r"""([A-Za-z0-9._~+/=:-]{12,}+))"""
    r"""|:[ \t]*["']?([A-Za-z0-9_~+/=-]{16,}+)(?![.(:]))"""
)
# A quoted literal assigned to a credential's name in code, wherever the name stands:
# ``const API_KEY = "…"``, ``f(api_key="…")``, ``{password: "…"}``, ``$password => "…"``,
# ``token := "…"`` (an unquoted value there is code: ``token = make_token()``; a quoted type
# after a colon is an annotation: ``private_key: "RSAPrivateKey"``).
_ANY_QUOTED = "(?:" + _QUOTED + "|" + _ESCAPED_QUOTED + ")"
# (a type declared between: ``const apiKey: string = "…"``, Rust's ``&str``, ``&'static str``,
# Kotlin's and Swift's ``String``, Go's ``var apiKey string = "…"``)
_TYPE = (
    r"&?(?:'static[ \t]+)?[A-Za-z_][\w.]{0,64}(?:<[^<>\n]{0,64}>)?(?:\[\])?\??"
    r"(?:[ \t]*\|[ \t]*[A-Za-z_][\w.]{0,64}){0,3}"  # (a union: ``string | undefined``)
)
_GO_STRING = re.compile(r"[ \t]+string[ \t]*=(?!=)")
_CODE_VALUE = re.compile(
    r"[ \t]*(?:=>?|:=|:" + _NO_ANNOTATION + r"|:[ \t]*" + _TYPE + r"[ \t]*=(?!=)"
    r"|[ \t]+string[ \t]*=(?!=))[ \t]*" + _ANY_QUOTED
)
# ...and inside an object literal's braces, where a colon gives a value, never a type:
# ``{ password: "Correcthorsebattery" }``.
_OBJECT_VALUE = re.compile(
    r"[ \t]*(?:=>?|:=?|:[ \t]*" + _TYPE + r"[ \t]*=(?!=))[ \t]*" + _ANY_QUOTED
)
# ...and to a quoted name: ``os.environ["API_KEY"] = "…"``, ``'password' => '…'``,
# ``{'api_key': '…'}`` (a Python dict printed).
_INDEXED_VALUE = re.compile(r"\]?[ \t]*(?:=>?|:)[ \t]*" + _QUOTED)
_ESCAPED_INDEXED_VALUE = re.compile(r'\\"\]?[ \t]*(?:=>?|:)[ \t]*' + _ESCAPED_QUOTED)
# A credential's name given as a name field's value, its value in the next field: Kubernetes'
# ``env`` (``- name: DB_PASSWORD`` then ``value: …``), ECS's and CloudFormation's JSON
# (``{"name": "DB_PASSWORD", "value": "…"}``, ``ParameterKey``/``ParameterValue``), .NET's
# ``<add key="ApiSecret" value="…" />``. (Where the name field ends, and then where the value
# is, after the name's closing quote or line end.)
# (a parameter's path before the name: ``"Name": "/prod/db/password"``, SSM's)
_PAIR_NAME_JSON = re.compile(r'"(?:[Nn]ame|[Kk]ey|ParameterKey)"[ \t]*:[ \t]*"[\w./-]{0,64}\Z')
_PAIR_VALUE_JSON = re.compile(
    # (pretty-printed across lines, as the AWS CLI and kubectl print it, a few short fields
    # between: ``"type": "String"``)
    r'"\s*,\s*(?:"[A-Za-z_]{1,32}"\s*:\s*(?:"[^"\\\n]{0,64}"|[\w.-]{1,32})\s*,\s*){0,3}'
    r'"(?:[Vv]alue|ParameterValue)"\s*:\s*"'
    r'(?=(?:[^"\\\n]|\\.){0,512}?[A-Za-z0-9])((?:[^"\\\n]|\\.){4,}+)"'
)
_PAIR_NAME_YAML = re.compile(r"(?:\A|[\s-])(?:[Nn]ame|ParameterKey):[ \t]*['\"]?\Z")
_PAIR_VALUE_YAML = re.compile(
    # (a field or two between: ``Type: String``, CloudFormation's SSM parameter; a ``#`` after
    # no blank is the value's, not a comment)
    r"['\"]?[ \t]*(?:\r?\n[ \t]*[A-Za-z]{1,32}:[ \t]*[^\n]{0,64}){0,2}?"
    r"\r?\n[ \t]*(?:[Vv]alue|ParameterValue):[ \t]*(?:"
    + _QUOTED
    # (words and the blanks between, each run taken whole: a long run of blanks was tried at
    # each of its places, quadratic; then a comment)
    + r"|([^\s'\"#|>](?:[^ \t\r\n#]|(?<![ \t])#)*+(?:[ \t]++(?:[^ \t\r\n#]|(?<![ \t])#)++)*+))"
    + r"[ \t]*+(?:#[^\n]*)?(?=\r|\n|\Z)"
)
_PAIR_NAME_XML = re.compile(r"(?:\A|\s)(?:key|name)=\"\Z")
_PAIR_VALUE_XML = re.compile(r'"[ \t]+value="([^"\n]{4,512}+)"')
# A pair's or an element's value that only stands for one: a boolean, a variable of Maven's
# (``${env.MAVEN_PASSWORD}``), Azure DevOps' (``$(ClientSecret)``), Octopus' (``#{X}#``), a
# token replacer's (``__ClientSecret__``)
_PLACEHOLDER = re.compile(
    r"(?i:true|false|null|yes|no|none)|\$\{[\w.-]{1,128}\}|\$\([\w.-]{1,128}\)"
    r"|#\{[\w.-]{1,128}\}#?|__[\w.-]{1,128}__"
    # (CloudFormation's intrinsic functions: !Ref, !GetAtt, !Sub …)
    r"|!(?:Ref|GetAtt|Sub|Join|Select|ImportValue|FindInMap|If|Base64|Split|GetAZs|Cidr"
    r"|Equals|Not|And|Or|Condition|Transform)(?:[ \t].*)?"
)
# A credential's name as a call's first argument and a quoted literal its second: PHP's
# ``define( 'DB_PASSWORD', '…' )`` (wp-config.php), ``os.environ.setdefault("API_KEY", "…")``.
_CALL_FIRST = re.compile(r"[A-Za-z0-9_.\]][ \t]?\([ \t]*['\"]\Z")
# (a module's or a setting's dotted name: no part with three digits, as a token's has)
# (possessive: each part read once, a value of 100 KB in a call is no quadratic walk)
# (a module's: parts in lower case, ``app.auth.get_token``; ``Correct.Horse.Battery9`` is a
# passphrase)
_DOTTED = re.compile(r"(?:[a-z_]++(?:[0-9]{1,2}+[a-z_]*+)?+\.)++[a-z_]++(?:[0-9]{1,2}+[a-z_]*+)?+")
_CALL_SECOND = re.compile(r"['\"][ \t]*,[ \t]*" + _QUOTED + r"[ \t]*\)")
# An XML element named as a credential: ``<password>…</password>`` (Maven's settings.xml).
_ELEMENT_VALUE = re.compile(r">([^<\n]{4,512}+)</")
# What may follow a name whose value ``_paired_value`` finds: a line end (YAML's pair), a
# blank before it, an element's ``>``
_PAIR_AFTER: Final = frozenset(("\n", "\r", ">", " "))
# A user and a password in base64 under an ``auth`` field: Docker's config.json
# (``"auth": "…"``), .npmrc's ``_auth=…`` (the value is taken where it decodes to ``user:…``).
_BASIC_AUTH = re.compile(  # (matched at ``auth``, after a quote or ``_``)
    r'auth(?:\\*")?[ \t]*[:=][ \t]*(?:\\*")?([A-Za-z0-9+/]{8,4096}+={0,2})(?![A-Za-z0-9+/=])'
)
# A name that is given a value (counted against ``_MAX_HITS``).
_ASSIGNED = re.compile(r"""[ \t]{0,4}[=:"'\\\]]""")
# A Markdown table's row whose first cell is a credential's name and whose second its value
# (an answer listing settings: ``| JWT_SECRET | Zk8… |``), in backticks or not: the name's end,
# then the value (no blank, 8 characters or more: a description or a type is left).
# (bold or in backticks, a note in parentheses after it; the value in backticks with a note
# after it, or bare; the row's last cell without its closing pipe, as GFM allows)
# (a cell's value: in backticks, what follows it a note; or bare, a note in parentheses after it)
_CELL_VALUE = (
    r"[ \t]*(?:`([^`\s|]{8,256}+)`[^|\n]{0,256}+"
    r"|([^\s|`\\\"']{8,256}+)[ \t]*(?:\([^()|\n]{0,64}\)[ \t]*)?)(?:\||(?=\r?\n)|\r?\Z)"
)
# (a name's cell's end: bold or in backticks, a note in parentheses after it, its pipe)
_CELL_END = r"(?:\*\*)?`?(?:\*\*)?(?:[ \t]+\([^()|\n]{0,64}\))?[ \t]*\|"
_TABLE_ROW = re.compile(_CELL_END + _CELL_VALUE)
_CELL = re.compile(_CELL_VALUE)
_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")
# (after a line's prefix, as a tool printed the file: ``cat -n``'s, a diff's, ``grep -n``'s)
_ROW_PREFIX = r"(?:[ \t]*\d{1,9}(?:→|\t)|[+ -]|>[ \t]?|[^\s:|]{1,256}?:\d{1,9}:)?"
_TABLE_CELL_END = re.compile(_CELL_END)
# A table's column that holds the settings' values (its header row's cell)
# (a ``Key`` column's shortcuts, translation keys and variables' names stay: ``_NAMING_CELL``)
_VALUE_HEADERS = frozenset(
    {"value", "secret", "password", "token", "key", "api key", "secret key", "credential"}
)
# A cell that names, not gives: a constant or a variable (``AUTH_E1002``, ``STORAGE_S3_SECRET``),
# a key combination (``Ctrl+Shift+F9``)
_NAMING_CELL = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)++|(?i:(?:ctrl|alt|shift|cmd|meta)\+\S+)")
_TABLE_HEAD = re.compile(_ROW_PREFIX + r"[ \t]*\|(?:[^|\n]*+\|)*?[ \t]*(?:\*\*)?`?(?:\*\*)?")
# A type's shape, as a schema's or an API's table gives it: ``VARCHAR(255)``, ``Uint8Array``
_TYPE_SHAPE = re.compile(r"[A-Za-z_][\w.]{0,64}\([0-9, ]{1,16}\)(?:\[\])?")
# A table's column that says what a setting is, not its value (its header row's cell)
_DESCRIBING = frozenset(
    {
        *("type", "data type", "datatype", "format", "algorithm", "description", "default"),
        *("example", "notes", "note", "required", "constraints", "purpose", "kind", "length"),
        *("size", "scope", "source", "where", "used by", "usage", "meaning", "encoding"),
        # (a code review's, a test report's: where a name is, what happened to it)
        *("location", "defined in", "file", "line", "path", "duration", "time", "commit"),
        *("revision", "error", "status", "result", "owner", "last rotated", "rotated", "hash"),
        *("version", "since", "test", "tests", "function", "method"),
    }
)
# A cell's value that is a place, a measure or a time: ``auth/utils.py:88``, ``120.50ms``,
# ``2024-03-01T10:00``
_NOT_SECRET_CELL = re.compile(
    r"[\w./-]+\.\w{1,8}(?::\d+){1,2}(?:-\d+)?"
    r"|\d+(?:\.\d+)?(?:ms|s|us|µs|ns|m|h|%|[KMG]i?B)"
    r"|\d{4}-\d{2}-\d{2}(?:[T ][\d:.]+)?(?:Z|[+-][\d:]+)?"
)
# A ``Cookie`` or ``Set-Cookie`` header (``curl -v``'s ``> Cookie: …``, ``-H 'Cookie: …'``, a
# JSON dump of headers): its name, then its value's pairs, each a session's token maybe.
# (its name quoted or not, a JSON string's or a Python dict's; HAR's ``{"name": "Cookie",
# "value": "…"}``; curl's ``-b``/``--cookie`` argument)
_COOKIE_HEADER = re.compile(
    r"""(?i:cookie)(?:(\\*["'])?[ \t]*:[ \t]*(?P<array>\[[ \t\r\n]*)?(?P<q1>\\*["'])?"""
    r"""|\\*"[ \t\r\n]*,[ \t\r\n]*\\*"value\\*"[ \t\r\n]*:[ \t\r\n]*(?P<q2>\\*")"""
    # code's: ``document.cookie = "…"`` (or a template), ``headers["Cookie"] = "…"``,
    # ``setHeader("Set-Cookie", "…")`` (or an array of them), ``headers.set('Cookie', '…')``
    r"""|(?:\\*["']\]?)?[ \t]*=[ \t]*(?P<q3>\\*["'`])"""
    r"""|\\*["'][ \t]*,[ \t]*(?P<array2>\[[ \t\r\n]*)?(?P<q4>\\*["']))"""
)
# A cookie set or sent by code, its name then its value: Flask's and Django's
# ``set_cookie("sid", "…")`` (``key=``, ``value=`` too; over lines, as Black writes it),
# Express's ``res.cookie("sid", "…")``, PHP's ``setcookie(…)``, requests' ``cookies.set("sid",
# "…")``, Next.js's ``cookies().set(…)``, Laravel's ``Cookie::make(…)``; one given by index,
# ``cookies["sid"] = "…"`` (Rails' ``cookies[:sid]``); and a dict of them, requests'
# ``cookies={"sid": "…"}``, a JSON ``"cookies": {…}``. (Each value taken where it is one
# token: a flash message, a date, a setting's list stay.)
_CALL_GAP = r"(?:\s|\\[nrt]){0,64}+"
_COOKIE_CALL = re.compile(
    r"""(?i:cookies?(?:\(\))?(?:\.set|\.append|::make|::forever|::create)?)\("""
    + _CALL_GAP
    + r"""(?:key[ \t]*=[ \t]*)?(\\*["'])[^"'\\\n]{1,64}+\1"""
    + _CALL_GAP
    + ","
    + _CALL_GAP
    + r"""(?:value[ \t]*=[ \t]*)?(\\*["'`])"""
)
_COOKIE_INDEX = re.compile(
    r"""(?i:cookies)\[[ \t]*(?::\w{1,64}+|(\\*["'])[^"'\\\n]{1,64}+\1)[ \t]*\][ \t]*=[ \t]*"""
    r"""(\\*["'`])"""
)
_COOKIE_DICT = re.compile(r"""(?i:cookies)(?:\\*["'])?[ \t]*[:=][ \t\r\n]*\{""")
_ISO_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d{1,9})?)?)?(?:Z|[+-]\d{2}:?\d{2})?"
)
# A file's path (not a token with a ``/`` in it, base64's: its parts mix cases): folders and a
# file's name in lower case (a capital first at most), its extension of one case; a Windows path
# after its drive (``C:\\Users\\dev\\project2024``, its ``\\`` maybe doubled in code); one
# from the root, each part so named
_PATH_PART = r"[A-Z]?[a-z0-9_.-]{1,64}"
_FILE_PATH = re.compile(
    r"(?:\.{0,2}/)?(?:"
    + _PATH_PART
    + r"/){1,32}"
    + _PATH_PART
    + r"\.(?:[a-z][a-z0-9]{0,7}|[A-Z]{1,8})"
    r"|[A-Za-z]:(?:\\{1,2}" + _PATH_PART + r"){1,32}\\{0,2}"
    r"|(?:/" + _PATH_PART + r"){1,32}/?"  # (from the root: ``/admin/v2/settings``)
)
_TOKEN_RUN = re.compile(r"(?![^\s;,]{0,4096}?://)[^\s;,]{16,4096}+")  # (no URL)
# a name that sets a cookie (``set_cookie``, ``setCookie``, ``set_signed_cookie``, ``setrawcookie``,
# ``add_cookie``), not one that reads or clears it (``get_cookie("theme", "<default>")``)
_COOKIE_SETTER = re.compile(r"(?<![a-z0-9_])(?:set|set_signed|setraw|add)_?\Z")
# a cookie's attributes, in a dict of them (the cookie's own, not a dict of cookies)
_COOKIE_ATTRIBUTES: Final = frozenset(
    ("name", "domain", "path", "expires", "expiry", "expirationdate", "samesite", "priority")
)
# A Netscape cookie file's line (curl's ``-c``, wget's, a browser's export, Python's
# ``MozillaCookieJar``): domain (a dot in it, or ``localhost``), its subdomains flag, path,
# secure, expiry (empty for a session's cookie), name, value, apart by tabs (``\\t`` in JSON
# text)
_NETSCAPE_COOKIE = re.compile(
    r"""(?<![\w.-])(?=[\w-]{0,253}+\.|localhost)[\w.-]{1,253}+(\t|\\t)(?:TRUE|FALSE)\1"""
    r"""/[^\t\n\\]{0,1024}+\1(?:TRUE|FALSE)\1-?[0-9.]{0,24}+\1[^\t\n\\]{1,256}+\1"""
    r"""([^\t\r\n\\]{1,4096}+)"""
)
_COOKIE_FLAG = re.compile(r"""(?:(?<=\s)-b|--cookie)[ \t]+(\\*["']?)(?=[^\s'"=;]{1,64}=)""")
_COOKIE_PAIR = re.compile(r"""[ \t]*[^\s;=,"'\\]{1,64}=(\\*"?)([^\s;"'\\`,)]{0,4096}+)\1[ \t]*""")
# A HAR file's or Playwright's storage state's ``"cookies": [{"name": …, "value": …}, …]``
# (its Python dump too: ``{'cookies': [{'name': …, 'value': …}]}``; a cookie's own objects, a
# partitioned one's ``"partitionKey": {…}``, inside it); the same objects given by code:
# Playwright's ``add_cookies([{…}])`` and ``addCookies([{ name: …, value: … }])``, Selenium's
# ``add_cookie({…})``, Puppeteer's ``setCookie({…})``, Go's ``http.Cookie{Name: …, Value: …}``
_COOKIE_ARRAY = re.compile(
    r"""(["'])cookies\1[ \t\r\n]*:[ \t\r\n]*\["""
    r"""|(?<![\w$])(?:add|set)_?[Cc]ookies?\([ \t\r\n]*\[?"""
    r"""|(?<![\w$])Cookie(?=\{)"""
)
_QUOTED_TEXT = r"""(?:"(?:[^"\\\n]|\\.)*+"|'(?:[^'\\\n]|\\.)*+')"""
# A quoted text in a cookie's object, or one that does not close on its line, which then runs to
# the line's end (a comment's "the user's token" hid the whole object; taken as a character, the
# quote was tried again at each next one, each to the line's end: 185 KB of \" took a minute)
_QUOTED_IN_OBJECT = (
    r"""(?:"(?:[^"\\\n]|\\.)*+(?:"|(?=[\\\n])|\Z)"""
    r"""|'(?:[^'\\\n]|\\.)*+(?:'|(?=[\\\n])|\Z))"""
)
# (a character escaped is one, outside a quoted text too: in code written inside a JSON string,
# every quote is escaped, and no quote opens a text that runs on through the next calls: each
# call's object ends at its brace, not at the JSON string's end; 8,000 calls on that one line
# took two minutes)
_COOKIE_OBJECT = re.compile(
    r"""[ \t\r\n,]*\{(?:\\.|[^{}"'\\]|\\|"""
    + _QUOTED_IN_OBJECT
    + r"""|\{(?:\\.|[^{}"'\\]|\\|"""
    + _QUOTED_IN_OBJECT
    + r""")*+\})*+\}"""
)
_COOKIE_VALUE = re.compile(  # (a key quoted, or not: JavaScript's ``value:``, Go's ``Value:``)
    r"""(?:(["'])value\1|(?<![\w$"'])[Vv]alue)[ \t\r\n]*:[ \t\r\n]*"""
    r"""(["'`])((?:(?!\2)[^\\\n]|\\.){0,4096}+)\2"""
)
_OPENSSL_PASS = re.compile(r"""(?<![\w-])-pass(?:in|out)?[ \t]+["']?pass:([^\s'"`)]{1,512}+)""")
_JOINED_COOKIE = re.compile(r""",[ \t]*[^\s;=,"'\\]{1,64}=(\\*"?)([^\s;,"'\\]{0,4096}+)""")
_HAS_DIGIT = re.compile(r"[0-9]")
_HAS_LETTER = re.compile(r"[A-Za-z]")
# Passwords given to commands without a name: ``curl -u user:password`` (``-U``: a proxy's),
# ``mysql -pPASSWORD`` (found after the command's name on the same line; ``-p`` alone asks for
# the password, ``-P`` is a port).
_COMMAND_PASSWORD = re.compile(  # (on the command's own part of the line: to a pipe, ; or &)
    r"""(?:(?i:curl)[^\n|;&]{0,512}?\s(?:-[uU]|--user|--proxy-user)(?:[ \t]+|=)?["']?"""
    r"""[^\s:"']{0,256}:"""
    r"""|(?i:mysql|mysqldump|mysqladmin|mariadb)[^\n|;&]{0,512}?\s-p"""
    # docker (podman, …) login, global options maybe before it: docker --config DIR login
    r"""|(?i:docker|podman|helm|nerdctl|buildah|skopeo)"""
    r"""(?:[ \t]+-{1,2}[^\s|;&]+(?:[ \t]+[^-\s|;&][^\s|;&]*)?){0,6}[ \t]+(?:registry[ \t]+)?"""
    r"""login[^\n|;&]{0,512}?\s-p[ \t]+"""
    # sshpass -p PASSWORD ssh … (among sshpass's own options, before the command it runs)
    r"""|(?i:sshpass)(?:[ \t]+(?:-[fdP][ \t]*[^\s|;&]{1,256}|-[evhV]{1,4})){0,8}[ \t]+-p[ \t]*"""
    r"""|(?i:redis-cli)[^\n|;&]{0,512}?\s(?:-a|--pass)[ \t]+)"""  # redis-cli -a PASSWORD
    # (quoted or not: -p'…', -p "…", to the closing quote; not a $VARIABLE, though a literal $
    # may start one, and in single quotes is one)
    r"""(?:"?"""
    + _DEFAULTED
    + r'"?'
    + r"""|'([^'\n]{4,}+)'|"(?!\$[A-Za-z_{(])([^"\n\\]{4,}+)"|\\"(?!\$[A-Za-z_{(])"""
    r"""([^"\n\\]{4,}+)\\"|(?!\$[A-Za-z_{(])([^\s"'\\]{4,}+))"""
)
# ...and curl's user and password in one quoted word, the password to the closing quote (blanks
# in it): ``curl -u 'admin:correct horse battery'``.
_CURL_QUOTED = re.compile(
    r"""(?i:curl)[^\n|;&]{0,512}?\s(?:-[uU]|--user|--proxy-user)(?:[ \t]+|=)?"""
    r"""(?:'[^\s:'"]{0,256}:([^'\n]{4,}+)'|"[^\s:'"]{0,256}:(?!\$[A-Za-z_{(])([^"\n\\]{4,}+)")"""
)
_COMMANDS: Final = (
    "curl",
    "mysql",
    "mariadb",
    "docker",
    "podman",
    "helm",
    "nerdctl",
    "buildah",
    "skopeo",
    "sshpass",
    "redis-cli",
)
# A bare ``token`` or ``pwd`` in code is as often a grammar's token type or a path:
# ``{ token: "comment" }``, ``pwd = "/srv/app"``; its value must look like a credential.
_BARE_NAMES: Final = frozenset({"token", "tokens", "pwd", "pass"})


def _value_span(found: re.Match[str] | None) -> tuple[int, int] | None:
    if found is None:
        return None
    for group in range(1, (found.re.groups or 0) + 1):
        if found.group(group) is not None:
            return found.span(group)
    return None


def _paired_value(s: str, start: int, end: int) -> tuple[int, int] | None:
    """The span of the value given beside the credential name ``s[start:end]`` where that name
    is a name field's value (``_PAIR_NAME_JSON`` and kin), a call's first argument
    (``_CALL_FIRST``), or an XML element's tag; None otherwise."""
    lo = max(0, start - 64)
    head = s[lo:start]
    found = None
    if s[end : end + 1] == '"':
        if _PAIR_NAME_JSON.search(head) is not None:
            found = _PAIR_VALUE_JSON.match(s, end)
        elif head.endswith('"') and _PAIR_NAME_XML.search(head) is not None:
            found = _PAIR_VALUE_XML.match(s, end)
    if found is None and head.endswith(("'", '"')) and _CALL_FIRST.search(head) is not None:
        found = _CALL_SECOND.match(s, end)
        if found is not None and not s[start:end].isupper():
            # (not a constant's: the value must look like a credential, a digit, no blank, 16
            # characters or more: ``t('auth.password', 'Password')`` is a label's default,
            # ``localStorage.setItem('authToken', 'a8f5…')`` is no label)
            value = s[found.start(1) : found.end(1)] if found.group(1) else found.group(2)
            if (
                len(value) < 16
                or not any(c.isdigit() for c in value)
                or any(c.isspace() for c in value)
                # (a route, a path: ``route('resetPassword', '/api/v1/…')``; base64 has "/")
                or value.startswith(("/", "./", "~/"))
                or "://" in value
                or _is_path(value)
                or _DOTTED.fullmatch(value) is not None  # (a module's name: ``a.b.token_v2``)
            ):
                return None
    if found is None and _PAIR_NAME_YAML.search(head) is not None:
        found = _PAIR_VALUE_YAML.match(s, end)
    if found is None and head.endswith("<") and s[end : end + 1] == ">":
        value = _ELEMENT_VALUE.match(s, end)
        if value is not None and s.startswith(s[start:end] + ">", value.end()):
            found = value
    span = _value_span(found)
    if span is None or _reference(s, *span) or _PLACEHOLDER.fullmatch(s, *span) is not None:
        return None
    return _plausible(s, start, end, span)  # (a bare ``token``'s value must look like one)


def _named_value(s: str, start: int, end: int) -> tuple[int, int] | None:
    """The span of the value named by the credential name ``s[start:end]`` (``_is_credential``),
    if the text there reads as an assignment of a literal to it; an empty span at the end of a
    value looked at and not taken (no secret; consumed); None otherwise."""
    before = s[start - 1] if start else "\n"
    after = s[end : end + 1]
    if after == ":" and s[start:end] in ("PASS", "Pass"):
        return None  # a test's status (automake's ``PASS: test_base64``), not a setting
    if after in "'\"\n\r> " and (paired := _paired_value(s, start, end)) is not None:
        return paired
    if after in "|` \t*" and (cell := _table_value(s, start, end)) is not None:
        return cell
    if s[end : end + 2] == '\\"' and s[start - 2 : start] == '\\"':  # \"api_key\": \"…\"
        found = _value_span(_ESCAPED_JSON_VALUE.match(s, end))  # (in a JSON string)
        if found is not None and s[start:end].lower() == "pass":  # (\"pass\": \"passed\")
            found = _plausible(s, start, end, found)
        if found is None and _in_code(s[start:end]):
            found = _plausible(s, start, end, _value_span(_ESCAPED_INDEXED_VALUE.match(s, end)))
        return found
    if after == before and after in "'\"":
        if after == '"':  # "client_secret": "…" (JSON)
            found = _value_span(_JSON_VALUE.match(s, end + 1))
            if found is not None and s[start:end].lower() == "pass":  # ("pass": "passed")
                found = _plausible(s, start, end, found)
            if found is not None:
                return found
        if _in_code(s[start:end]):
            return _plausible(s, start, end, _value_span(_INDEXED_VALUE.match(s, end + 1)))
        return None
    if before in "'\"" and after == ":":  # -H 'X-Api-Key: …' (a header in a command)
        if s[end + 1 : end + 2] in ("'", '"'):
            return None  # (``"secret:"``: the string ends at the colon, no value in it)
        found = _value_span(_HEADER_VALUE.match(s, end))
        if _string_start(s, max(0, start - 256), start) != start:
            return found
        # A JSON string that starts with it, an argv's ``"X-Api-Key:…"``, is a line too:
        # its value, as a header's, must be no type (``"token: TokenType"``, ``"password:
        # Optional[str] = None"`` in an edit's arguments): a digit in it or 20 characters, no
        # ``[`` after it; else it is read below as a line.
        if (
            found is not None
            and (found[1] - found[0] >= 20 or any(c.isdigit() for c in s[found[0] : found[1]]))
            and not _code_chain(s, *found)  # (``this.authService.token``)
            and _TYPE_NAME.fullmatch(s, *found) is None  # (``secretKey: Uint8Array``)
        ):
            return found
    if before in "?&" and after == "=":  # …?access_token=… (a URL's query)
        return _value_span(_QUERY_VALUE.match(s, end))
    if after == "=" and s[start:end].isupper():  # X_TOKEN=… anywhere (env, export, docker -e)
        braced = _braced_value(s, end)  # (ODBC's ``PWD={…};``)
        if braced is not None:
            return braced
        if _SHELL_DIRECTORY.search(s, max(0, start - 3), end + 1):  # PWD=/home/u (an `env`)
            return None
        return _value_span(_ENV_VALUE.match(s, end))
    lo = max(0, start - 256)  # a name after 256 characters of its line is not alone on it
    newline, escaped = s.rfind("\n", lo, start), s.rfind("\\n", lo, start)
    # (a JSON string's start is a line's too: a tool call's ``"new_string": "password = …"``)
    opened = _string_start(s, lo, start)
    if newline < 0 and escaped < 0 and opened < 0 and lo > 0:
        alone = False
    else:
        line = max(newline + 1, escaped + 2 if escaped >= 0 else 0, opened)
        # (an indent of escaped tabs in JSON text cut off, a file read with its line numbers:
        # ``     3→  password: …``, ``     3\t…``)
        # (and a diff's added line: ``+password = …``)
        # (and Markdown's bullet or backtick: an answer quoting a setting, ``password: …``;
        # and curl -v's ``> ``, ``< ``: a header it sent or got, ``> x-auth-token: …``)
        head = _LINE_NUMBER.sub("", s[line:start].replace("\\t", "\t")).strip(" \t-+*`<>")
        # (a backtick opens a quoted setting mid-sentence too: "Set `password: …` in yaml")
        alone = not head or head in ("export", "set") or before == "`"
    flag = s[start - 2 : start] == "--"
    if after in " \t" and (flag or _netrc(s, start, end, lo)):
        # --api-key VALUE (a flag, its value apart); machine … login … password VALUE (.netrc)
        return _value_span(_FLAG_VALUE.match(s, end))
    if alone or before in ":;" or flag:
        # password = … (INI), --password=…, :_authToken=… (.npmrc), …;Password=…; (a .NET
        # connection string)
        found = _braced_value(s, end)  # (ODBC's ``PWD={…};``)
        if found is None:
            found = _value_span(_ASSIGN_VALUE.match(s, end))
            if found is not None and _inline_code(s, lo, start, found, quoted=False):
                return _passed(s, found)  # (a call's last argument: ``password=DB_PW_2)``)
        if found is None and alone:  # password: … alone on its line (YAML)
            found = _value_span(_YAML_VALUE.match(s, end))
        if (
            found is not None
            and (before == "`" or (after == ":" and opened == start))  # (a declaration quoted)
            and _TYPE_NAME.fullmatch(s, *found) is not None
        ):
            return _passed(s, found)  # (``secretKey: Uint8Array``, in Markdown or an edit's)
        if found is not None:
            return found if flag else _taken_or_passed(s, start, end, found)
    if (
        after == "="
        and s[end + 1 : end + 2] != "="  # (``password==x``: a comparison)
        and before in _INLINE_BEFORE
        and not _keyword_argument(s, lo, start)
    ):
        # name=value inside a command's line: ``--from-literal=password=…``, ``helm --set
        # a=b,db.password=…``, ``docker run -e db_password=…``, ``terraform -var
        # 'db_password=…'``, ``&& password=… ./run``, libpq's ``"host=db password=…"``, a
        # form's ``-d "client_secret=…&grant_type=…"``, ``mvn -Dspring.datasource.password=…``,
        # Go's ``-password=…``, Hydra's ``+db.password=…``, sed's ``s/…/db_password=…/``. A
        # value looked at and not taken is consumed all the same (an empty span): a name
        # repeated in it is not looked at again (``token=token=…``: each look ran to the end).
        # A quoted word's value, not taken (a bare ``token``'s with a blank in it), is read
        # again as far as its first blank: ``ssh h 'token=Zk8… ./deploy.sh'``.
        found = None
        if before == "'":  # (a shell's single-quoted word: to its closing quote)
            found = _value_span(_INLINE_IN_SINGLE.match(s, end))
        elif before == '"':  # (a name that opens the string: ``"password=" + pw`` is code)
            found = _value_span(_INLINE_IN_DOUBLE.match(s, end))
            if found is not None and opened == start and _code_at(s, found[0], found[1]):
                return _passed(s, found)  # (a JSON string's start: ``self.password,`` is code)
        else:
            found = _braced_value(s, end)
            if found is None:
                found = _value_span(_INLINE_QUOTED.match(s, end))
        if found is not None and not _in_code(s[start:end]) and _inline_code(s, lo, start, found):
            return _passed(s, found)  # (a quoted literal to a code credential's name goes)
        if found is not None:
            taken = _plausible(s, start, end, found)
            if taken is not None:
                return taken
        unquoted = _value_span(_INLINE_UNQUOTED.match(s, end))
        if unquoted is not None:
            if _SNAKE_NAME.fullmatch(s, *unquoted) is not None:
                return _passed(s, unquoted)  # a variable passed on: ``token=token``
            if _inline_code(s, lo, start, unquoted, quoted=False):
                return _passed(s, unquoted)
            return _taken_or_passed(s, start, end, unquoted)
        if found is not None:
            return _passed(s, found)
        if before in "'\"":
            return None
    if not _in_code(s[start:end]):
        return None
    # In an object literal (a brace opened nearer than a parenthesis on the line), not in a
    # signature, where a quoted type may follow the colon.
    literal = s.rfind("{", lo, start) > max(s.rfind("(", lo, start), s.rfind("\n", lo, start))
    pattern = _OBJECT_VALUE if literal else _CODE_VALUE
    return _plausible(s, start, end, _value_span(pattern.match(s, end)))


def _table_value(s: str, start: int, end: int) -> tuple[int, int] | None:
    """The span of the value of the credential name ``s[start:end]`` where that name is a
    Markdown table row's cell: in the cell after it (``| DB_PASSWORD | `Zk8…` |``), or in the
    column its header names as the value's (``| Variable | Description | Value |``); a value
    with a letter and a digit, no path, reference, placeholder or type, in a column whose
    header does not say it describes the setting (``Type``, ``Default``); None otherwise."""
    cell_end = _TABLE_CELL_END.match(s, end)
    if cell_end is None:
        return None
    lo = max(0, start - 256)
    line = max(_line_start(s, lo, start), _string_start(s, lo, start))  # (a JSON string's too)
    if (line == lo and lo > 0) or _TABLE_HEAD.fullmatch(s, line, start) is None:
        return None  # (no line's start within the look back: no row's cell)
    span = _row_value(s, start, end, line, cell_end.end())
    # (a table's row with no value taken: read no other way, consumed to its cell's end)
    return span if span is not None else (cell_end.end(), cell_end.end())


def _row_value(s: str, start: int, end: int, line: int, cell_end: int) -> tuple[int, int] | None:
    """``_table_value``'s, in the row starting at ``s[line]`` whose name's cell ends at
    ``cell_end`` (past its pipe)."""
    if s[start:end].lower() in _BARE_NAMES:
        return None  # (``| PASS | test_login_v2 |``: a status, a word's cell)
    # (the name's, from 1; its value's is the next; a pipe escaped in a cell, ``\|``, is none)
    column = len(_UNESCAPED_PIPE.findall(s, line, start))
    headers: list[str] | None = None
    found = _TABLE_ROW.match(s, end)
    span = _value_span(found)
    if span is not None and _secret_cell(s, start, span):
        headers = _header_cells(s, line)
        if len(headers) <= column or headers[column] not in _DESCRIBING:
            return span
    # the column its header names as the value's, further on the row
    headers = _header_cells(s, line) if headers is None else headers
    wanted = next((i for i, h in enumerate(headers) if i > column and h in _VALUE_HEADERS), None)
    if wanted is None:
        return None
    row_end = s.find("\n", cell_end, cell_end + 4096)
    row_end = row_end if row_end >= 0 else min(len(s), cell_end + 4096)
    at = cell_end  # (past the pipe after the name's cell: column + 1 starts here)
    for _ in range(wanted - column):  # (``wanted`` from 0: the cells past the next one)
        pipe = _UNESCAPED_PIPE.search(s, at, row_end)
        if pipe is None:
            return None
        at = pipe.end()
    span = _value_span(_CELL.match(s, at, row_end))  # (the value, as beside its name)
    if span is None:  # (or the cell whole, without blanks: quotes in it, past 256 characters)
        pipe = _UNESCAPED_PIPE.search(s, at, row_end)
        cell = (at, pipe.start() if pipe is not None else row_end)
        text = s[cell[0] : cell[1]]
        stripped = text.strip(" \t\r`")
        if not stripped or any(c.isspace() for c in stripped):
            return None
        first = cell[0] + text.index(stripped)
        span = (first, first + len(stripped))
        if len(stripped) > 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
            span = (first + 1, first + len(stripped) - 1)  # (the quotes no part of it)
        if _EXPRESSION.fullmatch(s, *span) is not None:
            return None  # (``os.environ['DB_PASSWORD2']``, ``env("API_KEY_V2")``: a lookup)
    return span if _secret_cell(s, start, span) else None


def _secret_cell(s: str, start: int, span: tuple[int, int]) -> bool:
    """Whether the table cell ``s[span[0]:span[1]]`` given to the name at ``s[start]`` reads
    as a credential's value: a letter and a digit, 8 characters or more, no path, reference,
    placeholder, type, place, measure, time or test's name."""
    value = s[span[0] : span[1]]
    return not (
        len(value) < 8
        or not any(c.isdigit() for c in value)
        or not any(c.isalpha() for c in value)
        or "://" in value
        or value[0] in "<[{$%#"  # (a placeholder: ``<your-password>``, ``{{token}}``)
        or _is_path(value)
        or _reference(s, *span)
        or _PLACEHOLDER.fullmatch(s, *span) is not None
        or _TYPE_NAME.fullmatch(value) is not None  # (``Uint8Array``, ``bytes32``)
        or _TYPE_SHAPE.fullmatch(value) is not None  # (``VARCHAR(255)``)
        or _NOT_SECRET_CELL.fullmatch(value) is not None
        or _NAMING_CELL.fullmatch(value) is not None
        or _DOTTED.fullmatch(value) is not None  # (``auth.token_expired_v2``)
        or s.startswith("test_", start)  # (a test's name: ``| test_api_key | … |``)
    )


_LINE_PREFIX: Final = re.compile(_ROW_PREFIX)
_EXPRESSION: Final = re.compile(r"[A-Za-z_][\w.]{0,64}[\[(].{0,256}[\])]")
_TABLE_RULE: Final = re.compile(r"[ \t]*\|?(?:[ \t]*:?-{3,}+:?[ \t]*\|?)++[ \t]*\r?")  # (``|---|``)


def _header_cells(s: str, line: int) -> list[str]:
    """The lowered headers of the Markdown table whose row starts at ``s[line]`` (its cells
    counted from 1 past the row's opening pipe, the first at ``[0]``): the row above the
    table's ``|---|``, the last before it in 16 KB (a table of 200 rows); none where none is
    found. Within one ``_redact_named`` (one string), what the last look back found is kept
    (``_TABLE_MEMO``), none found too: a later row with no blank line nor rule line between
    takes it without looking back again (a table of rows of ``---`` took 18 s a MB)."""
    memo: _TableMemo | None = getattr(_TABLE_MEMO, "last", None)
    if (
        memo is not None
        and memo.text is s
        and memo.start < line
        and (line <= memo.checked or _TABLE_BREAK.search(s, memo.checked, line) is None)
    ):
        memo.checked = max(memo.checked, line)
        return memo.headers
    headers, rule = _look_back_for_header(s, line)
    if rule is not None:  # (it holds for the rows after this one until a break; none found is
        # not kept: a row inside a JSON string's line may have found none where the next finds)
        _TABLE_MEMO.last = _TableMemo(s, rule[1], line, headers)
    return headers


@dataclasses.dataclass
class _TableMemo:
    """What ``_header_cells`` found last in the string ``text`` (held only while
    ``_redact_named`` reads it: a string freed and another made at its address was taken for
    it): the headers of the rows after ``start``, its lines to ``checked`` known unbroken."""

    text: str
    start: int
    checked: int
    headers: list[str]


@dataclasses.dataclass
class _RuleScan:
    """Where ``_look_back_for_header``'s last pass for rule lines in ``text`` ended, and the
    last rule line it found (held only while ``_redact_named`` reads the string)."""

    text: str
    scanned_to: int
    last: tuple[int, int] | None


_TABLE_MEMO: Final = threading.local()
# A table's end between two rows: a blank line, or a rule line (another table's), as a tool
# printed them too (numbered, a diff's, ``grep -n``'s)
_TABLE_BREAK: Final = re.compile(r"\n" + _ROW_PREFIX + r"[ \t]*(?:\|?[ \t]*:?-{3,}|\r?\n)")


def _look_back_for_header(s: str, line: int) -> tuple[list[str], tuple[int, int] | None]:
    """``_header_cells``'s look back, with where the rule line it found is."""
    lo = max(0, line - 16384)
    found: tuple[int, int] | None = None
    dashes = s.rfind("---", lo, line)
    for _ in range(8):  # (the nearest ``---`` on a rule's line: a row's ``| --- |`` passed over)
        if dashes < 0:
            break
        rule = s.rfind("\n", lo, dashes) + 1
        rule_end = s.find("\n", dashes, line)
        if (rule == 0 and lo > 0) or rule_end < 0:
            break
        if _is_rule(s, rule, rule_end):
            found = (rule, rule_end)
            break
        dashes = s.rfind("---", lo, rule)
    else:
        # Rows of ``---`` cells between: the last rule line in the look back, in one pass, from
        # where the string's last such pass ended (rows of them, each a table of its own
        # between blank lines, read the same 16 KB again each: 2.7 s a MB)
        scan: _RuleScan | None = getattr(_TABLE_MEMO, "rules", None)
        start = lo
        if scan is not None and scan.text is s and lo <= scan.scanned_to <= line:
            start, found = scan.scanned_to, scan.last if scan.last and scan.last[0] >= lo else None
        for last in _RULE_LINE.finditer(s, start, line):
            found = last.span()
        _TABLE_MEMO.rules = _RuleScan(s, line, found)
    if found is None:
        return [], None
    rule, rule_end = found
    if rule == lo:
        return [], None  # (no line above it within the look back, or none at all: unknown)
    above = s.rfind("\n", max(lo, rule - 1025), rule - 1)
    if above < 0 and (lo > 0 or rule > 1025):
        return [], None  # (its start not within the look back, or a kilobyte: unknown)
    marked = _LINE_PREFIX.match(s, above + 1, rule - 1)
    cells = _UNESCAPED_PIPE.split(s[marked.end() if marked else above + 1 : rule - 1].strip())
    cells = cells[1:] if cells and not cells[0].strip() else cells  # (the opening pipe's)
    return [cell.strip(" \t*`").lower() for cell in cells], (rule, rule_end)


def _is_rule(s: str, start: int, end: int) -> bool:
    """Whether the line ``s[start:end]`` is a table's rule, after a tool's prefix or not (a
    diff's ``-`` prefix would take the first dash of a bare ``---``): as ``_RULE_LINE`` reads
    it, in one pass over many lines."""
    return _RULE_AT.fullmatch(s, start, end) is not None


_RULE_TEXT = r"(?:" + _ROW_PREFIX + r")?[ \t]*\|?(?:[ \t]*:?-{3,}+:?[ \t]*\|?)++[ \t]*\r?"
_RULE_AT: Final = re.compile(_RULE_TEXT)
_RULE_LINE: Final = re.compile(r"^" + _RULE_TEXT + r"$", re.M)


# A Kubernetes Secret (``kubectl get secret -o yaml`` or ``-o json``): every value under its
# ``data`` (base64) and ``stringData`` is a secret, whatever its name (``DATABASE_URL``,
# ``config.json``). kubectl writes ``data`` before ``kind``: the whole text is looked at.
_K8S_SECRET: Final = re.compile(r"""kind:[ \t]*["']?Secret\b|"kind"[ \t]*:[ \t]*"Secret(?=")""")
# A line's prefix where a tool printed the file: ``cat -n``'s or a reader's number (``     7\t``,
# ``7→``), a diff's ``+``/``-``/`` ``, a quote's ``>``, ``grep -n``'s ``file:7:`` (``file-7-``
# for a line of context). The lines of a block share its kind.
_LINE_PREFIXES: Final = (
    re.compile(r""),
    re.compile(r"[ \t]*\d{1,9}(?:→|\t)"),
    re.compile(r"[+ -]"),
    re.compile(r">[ \t]?"),
    re.compile(r"[^\s:]{1,256}?(?::\d{1,9}:|-\d{1,9}-)"),
)
_ANY_LINE_PREFIX: Final = "|".join(prefix.pattern for prefix in _LINE_PREFIXES[1:])
# (between a cookie dict's entries: blanks, commas, a line's start as a tool printed it)
_DICT_COOKIE = re.compile(
    r"""(?:[ \t\r,]|\\[nrt]|\n(?:"""
    + _ANY_LINE_PREFIX
    + r""")?)*+(\\*["'])([^"'\\\n]{1,64}+)\1[ \t]*:[ \t]*(?:(\\*["'])|(?:true|false|null"""
    r"""|-?[0-9][\w.+-]{0,63}+)(?![\w.+-]))"""
)
_YAML_DATA: Final = re.compile(
    "^(?:" + _ANY_LINE_PREFIX + ")??"
    r"([ \t]*)(?:data|stringData):[ \t]*(?:\{|#[^\n]*)?\r?$",
    re.M,
)
_YAML_KEY: Final = re.compile(  # (its value is read by hand: to the line's end, linear)
    r"""[ \t]*(?:"[^"\n]{1,253}"|'[^'\n]{1,253}'|[^\s:#'"][^:\n]{0,252}):(?=[ \t\r]|$)""",
    re.M,
)
_BLOCK_SCALAR: Final = re.compile(r"[|>][-+0-9]{0,3}")
_JSON_DATA: Final = re.compile(r'(?<![\w.-])"?(?:data|stringData)"?[ \t\r\n]*:[ \t\r\n]*\{')
# (a JSON object's entry, or a YAML flow map's, its key and value quoted or not)
# (a JSON entry's key and value quoted, the value a string; a YAML flow map's unquoted, the
# value a scalar: a number, an array or an object ends the walk, as it is no Secret's data)
_JSON_ENTRY: Final = re.compile(
    r"""[ \t\r\n]*(?:(?:"(?:[^"\\\n]|\\.){1,253}"|'[^'\n]{1,253}')[ \t\r\n]*:[ \t\r\n]*"""
    r"""(?:"((?:[^"\\\n]|\\.)*+)"|'([^'\n]*+)')"""
    r"""|[^\s:{},'"\[\]][^:{},\n]{0,252}[ \t]*:[ \t]*([^\s,{}'"\[\]][^,{}\[\]\n]*+))"""
    r"""[ \t\r\n]*,?"""
)
_BASE64_VALUE: Final = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _in_diff(hunk: int, at: int) -> bool:
    """Whether ``s[at]`` is in a unified diff's hunk: ``hunk``, where ``s``'s first ``@@ -``
    line starts (``_first_hunk``), is before it."""
    return 0 <= hunk < at


def _first_hunk(s: str) -> int:
    """Where ``s``'s first unified diff hunk's ``@@ -`` line starts; -1 where none does."""
    return 0 if s.startswith("@@ -") else s.find("\n@@ -")


def _secret_data(s: str) -> list[tuple[int, int]]:
    """The spans of the values under a Kubernetes Secret's ``data`` and ``stringData`` in
    ``s`` (YAML or JSON, its flow mapping too; a text that says ``kind: Secret``): each line's
    value, a block scalar's lines whole; the lines as a tool printed the file too (numbered, a
    diff's, ``grep -n``'s: ``_LINE_PREFIXES``)."""
    spans: list[tuple[int, int]] = []
    walked = 0  # (a ``data:`` inside a block walked already is not walked again: linear)
    hunk = _first_hunk(s)  # (found once: looked for again at each block, quadratic)
    for block in _YAML_DATA.finditer(s):
        if block.start() < walked or s[block.end() - 1 : block.end()] == "{":
            continue
        head = s[block.start() : block.start(1)]
        prefix = next(p for p in reversed(_LINE_PREFIXES) if p.fullmatch(head) is not None)
        indent = len(block.group(1).expandtabs())
        if not head and indent and _in_diff(hunk, block.start()):
            # a diff's line of context (`` data:``): its lines are the diff's, ``+``/``-`` too
            prefix, indent = _LINE_PREFIXES[2], indent - 1
        pos = block.end() + 1
        entry_indent = -1
        scalar = -1  # (a block scalar's key's indent: its lines are deeper)
        while pos < len(s):
            eol = s.find("\n", pos)
            eol = len(s) if eol < 0 else eol
            marked = prefix.match(s, pos, eol)
            if marked is None:
                break
            body = marked.end()
            line = s[body:eol]
            stripped = line.strip()
            depth = len(line) - len(line.lstrip(" \t"))
            if stripped and depth <= indent:
                break
            if stripped and scalar >= 0 and depth > scalar:
                spans.append((body + depth, body + len(line.rstrip("\r \t"))))
            elif stripped and not stripped.startswith("#"):
                key = _YAML_KEY.match(s, body, eol)
                if key is None or (entry_indent >= 0 and depth != entry_indent):
                    break
                entry_indent, scalar = depth, -1
                value = s[key.end() : eol].strip(" \t\r")
                comment = value.find(" #")  # (a comment after it stays: ``… # prod``)
                if comment > 0 and value[0] not in "'\"":
                    value = value[:comment].rstrip(" \t")
                start = s.find(value, key.end(), eol) if value else -1
                if _BLOCK_SCALAR.fullmatch(value) is not None:
                    scalar = depth
                elif len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                    if len(value) > 2 and not _reference(s, start + 1, start + len(value) - 1):
                        spans.append((start + 1, start + len(value) - 1))
                elif value and not _reference(s, start, start + len(value)):
                    spans.append((start, start + len(value)))
            pos = eol + 1
        walked = pos
    for block in _JSON_DATA.finditer(s):
        pos = block.end()
        # (``data``'s values are base64, as kubectl prints them: another object named
        # ``data`` in the text, a tool's ``{"data": {"stdout": …}}``, is not taken for one)
        encoded = "stringData" not in block.group()
        while (entry := _JSON_ENTRY.match(s, pos)) is not None:
            span = _value_span(entry)
            if span is not None:
                at, end = span
                while end > at and s[end - 1] in " \t\r":  # (a flow map's blanks before ``,``)
                    end -= 1
                if encoded and _BASE64_VALUE.fullmatch(s, at, end) is None:
                    break
                if end > at and not _reference(s, at, end):
                    spans.append((at, end))
            pos = entry.end()
    return spans


# Terraform's sensitive outputs, as ``terraform output -json`` (``"sensitive": true, "type": …,
# "value": …``) and its state (``"value": …, "type": …, "sensitive": true``) write them, and a
# ``random_password``'s ``result`` in its state or ``terraform show -json``.
# (a diff's ``-``, ``+`` or blank after a line end too: a state's or an output's diff)
_JSON_GAP = r"(?:[ \t\r]|\n[+ -]?)*+"
_JSON_TEXT = r'"((?:[^"\\\n]|\\.)*+)"'
_TYPE_FIELD = '"type"' + _JSON_GAP + ":" + _JSON_GAP + r'"[^"\n]{0,64}"'
_SENSITIVE_TRUE = '"sensitive"' + _JSON_GAP + ":" + _JSON_GAP + "true"
# a value, and in a diff its other side after it (``-  "value": "old"`` / ``+  "value": "new"``)
_VALUE_PAIR = (
    '"value"'
    + _JSON_GAP
    + ":"
    + _JSON_GAP
    + _JSON_TEXT
    + "(?:"
    + _JSON_GAP
    + ",?"
    + _JSON_GAP
    + '"value"'
    + _JSON_GAP
    + ":"
    + _JSON_GAP
    + _JSON_TEXT
    + ")?"
)
_COMMA = _JSON_GAP + "," + _JSON_GAP
_SENSITIVE_FIRST: Final = re.compile(_SENSITIVE_TRUE + _COMMA + _TYPE_FIELD + _COMMA + _VALUE_PAIR)
_VALUE_FIRST: Final = re.compile(_VALUE_PAIR + _COMMA + _TYPE_FIELD + _COMMA + _SENSITIVE_TRUE)
# (``terraform show -json``: sensitive, value, type)
_SENSITIVE_VALUE: Final = re.compile(_SENSITIVE_TRUE + _COMMA + _VALUE_PAIR)
_RESULT: Final = re.compile('"result"' + _JSON_GAP + ":" + _JSON_GAP + _JSON_TEXT)
_RANDOM_PASSWORD: Final = re.compile(r'"random_password"')


def _terraform_values(s: str, lowered: str) -> list[tuple[int, int]]:
    """The spans of Terraform's sensitive values in ``s``: a sensitive output's string value, a
    ``random_password``'s ``result`` (the first after its type's name, 4 KB on at most)."""
    spans: list[tuple[int, int]] = []
    if '"sensitive"' in lowered:
        for pattern in (_SENSITIVE_FIRST, _VALUE_FIRST, _SENSITIVE_VALUE):
            for found in pattern.finditer(s):
                spans += (found.span(g) for g in (1, 2) if found.group(g))
    named = _RANDOM_PASSWORD.search(s)
    while named is not None:  # (each stretch of text looked through once)
        # the resource's block: to the next resource's ``"mode"`` (64 KB at most), every
        # instance's ``result`` (``count``, ``for_each``) and a plan's ``before`` and ``after``
        end = s.find('"mode"', named.end(), named.end() + 65536)
        end = end if end >= 0 else min(len(s), named.end() + 65536)
        spans += (r.span(1) for r in _RESULT.finditer(s, named.end(), end) if r.group(1))
        named = _RANDOM_PASSWORD.search(s, end)
    return spans


def _cookie_values(s: str, lowered: str, at: int) -> tuple[list[tuple[int, int]], int]:
    """The spans of the values a ``Cookie`` header at ``s[at]`` gives that look like a token
    (16 characters or more, a letter and a digit: ``theme=dark`` stays), or of a
    ``Set-Cookie``'s cookies (each one's first pair: the rest are its attributes; a JSON array
    of them too); and where the header's value ends (the next header is looked for past it)."""
    named = at and (s[at - 1].isalnum() or s[at - 1] == "_")
    call = None
    if not named or _COOKIE_SETTER.search(lowered, max(0, at - 16), at) is not None:
        call = _COOKIE_CALL.match(s, at) or _COOKIE_INDEX.match(s, at)
    if call is not None:  # (a name, then the value alone; ``set_signed_cookie(``, ``setcookie(``)
        end = _value_end(s, call.end(), call.group(2))
        spans: list[tuple[int, int]] = []
        _take_token_run(s, call.end(), end, spans)
        return spans, end
    if lowered.startswith("cookies", at):
        found = _COOKIE_DICT.match(s, at)
        if found is not None:  # (``session_cookies = {…}`` too)
            return _dict_cookies(s, found.end())
    setting = at >= 4 and lowered.startswith(("set-", "set_"), at - 4)
    if named and not setting:
        return [], at + 6  # (``mycookie:``, a name of its own)
    header = _COOKIE_HEADER.match(s, at)
    if header is None:
        return [], at + 6
    array = header.group("array") is not None or header.group("array2") is not None
    quote = header.group("q1") or header.group("q2") or header.group("q3") or header.group("q4")
    return _cookie_pairs(s, header.end(), quote or "", setting, array)


def _cookie_arrays(s: str, lowered: str) -> Iterator[re.Match[str]]:
    """``_COOKIE_ARRAY``'s matches in ``s``, left to right, looked for only where each "cookie"
    of ``lowered`` may be a match's (``"cookies": [``, ``add_cookie(``, ``setCookie(``,
    ``Cookie{``): its alternatives begin with no literal, and a search tried every place (~55
    ms a MB of text that has the word)."""
    at = lowered.find("cookie")
    done = 0  # (where the last match ended: none overlaps it)
    while at >= 0:
        for start in (at - 4, at - 3, at - 1, at):
            found = _COOKIE_ARRAY.match(s, start) if start >= done else None
            if found is not None:
                yield found
                done = found.end()
                break
        at = lowered.find("cookie", at + 6)


def _dict_cookies(s: str, pos: int) -> tuple[list[tuple[int, int]], int]:
    """The spans of a dict's values from ``s[pos]`` (its ``{`` passed) that look like tokens:
    ``{"sid": "…", …}`` up to its first entry not a quoted name and a quoted value; and where it
    ended."""
    spans: list[tuple[int, int]] = []
    while (entry := _DICT_COOKIE.match(s, pos)) is not None:
        quote = entry.group(3)
        if quote is None:  # (a number, true, null: passed over)
            pos = entry.end()
            continue
        end = _value_end(s, entry.end(), quote)
        if entry.group(2).lower() not in _COOKIE_ATTRIBUTES:
            _take_token_run(s, entry.end(), end, spans)
        if not s.startswith(quote, end):
            return spans, end
        pos = end + len(quote)
    return spans, pos


def _cookie_pairs(
    s: str, pos: int, quote: str, setting: bool, array: bool = False
) -> tuple[list[tuple[int, int]], int]:
    """``_cookie_values``'s, for a header's value from ``s[pos]`` to its line's end or its
    closing ``quote``; each value of a JSON ``array`` of them (``["a=…; Path=/", …]``)."""
    spans: list[tuple[int, int]] = []
    while True:
        end = _value_end(s, pos, quote)
        first = True
        while pos < end:  # (pair by pair, one not read passed over to the next ``;``)
            pair = _COOKIE_PAIR.match(s, pos, end)
            semi = s.find(";", pair.end() if pair is not None else pos, end)
            if pair is not None and (first or not setting):
                _take_cookie(s, pair, spans)
            elif setting:
                # Set-Cookies joined by a comma (Python requests' ``r.headers``): the next one
                # starts after an attribute (``Path=/, sessionid=…``); a date's comma is
                # followed by no ``name=`` (``Expires=Thu, 01 Jan 1970 …``)
                joined = _JOINED_COOKIE.search(s, pos, end if semi < 0 else semi)
                if joined is not None:
                    _take_cookie(s, joined, spans)
            first = False
            pos = end if semi < 0 else semi + 1
        if not array:
            return spans, end
        # the next string of the array, after its comma
        after = re.match(r"""\\*["'][ \t\r\n]*,[ \t\r\n]*(\\*["'])""", s[end : end + 64])
        if after is None:
            return spans, end
        quote = after.group(1)
        pos = end + after.end()


def _take_cookie(s: str, pair: re.Match[str], spans: list[tuple[int, int]], group: int = 2) -> None:
    """``pair``'s value (its ``group``) into ``spans`` where it looks like a session's token."""
    _take_token(s, *pair.span(group), spans)


def _take_token_run(s: str, start: int, end: int, spans: list[tuple[int, int]]) -> None:
    """``_take_token``, for a value that is one run (no blank, ``;`` or ``,``: a message, a
    date, a list of settings are no token)."""
    if _TOKEN_RUN.fullmatch(s, start, end) is None:
        return
    value = s[start:end]
    if _ISO_TIME.fullmatch(value) is not None:
        return  # (a time: ``2024-01-15T10:30:00Z``)
    if ("/" in value or "\\" in value) and _FILE_PATH.fullmatch(value) is not None:
        return  # (a path: ``static/js/main.3f9a8b7c.js``, ``C:\\Users\\dev\\app2024``)
    _take_token(s, start, end, spans)


def _take_token(s: str, start: int, end: int, spans: list[tuple[int, int]]) -> None:
    """``s[start:end]`` into ``spans`` where it looks like a session's token: 16 characters or
    more, a letter and a digit, no reference."""
    if (
        end - start >= 16
        and _HAS_DIGIT.search(s, start, end) is not None
        and _HAS_LETTER.search(s, start, end) is not None
        and not _reference(s, start, end)
    ):
        spans.append((start, end))


_UNQUOTED: Final = " "  # (``_value_end``'s quote for an unquoted word)
_BLANK: Final = re.compile(r"\s")


def _value_end(s: str, pos: int, quote: str) -> int:
    """Where a header's value from ``s[pos]`` ends: its closing ``quote`` (``"``, ``'``,
    ``\\"`` in a JSON string), or its line's end, 16 KB on at most."""
    limit = min(len(s), pos + 16384)
    if quote is _UNQUOTED:  # (an unquoted argument: to its first blank)
        blank = _BLANK.search(s, pos, limit)
        return blank.start() if blank is not None else limit
    for end in ("\n", "\r", quote, "\\n" if "\\" in quote or not quote else ""):
        if end:  # (each looked for before the nearest found: the line's end, first)
            found = s.find(end, pos, limit)
            limit = found if found >= 0 else limit
    return limit


def _basic_credentials(value: str) -> bool:
    """Whether ``value`` is base64 of ``user:password`` (printable text with a colon)."""
    try:
        decoded = base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except ValueError:
        return False
    return b":" in decoded and decoded.isascii() and decoded.decode().isprintable()


def _code_at(s: str, start: int, end: int) -> bool:
    """Whether the value ``s[start:end]`` starts as code does: an attribute chain, maybe called
    or indexed, up to the first ``,;()[`` (``config.db_password_v2,``, ``os.getenv('X')``,
    ``request.form['password']``)."""
    cut = _CODE_CUT.search(s, start, end)
    return _code_chain(s, start, cut.start() if cut is not None else end)


def _code_chain(s: str, start: int, end: int) -> bool:
    """Whether ``s[start:end]`` is an attribute chain as code writes one: its parts names, the
    first with no digit, none with two (``config.db_password_v2``; a dotted token,
    ``Zk8a9Q2mP.xxYYzzT7``, ``s3cr3t.pw``, is none)."""
    if _CHAIN.fullmatch(s, start, end) is None:
        return False
    parts = s[start:end].split(".")
    return not any(c.isdigit() for c in parts[0]) and all(
        sum(c.isdigit() for c in part) < 2 for part in parts
    )


_CODE_CUT: Final = re.compile(r"[,;()\[]")


def _braced_value(s: str, end: int) -> tuple[int, int] | None:
    """The value of ODBC's ``=``{…}`` after the name ending at ``end``, inside its braces (passed
    over, as an empty span, where it is a format string's field: ``f"…;password={password};"``);
    None where there is none."""
    found = _value_span(_BRACED_VALUE.match(s, end))
    if found is not None and _reference(s, found[0], found[1]):
        return found[1] + 1, found[1] + 1
    return found


def _taken_or_passed(s: str, start: int, end: int, found: tuple[int, int]) -> tuple[int, int]:
    """``found`` where ``_plausible`` takes it as the value of the name ``s[start:end]``; else
    passed over (``_passed``)."""
    taken = _plausible(s, start, end, found)
    return taken if taken is not None else _passed(s, found)


def _passed(s: str, found: tuple[int, int]) -> tuple[int, int]:
    """The empty span that passes over a value looked at and not taken: to its first blank or
    ``;`` (what follows may be another setting: ``pwd=/srv/app;MYSQL_PWD=…``), no further
    than its end. A name repeated in the value passed over is not looked at again (``token=
    token=…``: each look ran to the end, 100 KB in 14 s)."""
    stop = _TOKEN.match(s, found[0], found[1])
    at = stop.end() if stop is not None else found[1]
    return at, at


_TOKEN: Final = re.compile(r"[^\s;]*")


def _inline_code(s: str, lo: int, at: int, found: tuple[int, int], quoted: bool = True) -> bool:
    """Whether a value given inline to the name at ``s[at]`` ends a call's argument list
    (``Database(host=h,\n    password=DB_PASSWORD_2)``, ``key_id='arn:…')``: code): opened on
    an earlier line, or after a name on this one (not a command's: ``$(…)``, a subshell's ``(cd
    x && …)``, also at a JSON string's start)."""
    end = found[1] + (1 if quoted and s[found[1] : found[1] + 1] in ("'", '"') else 0)
    if s[end : end + 1] != ")":
        return False
    line = _line_start(s, lo, at)
    opened = s.rfind("(", line, at)
    if opened < 0 or opened < s.rfind(")", line, at):
        # opened on an earlier line: a call's arguments, not a command's ``$(`` continued
        # (``TOKEN=$(curl … \`` then ``-d client_secret=…)``); unknown past the look back
        opened = s.rfind("(", lo, line)
        if opened < 0 or opened < s.rfind(")", lo, line):
            return False
    return _opens_call(s, opened)


def _keyword_argument(s: str, lo: int, at: int) -> bool:
    """Whether the name at ``s[at]`` is a call's keyword argument (code): it follows a ``,``
    (blanks between) inside a call's parentheses opened on its line, after a name
    (``connect(host=h, password=pw_2024)``; a subshell's ``(cd x && …)``, ``$(…)``, and a
    string inside the call, ``run(["--from-literal=password=…"])``, are no such place)."""
    line = _line_start(s, lo, at)
    if not s[line:at].rstrip(" \t").endswith(","):
        return False
    opened = s.rfind("(", line, at)
    return opened > s.rfind(")", line, at) and _opens_call(s, opened)


def _line_start(s: str, lo: int, at: int) -> int:
    """Where the line of ``s[at]`` starts (after a line end, escaped or not), ``lo`` at most
    (the look back's start)."""
    return max(s.rfind("\n", lo, at), s.rfind("\\n", lo, at), lo - 1) + 1


def _opens_call(s: str, opened: int) -> bool:
    """Whether the ``(`` at ``s[opened]`` opens a call's arguments: after a name (``connect(``,
    ``x.run(``, ``f()(``), not a command's (``$(…)``, a subshell's ``(cd x && …)``)."""
    return opened > 0 and (s[opened - 1].isalnum() or s[opened - 1] in "_.]")


def _string_start(s: str, lo: int, at: int) -> int:
    """Where the JSON string that holds ``s[at]`` starts, if its opening quote (``"``, or
    ``\\"`` in JSON text inside a JSON string) is the last quote in ``s[lo:at]`` and follows a
    ``:``, ``[`` or ``,`` (a value's, an element's); -1 otherwise."""
    quote = s.rfind('"', lo, at)
    if quote < 0:
        return -1
    mark = quote - 1 if quote > lo and s[quote - 1] == "\\" else quote
    # (an array's element may start a line of its own: a notebook cell's last line)
    return quote + 1 if s[lo:mark].rstrip(" \t\r\n").endswith((":", "[", ",")) else -1


_LINE_NUMBER: Final = re.compile(r"\A[ \t]*\d{1,9}(?:→|\t)")


def _netrc(s: str, start: int, end: int, lo: int) -> bool:
    """Whether the name ``s[start:end]`` is a ``.netrc`` line's ``password`` (after ``login``)."""
    return s[start:end].lower() == "password" and s.rfind("login", lo, start) >= 0


def _plausible(
    s: str, start: int, end: int, span: tuple[int, int] | None
) -> tuple[int, int] | None:
    """``span``, the value given to the name ``s[start:end]`` in code or a setting; for a bare
    ``token`` or ``pwd``, only when the value looks like a credential (a digit in it, no space,
    not a path or a markup); for a lower-case ``…_key`` that does not say which key (alone on
    its line, where code and settings look alike: ``storage_key = "uploads/avatars"``), only
    when it looks like a key: 16 characters or more, a digit, no space, no path."""
    if span is None:
        return span
    name = s[start:end]
    bare = name.lower() in _BARE_NAMES
    if not bare and _in_code(name):
        return span
    value = s[span[0] : span[1]]
    if any(c.isspace() for c in value) or not any(c.isdigit() for c in value):
        return None
    if bare:  # (a path or a markup is no token; a key's base64 may well start with "/")
        if value[0] in "/<.#":
            return None
        # (nodemailer's ``pass: '…'``; not a count, ``Pass: 142``: a letter, 8 characters;
        # nor a path)
        if name.lower() == "pass" and (
            len(value) < 8 or not any(c.isalpha() for c in value) or _is_path(value)
        ):
            return None
        return span
    return span if len(value) >= 16 and not _is_path(value) else None


# A path: segments of name characters between slashes (``/uploads/2024/avatars``,
# ``exports/2025-01-31/report.csv``), one of them five characters or more that begin as a
# lower-case word with a vowel (``uploads``, ``report.csv``, ``part-00001.parquet``), as random
# base64 seldom has between its slashes.
_PATH = re.compile(r"(?:[~.]{0,2}/)?(?:[\w.-]+/)+[\w.-]+")
_WORD = re.compile(r"[a-z]*[aeiouy][a-z]*(?:[-_][a-z0-9]+)*(?:\.[a-z0-9]{1,8})?")


def _is_path(value: str) -> bool:
    return _PATH.fullmatch(value) is not None and any(
        len(part) >= 5 and _WORD.fullmatch(part) is not None for part in value.split("/")
    )


def _in_code(name: str) -> bool:
    """Whether ``name`` (``_is_credential``) names a credential in code too."""
    return name.isupper() or _CODE_CREDENTIAL_NAME.search(name.lower()) is not None


def _is_credential(name: str) -> bool:
    """Whether ``name`` (a run of name characters) names a credential."""
    lowered = name.lower()
    return (
        len(name) <= _MAX_NAME
        and _CREDENTIAL_NAME.search(lowered) is not None
        and _HARMLESS_NAME.search(_CAMEL.sub("_", name).lower()) is None
    )


def without_values(text: str, values: Iterable[str]) -> str:
    """``text`` with each of the exact ``values`` (keys) replaced by ``[REDACTED]``, the longest
    first: a key that holds another is taken out whole."""
    for value in sorted(set(values), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


# The key a client sends to have cachegate's own used (``OPENAI_API_KEY=cachegate``): no secret
PLACEHOLDER_KEY: Final = "cachegate"
# Key headers that may name a scheme before the key, as ``Authorization`` does (a gateway's)
SCHEMED_KEY_HEADERS: Final = frozenset({"authorization", "helicone-auth", "cf-aig-authorization"})

# A query value taken for a key: long, with a letter and a digit, no date nor UUID
# (``?token=response`` took the word out of every line's JSON, its keys included: the log's
# structure broke; a date in a prompt went too)
QUERY_KEY_VALUE: Final = re.compile(
    r"(?=.*[0-9])(?=.*[A-Za-z])(?![0-9]{4}-[0-9]{2}-[0-9]{2}(?:[T ][0-9:.]+)?(?:Z|[+-][0-9:]+)?$)"
    r"(?![0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$)\S{20,}"
)


def placeholder_key(key: str | None) -> bool:
    """Whether ``key`` is no key: none, blank, or cachegate's placeholder (any case)."""
    return not key or not key.strip() or key.strip().lower() == PLACEHOLDER_KEY


# Query parameters a key goes in where a client sends it in the URL (Google's ``?key=``, Azure
# Functions' ``?code=``, OAuth's ``access_token``)
QUERY_KEY_NAMES: Final = frozenset(
    {"key", "api_key", "api-key", "apikey", "access_token", "token", "code"}
)


def query_keys(query: bytes) -> tuple[str, ...]:
    """The values of a request's query parameters that carry a key (``QUERY_KEY_NAMES``) and
    look like one (``QUERY_KEY_VALUE``), as sent and decoded (an upstream quotes the URL as it
    got it: ``%3D%3D`` at the end of an Azure key)."""
    from urllib.parse import unquote_plus

    keys: list[str] = []
    for pair in query.decode("latin-1").split("&"):
        name, _, raw = pair.partition("=")
        if unquote_plus(name).lower() not in QUERY_KEY_NAMES:
            continue
        for value in {raw, unquote_plus(raw)}:
            if QUERY_KEY_VALUE.fullmatch(value):
                keys.append(value)
    return tuple(keys)


def credential_keys(schemed: bool, value: str) -> list[str]:
    """The keys a key header's ``value`` holds: the value, or where it is ``schemed``
    (``SCHEMED_KEY_HEADERS``) what follows its scheme (``Bearer``, and a tab after it too: HTTP
    allows it), and of ``Basic`` the user and password it encodes; not cachegate's placeholder.
    Short ones are the caller's to leave out (``known_secrets``)."""
    text = value.strip()
    keys: list[str] = []
    if schemed:
        parts = text.split(None, 1)
        text = parts[1].strip() if len(parts) == 2 else text
        if len(parts) == 2 and parts[0].lower() == "basic":
            # (an upstream's refusal may quote the user and password it decoded: a key given as
            # Basic's user, ``-u KEY:``, as some services take it)
            with contextlib.suppress(ValueError):
                plain = base64.b64decode(text, validate=True).decode()
                user, _, password = plain.partition(":")
                keys += (plain, password)
                # (the user alone where it is the key, ``-u KEY:``, or looks like one: a user
                # name, ``developer``, is a word of every line's text)
                if not password or QUERY_KEY_VALUE.match(user) is not None:
                    keys.append(user)
    if not placeholder_key(text):
        keys.append(text)
    return keys


# The shortest piece of a key taken out where it is not whole: sixteen of its characters, longer
# than the start a provider's keys share (``sk-ant-api03-``, ``sk-svcacct-``, ``sk-proj-``), so a
# text that names that start is left; fewer at a cut say little of a key of 40 or more
KEY_PIECE: Final = 16


def holds_key(value: str, keys: Iterable[str]) -> bool:
    """Whether ``value`` holds one of ``keys`` (``known_secrets``), or, as the log takes a piece
    of one out of a text that is ``value`` (a session id: a JSON string of its own), ends with
    ``KEY_PIECE`` characters or more of a key's start or starts with as many of its end (an id
    made of part of a key: the log's lines had it redacted, its file's name showed it). An id
    that goes on otherwise past such a piece (``local-dev-key-for-testing-run2``) is logged as
    it is, and is no key."""
    for key in keys:
        if key in value:
            return True
        if len(key) <= KEY_PIECE:
            continue
        head = key[:KEY_PIECE]
        at = value.find(head)
        while at >= 0:  # (a run of the key's start to the value's end)
            if key.startswith(value[at:]):
                return True
            at = value.find(head, at + 1)
        if len(value) >= KEY_PIECE:
            at = key.find(value[:KEY_PIECE])
            while at >= 0:  # (a run of the key's end from the value's start)
                if value.startswith(key[at:]):
                    return True
                at = key.find(value[:KEY_PIECE], at + 1)
    return False


def known_secrets(values: Iterable[str]) -> tuple[str, ...]:
    """Exact values never shown, whatever they look like (cachegate's own upstream key): white
    space around them taken off, and short ones left out (they would take words out of text)."""
    return tuple({value.strip() for value in values if len(value.strip()) >= 8})


# A value that only refers to the credential: a variable (``"$DB_PASSWORD"``,
# ``"${DB_PASSWORD}"``, ``${X:?unset}``; not one with a default or an alternative,
# ``${DB_PASSWORD:-changeme}``, whose literal goes), Terraform's ``"${var.api_key}"``, a
# template's expression (``_template``).
_REFERENCE: Final = re.compile(
    r"\$(?:[A-Z_][A-Z0-9_]*|[a-z_][a-z_]*|\{[A-Za-z_][A-Za-z0-9_]*(?::?\?[^}\n]{0,256})?\})"
    r"|\$\{(?:var|local|data|module|each|self|path)\.[\w.\[\]\"'-]{1,256}\}"
)
_TEMPLATE: Final = re.compile(r"\$?\{\{([^{}\n]{1,512})\}\}")
_SUBSCRIPT: Final = re.compile(r"""\[[ \t]*(['"])[\w./-]{1,64}\1[ \t]*\]""")
_LOOKUP: Final = re.compile(
    r"""-?[ \t]*(?:lookup|query|q)[ \t]*\([^=(){}\n]*\)[ \t]*(?:\|[^'"{}\n]*)?-?[ \t]*"""
)
# A format string's or JSX's field: a name that starts in lower case and has no digit, maybe a
# subscript, a conversion and a format spec (``{password}``, ``{api_key[:6]}``,
# ``{secret!r:.4}``, ``{password:*^10}``, ``{self._secretKey}``, ``{process.env.API_KEY}``;
# not ``{CorrectHorseBattery}``, ``{Sup3r…}``, ``{x:Sup3r…}``: ODBC's braced values)
_FIELD: Final = re.compile(
    r"\{[a-z_][A-Za-z_.]{0,128}"
    # a subscript as code writes one: a slice, an index, a name, a quoted name (no literal)
    r"""(?:\[(?:-?[0-9]{0,4}(?::-?[0-9]{0,4}){0,2}|[a-z_][a-z_.]{0,32}|(['"])[a-z_][a-z_.-]{0,63}\1)\])?"""
    r"(?:![rsa])?"
    # Python's format spec, Rust's too (``{password:?}``, ``{x:>width$}``)
    r"(?::(?:.?[<>=^])?[-+ ]?#?0?(?:[0-9]{0,4}|[a-z_]\w{0,32}\$)[,_]?"
    r"(?:\.(?:[0-9]{1,4}|[a-z_]\w{0,32}\$))?[bcdeEfFgGnosxX%?]?)?\}"
)


def _template(s: str, start: int, end: int) -> bool:
    """Whether ``s[start:end]`` is a template's expression of no literal: Jinja's, Helm's or
    GitHub Actions' ``{{ … }}`` (``${{ … }}``) holding no quoted string but a subscript's key
    (``{{ .Values.db.password | b64enc }}``, ``{{ hostvars['db1']['db_password'] }}``), or an
    Ansible lookup of positional arguments (``{{ lookup('env', 'X') }}``; not ``{{
    lookup('vault', 'db', password='Sup3r…') }}``, nor ``{{ 'Sup3r…' | password_hash }}``)."""
    found = _TEMPLATE.fullmatch(s, start, end)
    if found is None:
        return False
    inner = found.group(1)
    if "'" not in inner and '"' not in inner:
        return True
    plain = _SUBSCRIPT.sub("", inner)
    return ("'" not in plain and '"' not in plain) or _LOOKUP.fullmatch(inner) is not None


def _reference(s: str, start: int, end: int) -> bool:
    """Whether the value ``s[start:end]`` only refers to the credential (``_REFERENCE``,
    ``_template``, or a field, ``_FIELD``: ``f"password={password}"``, ``apiKey={stripeKey}``;
    a braced value of another shape is one: ODBC's ``PWD={Sup3r…}``)."""
    if _REFERENCE.fullmatch(s, start, end) is not None or _template(s, start, end):
        return True
    if s[start - 1 : start] == "{" and s[end : end + 1] == "}":
        start, end = start - 1, end + 1
    elif s[start - 1 : start] in ('"', "'") and s[end : end + 1] == s[start - 1]:
        return False  # (a whole quoted value, "{correcthorse}": no field of a format string)
    return _FIELD.fullmatch(s, start, end) is not None


# Looks for a value that found none, per string: each looks up to 512 characters on, so a string
# made of thousands of names with no value (``A_TOKEN=\nA_TOKEN=\n…``) would cost ~40 µs per
# name; past this many the rest of the string is left to the other checks. A value found is
# consumed and costs no more than its length.
_MAX_HITS: Final = 1000


def _redact_named(s: str, lowered: str) -> str:
    try:
        return _redact_named_in(s, lowered)
    finally:
        _TABLE_MEMO.last = _TABLE_MEMO.rules = None  # (the string let go: its tables with it)


def _redact_named_in(s: str, lowered: str) -> str:
    spans: list[tuple[int, int]] = []
    # (failed looks, each up to 512 characters: as many as the text's length allows in linear
    # time, a thousand at least; a flat cap gave up on a 450 KB Terraform state's names)
    max_hits = max(_MAX_HITS, len(s) // 16)
    if "secret" in lowered and _K8S_SECRET.search(s) is not None:
        spans += _secret_data(s)
    if '"sensitive"' in lowered or "random_password" in lowered:
        spans += _terraform_values(s, lowered)
    hits = 0
    for word in _NAME_WORDS:
        at = lowered.find(word)
        while at >= 0 and hits < max_hits:
            # The name around the hit: its run of name characters, looked at once.
            start = at
            while start > 0 and at - start <= _MAX_NAME and s[start - 1] in _IDENT:
                start -= 1
            if start < at and s[start - 1 : start] == "\\" and s[start] in "nrt":
                start += 1  # an escaped line end inside a JSON string (a file, written by a tool)
            while start < at and s[start] in "-.":  # a flag's dashes are no part of the name
                start += 1
            run = _IDENT_RUN.match(s, at)  # always matches (maybe empty)
            end = run.end() if run is not None else at
            resume = max(end, at + len(word))
            assigned = (
                at - start <= _MAX_NAME
                and (
                    _ASSIGNED.match(s, end) is not None  # an operator or a quote follows
                    or (s[end : end + 1] in (" ", "\t") and s[start - 2 : start] == "--")
                    or (s[end : end + 1] == " " and s[start:end].lower() == "password")
                    or _GO_STRING.match(s, end) is not None  # (``var apiKey string = "…"``)
                    or _TABLE_CELL_END.match(s, end) is not None  # (``| API_KEY | Zk8… |``)
                )
            )
            if (
                (assigned or (at - start <= _MAX_NAME and s[end : end + 1] in _PAIR_AFTER))
                and _is_credential(s[start:end])
                # (a name field's value, its value in the next field; an element's tag)
                and (assigned or _paired_value(s, start, end) is not None)
            ):
                span = _named_value(s, start, end)
                if span is not None and span[0] < span[1] and _reference(s, *span):
                    # a reference: its own names are looked at (a lookup's password='…')
                    resume = max(resume, span[0])
                elif span is not None:  # the value is consumed: looked at once
                    if span[0] < span[1]:
                        spans.append(span)
                    resume = max(resume, span[1])
                else:  # (only the looks that found nothing count: each costs up to 512)
                    hits += 1
            at = lowered.find(word, resume)
    at = s.find("auth")
    while at >= 0:  # (each looks no further than the value: a few per text)
        before = s[at - 1 : at]
        if before == '"' or (before == "_" and not s[at - 2 : at - 1].isalnum()):
            pair = _BASIC_AUTH.match(s, at)
            if pair is not None and _basic_credentials(pair.group(1)):
                spans.append(pair.span(1))
        at = s.find("auth", at + 4)
    at = lowered.find("cookie")
    while at >= 0:  # (each looks no further than the header's value, and on past it)
        cookies, at = _cookie_values(s, lowered, at)
        spans += cookies
        at = lowered.find("cookie", at)
    if "cookie" in lowered:  # (each cookie's value, as a header's: a session's token)
        for array in _cookie_arrays(s, lowered):
            pos = array.end()
            while (cookie := _COOKIE_OBJECT.match(s, pos)) is not None:
                # (each value in it: Go's slice of cookies, ``[]*http.Cookie{{…}, {…}}``, is
                # one object of objects)
                for value in _COOKIE_VALUE.finditer(s, cookie.start(), cookie.end()):
                    _take_cookie(s, value, spans, group=3)
                pos = cookie.end()
    if "TRUE" in s or "FALSE" in s:  # (a cookie file's lines: each value, where a token's)
        for line in _NETSCAPE_COOKIE.finditer(s):
            _take_token(s, *line.span(2), spans)
    if "-pass" in lowered:  # openssl's ``-passout pass:…`` (its ``env:``, ``file:`` name one)
        spans += (found.span(1) for found in _OPENSSL_PASS.finditer(s))
    walked = 0  # (a flag inside an argument walked already is not walked again: linear)
    for flag in _COOKIE_FLAG.finditer(s) if "-b" in s or "--cookie" in lowered else ():
        if flag.start() >= walked:
            taken, walked = _cookie_pairs(s, flag.end(), flag.group(1) or _UNQUOTED, False)
            spans += taken
    at = lowered.find("authorization")
    while at >= 0:
        span = _value_span(_AUTHORIZATION.match(s, at))
        if span is not None:
            spans.append(span)
        at = lowered.find("authorization", at + 13)
    for command in _COMMANDS:  # each a look at most 512 characters on: so many at most
        at, looks = lowered.find(command), 0
        while at >= 0 and looks < _MAX_HITS:
            found = _CURL_QUOTED.match(s, at) if command == "curl" else None
            if found is None:
                found = _COMMAND_PASSWORD.match(s, at)
            span = _value_span(found)
            if span is not None and (
                s[span[0] - 1 : span[0]] == "'"  # (in single quotes a $ is a literal's)
                or not _reference(s, *span)
            ):
                spans.append(span)
            looks += 1
            at = lowered.find(command, found.end() if found is not None else at + len(command))
    if not spans:
        return s
    out: list[str] = []
    done = 0
    for start, end in sorted(spans):
        if end <= done:  # inside a value redacted already
            continue
        if start < done:  # overlapping: the rest of it goes too
            start = done
        else:
            out.append(s[done:start])
            out.append(REDACTED)
        done = end
    out.append(s[done:])
    return "".join(out)


# Every alternative of ``_SECRET`` contains one of these literals or matches one of the anchors: a
# cheap necessary condition. A substring test or a search for a pattern with a literal first
# character runs at memory speed, where the full pattern's search tries every position. The GitHub
# and AWS anchors are patterns because one search is cheaper than one substring test per prefix.
_KEY_IN_BASE64: Final = "LS0tLS1CRUdJTiB"  # "-----BEGIN " in base64: a PEM block's start
_KEY_IN_BASE64_BYTES: Final = _KEY_IN_BASE64.encode()
_SECRET_LITERALS: Final = (
    *("sk-", "xox", "xapp-", "npm_", "eyJ", "PRIVATE KEY", _KEY_IN_BASE64),
    # ("csk-" holds "sk-")
    *("ya29.", "xai-", "pplx-", "nvapi-", "r8_", "fw_", "lsv2_", "SG.", "_v1_"),
)
# Looked for in the lowered text: "Bearer" in any case, and the AWS secret's name.
_LOWERED_LITERALS: Final = ("earer", "secret_access_key")
# Patterns that start with one literal character, or a literal string: as fast as a substring
# test (an alternation of several first letters is not: it tries every position, ~15-40x slower
# on a 3 KB line). Families that share a first character or a literal share a scan: GitLab's
# ``glpat-`` costs nothing beside GitHub's ``g…``, nor Groq's ``gsk_`` beside Stripe's ``k_``
# (a look-behind once ``k_`` is found). Each scan of a 3 KB line takes ~1.4-3.4 µs.
_SECRET_ANCHORS: Final = (
    r"g(?:h[pousr]_|ithub_pat_|lpat-)",
    r"A(?:KI|SI)A|AIza",
    r"k_(?:live_|test_|(?<=gsk_))",
    r"hf_",
    # a URL with a password (and a user, or none), its slashes maybe escaped (PHP's JSON
    # writes ``mysql:\/\/user:pass@host``; a string inside a JSON string, ``\\\/``), its
    # user too (``postgres://\u0061pp:pw@db`` in a tool's output: its password was kept), a
    # backslash there only as such an escape's or after the user's first character (Windows'
    # ``CORP\jdoe``): a URL pattern's ``postgres://\w+:\w+@`` in a program's source is no URL
    r":\\*/\\*/(?:(?:[^\s/:@\\]|\\+[ux])(?:[^\s/:@\\]|\\+[^\s/:@\\])*)?:[^\s/@]+@",
)
# A key's letter, digit, "-", "." or "_" written as a ``\u`` escape, as no JSON writer does
# unasked: inside a JSON string in a string (a tool call's arguments) it stays as written, and a
# key one of whose characters an obfuscating writer escaped (``\u0067hp_…``, ``ghp\u005f…``)
# had no literal to be found by. It sends such strings to be read as the text they stand for
# (``_redact_escaped_strings``); the text as written, where no pattern can match across the
# escape, is not searched for it (a megabyte holding one regex's ``[\u0030-\u0039]`` was, at
# 200 ms).
_ESCAPED_KEY_CHARACTER: Final = (
    r"\\u00(?:2[dDeE]|3[0-9]|4[1-9a-fA-F]|5[0-9aAfF]|6[1-9a-fA-F]|7[0-9aA])"
)
_ESCAPED_KEY_CHARACTER_STR: Final = re.compile(_ESCAPED_KEY_CHARACTER)
_ESCAPED_KEY_CHARACTER_BYTES: Final = re.compile(_ESCAPED_KEY_CHARACTER.encode())
_ANCHORS_STR: Final = tuple(re.compile(anchor) for anchor in _SECRET_ANCHORS)
_LITERALS_BYTES: Final = tuple(literal.encode() for literal in _SECRET_LITERALS)
_ANCHORS_BYTES: Final = tuple(re.compile(anchor.encode()) for anchor in _SECRET_ANCHORS)
# Looked for in the lowered line: the names of credentials with what follows a name that is
# assigned a value (a JSON key's closing quote, escaped or not inside a JSON string, ``=``, ``:``),
# so that ``max_tokens``, ``tokenizer`` or the usual text pass; and "authorization", "secret" and
# "passw" as they are. A pattern with a literal start is found as fast as a plain substring (~0.7
# µs per 1.5 KB). Object fields named ``apikey``, ``x-api-key``, … end in ``key"``.
# (White space before the operator may be a tab, written ``\t`` in a JSON line.)
# Fields that count tokens, as a JSON key (after its quote): a plural ``tokens`` that names no
# credential (``deploy_tokens`` does; ``admin_tokens`` too, though it ends as ``min_tokens``).
_COUNT_KEYS: Final = (
    b"max_tokens",
    b"max_completion_tokens",
    b"max_new_tokens",
    b"max_output_tokens",
    b"max_thinking_tokens",
    b"min_tokens",
    b"prompt_tokens",
    b"completion_tokens",
    b"total_tokens",
    b"input_tokens",
    b"output_tokens",
    b"reasoning_tokens",
    b"thinking_tokens",
    b"cached_tokens",
    b"audio_tokens",
    b"text_tokens",
    b"image_tokens",
    b"accepted_prediction_tokens",
    b"rejected_prediction_tokens",
    b"prompt_cache_hit_tokens",
    b"prompt_cache_miss_tokens",
    b"cache_read_input_tokens",
    b"cache_creation_input_tokens",
    b"cache_read_tokens",
    b"cache_write_tokens",
    b"cache_creation_tokens",
    b"ephemeral_5m_input_tokens",
    b"ephemeral_1h_input_tokens",
    b"budget_tokens",
    b"num_tokens",
    b"n_tokens",
    b"special_tokens",
    b"stop_tokens",
    b"count_tokens",
    b"chunk_tokens",
    b"maxtokens",  # camelCase, lowered
    b"maxoutputtokens",
    b"maxcompletiontokens",
    b"prompttokens",
    b"completiontokens",
    b"totaltokens",
    b"inputtokens",
    b"outputtokens",
    b"cachedtokens",
    b"reasoningtokens",
    b"budgettokens",
)
# What may follow a credential's name in a credential field's: a version, ``_base``, ``_id``,
# ``_hash`` (as ``_NAME_END``: ``OPENAI_KEY_V2=``, ``pwd_hash"``, ``api-key-id"``).
_SUFFIX: Final = rb"(?:[_-]?(?:v\d+|base|ids?|hash))?"
# (a tab before the operator is ``\t`` in JSON text, ``\\t`` in the log's line where the text
# is a JSON string itself: a tool call's arguments; ``=`` is ``\u003d`` in HTML-safe JSON, as
# Gson writes it by default: ``"env":["API_KEY\u003d…"]``)
# (and a name field's value whose value field follows, Kubernetes' ``- name: X_KEY`` then
# ``value: …``: a line end, escaped in JSON text, then ``value:``; and Go's ``apiKey string =``)
_ASSIGNED_BYTES: Final = (
    rb"""(?:\\*["']|(?:\s|\\+t)*[=:]|\\+u003d"""
    rb"""|[ \t]*(?:\\+r)?\\+n(?:[ \t]|\\+t)*value:|[ \t]*\r?\n[ \t]*value:"""
    rb"""|(?:[ \t]|\\+t)+string(?:[ \t]|\\+t)*=|>"""
    # (a table's cell: ``| API_KEY | …``, bold, in backticks, a note after it)
    # (its note's 64 characters up to 6 bytes each in the line: UTF-8, ``\\uXXXX``)
    rb"""|(?:\*\*)?`?(?:\*\*)?(?:(?:[ \t]|\\+t)+\([^()|\n]{0,400}\))?(?:[ \t]|\\+t)*\|)"""
)
_NAMED_BYTES: Final = (
    # key", key\", key\\\" (nested), key', key=; keys", key_id", token_hash" (not tokens": a count)
    re.compile(rb"keys?" + _SUFFIX + _ASSIGNED_BYTES),
    # (and tokens_v2=: a plural with a suffix is no count)
    re.compile(rb"token(?:s?[_-]?(?:v\d+|base|ids?|hash))?" + _ASSIGNED_BYTES),
    # deploy_tokens", refreshTokens" (lowered): a plural that names credentials, not a count
    # (max_tokens", maxTokens"); the literal first, found as fast as a substring
    re.compile(
        rb"""tokens(?<=[a-z_]tokens)"""
        + b"".join(b'(?<!"' + key + b")" for key in _COUNT_KEYS)
        + _ASSIGNED_BYTES
    ),
    # DB_PASS=, db-pass", x.pass_v2= (the literal first: a leading class is searched ~10x as
    # slowly)
    re.compile(rb"pass(?<=[_.-]pass)" + _SUFFIX + _ASSIGNED_BYTES),
    # a bare pass= or pass: (nodemailer's ``auth: {user, pass: '…'}``)
    re.compile(rb"pass(?<![a-z0-9_.-]pass)" + _ASSIGNED_BYTES),
    re.compile(rb"(?<=\\)[nrt]pass" + _ASSIGNED_BYTES),  # (after an escaped line end or tab)
    re.compile(rb"pwd" + _SUFFIX + _ASSIGNED_BYTES),  # MYSQL_PWD=, pwd_hash"
    # a flag and its value apart: --api-key VALUE, --token VALUE
    re.compile(rb"--[a-z0-9_.-]{0,60}?(?:key|token|pass|secret|pwd)" + _SUFFIX + rb"(?: |\\+t)"),
    # Terraform's sensitive output (``terraform output -json``, its state)
    re.compile(rb'sensitive\\*"(?:[ \t\r\n]|\\+[rnt])*:(?:[ \t\r\n]|\\+[rnt])*true'),
    # a Cookie or Set-Cookie header, its value's cookies maybe a session's tokens (and HAR's
    # name/value pair, curl's -b argument)
    re.compile(rb"""cookie(?:\\*["'])?(?:[ \t]|\\+t)*:"""),
    re.compile(rb'cookie\\*"(?:[ \t\r\n]|\\+[nrt])*,(?:[ \t\r\n]|\\+[nrt])*\\*"value'),
    re.compile(rb"""cookies\\*["'](?:[ \t\r\n]|\\+[nrt])*:(?:[ \t\r\n]|\\+[nrt])*\["""),
    re.compile(rb"""(?:\s-b|(?<=\\)[nt]-b|--cookie)(?:[ \t]|\\+t)+\\*["']?[^\s'"=;]{1,64}="""),
    # ... and code's: an assignment, a header set by name, a call with a name and a value, a
    # dict of them (``_COOKIE_HEADER``, ``_COOKIE_CALL``, ``_COOKIE_DICT``); a cookie file's line
    re.compile(rb"""cookie(?:\\*["']\]?)?(?:[ \t]|\\+t)*=(?:[ \t]|\\+t)*\\*["'`]"""),
    re.compile(rb"""cookie\\*["'](?:[ \t]|\\+t)*,(?:[ \t]|\\+t)*(?:\[(?:\s|\\+[nrt])*)?\\*["']"""),
    re.compile(
        rb"""cookies?(?:\(\))?(?:\.set|\.append|::make|::forever|::create)?\("""
        rb"""(?:\s|\\+[nrt])*(?:key(?:[ \t]|\\+t)*=(?:[ \t]|\\+t)*)?\\*["']"""
    ),
    re.compile(rb"""cookies\[[^\]\n]{1,80}\](?:[ \t]|\\+t)*=(?:[ \t]|\\+t)*\\*["'`]"""),
    re.compile(rb"""cookies(?:\\*["'])?(?:[ \t]|\\+t)*[:=](?:[ \t\r\n]|\\+[nrt])*\{"""),
    # a cookie's object given by code: ``add_cookie({``, ``addCookies([{``, Go's ``Cookie{``
    re.compile(rb"""cookies?(?:\((?:\s|\\+[nrt])*(?:\[(?:\s|\\+[nrt])*)?)?\{"""),
    re.compile(rb"""(?:\t|(?<=\\)t)(?:true|false)(?:\t|\\+t)"""),
    # Docker's "auth": "…" and .npmrc's _auth=… (a user and a password in base64)
    re.compile(rb'auth(?<=["_]auth)\\*"?(?:[ \t]|\\+t)*[=:]'),
)
_NAMED_STR: Final = tuple(re.compile(p.pattern.decode()) for p in _NAMED_BYTES)
_WORDS_BYTES: Final = (b"authorization", b"secret", b"passw", b"earer")
# A command's password flag (``-u``, ``--user``, ``--proxy-user``, ``-p``, redis-cli's ``-a``; one
# literal start, as fast as a substring test), and only then the commands' names (~2 µs each).
_FLAG_BYTES: Final = re.compile(rb"-[uUpa]")
_FLAG_STR: Final = re.compile(r"-[uUpa]")
_COMMANDS_BYTES: Final = tuple(command.encode() for command in _COMMANDS)
_WORDS_STR: Final = ("authorization", "secret", "passw")


def _may_hold_secret(s: str, lowered: str | None = None) -> bool:
    """Whether ``_SECRET`` may match in ``s`` (``lowered``: ``_lowered(s)``, if made already):
    one of the literals or anchors each of its alternatives contains (a full search of a 30 KB
    string costs ~3 ms; this, ~0.15)."""
    for literal in _SECRET_LITERALS:
        if literal in s:
            return True
    if any(anchor.search(s) is not None for anchor in _ANCHORS_STR):
        return True
    lowered = _lowered(s) if lowered is None else lowered
    return any(literal in lowered for literal in _LOWERED_LITERALS)


def _lowered(s: str) -> str:
    """``s`` lower-cased character for character (a few characters lower into two: then only
    ASCII is lowered, so that positions in it are positions in ``s``)."""
    lowered = s.lower()
    return lowered if len(lowered) == len(s) else s.translate(_ASCII_LOWER)


_ASCII_LOWER: Final = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def line_may_hold_secret(line: bytes) -> bool:
    """Whether a serialized JSON line might hold anything ``redact`` would change: one of the
    literals or anchors every secret pattern contains, or a key ending like a credential field's
    name (any case). Secrets are made of characters JSON never escapes, so they appear in the line
    as they were; where a writer escaped a letter of one anyway (JSON inside a string keeps the
    escape as text), the escape is an anchor.

    The JSON strings that ``redact_text`` returns as they are, base64 payloads of a kilobyte or
    more (``_BINARY``), are left out of a long line before it is looked through: the ~20 scans
    cost ~20 ns a byte, 200 ms for 8 MB of screenshots, where leaving them out costs ~2; and a
    megabyte of random base64 holds ``xox`` or ``eyJ`` by chance, for which the line was redacted
    field by field (another ~60 ms)."""
    if len(line) >= _BLANK_MIN:
        line = blank_binary(line)
    scan = _multi_scan()
    if scan is not None:
        try:
            return scan(line)
        except Exception:  # never a line unscanned: the scans below decide
            pass
    return _scans(line)


def _scans(line: bytes) -> bool:
    """``line_may_hold_secret``'s checks, one scan of the line each."""
    for literal in _LITERALS_BYTES:
        if line.find(literal) >= 0:
            return True
    for anchor in _ANCHORS_BYTES:
        if anchor.search(line) is not None:
            return True
    if b'"' in line and _ESCAPED_KEY_CHARACTER_BYTES.search(line) is not None:
        return True  # (in a JSON string, whose escapes may hide a key)
    lowered = line.lower()
    for word in _WORDS_BYTES:
        if lowered.find(word) >= 0:
            return True
    if any(name.search(lowered) is not None for name in _NAMED_BYTES):
        return True
    return _FLAG_BYTES.search(line) is not None and any(
        lowered.find(command) >= 0 for command in _COMMANDS_BYTES
    )


# ``line_may_hold_secret``'s checks in one pass over the line, where ``hyperscan`` is installed
# (a dependency where it has wheels: pyproject.toml): its engine looks for many patterns
# at once, ~1 ns a byte where the ~22 scans above cost ~12 (the log writer's largest cost, ~16
# µs a request at concurrency 32), and outside the interpreter's lock. Each check has a pattern
# there that matches wherever the check's would (a literal as it is; a pattern as it is, or
# without its look-behinds, which hyperscan lacks, and then confirmed by the check's own pattern
# when found). So the answer is the checks' answer; the pass only tells at once the usual line
# that has none of them.
_EXACT: Final = 0  # found: the line may hold a secret
_CONFIRM: Final = 1  # found: the check's own pattern says (on the lowered line)
_CONFIRM_CASED: Final = 2  # the same, on the line as it is
_FLAG: Final = 3  # a command's password flag: with one of the commands' names
_COMMAND: Final = 4
_ESCAPE: Final = 5  # found (``_ESCAPED_KEY_CHARACTER``): where the text holds a JSON string
# What a text may hold (``_suspicion``): nothing, a key behind an escape in a JSON string in it
# only (that string is read as the text it stands for; the rest is not searched), or anything
_NONE: Final = 0
_ESCAPES_ONLY: Final = 1
_SUSPECT: Final = 2
_LOOK_BEHIND = re.compile(rb"\(\?<[=!](?:[^()\\]|\\.|\[[^]]*\])*\)")


def _hs_literal(literal: bytes) -> bytes:
    """``literal`` as a hyperscan pattern: every byte but a letter or digit escaped."""
    return b"".join(bytes([c]) if chr(c).isalnum() and c < 128 else b"\\x%02x" % c for c in literal)


def _hs_loose(pattern: bytes) -> bytes:
    """``pattern`` without its look-behinds: it then matches wherever it did, and elsewhere.
    (hyperscan's ``\\s``, ``\\d`` and repeats are Python's, for bytes.)"""
    return _LOOK_BEHIND.sub(b"", pattern)


class _MultiScan:
    """One hyperscan pass in place of ``_scans`` (each thread with its own scratch space)."""

    def __init__(self, hyperscan: Any) -> None:
        caseless = hyperscan.HS_FLAG_CASELESS
        entries: list[tuple[bytes, int, int, Any]] = []
        for literal in _LITERALS_BYTES:
            entries.append((_hs_literal(literal), 0, _EXACT, None))
        for anchor in _ANCHORS_BYTES:
            entries.append((_hs_loose(anchor.pattern), 0, _CONFIRM_CASED, anchor))
        entries.append((_ESCAPED_KEY_CHARACTER_BYTES.pattern, 0, _ESCAPE, None))
        for word in _WORDS_BYTES:  # (found in any case: as in the lowered line)
            entries.append((_hs_literal(word), caseless, _EXACT, None))
        for name in _NAMED_BYTES:
            entries.append((_hs_loose(name.pattern), caseless, _CONFIRM, name))
        entries.append((_hs_loose(_FLAG_BYTES.pattern), 0, _FLAG, None))
        for command in _COMMANDS_BYTES:
            entries.append((_hs_literal(command), caseless, _COMMAND, None))
        database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        database.compile(
            expressions=[entry[0] for entry in entries],
            ids=list(range(len(entries))),
            elements=len(entries),
            # each reported once at most; none may match the empty string
            flags=[entry[1] | hyperscan.HS_FLAG_SINGLEMATCH for entry in entries],
        )
        self._database = database
        self._kinds = [entry[2] for entry in entries]
        self._checks = [entry[3] for entry in entries]
        self._new_scratch = functools.partial(hyperscan.Scratch, database)
        self._local = threading.local()

    def __call__(self, line: bytes) -> bool:
        return self.verdict(line) != _NONE

    def verdict(self, line: bytes) -> int:
        """``_SUSPECT`` where a check but the escapes' finds something, else
        ``_ESCAPES_ONLY`` where an escaped key character is found and ``line`` holds a JSON
        string (a quote), else ``_NONE``."""
        local = self._local
        scratch = getattr(local, "scratch", None)
        if scratch is None:
            scratch = local.scratch = self._new_scratch()
        found: list[int] = []
        self._database.scan(line, _found, context=found, scratch=scratch)
        if not found:
            return _NONE
        kinds, checks = self._kinds, self._checks
        flag = command = escape = False
        lowered: bytes | None = None
        for index in found:
            kind = kinds[index]
            if kind == _EXACT:
                return _SUSPECT
            if kind == _CONFIRM_CASED:
                if checks[index].search(line) is not None:
                    return _SUSPECT
            elif kind == _CONFIRM:
                lowered = line.lower() if lowered is None else lowered
                if checks[index].search(lowered) is not None:
                    return _SUSPECT
            elif kind == _FLAG:
                flag = True
            elif kind == _ESCAPE:
                escape = True
            else:
                command = True
        if flag and command:
            return _SUSPECT
        return _ESCAPES_ONLY if escape and b'"' in line else _NONE


def _found(index: int, start: int, end: int, flags: int, found: list[int]) -> None:
    found.append(index)


def prepare_scan() -> None:
    """Make the one-pass scan now, not when the first line is looked through: its database
    takes ~55 ms of CPU to compile (outside the interpreter's lock). The log writer makes it
    when it is created, before cachegate serves: made for the first line, it competed with the
    event loop for the CPU during the first burst of requests (on one core, that burst's
    streams started later: 950 of 1,000 first events late in a fresh process, 134 after)."""
    _multi_scan()


@functools.cache
def _multi_scan() -> _MultiScan | None:
    """The one-pass scan, or None without ``hyperscan`` (or where its database cannot be made:
    the scans then run one by one, as they always may)."""
    try:
        import hyperscan
    except ImportError:
        return None
    try:
        return _MultiScan(hyperscan)
    except Exception:  # (hyperscan.error and kin: an engine without a feature a pattern uses)
        return None


# A binary payload carried as text: an image or a file as a base64 data URL (OpenAI's
# ``image_url``) or bare base64 (Anthropic's ``source.data``), a kilobyte or more; or a Fernet
# token, in URL-safe base64 (a Responses API reasoning or compaction item's sealed state,
# ``encrypted_content``: one in ~1,200 of 4 KB holds ``-sk-`` or ``_sk-`` by chance, and its
# log copy was cut there, which the provider cannot decrypt). It holds no credential as text,
# and a secret pattern found in it would be chance: the scan took ~0.2 s of the interpreter
# (the event loop's too) per 2 MB screenshot and now and then cut the image.
_BINARY_MIN: Final = 1024
_DATA_URL: Final = r"data:[\w.+-]+/[\w.+-]+(?:;[\w.+-]+=[\w.+-]+)*;base64,"  # (its prefix)
_FERNET: Final = "gAAAAA"  # (a Fernet token's version byte, 0x80, and its time's first bytes)
# What such a payload is, whole (``is_binary`` tells it without this pattern's walk)
_BINARY = re.compile(
    r"(?:" + _DATA_URL + r")?[A-Za-z0-9+/]+={0,2}|" + _FERNET + r"[A-Za-z0-9_-]+={0,2}"
)


# Lines this long have their base64 strings left out before they are looked through.
_BLANK_MIN: Final = 64 * 1024
# A base64 string's start in a serialized line: its opening quote, a data URL's prefix, 64
# characters of base64. Its end is the next quote; what lies between is checked by ``_is_base64``.
# (two patterns, each searched from its literal: one with the data URL's prefix optional was
# tried at every quote, ~80 ns each, 2-3 times the scan of a long line of short strings)
_BARE_START: Final = re.compile(rb'"[A-Za-z0-9+/]{64}')
_DATA_START: Final = re.compile(b'"(' + _DATA_URL.encode() + b")[A-Za-z0-9+/]{64}")
_BASE64_ALPHABET: Final = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_URL_SAFE_ALPHABET: Final = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
# A Fernet token as a field's value (``blank_binary``; JSON that Python writes has a space)
_SEALED_START: Final = re.compile(rb'"encrypted_content": ?("gAAAAA[A-Za-z0-9_-]{58})')
_BINARY_HEAD: Final = re.compile(
    "(" + _DATA_URL + ")?[A-Za-z0-9+/]{64}|" + _FERNET + "[A-Za-z0-9_-]{58}", re.ASCII
)


def _is_base64(data: bytes, alphabet: bytes = _BASE64_ALPHABET) -> bool:
    """Whether ``data`` is base64 with at most two ``=`` of padding (as ``_BINARY``'s part after
    a data URL's prefix): a table lookup per byte, ~4 times as fast as the pattern; of another
    ``alphabet`` (a Fernet token's, URL-safe: ``-`` and ``_`` for ``+`` and ``/``)."""
    if data.endswith(b"="):
        data = data[:-2] if data.endswith(b"==") else data[:-1]
    return bool(data) and not data.translate(None, alphabet)


def _is_payload(data: bytes, bare: bool) -> bool:
    """Whether ``data`` is base64 (``_is_base64``), or ``bare`` (no data URL's prefix before
    it) a Fernet token, in URL-safe base64."""
    return _is_base64(data) or (
        bare and data.startswith(b"gAAAAA") and _is_base64(data, _URL_SAFE_ALPHABET)
    )


def is_binary(s: str) -> bool:
    """Whether ``s`` is a base64 payload of a kilobyte or more, bare or as a data URL: an image,
    a file, audio; or a Fernet token (sealed state: ``encrypted_content``). ``_BINARY.fullmatch``
    would say so too (an ASCII data URL's prefix only)."""
    if len(s) < _BINARY_MIN or not s.isascii():
        return False
    head = _BINARY_HEAD.match(s)  # (text fails here, at its first space: no copy of it made)
    if head is None:
        return False
    if head.group(1):
        return _is_base64(s[head.end(1) :].encode("ascii"))
    return _is_payload(s.encode("ascii"), bare=True)


def blank_binary(line: bytes) -> bytes:
    """``line`` (serialized JSON) with each string that ``redact_text`` returns as it is, a base64
    payload of a kilobyte or more (looked for as a data URL, a ``data`` field's, an
    ``encrypted_content``'s Fernet token), emptied; its keys kept (a key's name may say credential, which
    ``redact`` reads): what is left holds whatever ``redact`` would change in the line."""
    # Looked for only where the line has a data URL, or a ``data`` field (bare base64: audio,
    # Anthropic-style images): each quote tried costs ~80 ns, and a line of short strings has
    # many (1.6 MB of short messages: 13 ms, where the two literals are looked for in ~0.2).
    starts: list[tuple[int, int]] = []
    if line.find(b'"data":"') >= 0:
        starts = [(m.start(), m.start() + 1) for m in _BARE_START.finditer(line)]
    if line.find(b'"data:') >= 0:
        starts += [(m.start(), m.end(1)) for m in _DATA_START.finditer(line)]
        starts.sort()
    if line.find(b'"encrypted_content":') >= 0:  # (reasoning and compaction items' sealed state)
        starts += [(m.start(1), m.start(1) + 1) for m in _SEALED_START.finditer(line)]
        starts.sort()
    kept: list[bytes] = []
    at = 0
    for opening, data in starts:
        if opening < at:
            continue
        closing = line.find(b'"', data)
        if closing < 0:
            break
        if (
            closing - opening > _BINARY_MIN
            and line[opening - 1 : opening] != b"\\"  # (an escaped quote: inside a longer text)
            and line[closing + 1 : closing + 2] != b":"  # (a key)
            and not line.startswith(_KEY_IN_BASE64_BYTES, data)  # (a private key's: read)
            and _is_payload(line[data:closing], bare=data == opening + 1)
        ):
            kept.append(line[at : opening + 1])
            at = closing
    if not kept:
        return line
    kept.append(line[at:])
    return b"".join(kept)


def redact_text(s: str) -> str:
    """Return ``s`` with every secret-looking substring replaced (``s`` itself when none). A
    base64 payload of a kilobyte or more (``is_binary``) is returned as it is. A JSON string in
    it with escapes (a tool call's arguments, a tool's JSON output, a notebook a tool writes) is
    redacted as the text it stands for, at any depth of JSON inside JSON
    (``_redact_escaped_strings``)."""
    if len(s) < _MIN_SECRET_LEN:
        return s
    if is_binary(s) and _KEY_IN_BASE64 not in s[:256]:  # (a private key's, a data URL's too)
        return s
    suspicion = _suspicion(s)
    if suspicion == _NONE:  # (neither check below could find anything)
        return s
    if suspicion == _ESCAPES_ONLY:  # (a key behind an escape, in a JSON string: only there)
        return _redact_escaped_strings(s)
    out = s
    lowered = _lowered(s)
    if "\\" in s and '"' in s:
        out = _redact_escaped_strings(s)
        if out is not s:
            lowered = _lowered(out)
    if _may_hold_secret(out, lowered):
        if _SECRET.search(out) is not None:
            out = _SECRET.sub(_replace, out)
            lowered = _lowered(out)
        if any(mark in out for mark in _AFTER_MARKS) and _SECRET_AFTER.search(out) is not None:
            out = _SECRET_AFTER.sub(_replace, out)
            lowered = _lowered(out)
    if _names_a_secret(out, lowered):
        out = _redact_named(out, lowered)
    return s if out == s else out


def _names_a_secret(s: str, lowered: str) -> bool:
    """Whether ``s`` (``lowered``: ``_lowered(s)``) names a credential, or gives a command a
    password, where ``_redact_named`` may find a value."""
    return (
        any(word in lowered for word in _WORDS_STR)
        or any(name.search(lowered) is not None for name in _NAMED_STR)
        or (_FLAG_STR.search(s) is not None and any(c in lowered for c in _COMMANDS))
    )


def _suspect(s: str, lowered: str) -> bool:
    return _may_hold_secret(s, lowered) or _names_a_secret(s, lowered)


# Characters ``\s`` matches in text but not in bytes (the checks' patterns read them as blanks)
_STR_ONLY_BLANKS: Final = re.compile("[\x1c-\x1f]")


def _suspicion(s: str) -> int:
    """What ``s`` may hold (``_NONE``, ``_ESCAPES_ONLY``, ``_SUSPECT``): ``_suspect(s,
    _lowered(s))``, then an escaped key character where ``s`` holds a JSON string; by the
    one-pass scan where it answers the same (ASCII text: the checks' bytes forms are the
    text's, ``line_may_hold_secret``'s): ~0.7 µs for a short string where the checks one by
    one take ~3, and ~1 µs for 2 KB where they take ~36."""
    if s.isascii() and _STR_ONLY_BLANKS.search(s) is None:
        scan = _multi_scan()
        if scan is not None:
            try:
                verdict = scan.verdict(s.encode())
            except Exception:  # (the checks one by one decide)
                pass
            else:
                return verdict
    if _suspect(s, _lowered(s)):
        return _SUSPECT
    if '"' in s and _ESCAPED_KEY_CHARACTER_STR.search(s) is not None:
        return _ESCAPES_ONLY
    return _NONE


def _suspect_text(s: str) -> bool:
    """Whether ``s`` may hold anything ``redact_text`` takes out (``_suspicion``)."""
    return _suspicion(s) != _NONE


# A JSON string with at least one escape in it, on one line, or left open at the line's end
# (cut off: an interrupted call's arguments, a truncated output). It starts at a quote no
# backslash escapes: inside a string every quote is escaped, so a start that finds no end
# before the line's reaches no other start (linear; starting at each escaped quote of a
# string left open took 3 s for 32 KB). Unrolled and possessive: a long string is walked run
# by run, not character by character.
_ESCAPED_STRING: Final = re.compile(
    r'(?<!\\)"[^"\\\n]*+(?:\\.[^"\\\n]*+)++(?:"|(?P<open>\\?)(?=\n|\Z))'
)
_PARTIAL_ESCAPE: Final = re.compile(r"\\u[0-9a-fA-F]{0,3}\Z")  # (cut in a \uXXXX escape)
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def _redact_escaped_strings(s: str) -> str:
    """``s`` with each JSON string in it that holds an escape replaced, where the text it stands
    for has a secret, by that text redacted (``redact_text``: JSON inside it in turn) and
    written as a JSON string again; ``s`` itself when none changed. The escapes hid settings
    from the rules for text (a tab-indented ``token = …`` of a ``.gitconfig`` a tool writes is
    ``\\ttoken = …`` in its arguments, ``\\\\t…`` one level down). Only such strings are
    written anew (as ``json.dumps`` writes them: ``\\u`` escapes where they had only ASCII, or a
    lone surrogate, else the characters; ``\\/`` as ``/``): the layout, numbers, keys and the
    rest of the text stay as they were, also in JSON cut off (a string left open is read to
    its end, and stays open), wrapped in other output or one object a line."""
    parts: list[str] = []
    done = 0
    for found in _ESCAPED_STRING.finditer(s):
        if found.end() - found.start() < _MIN_SECRET_LEN + 2:  # (too short to hold one)
            continue
        token = found.group()
        unclosed = found.group("open")
        tail = ""
        if unclosed is not None:  # left open: read as if closed there, and left open
            body = token[: len(token) - len(unclosed)]
            cut = _PARTIAL_ESCAPE.search(body)
            if cut is not None:
                body, tail = body[: cut.start()], body[cut.start() :]
            body, tail = body + '"', tail + unclosed
        else:
            body = token
        if not _suspect_text(body):
            continue
        try:
            text = json.loads(body)
        except ValueError:  # (no JSON string: quotes and backslashes of other text)
            continue
        if not isinstance(text, str):
            continue
        redacted = redact_text(text)
        if redacted is text:
            continue
        ascii_only = body.isascii() or _SURROGATE.search(redacted) is not None
        written = json.dumps(redacted, ensure_ascii=ascii_only)
        if unclosed is not None:
            written = written[:-1] + tail
        parts += (s[done : found.start()], written)
        done = found.end()
    if not parts:
        return s
    parts.append(s[done:])
    return "".join(parts)


def redact(obj: Any) -> Any:
    """Return ``obj`` with secrets redacted in every string, key and credential field.

    Containers are copied only along the paths where something changed; everything else is shared
    with the input, which is never mutated.
    """
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, dict):
        return _redact_dict(obj)
    if isinstance(obj, list | tuple):
        changed: list[Any] | None = None
        for i, item in enumerate(obj):
            new = redact(item)
            if new is not item:
                if changed is None:
                    changed = list(obj)
                changed[i] = new
        if changed is None:
            return obj
        return changed if isinstance(obj, list) else tuple(changed)
    return obj


def _secret_field(key: str, value: str) -> bool:
    """Whether an object's field ``key`` holds a credential as its whole string ``value``: a
    field named as one of ``_SECRET_KEYS``, or named as a credential (``_is_credential``): a
    password or a secret with a value as a JSON text's would be redacted (``"db_password":
    "…"`` in a request's ``metadata``), a key or a token with a value that looks like one."""
    if not value:
        return False
    if key.lower() in _SECRET_KEYS:
        return True
    if len(value) < 6 or not _credential_field(key) or _FIELD_VALUE.match(value) is None:
        return False
    if value == REDACTED:
        return False
    if _SAYS_SECRET.search(_CAMEL.sub("_", key).lower()) is not None:
        return True
    # A key or a token, as many things are named that are no credentials ("trace_key":
    # "run-2024-11", "next_token" a page's cursor, a logprob's "token": "Hello"): its value must
    # look like one: no space, a digit, 16 characters or more, no path, no markup.
    return (
        len(value) >= 16
        and value[0] not in "/<.#"
        and any(c.isdigit() for c in value)
        and not any(c.isspace() for c in value)
        and not _is_path(value)
    )


@functools.lru_cache(maxsize=1024)
def _credential_field(key: str) -> bool:
    """``_is_credential`` for an object's field name: the same few names come in every event."""
    return _is_credential(key)


# Names that say a secret whatever their value (not a key or a token: those name other things too)
_SAYS_SECRET = re.compile(  # (of the name lowered, camelCase words separated)
    r"passw|secret|[_.-]pwd|_pass(?:[_-]|$)"
    r"|(?:access|refresh|auth|api|bearer|oauth|session|csrf|xsrf|personal|bot)[_-]?tokens?$"
    r"|(?:^|[_.-])id[_-]?tokens?$"  # (an id token; not paid_tokens)
)
# (as ``_JSON_VALUE`` takes a value: a letter or a digit in its first 512 characters)
_FIELD_VALUE = re.compile(r"[^A-Za-z0-9]{0,511}[A-Za-z0-9]")


# The ``type`` of an ``authentication`` object of Azure OpenAI's ``data_sources``
_AZURE_AUTH_TYPES: Final = frozenset(
    {
        "api_key",
        "connection_string",
        "key_and_key_id",
        "encoded_api_key",
        "access_token",
        "username_and_password",
        "system_assigned_managed_identity",
        "user_assigned_managed_identity",
    }
)


def _authentication(obj: dict[Any, Any]) -> dict[Any, Any]:
    """An ``authentication`` object (Azure OpenAI's ``data_sources``: ``{"type": "api_key",
    "key": …}``, ``key_and_key_id``, ``connection_string``, ``access_token``,
    ``username_and_password``): every string in it but its ``type`` is a credential, or names
    one, whatever it looks like (a bare ``key`` is none elsewhere). Another object of that name
    (a tool schema's property, ``{"type": "string", …}``) is redacted as any is."""
    if obj.get("type") not in _AZURE_AUTH_TYPES:
        return _redact_dict(obj)
    out = {
        k: REDACTED if isinstance(v, str) and v and k != "type" else redact(v)
        for k, v in obj.items()
    }
    return obj if all(out[k] is v for k, v in obj.items()) else out


def _redact_dict(obj: dict[Any, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] | None = None
    for i, (key, value) in enumerate(obj.items()):
        new_key = redact_text(key) if isinstance(key, str) else key
        if isinstance(key, str) and isinstance(value, str) and _secret_field(key, value):
            new_value: Any = REDACTED
        elif key == "authentication" and isinstance(value, dict):
            new_value = _authentication(value)
        else:
            new_value = redact(value)
        if out is None and (new_key is not key or new_value is not value):
            # Rebuild the keys seen so far so the copy keeps the original order.
            out = dict(list(obj.items())[:i])
        if out is not None:
            out[new_key] = new_value
    return obj if out is None else out
