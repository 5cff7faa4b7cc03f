"""Which thread waits for a core? Every 10 ms, for each thread of a running generate_stalls.py
(the client), vLLM's API process and everything under it (engine core, model worker): the time it
has run and the time it has waited runnable (/proc/<pid>/task/<tid>/schedstat), and the CPU it was
last on. Then, for any window of monotonic time, each thread's run and wait per second.

    python bench/stall_probe/threads.py record OUT.json SECONDS    # start it beside generate_stalls.py
    python bench/stall_probe/threads.py show OUT.json START:END ...
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import psutil


def _find() -> dict[str, int]:
    """The client and the server's processes, once the server is up (engine core and worker)."""
    while True:
        client, servers = None, []
        for proc in psutil.process_iter(["cmdline"]):
            line = " ".join(proc.info["cmdline"] or [])
            if "generate_stalls.py" in line and "timeout" not in line:
                client = proc.pid
            elif "vllm.entrypoints.openai.api_server" in line:
                servers.append(proc)  # the API process, and the tether that runs it
        pids = {proc.pid for proc in servers}
        api = next((proc for proc in servers if proc.ppid() in pids), None)
        try:
            children = api.children(recursive=True) if api else []
            if client and len(children) >= 2:
                return {"client": client, "api": api.pid, **{f"{c.name()}-{c.pid}": c.pid for c in children}}  # type: ignore[union-attr]
        except psutil.Error:
            pass
        time.sleep(0.5)


def _children(roles: dict[str, int]) -> dict[str, int]:
    try:
        children = psutil.Process(roles["api"]).children(recursive=True)
    except psutil.Error:  # the server has stopped
        return roles
    return {"client": roles["client"], "api": roles["api"], **{f"{c.name()}-{c.pid}": c.pid for c in children}}


def record(out: str, seconds: float) -> None:
    roles, found_at = _find(), time.monotonic()
    names: dict[str, str] = {}
    rows = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now, row = time.monotonic(), {}
        if now - found_at > 1.0:  # the engine's worker starts after its core: look again
            roles, found_at = _children(roles), now
        for role, pid in roles.items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    run, wait, _ = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
                    cpu = int(open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[36])
                    names.setdefault(tid, f"{role}:{open(f'/proc/{pid}/task/{tid}/comm').read().strip()}")
                    row[tid] = (int(run), int(wait), cpu)
                except (OSError, ValueError):
                    pass  # a thread that ended between the listing and the read
        rows.append((now, row))
        time.sleep(0.01)
    with open(out, "w") as f:
        json.dump({"names": names, "rows": rows}, f)
    print(f"{len(rows)} samples of {len(names)} threads: {sorted(set(names.values()))}", file=sys.stderr)


def show(path: str, windows: list[str]) -> None:
    with open(path) as f:
        data = json.load(f)
    for window in windows:
        start, end = map(float, window.split(":"))
        rows = [r for r in data["rows"] if start <= r[0] <= end]
        (first_at, first), (last_at, last) = rows[0], rows[-1]
        span = last_at - first_at
        cpus: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        for _, row in rows:
            for tid, value in row.items():
                cpus[tid][value[2]] += 1
        print(f"{window} ({span:.1f} s): thread, runs s/s, waits runnable s/s, samples on each CPU")
        found = []
        for tid, (run, wait, _) in last.items():
            if tid in first:
                ran, waited = (run - first[tid][0]) / 1e9 / span, (wait - first[tid][1]) / 1e9 / span
                if ran > 0.01 or waited > 0.01:
                    found.append((ran, waited, data["names"][tid], dict(cpus[tid])))
        for ran, waited, name, on in sorted(found, reverse=True):
            print(f"  {name:40s} {ran:6.3f} {waited:6.3f}  {on}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        record(sys.argv[2], float(sys.argv[3]))
    elif sys.argv[1:2] == ["show"]:
        show(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
