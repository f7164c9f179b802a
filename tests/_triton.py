"""What the tests of the real Triton Inference Server share (tests/test_triton_server.py,
tests/test_triton_launcher.py): why they are skipped, free loopback ports, listening sockets."""

from __future__ import annotations

import socket
from pathlib import Path


def skip_reason() -> str | None:
    from infhip.runtime.serving.triton.launch import TritonNotFound, numpy_ok, pytriton_dist
    try:
        pytriton_dist()
    except TritonNotFound as e:
        return str(e)
    if not numpy_ok():
        return ("the Python-backend stub of pytriton 0.7.0 crashes on string tensors with numpy >= 2 "
                "(the triton-server extra pins numpy < 2)")
    try:
        import tritonclient.grpc  # noqa: F401
    except ImportError:
        return "tritonclient[grpc] is not installed (pip install -e \".[triton-server]\")"
    return None


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def listening(port: int) -> list[str]:
    """Local addresses of the sockets listening on port (from /proc/net/tcp{,6}, hex as the kernel writes it)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(addr)
    return found


LOOPBACK = {"0100007F",  # 127.0.0.1
             "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
             "00000000000000000000000001000000"}  # ::1
