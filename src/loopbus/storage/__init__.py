"""Object storage for checkpoints: URLs (``s3://``, ``gs://``, any fsspec URL), the
optional package each scheme needs (``loopbus[s3]``, ``loopbus[gcs]``), and a directory
of objects with retried writes.

Imports the base layer, the standard library and, only when a URL is used, fsspec; a
local path never imports fsspec. The checkpoint package builds its remote format
(object, completeness marker, ``last.json``) on :class:`Store`.

Modules: ``_store`` (URLs, :class:`RemotePath`, :class:`Store`).
"""

from __future__ import annotations

from ._store import RemotePath as RemotePath
from ._store import Store as Store
from ._store import is_url as is_url
from ._store import remote_path as remote_path
from ._store import require_backend as require_backend

__all__ = ["RemotePath", "Store", "is_url", "remote_path", "require_backend"]
