"""Start ``tailserve serve`` in a child process for a bench run, and stop it afterwards."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx

from tailserve.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc: subprocess.Popen, url: str, timeout_s: float) -> str:
    """Poll ``url``/health: "ok" once it answers 200, "exited" if the process ends first,
    "timeout" after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "exited"
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return "ok"
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return "timeout"


class LocalServer:
    """``with LocalServer(["--speculative-model", "builtin"]) as srv: srv.url``"""

    def __init__(self, args: Sequence[str] = (), startup_timeout_s: float = 180.0,
                 cpus: Sequence[int] | None = None) -> None:
        self.args = list(args)
        # cpus: the cores the server may run on (os.sched_setaffinity in the child before it
        # starts, so its thread pools size themselves to them); None: whatever this process has.
        self.cpus = None if cpus is None else sorted(set(cpus))
        self.port, self.h2_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.url_h2 = f"http://127.0.0.1:{self.h2_port}"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in __exit__, read on a failed start

    @classmethod
    def from_string(cls, args: str) -> LocalServer:
        return cls(shlex.split(args))

    # A free port can be taken by another process between free_port() and the server's bind
    # (seen with tests in parallel): a start that fails on that alone is tried on new ports.
    PORT_TRIES = 3

    def __enter__(self) -> LocalServer:
        for attempt in range(self.PORT_TRIES):
            if attempt:
                self.port, self.h2_port = free_port(), free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                self.url_h2 = f"http://127.0.0.1:{self.h2_port}"
                self._log.seek(0)
                self._log.truncate()
            if self._start():
                return self
        raise ConfigError(f"tailserve serve {' '.join(self.args)} found no free port in {self.PORT_TRIES} tries: "
                          f"{self._tail()}")

    def _start(self) -> bool:
        """Start and wait for /health: True once it answers, False when the port was taken."""
        cmd = [sys.executable, "-m", "tailserve", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--http2-port", str(self.h2_port), *self.args]
        cpus = self.cpus
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus and hasattr(os, "sched_setaffinity") else None
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=pin,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        state = wait_for_health(self.proc, self.url, self.startup_timeout_s)
        if state == "ok":
            return True
        if state == "exited":
            if "Address already in use" in self._tail():
                return False
            raise ConfigError(f"tailserve serve {' '.join(self.args)} exited during start-up: {self._tail()}")
        self.__exit__(None, None, None)
        raise ConfigError(f"tailserve serve did not answer /health within {self.startup_timeout_s:.0f} s")

    def output(self) -> str:
        """Everything the server printed so far (its log goes to a file, never a pipe that
        a chatty server could fill)."""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def _tail(self) -> str:
        lines = self.output().strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
