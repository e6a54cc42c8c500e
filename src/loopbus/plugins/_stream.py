"""``StreamServer``: serve a trainer's put records and lifecycle events to other processes.

A thin adapter: the server is :class:`loopbus.stream.Server`; this plugin opens one,
hands it the trainer's records (destination ``"external"``) and stage and epoch
boundaries, and closes it at the end of the trainer's life (or of each stage, with
``scope="stage"``).

Its handlers subscribe *inline*: each costs the step an append to the server's queue,
cheaper than a hop through a bus queue, and one queue keeps records and lifecycle events
in the single order the run produced them (separate bus queues per event type would let
an ``EpochEnded`` overtake that epoch's last records).
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from typing import TYPE_CHECKING, Any, Literal

from loopbus import Delivery, Event, Plugin, PutRecord, check_choice, on
from loopbus.events import EpochCompleted, Teardown
from loopbus.stream import (
    MAX_CLIENT_FRAME,
    Address,
    EpochEnded,
    Server,
    StageEnded,
    StageStarted,
    parse_address,
)

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import TrainerView

__all__ = ["ServerStarted", "StreamServer"]

_OWNER = "StreamServer"
_SCOPES = {
    "trainer": "one address from the first stage until the plugin is closed",
    "stage": "a server for each stage, closed when the stage ends",
}


class ServerStarted(Event, frozen=True, kw_only=True):
    """Published by :class:`StreamServer` at the start of each stage, once it listens,
    before the stage's first loop event. ``address`` is where to connect (the first of
    ``addresses``; the same for every stage unless ``scope="stage"``)."""

    address: str
    addresses: tuple[str, ...]
    stage: str


def _shut_down(server: Server, reason: str) -> None:
    """Close a server that runs in its thread and wait for it (bounded by its linger)."""
    server.close(reason)
    server.join(server.linger + 2.0)


class StreamServer(Plugin):
    """Serve the run's put records (destination ``"external"``) and lifecycle events to
    clients in other processes (``loopbus watch``, ``loopbus.connect``, a dashboard).

    * ``scope="trainer"`` (default): one server, one address, for the whole job: it opens
      at the first stage and serves ``fit``, ``validate``, ``test`` and ``predict`` alike
      (clients see ``StageStarted`` / ``StageEnded`` between them) until :meth:`close`,
      until the plugin (with its trainer) is garbage-collected, or until the interpreter
      exits. It runs in a thread of its own, so it also reaches its clients while no
      stage runs and between ``loopbus.run`` calls.
      ``scope="stage"``: a server for each stage on the trainer's event loop, closed
      (with a bye to every client) when the stage ends; with ``port=0`` each stage gets
      a new port.
    * ``announce``: print the address to stderr when the server starts.

    The other options are :class:`loopbus.stream.Server`'s: ``host``, ``port``,
    ``path``, ``token``, ``client_buffer``, ``send_buffer``, ``max_clients``,
    ``max_frame``, ``flush_interval``, ``linger``, ``handshake_timeout``,
    ``subscribe_rate``, ``accept_rate`` (``docs/protocol.md`` describes each).

    Use :meth:`from_address` to build one from ``"tcp://HOST:PORT"`` or
    ``"unix:///path"``. :attr:`server` is the current server; its counters are repeated
    here: :attr:`connected`, :attr:`subscribers`, :attr:`accepted`, :attr:`rejected`,
    :attr:`aborted`, :attr:`paced`, :attr:`dropped`, :attr:`errors`.
    """

    #: Inline, for the external destination, on rank 0 only in a distributed run.
    delivery = Delivery(destination="external", mode="inline", ranks="zero")

    def __init__(
        self,
        host: str | None = "127.0.0.1",
        port: int = 0,
        *,
        scope: Literal["trainer", "stage"] = "trainer",
        path: str | os.PathLike[str] | None = None,
        token: str | None = None,
        client_buffer: int = 16384,
        send_buffer: int | None = None,
        max_clients: int = 64,
        max_frame: int = MAX_CLIENT_FRAME,
        flush_interval: float = 0.1,
        linger: float = 2.0,
        handshake_timeout: float = 10.0,
        subscribe_rate: float = 10.0,
        accept_rate: float = 10.0,
        announce: bool = True,
    ) -> None:
        self.scope = check_choice("scope", scope, _SCOPES, owner=_OWNER)
        self.announce = announce
        self._options: dict[str, Any] = {
            "host": host,
            "port": port,
            "path": path,
            "token": token,
            "client_buffer": client_buffer,
            "send_buffer": send_buffer,
            "max_clients": max_clients,
            "max_frame": max_frame,
            "flush_interval": flush_interval,
            "linger": linger,
            "handshake_timeout": handshake_timeout,
            "subscribe_rate": subscribe_rate,
            "accept_rate": accept_rate,
            "owner": _OWNER,
        }
        # Validates the options now, and is the server of the first stage.
        self._server = Server(**self._options)
        self._finalizer: weakref.finalize[[Server, str], StreamServer] | None = None

    @classmethod
    def from_address(cls, address: str | Address, **options: Any) -> StreamServer:
        """``StreamServer.from_address("tcp://127.0.0.1:8765")`` or
        ``("unix:///tmp/run.sock")``; ``options`` are the constructor's."""
        where = parse_address(address)
        if where.kind == "unix":
            return cls(host=None, path=where.path, **options)
        return cls(host=where.host, port=where.port, **options)

    # ------------------------------------------------------------ the server's state
    @property
    def server(self) -> Server:
        """The server of the current (or last) stage."""
        return self._server

    @property
    def host(self) -> str | None:
        return self._server.host

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def path(self) -> str | None:
        return self._server.path

    @property
    def token(self) -> str | None:
        return self._server.token

    @property
    def client_buffer(self) -> int:
        return self._server.client_buffer

    @property
    def send_buffer(self) -> int | None:
        return self._server.send_buffer

    @property
    def max_clients(self) -> int:
        return self._server.max_clients

    @property
    def max_frame(self) -> int:
        return self._server.max_frame

    @property
    def flush_interval(self) -> float:
        return self._server.flush_interval

    @property
    def linger(self) -> float:
        return self._server.linger

    @property
    def handshake_timeout(self) -> float:
        return self._server.handshake_timeout

    @property
    def subscribe_rate(self) -> float:
        return self._server.subscribe_rate

    @property
    def accept_rate(self) -> float:
        return self._server.accept_rate

    @property
    def address(self) -> str | None:
        """The first address served, while the server serves (None otherwise)."""
        return self._server.address

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._server.addresses

    @property
    def connected(self) -> int:
        return self._server.connected

    @property
    def subscribers(self) -> int:
        return self._server.subscribers

    @property
    def accepted(self) -> int:
        return self._server.accepted

    @property
    def rejected(self) -> int:
        return self._server.rejected

    @property
    def aborted(self) -> int:
        return self._server.aborted

    @property
    def paced(self) -> int:
        return self._server.paced

    @property
    def errors(self) -> int:
        return self._server.errors

    @property
    def dropped(self) -> int:
        return self._server.dropped

    def __repr__(self) -> str:
        return repr(self._server)

    # ------------------------------------------------------------ lifecycle
    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        server = self._server
        opened = not server.serving
        if opened:
            if server.closed:
                server = self._server = Server(**self._options)
            if self.scope == "stage":
                await task_group.start(server.serve)
            else:
                server.start_in_thread()
                self._finalizer = weakref.finalize(
                    self, _shut_down, server, "the trainer's stream server closed"
                )
        run_dir = getattr(trainer, "run_dir", None)
        if run_dir is not None:  # told to clients, so that a dashboard reads the history
            server.run_dir = os.path.abspath(run_dir)  # noqa: ASYNC240 - no I/O, a string
        server.publish_event(
            StageStarted(
                stage=stage, step=trainer.global_step, epoch=trainer.current_epoch, time=time.time()
            )
        )
        address = server.address
        assert address is not None
        if opened and self.announce:
            print(
                f"loopbus: streaming records on {address} (watch them with: loopbus watch "
                f"{address})",
                file=sys.stderr,
                flush=True,
            )
        await trainer.publish(ServerStarted(address=address, addresses=server.addresses, stage=stage))

    async def stop(self, trainer: TrainerView, stage: str) -> None:
        if self.scope == "stage":
            await self._server.aclose(f"the {stage} stage ended")

    def close(self) -> None:
        """Close the trainer-scoped server now (clients receive what is queued and a bye);
        the next stage opens a new one. Also done when the plugin is garbage-collected
        and at interpreter exit."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()
        else:
            self._server.close()

    # ------------------------------------------------------------ handlers (inline)
    @on(PutRecord)
    def on_record(self, record: PutRecord) -> None:
        self._server.publish_record(record)

    @on(EpochCompleted)
    def on_epoch_completed(self, event: EpochCompleted) -> None:
        self._server.publish_event(EpochEnded(epoch=event.epoch, step=event.step, time=time.time()))

    @on(Teardown)
    def on_teardown(self, event: Teardown) -> None:
        self._server.publish_event(
            StageEnded(
                stage=event.stage,
                reason=event.reason,
                step=event.step,
                epoch=event.epoch,
                time=time.time(),
            )
        )
