"""The server's listening socket, bound before anything loads (vLLM binds its own early too).

A port in use is a one-line `mmserve: error:` at once, not after the model has loaded, and no other
process can take the port between the start and the first request. One socket serves every API
server: the launcher binds it and hands it to each (`launcher/launcher.py`), so no process sets
`SO_REUSEPORT`, and a second server started on a port in use is refused, not given half of the
connections.
"""

from __future__ import annotations

import errno
import socket


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` (0: a port the kernel picks); ValueError when it
    cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server binds at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        taken = " (is another server running on it?)" if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}{taken}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
