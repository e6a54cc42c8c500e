"""``put``: metric records from modules and plugins, checked once, kept until their step
ends, and handed to the bus for delivery to their destinations.

Imports ``loopbus.events``, ``loopbus.data`` (deferred device values), ``loopbus.state``.
"""

from __future__ import annotations

from ._destinations import register_destination as register_destination
from ._recorder import Publication as Publication
from ._records import PutMixin as PutMixin

__all__ = [
    "Publication",
    "PutMixin",
    "register_destination",
]
