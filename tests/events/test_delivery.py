"""Plugin delivery settings under one roof (``Delivery``), the natural option names they
free (``EarlyStopping(mode=...)``), and the old spellings kept for one release."""

from __future__ import annotations

import pytest

from loopbus import Delivery, MisconfigurationError, Plugin, Trainer, on
from loopbus.events import EpochCompleted, PutRecord
from loopbus.plugins import Checkpoint, CSVLogger, EarlyStopping, ProgressBar
from tests.helpers import TinyModule, make_loader


def test_delivery_is_frozen_validated_and_replaceable() -> None:
    d = Delivery(mode="queued", ranks="zero")
    assert (d.destination, d.mode, d.buffer, d.overflow, d.priority, d.ranks) == (
        "callbacks",
        "queued",
        1024,
        "block",
        0,
        "zero",
    )
    with pytest.raises(AttributeError):
        d.mode = "inline"  # type: ignore[misc]
    assert d.replace(priority=-5) == Delivery(mode="queued", ranks="zero", priority=-5)
    for bad in (
        {"mode": "later"},
        {"overflow": "spill"},
        {"ranks": "some"},
        {"buffer": -1},
        {"priority": 1.5},
        {"destination": ""},
    ):
        with pytest.raises(MisconfigurationError, match=next(iter(bad))):
            Delivery(**bad)


def test_plugin_options_take_their_natural_names() -> None:
    stop = EarlyStopping("val/loss", mode="max")
    assert stop.mode == "max"
    assert stop.delivery.mode == "inline"
    ckpt = Checkpoint("unused", monitor="val/acc", mode="max")
    assert ckpt.mode == "max"
    assert ckpt.delivery.priority == -100
    csv = CSVLogger("unused", mode="a", overflow="drop")
    assert csv.mode == "a"
    assert (csv.delivery.mode, csv.delivery.overflow, csv.delivery.ranks) == (
        "queued",
        "drop",
        "zero",
    )
    assert type(csv).delivery.overflow == "block"  # per instance, not per class
    assert ProgressBar.delivery.ranks == "zero"


def test_the_old_names_still_work_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"delivery = Delivery\(mode='queued'"):

        class Old(Plugin):
            mode = "queued"
            priority = -3

    assert Old.delivery == Delivery(mode="queued", priority=-3)
    with pytest.warns(DeprecationWarning, match="plugin.delivery.ranks"):
        assert ProgressBar().ranks == "zero"
    with pytest.warns(DeprecationWarning, match="earlystopping.mode"):
        assert EarlyStopping("x", mode="max").monitor_mode == "max"
    with pytest.warns(DeprecationWarning, match="delivery.overflow"):
        assert CSVLogger("unused", overflow="drop").overflow_policy == "drop"


def test_an_attribute_of_the_same_name_that_is_no_delivery_setting_is_left_alone() -> None:
    class Own(Plugin):
        mode = "fast"  # the plugin's own meaning: not a delivery mode

    assert Own.mode == "fast"
    assert Own.delivery == Delivery()


def test_both_spellings_at_once_are_refused() -> None:
    with pytest.raises(TypeError, match="keep only delivery"):

        class Both(Plugin):
            delivery = Delivery(mode="queued")
            mode = "inline"


async def test_the_declared_delivery_is_what_the_bus_uses() -> None:
    modes: list[str] = []
    names: list[str] = []

    class Queued(Plugin):
        delivery = Delivery(mode="queued", destination="loggers")

        def setup(self, trainer: Trainer, stage: str) -> None:
            self.trainer = trainer

        @on(PutRecord)
        async def record(self, record: PutRecord) -> None:
            names.append(record.name)

        @on(EpochCompleted)
        async def epoch(self, event: EpochCompleted) -> None:
            modes.extend(s.mode for s in self.trainer.bus.subscriptions if s.owner.startswith("Queued."))

    trainer = Trainer(max_epochs=1, plugins=[Queued()], device="cpu")
    await trainer.fit(TinyModule(), make_loader(16))
    assert modes
    assert set(modes) == {"queued"}
    assert names  # the loggers destination got the module's records
