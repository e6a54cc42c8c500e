"""Where bytes that outlive the process live: one interface (:class:`Storage`, the
entries of a directory by name) with a local backend (:class:`LocalStore`) and an
fsspec one (:class:`Store`), chosen once by :func:`store_for`, the one place that tells
a URL from a local path. For URLs (``s3://``, ``gs://``, any fsspec URL): the optional
package each scheme needs (``loopbus[s3]``, ``loopbus[gcs]``), a directory of objects
whose every call is held to deadlines (:class:`StoreDeadlines`) and retried, the lease
that keeps one writer per checkpoint folder, and what the calls to a store have met
lately (:class:`StoreHealth`: an outage, since when and why).

Imports the base layer, the standard library and, only when a URL is used, fsspec; a
local path never imports fsspec. The checkpoint package builds its format (entry,
completeness marker, ``last.json``) on a :class:`Storage`.

Modules: ``_advice`` (what a failed store call means, and what to do), ``_store`` (URLs, :class:`RemotePath`, :class:`StoreDeadlines`, :class:`Store`),
``_local`` (:class:`Storage`, :class:`LocalStore`, :func:`store_for`, :func:`located`,
:func:`open_location`, the local store's temporaries: :func:`temporary_for`,
:func:`temporary_writer`),
``_lease`` (:class:`FolderLease`, :func:`folder_lease`), ``_health``
(:class:`StoreHealth`, :class:`Outage`), ``_complete`` (what completing a sharded
checkpoint shares between the backends, and :class:`CompletionFailed`).
"""

from __future__ import annotations

from ._complete import CompletionFailed as CompletionFailed
from ._health import Outage as Outage
from ._health import StoreHealth as StoreHealth
from ._lease import LEASE_NAME as LEASE_NAME
from ._lease import LEASE_TTL_S as LEASE_TTL_S
from ._lease import FolderLease as FolderLease
from ._lease import folder_lease as folder_lease
from ._local import TEMP_TAG as TEMP_TAG
from ._local import LocalStore as LocalStore
from ._local import Storage as Storage
from ._local import crc32_of as crc32_of
from ._local import host_tag as host_tag
from ._local import located as located
from ._local import location as location
from ._local import open_location as open_location
from ._local import store_for as store_for
from ._local import temporary_for as temporary_for
from ._local import temporary_writer as temporary_writer
from ._store import RemotePath as RemotePath
from ._store import Store as Store
from ._store import StoreDeadlines as StoreDeadlines
from ._store import is_url as is_url
from ._store import remote_path as remote_path
from ._store import require_backend as require_backend

__all__ = [
    "LEASE_NAME",
    "LEASE_TTL_S",
    "CompletionFailed",
    "FolderLease",
    "LocalStore",
    "Outage",
    "RemotePath",
    "Store",
    "StoreDeadlines",
    "Storage",
    "StoreHealth",
    "TEMP_TAG",
    "crc32_of",
    "folder_lease",
    "host_tag",
    "is_url",
    "located",
    "location",
    "open_location",
    "remote_path",
    "require_backend",
    "store_for",
    "temporary_for",
    "temporary_writer",
]
