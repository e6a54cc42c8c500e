"""What one run holds and gets back exactly: the run's state (one object, one writer),
the protocol every stateful part follows, per-run and per-iteration scopes that free
memory by themselves, seeding and snapshots of the random generators (``_rng``), and the run's folder and configuration as written to
disk (``_run_folder``, ``_run_config``).

Imports the base layer only (``loopbus._exceptions``, ``loopbus._validate``) and torch.
"""

from __future__ import annotations

from ._ranges import profiling_ranges as profiling_ranges
from ._rng import RngSnapshot as RngSnapshot
from ._runstate import ResumePlan as ResumePlan
from ._runstate import RunState as RunState
from ._scope import Scope as Scope
from ._seed import seed_everything as seed_everything
from ._stateful import Stateful as Stateful

__all__ = [
    "ResumePlan",
    "RngSnapshot",
    "RunState",
    "Scope",
    "Stateful",
    "profiling_ranges",
    "seed_everything",
]
