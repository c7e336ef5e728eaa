"""A fake host end of the agent's link (cpuos_agent.transport.Link) for tests that run a
piece of the agent in-process: each frame the agent sends is handed to ``frame``."""

from __future__ import annotations

import io
from typing import Any

from cpuos_agent import protocol as P


class HostEnd:
    """``sendall`` parses the frame (one per call: cpuos_agent.conn.Conn sends them whole)
    and calls ``frame`` with its header and payload; nothing comes from the host."""

    @property
    def rfile(self) -> Any:
        return io.BytesIO()

    def sendall(self, data: bytes) -> None:
        hlen, _ = P.parse_prefix(data[:P.PREFIX_LEN])
        h = P.parse_header(data[P.PREFIX_LEN:P.PREFIX_LEN + hlen])
        self.frame(h, data[P.PREFIX_LEN + hlen:])

    def frame(self, h: P.Header, payload: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
