"""Start one of our loopback servers as a child process and wait until it answers; it dies with
us (a tether ends its process group when this process dies, however it dies)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from eagleops.pipeline.errors import RunError
from eagleops.pipeline.servers.groups import stop_group
from eagleops.pipeline.servers.tether import tethered

__all__ = ["start_server"]


@contextlib.contextmanager
def start_server(argv: list[str], port_file: Path, *, log_path: Path, timeout_s: float = 120.0) -> Iterator[int]:
    """Start one of our loopback servers as a subprocess; yield its port; stop it after."""
    port_file.unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            tethered([sys.executable, "-m", *argv, "--port", "0", "--port-file", str(port_file)]),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopping it stops whatever it started
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if proc.poll() is not None:
                raise RunError(f"server exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise RunError(f"server did not start in {timeout_s:.0f}s; see {log_path}")
            time.sleep(0.05)
        port = int(port_file.read_text())
        while True:  # the port file is written once listening; health confirms the app is routed
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RunError(f"server on port {port} never answered /health ({exc}); see {log_path}") from None
                time.sleep(0.05)
        yield port
    finally:
        stop_group(proc)
