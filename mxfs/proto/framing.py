"""Framing of control messages on a Unix stream socket.

A message is a 12-byte header (magic b"MXFS", protocol version, number of
descriptors, payload length; network order) and a JSON object as payload.
Descriptors travel as SCM_RIGHTS on the header's sendmsg, so they arrive with
the message that names them (layouts of chunk files for direct I/O).

Requests carry "op" and "id"; replies carry the same "id" and "ok": true with
the op's fields, or "ok": false with "errno" and "error".
"""

from __future__ import annotations

import array
import errno
import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

MAGIC = b"MXFS"
VERSION = 1
HEADER = struct.Struct("!4sHHI")
MAX_PAYLOAD = 1 << 20
MAX_FDS = 64
# Requests nest a few levels (lists of keys, layouts in replies); deeper is an attack.
MAX_DEPTH = 16
# A request's lists and objects hold at most this many values in all (a batch of 4096
# keys and their data is 8192): a 1 MiB payload of empty objects costs tens of MiB.
MAX_VALUES = 20_000
# Digits of one integer at most (a signed 64-bit one has 19, and a sign): 243 integers
# of 4,299 digits, a 1 MiB payload, held the daemon's thread 17-35 ms to parse.
MAX_INT_CHARS = 20
MAX_FLOAT_CHARS = 32  # characters of a number with a fraction or exponent (a double: 24)


class ProtocolError(Exception):
    """The peer sent something that is not a valid message; the connection is dropped."""


def encode(msg: dict[str, Any], nfds: int = 0) -> bytes:
    payload = json.dumps(msg, separators=(",", ":")).encode()
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"message of {len(payload)} bytes is over {MAX_PAYLOAD}")
    if nfds > MAX_FDS:
        raise ProtocolError(f"{nfds} descriptors is over {MAX_FDS}")
    return HEADER.pack(MAGIC, VERSION, nfds, len(payload)) + payload


def parse_header(raw: bytes) -> tuple[int, int, int]:
    """(version, descriptor count, payload length) of a header, or ProtocolError."""
    magic, version, nfds, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("bad magic: not an mxfs control message")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this is {VERSION})")
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"message of {length} bytes is over {MAX_PAYLOAD}")
    if nfds > MAX_FDS:
        raise ProtocolError(f"{nfds} descriptors is over {MAX_FDS}")
    return version, nfds, length


def decode_payload(raw: bytes, max_values: int | None = None) -> dict[str, Any]:
    """A payload as a dict; ProtocolError if it is not one, nests too deep, or (with
    `max_values`: the daemon reading requests) holds too many values: counted first
    from the bytes that open or separate values, which bound them, so that a payload
    of a million empty lists costs a count, not a parse (100 ms of the daemon's
    thread, and 22 times the payload's size in memory)."""
    if max_values is not None and \
            raw.count(b",") + raw.count(b"[") + raw.count(b"{") > 2 * max_values:
        raise ProtocolError(f"payload holds over {max_values} values")
    try:
        msg = loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"payload is not JSON ({e})") from None
    except RecursionError:
        raise ProtocolError(f"payload nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(msg, dict):
        raise ProtocolError("payload is not a JSON object")
    depth, values = _shape(msg)
    if depth > MAX_DEPTH or max_values is not None and values > max_values:
        del msg  # (not held by the error's traceback while the refusal is sent)
        raise ProtocolError(f"payload nests deeper than {MAX_DEPTH} levels"
                            if depth > MAX_DEPTH else f"payload holds over {max_values} values")
    return msg


def loads(raw: bytes | str) -> Any:
    """JSON as a peer may send it: integers of MAX_INT_CHARS characters at most, numbers
    with a fraction or exponent of MAX_FLOAT_CHARS, and no NaN or Infinity (Python's
    json takes them; nothing here means them); ValueError for any of them."""
    return json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)


def _int(text: str) -> int:
    if len(text) > MAX_INT_CHARS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _float(text: str) -> float:
    # (Any double is written in 24 characters.  One of 758 digits halfway between two
    # doubles took 30 us to round, and a 1 MiB request of them held the daemon's
    # thread 41 ms, before its op was looked at.)
    if len(text) > MAX_FLOAT_CHARS:
        raise ValueError(f"a number of {len(text)} characters")
    return float(text)


def _constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number a message carries")


def _shape(value: Any) -> tuple[int, int]:
    """(how deeply lists and objects nest, how many values they hold) in a decoded
    payload; iterative, and it stops counting past the limits."""
    deepest, values, stack = 0, 0, [(value, 1)]
    while stack and values <= MAX_VALUES * 4:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        values += len(v)
        if d <= MAX_DEPTH:
            stack.extend((x, d + 1) for x in v if isinstance(x, dict | list))
    return deepest, values


def fds_from_ancdata(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def ancillary_space(fds: int = MAX_FDS) -> int:
    """Room for `fds` descriptors in a received message's ancillary data."""
    return socket.CMSG_SPACE(fds * array.array("i").itemsize)


def send_message(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = encode(msg, len(fds))
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("control socket closed mid-message")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Read one message and the descriptors that came with it (blocking).  They
    arrive close-on-exec (as every descriptor Python opens): inherited, a program
    the client runs kept a hidden file's write descriptors (its commit refused
    until that exited) or a root launcher's read ones."""
    head, anc, flags, _addr = sock.recvmsg(HEADER.size, ancillary_space(),
                                           socket.MSG_CMSG_CLOEXEC)
    if not head:
        raise ConnectionError("control socket closed")
    fds = fds_from_ancdata(anc)
    if len(head) < HEADER.size:
        head += _recv_exact(sock, HEADER.size - len(head))
    _, sent, length = parse_header(head)
    msg = decode_payload(_recv_exact(sock, length))  # read whole: the next reply stays framed
    if len(fds) < sent or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise OSError(errno.EMFILE, f"{sent - len(fds)} of the {sent} descriptors the daemon "
                      "sent were lost: this process is at its open-file limit (raise "
                      "`ulimit -n`, or close files)")
    return msg, fds
