"""Preemption inside this process: when the signal handlers are installed (main thread,
while a stage runs, when wanted), that they chain to and restore the application's
handler, that a signal stops at the step boundary and raises ``Preempted``, the options'
validation, and ``Checkpoint``'s last-checkpoint names."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

import loopbus
from loopbus import MisconfigurationError, Plugin, Preempted, Trainer, on
from loopbus.events import PreemptionRequested, Teardown, TrainBatchCompleted
from loopbus.plugins import Checkpoint
from tests.helpers import TinyModule, make_loader

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Host:
    """An application's own handler of both signals, recording what it gets."""

    def __init__(self) -> None:
        self.calls: dict[int, list[int]] = {int(s): [] for s in SIGNALS}

    def handler(self, signum: int, frame: Any) -> None:
        self.calls[signum].append(signum)


@pytest.fixture
def host() -> Iterator[Host]:
    """The application's handler installed for the test, the previous ones put back."""
    app = Host()
    previous = {s: signal.signal(s, app.handler) for s in SIGNALS}
    try:
        yield app
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


class Probe(Plugin):
    """Sees the handlers during the stage; sends ``send`` to this process after step
    ``at``; records PreemptionRequested and Teardown."""

    handles_preemption: ClassVar[bool] = False

    def __init__(self, send: int | None = None, at: int = 3) -> None:
        self.send = send
        self.at = at
        self.during: dict[int, Any] = {}
        self.events: list[Any] = []

    @on(TrainBatchCompleted)
    def _batch(self, event: TrainBatchCompleted) -> None:
        if event.step == 1:
            self.during = {int(s): signal.getsignal(s) for s in SIGNALS}
        if self.send is not None and event.step == self.at:
            os.kill(os.getpid(), self.send)

    @on(PreemptionRequested)
    def _preempted(self, event: PreemptionRequested) -> None:
        self.events.append(event)

    @on(Teardown)
    def _teardown(self, event: Teardown) -> None:
        self.events.append(event)


class Aware(Probe):
    handles_preemption: ClassVar[bool] = True


async def test_sigusr1_stops_at_the_boundary_chains_and_restores(
    host: Host,
) -> None:
    probe = Aware(send=signal.SIGUSR1, at=3)
    trainer = Trainer(max_epochs=2, plugins=[probe], enable_model_summary=False)
    with pytest.raises(Preempted, match="stopped at step 3 on SIGUSR1; exit status 138") as info:
        await trainer.fit(TinyModule(), make_loader(64, 4))
    assert info.value.code == 138
    assert isinstance(info.value, SystemExit)
    assert (info.value.signal, info.value.step) == ("SIGUSR1", 3)
    assert trainer.global_step == 3
    assert trainer.stop_reason == "preempted (SIGUSR1)"
    # Ours while the stage ran; the application's ran after ours, and is back.
    handler = host.handler
    assert all(h != handler and callable(h) for h in probe.during.values())
    assert host.calls[int(signal.SIGUSR1)] == [int(signal.SIGUSR1)]
    assert all(signal.getsignal(s) == handler for s in SIGNALS)
    preempted, teardown = probe.events
    assert isinstance(preempted, PreemptionRequested)
    assert (preempted.signal, preempted.signum, preempted.step, preempted.epoch) == (
        "SIGUSR1",
        int(signal.SIGUSR1),
        3,
        0,
    )
    assert (preempted.stage, preempted.rank, preempted.deadline) == ("fit", 0, None)
    assert (teardown.reason, teardown.step) == ("stopped", 3)


async def test_grace_sets_the_deadline_and_the_exit_code_is_the_option(
    host: Host,
) -> None:
    probe = Probe(send=signal.SIGTERM, at=2)
    trainer = Trainer(
        max_epochs=2,
        plugins=[probe],
        enable_model_summary=False,
        preemption=True,
        preemption_exit_code=3,
        preemption_grace_s=300,
    )
    with pytest.raises(Preempted) as info:
        await trainer.fit(TinyModule(), make_loader(64, 4))
    assert info.value.code == 3
    preempted = probe.events[0]
    assert preempted.deadline is not None
    assert host.calls[int(signal.SIGTERM)] == [int(signal.SIGTERM)]
    assert signal.getsignal(signal.SIGTERM) == host.handler


@pytest.mark.parametrize(("mode", "plugin"), [(False, Aware), ("auto", Probe)])
async def test_not_wanted_leaves_the_handlers_alone(
    host: Host, mode: Any, plugin: type[Probe]
) -> None:
    probe = plugin()
    trainer = Trainer(max_epochs=1, plugins=[probe], enable_model_summary=False, preemption=mode)
    await trainer.fit(TinyModule(), make_loader(32, 8))
    assert all(h == host.handler for h in probe.during.values())


async def test_checkpoint_turns_it_on_and_validate_is_preempted_too(
    tmp_path: Path, host: Host
) -> None:
    probe = Probe()
    trainer = Trainer(
        max_epochs=1,
        plugins=[probe, Checkpoint(tmp_path)],
        enable_model_summary=False,
    )
    await trainer.fit(TinyModule(), make_loader(32, 8))
    assert all(h != host.handler for h in probe.during.values())

    class SignalDuringValidation(Plugin):
        @on(Teardown)
        def _end(self, event: Teardown) -> None:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer = Trainer(plugins=[SignalDuringValidation()], preemption=True)
    with pytest.raises(Preempted, match="SIGTERM"):
        await trainer.validate(TinyModule(), make_loader(32, 8))
    assert signal.getsignal(signal.SIGTERM) == host.handler


