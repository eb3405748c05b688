"""Dockerfile, docker-compose.yml and provisioning files keep the ports, volumes and health check
they promise. No container engine runs here, so the files are read, not run.

YAML is parsed by a small reader for the subset these files use (block mappings and sequences,
plain or double-quoted scalars); PyYAML is not a dependency of cachegate.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEY = re.compile(r"^([A-Za-z0-9_.-]+):(?:\s+(.*))?$")


def scalar(text: str) -> str:
    if text.startswith('"'):
        value = json.loads(text)
        assert isinstance(value, str)
        return value
    if text[:1] in ("'", "[", "{", "&", "*", "|", ">") or " #" in text:
        raise ValueError(f"outside the YAML subset: {text!r}")
    return text


def parse_yaml(text: str) -> Any:
    """Parse the block-style YAML subset used by the deploy files."""
    lines: list[tuple[int, str]] = []
    for raw in text.splitlines():
        content = raw.strip()
        if content and not content.startswith("#"):
            lines.append((len(raw) - len(raw.lstrip(" ")), content))
    value, end = _block(lines, 0)
    if end != len(lines):
        raise ValueError(f"unexpected indentation at {lines[end]!r}")
    return value


def _block(lines: list[tuple[int, str]], i: int) -> tuple[Any, int]:
    indent, content = lines[i]
    if content == "-" or content.startswith("- "):
        return _sequence(lines, i, indent)
    return _mapping(lines, i, indent)


def _mapping(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent:
        match = KEY.match(lines[i][1])
        if match is None:
            raise ValueError(f"expected a key at {lines[i]!r}")
        key, rest = match.group(1), match.group(2)
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        i += 1
        if rest:
            out[key] = scalar(rest)
        elif i < len(lines) and (
            lines[i][0] > indent or (lines[i][0] == indent and lines[i][1].startswith("- "))
        ):
            out[key], i = _block(lines, i)
        else:
            out[key] = None
    return out, i


def _sequence(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
        item = lines[i][1][2:].strip()
        if KEY.match(item) or item.endswith(":"):
            # "- key: value" opens a mapping whose keys sit two columns further in.
            lines[i] = (indent + 2, item)
            value, i = _mapping(lines, i, indent + 2)
            out.append(value)
        else:
            out.append(scalar(item))
            i += 1
    return out, i


def load_yaml(relative: str) -> Any:
    return parse_yaml((ROOT / relative).read_text(encoding="utf-8"))


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    logical = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, args = line.partition(" ")
            out.append((instruction.upper(), args.strip()))
    return out


def instructions(name: str) -> list[str]:
    return [args for instruction, args in dockerfile() if instruction == name]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = load_yaml("docker-compose.yml")
    assert isinstance(loaded, dict)
    return loaded


def test_yaml_reader_handles_the_subset_and_refuses_the_rest() -> None:
    text = 'a:\n  b: "x: y"\n  c:\n    - 1\n    - k: v\n      w: z\nd:\n- e\n'
    assert parse_yaml(text) == {"a": {"b": "x: y", "c": ["1", {"k": "v", "w": "z"}]}, "d": ["e"]}
    with pytest.raises(ValueError):
        parse_yaml("a: [1, 2]\n")
    with pytest.raises(ValueError):
        parse_yaml("a: 1\na: 2\n")


def test_every_published_port_is_bound_to_loopback(compose: dict[str, Any]) -> None:
    published = [
        port for service in compose["services"].values() for port in service.get("ports", [])
    ]
    assert published
    assert all(port.startswith("127.0.0.1:") for port in published), published
    assert compose["services"]["cachegate"]["ports"] == ["127.0.0.1:8787:8787"]


def test_a_stop_gives_the_event_logs_writer_its_time(compose: dict[str, Any]) -> None:
    """Docker's default 10 s before SIGKILL is less than the 5 s grace period and the writer's
    30 s to write what is queued: the lines of answered exchanges went with the container."""
    from proxy.app import WRITER_DRAIN_S

    grace = compose["services"]["cachegate"]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) >= 5 + WRITER_DRAIN_S


def test_cachegate_service_builds_the_image_with_config_and_log_volumes(
    compose: dict[str, Any],
) -> None:
    service = compose["services"]["cachegate"]
    assert service["build"] == "."
    targets = {volume.split(":")[1]: volume for volume in service["volumes"]}
    assert targets["/config"] == "./config:/config:ro"
    assert targets["/logs"].startswith("cachegate-logs:")
    assert "cachegate-logs" in compose["volumes"]


def test_prometheus_scrapes_cachegate(compose: dict[str, Any]) -> None:
    service = compose["services"]["prometheus"]
    assert "./config/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in service["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in service["command"]
    assert service["depends_on"]["cachegate"]["condition"] == "service_healthy"
    config = load_yaml("config/prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["cachegate:8787"]}]


def test_grafana_loads_the_provisioned_datasource_and_dashboards(compose: dict[str, Any]) -> None:
    service = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == "./dashboards/provisioning"
    assert (ROOT / "dashboards/provisioning").is_dir()
    datasource = load_yaml("dashboards/provisioning/datasources/prometheus.yml")
    (source,) = datasource["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in compose["services"]["prometheus"]["ports"]
    providers = load_yaml("dashboards/provisioning/dashboards/cachegate.yml")
    (provider,) = providers["providers"]
    path = provider["options"]["path"]
    assert Path(mounts[path]) == Path("./dashboards")
    assert sorted(p.name for p in (ROOT / "dashboards").glob("*.json")) == [
        "cachegate.json",
        "laptop.json",
    ]


def test_dockerfile_base_image_and_install() -> None:
    assert instructions("FROM") == ["python:3.11-slim"]
    assert any("pip install --no-cache-dir ." in args for args in instructions("RUN"))


def test_dockerfile_runs_as_a_non_root_user() -> None:
    users = instructions("USER")
    assert users
    assert users[-1] not in ("root", "0", "0:0")
    # The user runs the command: nothing after the last USER switches back.
    order = [instruction for instruction, _ in dockerfile()]
    assert order.index("CMD") > max(i for i, name in enumerate(order) if name == "USER")


def test_dockerfile_declares_volumes_port_and_healthcheck() -> None:
    (volume,) = instructions("VOLUME")
    assert set(json.loads(volume)) == {"/config", "/logs"}
    assert instructions("EXPOSE") == ["8787"]
    (healthcheck,) = instructions("HEALTHCHECK")
    options, _, command = healthcheck.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    argv = json.loads(command)
    assert argv[0] == "python"
    assert "http://127.0.0.1:8787/healthz" in argv[-1]


def test_the_healthcheck_reaches_cachegate_whatever_proxy_the_container_is_given() -> None:
    """The healthcheck's command, run as Docker runs it, against a server on this machine: with
    ``http_proxy`` set (Docker's client ``proxies`` setting gives containers one) the check went
    to that proxy, failed, and compose never started what waits for a healthy cachegate."""
    import os
    import subprocess
    import sys

    from proxy.serving import ServerThread

    async def healthz(scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b'{"status":"ok"}'})  # type: ignore[operator]

    (healthcheck,) = instructions("HEALTHCHECK")
    argv = json.loads(healthcheck.partition("CMD ")[2])
    with ServerThread(healthz) as server:  # type: ignore[arg-type]
        port = server.url.rsplit(":", 1)[1]
        command = [sys.executable, *argv[1:-1], argv[-1].replace(":8787/", f":{port}/")]
        env = {**os.environ, "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
        env.pop("no_proxy", None)
        env.pop("NO_PROXY", None)
        assert subprocess.run(command, env=env, timeout=30).returncode == 0


def test_dockerfile_command_serves_on_all_interfaces_of_the_container() -> None:
    (cmd,) = instructions("CMD")
    argv = json.loads(cmd)
    assert argv[:2] == ["sh", "-c"]
    script = argv[2]
    serve = shlex.split(script.rpartition("exec ")[2])
    assert serve == [
        "cachegate",
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "8787",
        "--log-dir",
        "/logs",
    ]
    assert "[ -f /config/cachegate.toml ]" in script
    assert "export CACHEGATE_CONFIG=/config/cachegate.toml" in script


def test_the_reports_run_inside_the_image_read_the_served_logs() -> None:
    """``docker exec … cachegate sessions list`` reads CACHEGATE_LOG_DIR: it must name the
    directory the served command writes (else it looks for /logs/cachegate-logs)."""
    (env,) = instructions("ENV")
    settings = dict(pair.split("=", 1) for pair in shlex.split(env))
    (cmd,) = instructions("CMD")
    serve = shlex.split(json.loads(cmd)[2].rpartition("exec ")[2])
    assert settings["CACHEGATE_LOG_DIR"] == serve[serve.index("--log-dir") + 1] == "/logs"
