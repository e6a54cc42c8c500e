"""Test configuration: every async test runs on asyncio (debug mode) and trio, and the
scope leak check is on for every trainer the tests build.

The suite is hermetic: it gives the same result on a fresh machine, on one that ran it
before, and in any order.

* torch's compile caches (inductor's, which holds the FX graph and AOT autograd caches,
  and Triton's) go to a fresh temporary folder per test session, removed at its end, so
  a compile test never finds kernels an earlier run left behind. Subprocesses the tests
  start (torchrun, scripts) inherit the same folders.
* Before each test the random generators are seeded (Python's, NumPy's, torch's), and
  after it the process-global state a test can change is compared with what it was:
  the recursion limit, torch's default dtype, grad mode and thread count, the signal
  handlers, the environment and the working directory. A test that leaves any of them
  changed fails, naming what it changed, and the state is put back, so the next test
  starts from the same state whatever ran before it. The recursion limit and
  PYTHONHASHSEED are put back without failing the test: torch's inductor raises the
  limit while it compiles, and ``seed_everything`` sets the variable on purpose.
* ``--order=reverse`` runs the collected tests in reverse order (CI does, so an order
  dependency fails there even when the usual order hides it).
* Tests that start a process (a script, ``torchrun``, a browser, inductor's compile
  workers) or stand up a server outside the engine (the S3 server, the dashboard's web
  server) are marked ``external``. ``./dev test --quick`` deselects them
  (``-m "not external"``), and then fails any test that starts a process unmarked.
* After collection the objects alive so far are frozen out of the garbage collector's
  reach (``pytest_collection_finish``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("LOOPBUS_LEAK_CHECK", "raise")
# A cold compile cache of this session's own: set before torch is imported anywhere.
_COMPILE_CACHE = tempfile.mkdtemp(prefix="loopbus-test-compile-cache-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_COMPILE_CACHE, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_COMPILE_CACHE, "triton")

import gc  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import hypothesis  # noqa: E402, F401
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# The tests use tiny models: one intra-op thread is fastest and stays fast on a busy
# machine (a pool of spinning threads fighting for two cores is not).
torch.set_num_threads(1)

_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--order",
        choices=("forward", "reverse"),
        default="forward",
        help="run the collected tests in their usual order or in reverse (to show that "
        "no test depends on what an earlier one left behind)",
    )


#: Fixtures that start a process or a server outside the engine: a test that uses one
#: is ``external`` (the S3 server; the shared launches of the distributed scripts).
_EXTERNAL_FIXTURES = {"s3_endpoint", "own_server", "sharded_references", "ddp_runs", "fsdp_runs"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _EXTERNAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.external)
    if config.getoption("--order") == "reverse":
        items.reverse()


def _quick(config: pytest.Config) -> bool:
    """Whether this run leaves the ``external`` tests out (``./dev test --quick``)."""
    return "not external" in (config.getoption("markexpr") or "")


@pytest.fixture(autouse=True)
def _no_process_unless_external(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a quick run, a test that starts a process fails, naming the mark it lacks."""
    if not _quick(request.config) or request.node.get_closest_marker("external"):
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.external "
            "(the quick run, ./dev test --quick, leaves those out)"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)


# Variables a library sets (or removes) for itself while it runs: pytest's current test,
# torch's inductor's process-wide settings (and, on CUDA, the ptxas it points Triton
# at), the OpenMP runtime's (set when scikit-learn
# or torch load it), wandb's service address, MLflow's telemetry session: theirs to keep,
# not a test's leak.
_LIBRARY_VARIABLES = (
    "PYTEST_CURRENT_TEST",
    "_TORCHINDUCTOR_",
    "TRITON_PTXAS_PATH",
    "KMP_",
    "WANDB_SERVICE",
    "_MLFLOW_",
)
# Set by what a test calls on purpose (``seed_everything`` sets PYTHONHASHSEED for the
# processes the run starts, as Lightning's does): put back after each test, not a failure.
_RESTORED_VARIABLES = ("PYTHONHASHSEED",)


def _libraries_own(key: str) -> bool:
    return key.startswith(_LIBRARY_VARIABLES) or key in _RESTORED_VARIABLES


