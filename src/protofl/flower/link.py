"""What a ServerApp can tell of its federation's transport: whether the SuperLink serves the
SuperNodes over TLS and admits only authenticated ones, read from the SuperLink's command
line (the ServerApp's ancestor process under the SuperLink's default ``subprocess``
isolation; on Linux, through ``/proc``). The ServerApp logs it as its first line."""

from __future__ import annotations

from pathlib import Path

SUPERLINK = "flower-superlink"
PROC = Path("/proc")
MAX_HOPS = 8  # ancestors walked before giving up


def _cmdline(pid: int, proc: Path) -> list[str]:
    try:
        return (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int, args: list[str], proc: Path) -> int | None:
    """The process that started ``pid``: a ``--parent-pid`` it was given (Flower's SuperExec
    and apps name the SuperLink so), else its PPid."""
    for i, a in enumerate(args):
        if a == "--parent-pid" and i + 1 < len(args) and args[i + 1].isdigit():
            return int(args[i + 1])
        if a.startswith("--parent-pid=") and a.split("=", 1)[1].isdigit():
            return int(a.split("=", 1)[1])
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1]) or None
    except (OSError, ValueError, IndexError):
        return None
    return None


def superlink_args(pid: int | None = None, proc: Path = PROC) -> list[str] | None:
    """The command line of the SuperLink among ``pid``'s (default: this process's)
    ancestors, or None when none is visible (another machine or container, no /proc)."""
    import os

    pid = os.getpid() if pid is None else pid
    for _ in range(MAX_HOPS):
        args = _cmdline(pid, proc)
        if any(Path(a).name == SUPERLINK or a.endswith(f"/{SUPERLINK}") for a in args[:2]):
            return args
        parent = _parent(pid, args, proc)
        if parent is None or parent == pid:
            return None
        pid = parent
    return None


def _flag(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def transport_line(simulated: bool, args: list[str] | None) -> str:
    """One line: TLS and SuperNode authentication on or off, and how protofl knows."""
    if simulated:
        return ("federation: Flower's simulation engine, in one machine's processes (no "
                "network: TLS and SuperNode authentication do not apply)")
    if args is None:
        return ("federation: TLS and SuperNode authentication unknown (the SuperLink's command "
                "line is not visible from this process; check how it was started)")
    tls = "on" if not _flag(args, "--insecure") else "OFF (--insecure)"
    auth = "on" if _flag(args, "--enable-supernode-auth") else "OFF"
    return (f"federation: TLS {tls}, SuperNode authentication {auth} (from the SuperLink's "
            "command line)")
