"""The metric stream: wire protocol, addresses and the Python client.

The server is a plugin, ``loopbus.plugins.StreamServer``; ``docs/protocol.md`` specifies
the protocol. Imports events, never the engine or torch-dependent code.
"""

from __future__ import annotations

from .._exceptions import fixup_module_metadata as _fixup_module_metadata
from ..events._wire import BYE_CODES as BYE_CODES
from ..events._wire import HEADER_SIZE as HEADER_SIZE
from ..events._wire import MAX_CLIENT_FRAME as MAX_CLIENT_FRAME
from ..events._wire import MAX_SERVER_FRAME as MAX_SERVER_FRAME
from ..events._wire import PROTOCOL_VERSION as PROTOCOL_VERSION
from ..events._wire import TOPICS as TOPICS
from ..events._wire import Batch as Batch
from ..events._wire import Bye as Bye
from ..events._wire import ClientMessage as ClientMessage
from ..events._wire import EpochEnded as EpochEnded
from ..events._wire import FrameReader as FrameReader
from ..events._wire import Gap as Gap
from ..events._wire import Hello as Hello
from ..events._wire import Item as Item
from ..events._wire import RawBatch as RawBatch
from ..events._wire import Record as Record
from ..events._wire import ServerMessage as ServerMessage
from ..events._wire import StageEnded as StageEnded
from ..events._wire import Subscribe as Subscribe
from ..events._wire import Subscribed as Subscribed
from ..events._wire import Welcome as Welcome
from ..events._wire import append_frame as append_frame
from ..events._wire import record_fields as record_fields
from ._address import Address as Address
from ._address import is_loopback as is_loopback
from ._address import parse_address as parse_address
from ._client import Stream as Stream
from ._client import StreamItem as StreamItem
from ._client import connect as connect

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
    "ServerMessage",
    "StageEnded",
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
