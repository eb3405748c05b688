"""Command-line options of ``cachegate simulate``; ``proxy.cli`` owns the parser and dispatch."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from proxy.config import url_host
from proxy.simulator.config import DIALECTS, SimConfig

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8788


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:  # the socket layer would take 106659 as 106659 - 65536
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's options to ``parser`` (defaults are ``SimConfig``'s)."""
    defaults = SimConfig()
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help="port (default: %(default)s)"
    )
    parser.add_argument(
        "--dialect",
        # "anthropic" as the config file's models.*.dialect spells it
        type=lambda value: "anthropic-compat" if value == "anthropic" else value,
        choices=DIALECTS,
        default=defaults.dialect,
        help="provider to imitate (default: %(default)s; anthropic: anthropic-compat)",
    )
    parser.add_argument(
        "--ttft-ms",
        type=float,
        default=defaults.ttft_ms,
        help="time to first token, ms (default: %(default)s)",
    )
    parser.add_argument(
        "--chunk-ms",
        type=float,
        default=defaults.chunk_ms,
        help="pause between stream chunks, ms (default: %(default)s)",
    )
    parser.add_argument(
        "--cache-ttl-s",
        type=float,
        default=defaults.cache_ttl_s,
        help="idle seconds before a prefix-cache entry expires (default: %(default)s)",
    )
    parser.add_argument(
        "--context-window",
        type=int,
        default=defaults.context_window,
        help="largest prompt accepted, in tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed for ids and faults (default: %(default)s)",
    )
    parser.add_argument(
        "--keepalive",
        action="store_true",
        help="send ': keep-alive' comments while waiting for the first token",
    )
    parser.add_argument(
        "--cache-unmarked",
        action="store_true",
        help="anthropic-compat: cache requests with no cache_control whole, as a gateway that"
        " marks them for its clients makes Claude do (default: only up to the last mark)",
    )
    parser.add_argument(
        "--refuse-stream-options",
        action="store_true",
        help="answer 422 to a request with stream_options, as Mistral does",
    )
    parser.add_argument(
        "--mistral-rules",
        action="store_true",
        help="refuse a user message right after a tool result and tool call ids other than"
        " nine letters and digits (400), as Mistral does",
    )
    parser.add_argument(
        "--gemini-rules",
        action="store_true",
        help="refuse an assistant message with an empty text (400), as Gemini's OpenAI"
        " endpoint does",
    )
    parser.add_argument(
        "--interleave-tool-calls",
        action="store_true",
        help="stream parallel tool calls' arguments interleaved by index, as some compatible"
        " servers do (default: each call whole in turn, as OpenAI)",
    )
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=defaults.fault_rate,
        help="chance of a random fault per chat request, 0..1 (default: %(default)s)",
    )


def flags() -> list[str]:
    """The long options ``add_arguments`` adds, longest first."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    names = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    return sorted(names, key=len, reverse=True)


def config_from_args(ns: argparse.Namespace) -> SimConfig:
    """A ``SimConfig`` from parsed options; ``ValueError`` names a bad value."""
    return SimConfig(
        dialect=ns.dialect,
        ttft_ms=ns.ttft_ms,
        chunk_ms=ns.chunk_ms,
        cache_ttl_s=ns.cache_ttl_s,
        context_window=ns.context_window,
        seed=ns.seed,
        keepalive=ns.keepalive,
        fault_rate=ns.fault_rate,
        cache_unmarked=ns.cache_unmarked,
        refuse_stream_options=ns.refuse_stream_options,
        mistral_rules=ns.mistral_rules,
        gemini_rules=ns.gemini_rules,
        interleave_tool_calls=ns.interleave_tool_calls,
    )


def serve(
    config: SimConfig,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Serve the simulator until interrupted (blocking), on ``sockets`` when bound already (they
    are closed at the end). Returns the exit code: 0 after Ctrl+C, 3 when start-up failed.
    Its line (``cachegate simulate: openai on http://…/v1``) comes once it accepts connections,
    as ``serve``'s does: a script may wait for it, then connect."""
    line = f"cachegate simulate: {config.dialect} on http://{url_host(host)}:{port}/v1"
    import uvicorn  # (here: the other commands build this one's options without its server)

    from proxy.serving import HttpProtocol, Server, listening_sockets, serve_until_stopped
    from proxy.simulator.app import create_simulator_app

    app = create_simulator_app(config, bind_host=host)
    if sockets is None:
        sockets = listening_sockets(host, port)
    return serve_until_stopped(
        sockets,
        lambda: Server(
            uvicorn.Config(app, log_level="warning", http=HttpProtocol),
            on_started=lambda: print(line, file=sys.stderr),
        ),
    )
