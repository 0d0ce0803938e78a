"""The server's listening socket, bound before uvicorn starts: a taken port or a wrong host is
an exception the caller can catch and explain, never a log line after "startup complete"."""

from __future__ import annotations

import errno
import socket

from guard_server.errors import AddressError, PortInUseError

__all__ = ["listening_socket", "server_socket"]


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; PortInUseError if taken."""
    # Bound here, in the caller's thread, so a taken port is an exception the caller can
    # catch, not a log line in a thread that then dies.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio sets TCP_NODELAY on accepted sockets only when the listening one
    # says IPPROTO_TCP; with proto 0 every kept-alive scrape waited ~40 ms on delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind right after a restart
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(host, port) from exc
        raise
    return sock


def server_socket(host: str, port: int) -> socket.socket:
    """`listening_socket` for `guard serve`: every way the address can be wrong is an
    AddressError that names the setting and what to do."""
    if not 0 <= port <= 65535:
        raise AddressError("port", port, "is not a TCP port", "give one from 1 to 65535",
                           invalid=True)
    try:
        return listening_socket(host, port)
    except PortInUseError as exc:
        raise AddressError("port", port, f"is in use on {host}", "choose another port, or stop "
                           f"the process that holds it (ss -ltnp 'sport = :{port}')") from exc
    except socket.gaierror as exc:  # not an IP address, and no name that resolves
        raise AddressError("host", host, f"is not an address ({exc.strerror})", "give an IP "
                           "address of this machine (127.0.0.1, or 0.0.0.0 for every "
                           "interface) or a name that resolves to one", invalid=True) from exc
    except OSError as exc:
        if exc.errno == errno.EACCES:
            raise AddressError("port", port, "needs privileges to listen on",
                               "choose a port from 1024 up") from exc
        # EADDRNOTAVAIL: an address, but none of this machine's interfaces has it.
        raise AddressError("host", host, f"cannot be listened on ({exc.strerror})",
                           "give an address of this machine (127.0.0.1, or 0.0.0.0 for every "
                           "interface)") from exc
