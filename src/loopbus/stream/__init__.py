"""The metric stream: wire protocol, addresses, the server and the Python client.

:class:`Server` serves whatever is published to it, with or without a trainer;
``loopbus.plugins.StreamServer`` feeds one from a trainer's bus. ``docs/protocol.md``
specifies the protocol. Imports events, never the engine or torch (``loopbus watch``
starts fast).
"""

from __future__ import annotations

from .._exceptions import fixup_module_metadata as _fixup_module_metadata
from ._address import Address as Address
from ._address import is_loopback as is_loopback
from ._address import parse_address as parse_address
from ._client import Stream as Stream
from ._client import StreamItem as StreamItem
from ._client import connect as connect
from ._server import Server as Server
from ._wire import BYE_CODES as BYE_CODES
from ._wire import HEADER_SIZE as HEADER_SIZE
from ._wire import MAX_CLIENT_FRAME as MAX_CLIENT_FRAME
from ._wire import MAX_SERVER_FRAME as MAX_SERVER_FRAME
from ._wire import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._wire import TOPICS as TOPICS
from ._wire import Batch as Batch
from ._wire import Bye as Bye
from ._wire import ClientMessage as ClientMessage
from ._wire import EpochEnded as EpochEnded
from ._wire import FrameReader as FrameReader
from ._wire import Gap as Gap
from ._wire import Hello as Hello
from ._wire import Item as Item
from ._wire import RawBatch as RawBatch
from ._wire import Record as Record
from ._wire import ServerMessage as ServerMessage
from ._wire import StageEnded as StageEnded
from ._wire import StageStarted as StageStarted
from ._wire import Subscribe as Subscribe
from ._wire import Subscribed as Subscribed
from ._wire import Welcome as Welcome
from ._wire import append_frame as append_frame
from ._wire import record_fields as record_fields

__all__ = [
    "BYE_CODES",
    "HEADER_SIZE",
    "MAX_CLIENT_FRAME",
    "MAX_SERVER_FRAME",
    "PROTOCOL_VERSION",
    "TOPICS",
    "Address",
    "Batch",
    "Bye",
    "ClientMessage",
    "EpochEnded",
    "FrameReader",
    "Gap",
    "Hello",
    "Item",
    "RawBatch",
    "Record",
    "Server",
    "ServerMessage",
    "StageEnded",
    "StageStarted",
    "Stream",
    "StreamItem",
    "Subscribe",
    "Subscribed",
    "Welcome",
    "append_frame",
    "connect",
    "is_loopback",
    "parse_address",
    "record_fields",
]

_fixup_module_metadata(__name__, globals())
