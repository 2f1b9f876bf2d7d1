"""Local TCP ports for the processes that ``lmsp up`` and the benchmarks start themselves."""

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
