"""Small networking helpers shared by services and tests."""

import socket


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free when this call returned.

    The kernel picks the port (bind to port 0); the socket is closed before returning,
    so another process may in principle take it before the caller binds it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
