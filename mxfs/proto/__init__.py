"""The control protocol: the one module the daemon and its clients share (stdlib only)."""

from mxfs.proto.framing import (
    HEADER,
    MAX_FDS,
    MAX_PAYLOAD,
    MAX_VALUES,
    VERSION,
    ProtocolError,
    decode_payload,
    encode,
    fds_from_ancdata,
    parse_header,
    recv_message,
    send_message,
)
from mxfs.proto.messages import BY_NAME, OPS, Op

__all__ = ["BY_NAME", "HEADER", "MAX_FDS", "MAX_PAYLOAD", "MAX_VALUES", "OPS", "VERSION", "Op",
           "ProtocolError",
           "decode_payload", "encode", "fds_from_ancdata", "parse_header", "recv_message",
           "send_message"]
