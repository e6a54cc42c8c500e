"""Configuration commands: ``loopbus fit|validate|test|predict --config FILE`` and
:func:`main` for scripts. Reads LightningCLI-shaped YAML, TOML and JSON files and
``--KEY=VALUE`` overrides, checks every key (trainer options against their
declarations, class paths' ``init_args`` against their signatures), prints the resolved
configuration or where each value came from, and runs the stage.

The top of the package graph: it may import ``loopbus``'s public names (the engine, the
plugins) and is imported by nothing in the engine; only ``loopbus.__main__`` imports
it. Importing it imports neither torch nor the engine (``loopbus fit --help`` starts
fast): they are imported when a configuration is checked.
"""

from __future__ import annotations

from ._errors import ConfigError as ConfigError
from ._errors import Problem as Problem
from ._main import main as main

__all__ = ["ConfigError", "Problem", "main"]
