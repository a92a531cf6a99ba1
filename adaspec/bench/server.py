"""Start, health-check and stop one `adaspec serve` process for a sweep arm."""
from __future__ import annotations

import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from adaspec.errors import AdaspecError


class ServerStartError(AdaspecError):
    """The server process died or never answered /health."""


def free_port() -> int:
    # Bind to port 0 and release it: the kernel's pick is free at this instant (small race,
    # acceptable for loopback test servers).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """`python -m adaspec.cli serve MODEL ...` on a free loopback port; output goes to a log file
    (a pipe nobody reads would fill and block the server)."""

    def __init__(self, model: str, spec_config: dict | None, log_path: Path, extra_args: list[str] | None = None,
                 startup_timeout: float = 600.0, launcher: list[str] | None = None):
        self.model = model
        self.spec_config = spec_config
        self.log_path = Path(log_path)
        self.extra_args = list(extra_args or [])
        self.startup_timeout = startup_timeout
        # What runs `serve ...`; tests swap in a fake server with the same arguments.
        self.launcher = list(launcher or [sys.executable, "-m", "adaspec.cli"])
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # seconds from launch to the first healthy /health (start())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = self.launcher + ["serve", self.model, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.spec_config is not None:
            cmd += ["--speculative-config", json.dumps(self.spec_config)]
        return cmd + self.extra_args

    def command_line(self) -> str:
        """The command as one pasteable shell line (the JSON of --speculative-config quoted)."""
        return shlex.join(self.command())

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {self.command_line()}\n".encode())
        log.flush()
        # New session: SIGTERM reaches the server only, never the sweep's own terminal group.
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        t0 = time.monotonic()
        try:
            self._wait_healthy()
        except BaseException:  # SIGTERM (SweepStopped) or Ctrl-C while it starts: it must not outlive us
            self.stop()
            raise
        # load, graph capture, cost profiling, warm-up: what each arm's start takes from a budget
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {self.proc.returncode} before answering /health; "
                    f"last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"server did not answer {self.url}/health within {self.startup_timeout:.0f} s; "
            f"last lines of {self.log_path}:\n{tail(self.log_path)}"
        )

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM (the server drains), then SIGKILL if it is still alive after `grace` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
