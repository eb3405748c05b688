"""The benchmark's server processes: start, pin, wait for, measure (CPU, RSS) and stop them."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HAVE_TASKSET = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid``, from ``schedstat`` (ns resolution), else ``stat`` ticks."""
    total = 0
    found = False
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(path) as f:
                total += int(f.read().split()[0])
            found = True
    if found:
        return total / 1e9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmRSS")


def peak_rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmHWM")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(path) as f:
            out.extend(int(x) for x in f.read().split())
    return out


@dataclass
class Server:
    """One server process listening on ``port``; ``pid`` is the server itself (not a wrapper)."""

    name: str
    port: int
    popen: subprocess.Popen[bytes]
    log_path: Path
    wrapped: bool = False  # started under a profiler: the server is the wrapper's child
    pid: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def rss(self) -> int:
        return rss_kib(self.pid)

    def wait_ready(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        request = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode()
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(request)
                    if s.recv(64).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{self.name} not ready after {timeout_s}s: {self.log_tail()}")
        if self.wrapped:
            for _ in range(50):
                kids = _children(self.popen.pid)
                if kids:
                    self.pid = kids[0]
                    break
                time.sleep(0.1)
        else:
            self.pid = self.popen.pid

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        target = self.pid if self.wrapped and self.pid else self.popen.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGINT)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def start(
    name: str,
    argv: list[str],
    *,
    port: int,
    cpu: int | None,
    log_dir: Path,
    env: dict[str, str] | None = None,
    wrapper: list[str] | None = None,
) -> Server:
    """Start ``argv`` pinned to ``cpu`` (``taskset`` when present), output to a log file."""
    cmd = list(argv)
    if wrapper:
        cmd = [*wrapper, "--", *cmd]
    if cpu is not None and HAVE_TASKSET:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    log_path = log_dir / f"{name}.log"
    out = open(log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
    popen = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        preexec_fn=_die_with_parent if _PRCTL is not None else None,
    )
    out.close()
    return Server(name, port, popen, log_path, wrapped=bool(wrapper))


def _load_prctl() -> Any:
    """libc's ``prctl`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: a SIGTERM when the runner dies however it dies (killed with
    SIGKILL, or a SIGTERM its handler could not turn into a clean stop): no server is left
    listening, to disturb the next run."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def stop_on_sigterm() -> None:
    """A SIGTERM to the runner stops it as Ctrl+C does: its ``finally`` blocks stop the servers
    and remove its working directory (Python runs none of them on a SIGTERM by default)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def bench_env() -> dict[str, str]:
    """The environment for servers: no cachegate overrides, no provider key, unbuffered output."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CACHEGATE_") and k not in ("OPENAI_API_KEY", "DATABASE_URL")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


def python() -> str:
    return sys.executable
