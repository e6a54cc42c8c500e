"""A client written from docs/protocol.md alone: it sends frames as bytes and decodes what
the server answers into plain MessagePack values (maps, arrays), not into loopbus's own
message types, so what it sees is what a client in another language would see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from anyio.abc import SocketStream

from loopbus.stream import MAX_SERVER_FRAME, Address, FrameReader, parse_address

_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


def encode_frame(message: dict[str, Any]) -> bytes:
    """One frame: a big-endian uint32 length, then ``message`` as MessagePack (a map whose
    keys keep the order given)."""
    payload = msgspec.msgpack.encode(message)
    return len(payload).to_bytes(4, "big") + payload


class RawClient:
    """One connection; :attr:`frames` holds every frame payload the server sent, in order."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.frames: list[bytes] = []
        self.ended = False
        self._reader = FrameReader(MAX_SERVER_FRAME)
        self._seen = 0

    @classmethod
    async def open(cls, address: str | Address, payload: bytes = b"") -> RawClient:
        client = cls(await parse_address(address).connect())
        if payload:
            await client.stream.send(payload)
        return client

    @property
    def messages(self) -> list[Any]:
        return [msgspec.msgpack.decode(frame) for frame in self.frames]

    @property
    def summary(self) -> list[str]:
        """The types of the messages received (and a Batch's first sequence number)."""
        return [
            f"{m['type']}@{m['seq']}" if m.get("type") in ("Batch", "Gap") else m.get("type")
            for m in self.messages
        ]

    async def send(self, payload: bytes) -> None:
        await self.stream.send(payload)

    async def _receive(self) -> None:
        try:
            data = await self.stream.receive()
        except _GONE:
            self.ended = True
            return
        self.frames += self._reader.feed(data)

    async def read_until(self, done: Callable[[Any], bool], *, within: float = 30.0) -> Any:
        """Read until a message for which ``done`` is true arrives (among those not yet
        looked at); return it."""
        with anyio.move_on_after(within):
            while True:
                while self._seen < len(self.frames):
                    message = msgspec.msgpack.decode(self.frames[self._seen])
                    self._seen += 1
                    if done(message):
                        return message
                if self.ended:
                    raise AssertionError(
                        f"the server closed the connection first; it sent {self.messages}"
                    )
                await self._receive()
        raise AssertionError(f"still waiting after {within} s; the server sent {self.summary}")

    async def read_to_end(self, *, within: float = 30.0) -> list[Any]:
        """Read until the server closes the connection; return every message it sent."""
        with anyio.move_on_after(within):
            while not self.ended:
                await self._receive()
        if not self.ended:
            await self.aclose()
            raise AssertionError(
                f"the server did not end the connection within {within} s; it sent {self.summary}"
            )
        self._seen = len(self.frames)
        await self.aclose()
        return self.messages

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)


def is_type(kind: str) -> Callable[[Any], bool]:
    return lambda message: isinstance(message, dict) and message.get("type") == kind


def accounting(messages: list[Any]) -> tuple[list[Any], int, int]:
    """Follow the sequence numbers of a connection's messages as docs/protocol.md says a
    client should: every Batch or Gap starts where the previous one ended. Returns the
    items received, the count reported missing, and the next sequence number."""
    items: list[Any] = []
    missing = 0
    expected = 0
    for message in messages:
        if message["type"] == "Batch":
            assert message["seq"] == expected, (message, expected)
            items += message["items"]
            expected += len(message["items"])
        elif message["type"] == "Gap":
            assert message["seq"] == expected, (message, expected)
            assert message["count"] >= 1, message
            missing += message["count"]
            expected += message["count"]
    return items, missing, expected
