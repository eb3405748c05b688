"""The simulator's state: its clock, the requests it received, the prefix cache, the script queue.

Tests hold the ``Simulator`` directly (its server runs in another thread), so every method takes a
lock; none of them awaits.
"""

from __future__ import annotations

import math
import random
import string
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.relay import CLIENT_KEY_HEADERS, GATEWAY_KEY_HEADERS
from proxy.simulator.cache import LONG_TTL_S, POLICIES, CacheResult, PrefixCache
from proxy.simulator.config import SimConfig
from proxy.simulator.reply import Reply, parse_script

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass
class ReceivedRequest:
    """One request as the simulator saw it, and what it answered (filled in while handling)."""

    method: str
    path: str
    headers: dict[str, str]
    raw: bytes
    time: float
    body: Any = None
    status: int | None = None
    fault: str | None = None
    usage: dict[str, Any] | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        """The JSON form served by ``GET /_sim/requests`` (raw bytes as their length; keys masked:
        a cachegate in front with the user's real key in its environment sends it here, and
        this route answers any local client)."""
        return {
            "method": self.method,
            "path": self.path,
            "headers": {k: _masked(k, v) for k, v in self.headers.items()},
            "body": self.body,
            "raw_bytes": len(self.raw),
            "time": self.time,
            "status": self.status,
            "fault": self.fault,
            "usage": self.usage,
        }


_KEY_HEADERS = frozenset(
    {name.decode() for name in CLIENT_KEY_HEADERS | GATEWAY_KEY_HEADERS}
    | {"proxy-authorization", "cookie"}
)


def _masked(name: str, value: str) -> str:
    """A header's value as ``/_sim/requests`` shows it: a credential's with its secret hidden,
    its scheme and last four characters staying, enough to tell which key came; a cookie's
    with every value hidden, its names staying (each may be a session's token)."""
    name = name.lower()
    if name not in _KEY_HEADERS:
        return value
    if name == "cookie":
        return "; ".join(
            f"{pair.partition('=')[0].strip()}=…" if "=" in pair else "…"  # (a nameless one)
            for pair in value.split(";")
            if pair.strip()
        )
    scheme, _, secret = value.rpartition(" ")
    hidden = "…" + secret[-4:] if len(secret) > 12 else "…"
    return f"{scheme} {hidden}" if scheme else hidden


# The requests a simulator keeps for ``GET /_sim/requests``: the latest this many, holding at
# most this much memory (a simulator left running as an agent's upstream all day took 3 GB).
# A request costs its body twice over: as received, and parsed (~6x its bytes for an agent's
# history of many small messages).
KEEP_REQUESTS = 10_000
KEEP_BYTES = 64 * 1024 * 1024
BODY_COST = 7  # bytes held per byte of a body
KEEP_RESPONSES = 4096  # Responses API answers whose calls are kept (``store_response``)


