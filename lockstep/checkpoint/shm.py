"""Named POSIX shared-memory segments for the staging buffer, and cleanup of ones a crash left.

The trainer stages each save into one shared segment per rank that its writer process attaches
by name. Python's resource tracker unlinks a segment whose creator died, but a kill of the whole
process group (the tracker included) leaves it in ``/dev/shm``, holding RAM the size of a rank's
state. So segments are named ``lockstep-ckpt-<pid namespace>-<pid>-<token>`` and a new
Checkpointer unlinks those whose creating process, in this pid namespace, no longer exists.
Torch-free: the writer process imports this.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory

PREFIX = "lockstep-ckpt-"
SHM_DIR = "/dev/shm"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def create_segment(size: int) -> shared_memory.SharedMemory:
    """A new segment of ``size`` bytes named after this process (see the module docstring)."""
    name = f"{PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(4)}"
    return shared_memory.SharedMemory(name=name, create=True, size=size)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def stale_segments() -> list[str]:
    """Names of lockstep segments in ``/dev/shm`` whose creator (same pid namespace) has exited."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:  # no /dev/shm (macOS): segments there are not files and are not scanned
        return []
    namespace, stale = _pid_namespace(), []
    for name in names:
        parts = name[len(PREFIX):].split("-") if name.startswith(PREFIX) else []
        if len(parts) == 3 and parts[0] == namespace and parts[1].isdigit() and not _alive(int(parts[1])):
            stale.append(name)
    return stale


def remove_stale_segments() -> list[str]:
    """Unlink :func:`stale_segments`; returns the names removed."""
    removed = []
    for name in stale_segments():
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:  # another process removed it first
            pass
    return removed
