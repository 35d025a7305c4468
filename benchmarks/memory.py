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


def pss(pid: int) -> int:
    """Proportional resident bytes of one process: a page shared by n processes counts 1/n
    (``/proc/PID/smaps_rollup``; its RSS where that file is missing)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return rss(pid)


def tree_rss(pid: int, proportional: bool = False) -> int:
    """Resident bytes of ``pid`` and all its descendants: shared pages counted per process,
    or (``proportional``) once in all (PSS), which is what a forked worker adds."""
    size = pss if proportional else rss
    kids, total, todo = _children(), 0, [pid]
    while todo:
        p = todo.pop()
        total += size(p)
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

    def __init__(self, pid: int | None = None, every: float = 0.05, proportional: bool = False):
        self.pid, self.every, self.peak = pid or os.getpid(), every, 0
        self.proportional = proportional
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid, self.proportional))
            self._stop.wait(self.every)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss(self.pid, self.proportional))


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_cpu(pid: int | None = None) -> float:
    """CPU seconds of ``pid`` (default: this process) and its living descendants (worker
    processes included, which ``time.process_time`` leaves out)."""
    pid = pid or os.getpid()
    kids, total, todo = _children(), 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_seconds(p)
        todo.extend(kids.get(p, []))
    return total


def now() -> float:
    return time.perf_counter()
