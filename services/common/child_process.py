"""Child processes that cannot outlive their parent: the kernel's parent-death signal (Linux ``prctl``).

``kvconductor up`` starts every service, etcd included, as its child, and a service may start its own
(the store's ``mooncake_master``). When the parent dies without stopping them (SIGKILL, a closed terminal),
each child gets SIGTERM from the kernel, which a service handles as a drain: it leaves etcd at once and
exits. Passed as ``preexec_fn``: it runs in the child between fork and exec and only makes one system call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def die_with_parent() -> None:
    """In the child: SIGTERM when the parent (the thread that forked it) exits; at once if it already has."""
    if _libc is None:
        return
    parent = os.getppid()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died between the fork and the call
        os.kill(os.getpid(), signal.SIGTERM)