class Simulator:
    """Everything a simulated provider remembers between requests."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self._lock = threading.Lock()
        self.requests: list[ReceivedRequest] = []
        self._kept_bytes = 0
        self.cache = PrefixCache(POLICIES[self.config.dialect], self.config.cache_ttl_s)
        self._script: deque[Reply] = deque()
        self._rng = random.Random(self.config.seed)
        self._now = self.config.start_time
        # The calls of the Responses API answers it gave, by response id (the latest
        # ``KEEP_RESPONSES``): a request that continues one (``previous_response_id``) must
        # answer them, as OpenAI's stored responses must be
        self.response_calls: OrderedDict[str, tuple[tuple[str, str], ...]] = OrderedDict()
        # The Responses API answers it gave, whole, by id (the latest ``KEEP_RESPONSES``), as
        # ``GET /v1/responses/{id}`` gives them back: whole even where a client cut its stream
        self.responses: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def store_response(self, response_id: str, calls: tuple[tuple[str, str], ...]) -> None:
        """Keep the calls (``call_id``, what OpenAI names its kind) of the answer
        ``response_id``."""
        with self._lock:
            self.response_calls[response_id] = calls
            while len(self.response_calls) > KEEP_RESPONSES:
                self.response_calls.popitem(last=False)

    def keep_response(self, response: dict[str, Any]) -> None:
        """Keep the answer ``response`` whole (``GET /v1/responses/{id}``)."""
        with self._lock:
            self.responses[response["id"]] = response
            while len(self.responses) > KEEP_RESPONSES:
                self.responses.popitem(last=False)

    def stored_response(self, response_id: str) -> dict[str, Any] | None:
        """The answer ``response_id`` as it was given, or None."""
        with self._lock:
            return self.responses.get(response_id)

    @property
    def now(self) -> float:
        """The simulated time (Unix seconds); it moves only through ``advance``."""
        return self._now

    def advance(self, seconds: float) -> float:
        """Move the simulated clock forward by ``seconds`` (>= 0); return the new time."""
        if not 0 <= seconds < math.inf:  # (NaN and infinity too: the clock must stay a time)
            raise ValueError("the clock only moves forward, by a finite time")
        with self._lock:
            if not math.isfinite(self._now + seconds) or self._now + seconds >= 2**62:
                raise ValueError("the clock would move past any time")
            self._now += seconds
            return self._now

    def reset(self) -> None:
        """Forget requests, cache, script and the answers' calls; restart the clock and the
        seeded generator."""
        with self._lock:
            self.requests.clear()
            self._kept_bytes = 0
            self.cache.clear()
            self._script.clear()
            self._rng = random.Random(self.config.seed)
            self._now = self.config.start_time
            self.response_calls.clear()
            self.responses.clear()

    def record(
        self, method: str, path: str, headers: dict[str, str], raw: bytes
    ) -> ReceivedRequest:
        """Remember a request at the current simulated time (the oldest are forgotten past
        ``KEEP_REQUESTS`` requests or ``KEEP_BYTES`` of memory held, ``BODY_COST`` per byte)."""
        with self._lock:
            received = ReceivedRequest(method, path, headers, raw, self._now)
            requests = self.requests
            requests.append(received)
            self._kept_bytes += BODY_COST * len(raw)
            drop = 0
            while len(requests) - drop > 1 and (
                len(requests) - drop > KEEP_REQUESTS or self._kept_bytes > KEEP_BYTES
            ):
                self._kept_bytes -= BODY_COST * len(requests[drop].raw)
                drop += 1
            if drop:
                del requests[:drop]
            return received

    def enqueue(self, replies: Iterable[Reply | str | Mapping[str, Any]]) -> int:
        """Queue scripted replies for the next valid chat requests; return the queue length.
        A reply may be given in its JSON form too (a string, ``{"content": …}``: as
        ``POST /_sim/script`` takes it); ``ValueError`` names what is wrong in one, and none of
        them is queued then."""
        parsed = [r if isinstance(r, Reply) else parse_script(r) for r in replies]
        with self._lock:
            self._script.extend(parsed)
            return len(self._script)

    def take_scripted(self) -> Reply | None:
        """The next scripted reply, if any."""
        with self._lock:
            return self._script.popleft() if self._script else None

    def draw_fault(self) -> str | None:
        """A fault chosen by ``fault_rate`` with the seeded generator, or None."""
        if self.config.fault_rate <= 0:
            return None
        with self._lock:
            if self._rng.random() >= self.config.fault_rate:
                return None
            return self._rng.choice(self.config.faults)

    def new_id(self, prefix: str, length: int) -> str:
        """A seeded random id such as ``chatcmpl-…`` or ``call_…``."""
        with self._lock:
            return prefix + "".join(self._rng.choices(_ID_ALPHABET, k=length))

    def new_uuid(self) -> str:
        """A seeded random UUID (DeepSeek's completion ids look like this)."""
        with self._lock:
            return str(uuid.UUID(int=self._rng.getrandbits(128), version=4))

    def process_prompt(
        self,
        tokens: Sequence[bytes],
        scope: str,
        limit: int | None = None,
        long_limit: int = 0,
        entries: Sequence[int] | None = None,
        long_ttl_s: float = LONG_TTL_S,
        minimum: int | None = None,
        bounds: Mapping[int, int] | None = None,
    ) -> CacheResult:
        """Run a prompt (its first ``limit`` tokens) through the prefix cache at the current
        simulated time (its first ``long_limit`` kept for an hour; with ``entries``, read and
        written only as prefixes ending there, and with ``bounds`` read only within Claude's
        look back of them, ``PrefixCache.process``)."""
        with self._lock:
            return self.cache.process(
                tokens, self._now, scope, limit, long_limit, entries, long_ttl_s, minimum, bounds
            )
