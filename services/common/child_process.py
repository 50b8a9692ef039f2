"""Child processes that cannot outlive their parent: the kernel's parent-death signal (Linux ``prctl``).

``kvconductor up`` starts every service, etcd included, as its child, and a service may start its own
(the store's ``mooncake_master``). When the parent dies without stopping them (SIGKILL, a closed terminal),
each child gets SIGTERM from the kernel, which a service handles as a drain: it leaves etcd at once and
exits.

The signal is set by ``setpriv --pdeathsig`` (util-linux), which then execs the command, not by a
``preexec_fn``: a ``preexec_fn`` makes Python fork instead of vfork, and a fork while the parent's gRPC
threads run (every service has them, for etcd and its own server) can abort the child: gRPC skips its fork
handlers then (seen under load in ``bench/conductor/serve.py``). The signal goes when the thread that
started the child exits; each caller starts its children from its main thread.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

SETPRIV = shutil.which("setpriv")


def dies_with_parent(command: Sequence[str]) -> list[str]:
    """``command``, run so that it gets SIGTERM when this process exits (unchanged without ``setpriv``)."""
    if SETPRIV is None:
        return list(command)
    return [SETPRIV, "--pdeathsig", "TERM", *command]
