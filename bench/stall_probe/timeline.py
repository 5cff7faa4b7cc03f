"""Line up the stall probe's events (sitecustomize.py) in buckets of time, with the schedule of
the threads generate_stalls.py sampled (``--samples``): what each hop did, bucket by bucket.

    python bench/stall_probe/timeline.py PROBE_DIR START END [--step 0.2] [--samples FILE]

START and END are monotonic seconds (generate_stalls.py prints each round's start).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

EVENTS = ("c_req", "c_write", "recv", "parsed", "core_add", "step", "responded", "c_recv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("probe_dir", type=Path)
    parser.add_argument("start", type=float)
    parser.add_argument("end", type=float)
    parser.add_argument("--step", type=float, default=0.2)
    parser.add_argument("--samples", type=Path, help="generate_stalls.py --samples: run-queue waits per bucket")
    args = parser.parse_args()
    counts: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    busy: dict[int, float] = collections.defaultdict(float)
    for log in args.probe_dir.glob("*.log"):
        for line in log.read_text().splitlines():
            at, _pid, event, *key = line.split()
            if args.start <= float(at) < args.end:
                bucket = int((float(at) - args.start) / args.step)
                counts[bucket][event] += 1
                if event == "step":
                    busy[bucket] += float(key[0])
    samples: dict[int, list] = {}
    for line in args.samples.read_text().splitlines() if args.samples else ():
        sample = json.loads(line)
        if args.start <= sample[0] < args.end:
            samples.setdefault(int((sample[0] - args.start) / args.step), sample)
    print("t (s)  " + " ".join(f"{e:>9}" for e in EVENTS) + "  step-s  | run-queue wait s: api, client")
    for bucket in range(int((args.end - args.start) / args.step) + 1):
        now, after = samples.get(bucket), samples.get(bucket + 1)
        waits = f"{after[6] - now[6]:.3f} {after[7] - now[7]:.3f}" if now and after else ""
        row = " ".join(f"{counts[bucket][e]:9d}" for e in EVENTS)
        print(f"{bucket * args.step:5.1f}  {row}  {busy[bucket]:6.3f}  | {waits}")


if __name__ == "__main__":
    main()