def _global_state() -> dict[str, Any]:
    return {
        "torch's default dtype": torch.get_default_dtype(),
        "torch's grad mode": torch.is_grad_enabled(),
        "torch's intra-op thread count": torch.get_num_threads(),
        "the signal handlers": {s: signal.getsignal(s) for s in _SIGNALS},
        "the environment": {k: v for k, v in os.environ.items() if not _libraries_own(k)},
        "the working directory": os.getcwd(),
    }


def _restore(name: str, value: Any) -> None:
    if name == "torch's default dtype":
        torch.set_default_dtype(value)
    elif name == "torch's grad mode":
        torch.set_grad_enabled(value)
    elif name == "torch's intra-op thread count":
        torch.set_num_threads(value)
    elif name == "the signal handlers":
        for s, handler in value.items():
            if handler is not None:
                signal.signal(s, handler)
    elif name == "the environment":
        for key in [k for k in os.environ if k not in value and not _libraries_own(k)]:
            del os.environ[key]
        os.environ.update(value)
    elif name == "the working directory":
        os.chdir(value)


def _changes(name: str, before: Any, after: Any) -> str:
    if isinstance(before, dict):
        keys = sorted({*before, *after}, key=str)
        changed = [k for k in keys if before.get(k) != after.get(k)]
        shown = ", ".join(
            f"{getattr(k, 'name', k)}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed
        )
        return f"{name} ({shown})"
    return f"{name} ({before!r} -> {after!r})"


@pytest.fixture(autouse=True)
def _hermetic(request: pytest.FixtureRequest) -> Iterator[None]:
    """Seed the generators, and fail a test that leaves process-global state changed."""
    recursion_limit = sys.getrecursionlimit()
    restored_variables = {key: os.environ.get(key) for key in _RESTORED_VARIABLES}
    before = _global_state()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
    sys.setrecursionlimit(recursion_limit)
    for key, value in restored_variables.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    after = _global_state()
    leaked = [name for name in before if before[name] != after[name]]
    for name in leaked:
        _restore(name, before[name])
    if leaked:
        pytest.fail(
            f"{request.node.nodeid} left process-global state changed: "
            + "; ".join(_changes(name, before[name], after[name]) for name in leaked)
            + ". Set it back at the test's end (a fixture, monkeypatch, or try/finally).",
            pytrace=False,
        )


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def sharded_references(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The sharded-checkpoint job of ``tests/distributed/test_sharded.py`` run to its end
    on 2 DDP ranks and on 2 FSDP ranks, never killed, in one launch: the references its
    killed runs (local and remote) must match bit for bit. Run once per session."""
    from tests.distributed.test_sharded import REFERENCES

    return REFERENCES.run_once(tmp_path_factory, "sharded-references")


@pytest.fixture(scope="session")
def uninterrupted(sharded_references: Any) -> Any:
    """The DDP reference of ``sharded_references``: its folder."""
    return sharded_references.out("ddp")


@pytest.fixture(scope="session")
def uninterrupted_fsdp(sharded_references: Any) -> Any:
    """The FSDP reference of ``sharded_references``: its folder."""
    return sharded_references.out("fsdp")


def _freeze_what_is_alive() -> None:
    """Collect, then move every object still alive out of the garbage collector's reach
    (``gc.freeze``): later collections scan only what the tests make after this."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once every test module is imported, freeze what the process holds so far (torch,
    the libraries, the test modules: hundreds of thousands of objects that stay alive
    to the end). The leak checks, the batch-size finder and the tests that count live
    tensors collect often, and a full collection of the whole heap took a fraction of a
    second each time. (Hypothesis is imported above, before the freeze: when it loads,
    it checks with ``gc.get_referrers`` that the generators other libraries hand it are
    referenced, and frozen referrers are not listed.)"""
    _freeze_what_is_alive()


@pytest.fixture(scope="module", autouse=True)
def _freeze_after_each_module() -> Iterator[None]:
    """What a test module leaves alive for good (caches it filled, compiled code) is
    frozen too once it ends, after a collection, so the heap later tests scan stays
    small; the garbage it left is collected first, never frozen."""
    yield
    _freeze_what_is_alive()
