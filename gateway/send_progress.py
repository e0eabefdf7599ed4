"""Whether a connection's peer takes what we send: the kernel's own counts, read per connection.

A client that stops reading is not seen by the writer at once: the kernel's send buffer takes
what the peer does not, and on Linux it grows by itself up to net.ipv4.tcp_wmem's maximum (4
MiB by default), a whole long stream of tokens. Only then does the transport pause. What does
show at once is the peer's acknowledgements: its kernel acknowledges bytes only as far as its
receive buffer has room, which its reader makes. So a connection has stalled when bytes wait
(in the kernel or the transport) and the bytes acknowledged have not moved.
"""

from __future__ import annotations

import array
import fcntl
import socket
import struct
import termios

# struct tcp_info (linux/tcp.h): 8 one-byte fields, 24 u32, then u64 pacing_rate,
# max_pacing_rate, bytes_acked (Linux >= 4.1)
BYTES_ACKED_OFFSET = 120
TCP_INFO_LENGTH = 256  # room for the whole struct; the kernel returns what it has


def peer_progress(sock) -> tuple[int, int] | None:
    """(bytes the peer has acknowledged, bytes sent to it and not yet acknowledged) of a TCP
    socket (or uvloop's stand-in for one), or None where the kernel does not tell (not Linux,
    too old a kernel, not TCP, already closed)."""
    tcp_info = getattr(socket, "TCP_INFO", None)
    if tcp_info is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, TCP_INFO_LENGTH)
        queued = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)  # SIOCOUTQ
    except (OSError, ValueError):
        return None
    if len(info) < BYTES_ACKED_OFFSET + 8:
        return None
    (acked,) = struct.unpack_from("=Q", info, BYTES_ACKED_OFFSET)
    return acked, queued[0]
