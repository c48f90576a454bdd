"""Where a py-spy profile's time went: inclusive and self shares per function.

A flame graph is for browsing; the bottleneck list in BENCHMARKS.md wants numbers that
can be quoted. Reads py-spy's collapsed-stack output (``--format raw``, as written by the
benchmarks' ``--profile``), one ``frame;frame;... count`` per line.

    python benchmarks/profile_summary.py PROFILE.txt [--top 30] [--match orchestrator]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
# "name (path/to/file.py:123)" -> "file.py:name"; the line number would split a function.
_FRAME = re.compile(r"^(?P<name>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frame_label(frame: str) -> str:
    match = _FRAME.match(frame)
    if not match:
        return frame
    path = match["file"]
    for marker in ("site-packages/", "/orchestrator/", "lib/python3."):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "/orchestrator/":
                path = "orchestrator/" + path
            break
    return f"{path}:{match['name']}"


def summarise(path: Path) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    """Total samples, inclusive and self counts per function, and samples per thread."""
    total = 0
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        match = _LINE.match(line.strip())
        if not match:
            continue
        count = int(match["count"])
        raw = [f for f in match["stack"].split(";") if f]
        if raw and raw[0].startswith("thread ("):
            # --threads: "thread (123): MainThread" or "thread (124): Thread-1 (target)".
            threads[raw.pop(0).split("): ", 1)[-1]] += count
        frames = [frame_label(f) for f in raw]
        total += count
        for label in set(frames):
            inclusive[label] += count
        if frames:
            own[frames[-1]] += count
    return total, inclusive, own, threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--match", help="only functions whose label contains this")
    args = parser.parse_args(argv)
    total, inclusive, own, threads = summarise(args.profile)
    print(f"{total:,} samples (active threads only)")
    if threads:
        print("\nby thread:")
        for label, count in threads.most_common():
            print(f"  {100 * count / total:5.1f}%  {label}")
    for title, counter in (("inclusive", inclusive), ("self", own)):
        print(f"\n{title}:")
        shown = 0
        for label, count in counter.most_common():
            if args.match and args.match not in label:
                continue
            print(f"  {100 * count / total:5.1f}%  {label}")
            shown += 1
            if shown >= args.top:
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
