"""Resident memory of a process and its descendants, read from /proc (Linux)."""

from __future__ import annotations

import os
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def rss(pid: int) -> int:
    """Resident bytes of one process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (shared pages counted per process)."""
    kids, total, todo = _children(), 0, [pid]
    while todo:
        p = todo.pop()
        total += rss(p)
        todo.extend(kids.get(p, []))
    return total


def peak_self_rss() -> int:
    """This process's peak resident bytes so far (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class TreeSampler:
    """Samples the process tree's RSS in a thread; ``peak`` is the largest sum seen."""

    def __init__(self, pid: int | None = None, every: float = 0.05):
        self.pid, self.every, self.peak = pid or os.getpid(), every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.every)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss(self.pid))


def now() -> float:
    return time.perf_counter()
