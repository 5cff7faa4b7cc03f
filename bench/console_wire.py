"""What the attached console costs, measured from outside it: its CPU from /proc/PID/stat, the
bytes it writes to its terminal read by our own pty reader (what an SSH link carries), and how
many of those bytes repaint exactly what that screen position already showed.

The engine runs headless (`eagleops run --no-tui`, its own process: it runs whether or not a
console watches), 8 datasets each fed about 10 completions/s by the loopback fault server with
2% faults, the GPU pane fed by the synthetic reader; `eagleops attach` runs in a pty of ours at
120x40 (TERM=xterm-256color), default 1 s refresh. Baseline: the same console process idle on a
finished run (nothing changes on screen), in the same run.

    python bench/console_wire.py [--seconds 30] [--size 120x40]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.console_overhead import _env, _run_file
from eagleops.pipeline.servers.launch import start_server

_TICKS = os.sysconf("SC_CLK_TCK")
_MOVE = re.compile(rb"\x1b\[(\d+);(\d+)H")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc, not from the process's own figures."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


class PtyReader:
    """The console's terminal: a pty whose master we drain, every byte timestamped."""

    def __init__(self, argv: list[str], env: dict, columns: int, rows: int):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.process = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env={**env, "TERM": "xterm-256color"}, start_new_session=True
        )
        os.close(slave)
        self.chunks: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    data = os.read(self.master, 65536)
                except OSError:
                    return
                if not data:
                    return
                self.chunks.append((time.monotonic(), data))

    def between(self, t0: float, t1: float) -> bytes:
        return b"".join(data for at, data in self.chunks if t0 <= at < t1)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self._stop.set()
        with contextlib.suppress(OSError):
            os.close(self.master)


def repaint_profile(wire: bytes) -> tuple[dict[int, int], dict[int, int]]:
    """(per screen row: bytes that rewrite exactly what their position last got, all bytes).
    Textual moves the cursor (CSI row;col H) before each run of cells it writes."""
    last: dict[tuple[int, int], bytes] = {}
    unchanged: collections.Counter[int] = collections.Counter()
    per_row: collections.Counter[int] = collections.Counter()
    moves = list(_MOVE.finditer(wire))
    for move, following in zip(moves, [*moves[1:], None]):
        payload = wire[move.end() : following.start() if following else len(wire)]
        position = (int(move[1]), int(move[2]))
        per_row[position[0]] += len(payload) + len(move[0])
        if last.get(position) == payload:
            unchanged[position[0]] += len(payload) + len(move[0])
        last[position] = payload
    return dict(unchanged), dict(per_row)


def measure(reader: PtyReader, seconds: float) -> tuple[float, float, dict[int, int], dict[int, int]]:
    """(console CPU share of one core, bytes/s, unchanged-repaint bytes, bytes per row) over ``seconds``."""
    cpu0, t0 = cpu_seconds(reader.process.pid), time.monotonic()
    time.sleep(seconds)
    cpu1, t1 = cpu_seconds(reader.process.pid), time.monotonic()
    wire = reader.between(t0, t1)
    unchanged, per_row = repaint_profile(wire)
    return (cpu1 - cpu0) / (t1 - t0), len(wire) / (t1 - t0), unchanged, per_row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--size", default="120x40")
    args = parser.parse_args()
    columns, rows = (int(x) for x in args.size.split("x"))
    work = Path(tempfile.mkdtemp(prefix="eagleops-wire-"))
    env = _env(work)
    server = ["eagleops.pipeline.testservers.fault", "--tokens", "200", "--fault-rate", "0.02"]
    with start_server(server, work / "port", log_path=work / "server.log") as port:
        run = _run_file(work, f"http://127.0.0.1:{port}/v1", "wire")
        engine = subprocess.Popen([sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        reader = None
        try:
            time.sleep(3)
            sockets = list((work / "rt").rglob("*.sock"))
            reader = PtyReader([sys.executable, "-m", "eagleops", "attach", str(sockets[0])], env, columns, rows)
            time.sleep(5)  # imports, first paint
            busy = measure(reader, args.seconds)
            subprocess.run([sys.executable, "-m", "eagleops", "pause", "--socket", str(sockets[0])], env=env, capture_output=True)
            time.sleep(3)
            idle = measure(reader, args.seconds / 3)  # the same console, nothing moving but the clock
        finally:
            if reader is not None:
                reader.close()
            engine.send_signal(signal.SIGTERM)
            engine.wait(30)
    cpu, rate, unchanged, per_row = busy
    print(
        f"## Console on the wire ({args.seconds:.0f} s, 8 busy datasets, 2% faults, synthetic GPU, 1 s refresh, {args.size}; from /proc and our pty)\n"
    )
    print("| console | CPU (share of one core) | written to the terminal |")
    print("|---|---|---|")
    print(f"| attached, 8 datasets generating | {100 * cpu:.2f}% | {rate / 1024:.2f} KB/s |")
    print(f"| attached, every dataset paused (baseline: only the clock moves) | {100 * idle[0]:.2f}% | {idle[1] / 1024:.2f} KB/s |")
    total = rate * args.seconds
    print(f"\nBytes that repaint exactly what their screen position already showed: {100 * sum(unchanged.values()) / max(1.0, total):.1f}%"
          + (" (rows " + ", ".join(f"{r}: {n / args.seconds:.0f} B/s" for r, n in sorted(unchanged.items(), key=lambda kv: -kv[1])[:6]) + ")" if unchanged else ""))  # fmt: skip
    top = sorted(per_row.items(), key=lambda kv: -kv[1])[:8]
    print("Bytes per screen row, most first: " + ", ".join(f"row {r} {n / args.seconds:.0f} B/s" for r, n in top))


if __name__ == "__main__":
    main()
