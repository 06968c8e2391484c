"""Child processes: those that must not outlive their parent (the engine process when the API
server dies, however it dies; the tensor-parallel workers when the engine process dies), and
finding a process's children (the tests and benchmarks that kill them)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux; elsewhere nothing),
    and exit now if `parent_pid` is already gone (it died before this call)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: not Linux
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; zombies included)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found