def test_outside_the_main_thread_the_handlers_are_left_alone(
    caplog: pytest.LogCaptureFixture, host: Host
) -> None:
    probe = Probe()
    trainer = Trainer(max_epochs=1, plugins=[probe], enable_model_summary=False, preemption=True)
    errors: list[BaseException] = []

    def train() -> None:
        try:
            loopbus.run(trainer.fit, TinyModule(), make_loader(32, 8))
        except BaseException as exc:
            errors.append(exc)

    with caplog.at_level(logging.WARNING, logger="loopbus"):
        thread = threading.Thread(target=train)
        thread.start()
        thread.join()
    assert errors == []
    assert "outside the main thread" in caplog.text
    assert all(h == host.handler for h in probe.during.values())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"preemption": "yes"}, r"preemption must be 'auto'.*True \(always\).*got 'yes'"),
        ({"preemption": 1}, r"preemption must be 'auto'.*got 1"),
        ({"preemption_exit_code": 300}, r"preemption_exit_code must be an exit status in 0\.\.255"),
        ({"preemption_exit_code": True}, r"preemption_exit_code must be.*got True"),
        ({"preemption_grace_s": 0}, r"preemption_grace"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        Trainer(**options)


def test_options_are_read_only_attributes() -> None:
    trainer = Trainer(preemption=False, preemption_exit_code=0, preemption_grace_s=20)
    assert (trainer.preemption, trainer.preemption_exit_code, trainer.preemption_grace_s) == (
        False,
        0,
        20.0,
    )
    with pytest.raises(AttributeError, match=r"Trainer\.preemption cannot be changed"):
        trainer.preemption = True


async def test_last_checkpoint_path_is_a_property_and_calling_it_is_deprecated(
    tmp_path: Path,
) -> None:
    checkpoint = Checkpoint(tmp_path, every_n_steps=2)
    assert checkpoint.last_checkpoint_path is None
    trainer = Trainer(max_epochs=1, plugins=[checkpoint], enable_model_summary=False)
    await trainer.fit(TinyModule(), make_loader(32, 8))
    # The end-of-fit save, after the periodic one of the same step (which it keeps).
    last = tmp_path / "epoch=0-step=4-v1.ckpt"
    assert checkpoint.last_checkpoint_path == last
    with pytest.warns(DeprecationWarning, match="property now"):
        called = checkpoint.last_checkpoint_path()
    assert called == last
    assert type(called) is type(Path())


async def test_the_event_loops_own_signal_handling_keeps_working(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    """An application that handles SIGUSR1 through its event loop (asyncio's
    ``loop.add_signal_handler``, trio's ``open_signal_receiver``) still gets the signal
    that preempted the stage, and still has its handling afterwards."""
    trainer = Trainer(max_epochs=2, plugins=[Aware(send=signal.SIGUSR1, at=2)])
    trainer_module = TinyModule()
    if anyio_backend[0] == "asyncio":
        import asyncio

        loop = asyncio.get_running_loop()
        got: list[str] = []
        loop.add_signal_handler(signal.SIGUSR1, got.append, "first")
        try:
            installed = signal.getsignal(signal.SIGUSR1)
            with pytest.raises(Preempted, match="SIGUSR1"):
                await trainer.fit(trainer_module, make_loader(64, 4))
            await asyncio.sleep(0.05)  # the loop reads its wakeup pipe
            assert got == ["first"]
            assert signal.getsignal(signal.SIGUSR1) == installed
            loop.add_signal_handler(signal.SIGUSR1, got.append, "second")
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.sleep(0.05)
            assert got == ["first", "second"]
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
    else:
        import trio

        with trio.open_signal_receiver(signal.SIGUSR1) as received:
            with pytest.raises(Preempted, match="SIGUSR1"):
                await trainer.fit(trainer_module, make_loader(64, 4))
            with trio.fail_after(5):
                assert await received.__anext__() == signal.SIGUSR1
            os.kill(os.getpid(), signal.SIGUSR1)
            with trio.fail_after(5):
                assert await received.__anext__() == signal.SIGUSR1


async def test_a_plugin_with_a_last_checkpoint_path_method_still_resumes(tmp_path: Path) -> None:
    """``ckpt_path="last"`` reads ``last_checkpoint_path`` as a property (``Checkpoint``)
    and still calls a plugin's method of that name (the protocol before it was one)."""
    checkpoint = Checkpoint(tmp_path, every_n_steps=2)
    trainer = Trainer(max_epochs=1, plugins=[checkpoint], enable_model_summary=False)
    await trainer.fit(TinyModule(), make_loader(32, 8))

    class Finder(Plugin):
        def last_checkpoint_path(self) -> Path | None:
            return loopbus.latest_checkpoint(tmp_path)

    resumed = Trainer(max_epochs=2, plugins=[Finder()], enable_model_summary=False)
    with pytest.warns(UserWarning, match=r"epoch=0-step=4-v1\.ckpt with ckpt_strict=False"):
        # Strict would refuse: the checkpoint holds the Checkpoint plugin's state.
        await resumed.fit(TinyModule(), make_loader(32, 8), ckpt_path="last", ckpt_strict=False)
    assert resumed.global_step == 8
