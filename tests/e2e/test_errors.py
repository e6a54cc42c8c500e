"""One exception family for bad options, validators with one wording, public names."""

from __future__ import annotations

import inspect
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

import loopbus
from loopbus import (
    LoopbusError,
    MisconfigurationError,
    SubscriptionError,
    check_choice,
    check_int,
    check_number,
)
from loopbus import _exceptions as exceptions_module
from loopbus.events import EventBus, FitStarted
from loopbus.plugins import (
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    JSONLLogger,
    LearningRateMonitor,
    MixedPrecision,
    ProgressBar,
    StreamServer,
    Timer,
)

PUBLIC_MODULES = (loopbus, loopbus.events, loopbus.stream, loopbus.plugins)


# ---------------------------------------------------------------- the exceptions


def test_traceback_shows_the_public_name() -> None:
    error = MisconfigurationError("max_epochs must be an int >= 0, got -1.")
    assert traceback.format_exception_only(error) == [
        "loopbus.MisconfigurationError: max_epochs must be an int >= 0, got -1.\n"
    ]
    with pytest.raises(MisconfigurationError) as info:
        EarlyStopping("val/loss", patience=-1)
    last = traceback.format_exception(info.value)[-1]
    assert last.startswith("loopbus.MisconfigurationError: EarlyStopping(patience=...)")


@pytest.mark.parametrize("name", exceptions_module.__all__)
def test_every_exception_is_public_and_says_when_it_is_raised(name: str) -> None:
    cls = getattr(loopbus, name)
    assert cls is getattr(exceptions_module, name)
    assert cls.__module__ == "loopbus"
    assert cls.__qualname__ == name
    assert (cls.__doc__ or "").startswith("Raised ")
    error = cls.__new__(cls, "x")
    error.args = ("x",)
    assert traceback.format_exception_only(error) == [f"loopbus.{name}: x\n"]


def test_the_family() -> None:
    assert issubclass(MisconfigurationError, LoopbusError)
    assert issubclass(MisconfigurationError, ValueError)
    # A bad subscription is a bad option too, and stays the TypeError it always was.
    assert issubclass(SubscriptionError, MisconfigurationError)
    assert issubclass(SubscriptionError, TypeError)
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        EventBus().subscribe(FitStarted, lambda e: None, every=0)


def _exports(module: Any) -> list[tuple[str, Any]]:
    return [(name, getattr(module, name)) for name in module.__all__]


def test_exports_carry_public_module_names() -> None:
    for module in PUBLIC_MODULES:
        for name, obj in _exports(module):
            if not (isinstance(obj, type) or inspect.isfunction(obj)):
                continue
            owner = obj.__module__
            if isinstance(obj, type) and inspect.get_annotations(obj):
                # Annotations are evaluated in sys.modules[cls.__module__]: kept.
                continue
            assert not any(part.startswith("_") for part in owner.split(".")), (name, owner)
            assert getattr(sys.modules[owner], name) is obj, (name, owner)


def test_renamed_classes_keep_working() -> None:
    assert loopbus.Trainer.__module__ == "loopbus"
    assert loopbus.Trainer.fit.__module__ == "loopbus"
    assert loopbus.EventBus.__module__ == "loopbus.events"
    assert loopbus.plugins.EarlyStopping.__module__ == "loopbus.plugins"
    assert loopbus.connect.__module__ == "loopbus.stream"
    # Qualified names, which plugins' checkpoint keys use, are unchanged.
    assert loopbus.plugins.EarlyStopping.__qualname__ == "EarlyStopping"
    assert loopbus.Trainer.fit.__qualname__ == "Trainer.fit"
    # msgspec resolves a Struct's annotations in its module: they must still resolve.
    for module in (loopbus.events, loopbus.stream, loopbus.plugins):
        for _, obj in _exports(module):
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
                msgspec.json.Decoder(obj)
                msgspec.msgpack.Decoder(obj)


# ---------------------------------------------------------------- the validators


def test_check_int() -> None:
    assert check_int("every", 3) == 3
    assert check_int("max_epochs", 0, minimum=0) == 0
    assert check_int("priority", -5, minimum=None) == -5
    assert check_int("port", 65535, minimum=0, maximum=65535) == 65535
    assert check_int("every", None, allow_none=True) is None
    with pytest.raises(MisconfigurationError, match=r"^every must be an int >= 1, got True\.$"):
        check_int("every", True)
    with pytest.raises(MisconfigurationError, match=r"^every must be an int >= 1, got None\.$"):
        check_int("every", None)
    with pytest.raises(MisconfigurationError, match=r"got 2\.0"):
        check_int("every", 2.0)
    with pytest.raises(MisconfigurationError, match=r"got '3'"):
        check_int("every", "3")
    # The wording the Trainer's own checks use.
    with pytest.raises(MisconfigurationError, match=r"max_epochs must be an int >= 0, got -1"):
        check_int("max_epochs", -1, minimum=0, allow_none=True)
    with pytest.raises(
        MisconfigurationError,
        match=r"^StreamServer\(port=\.\.\.\) must be an int from 0 to 65535, got 70000; "
        r"0 picks a free port\.$",
    ):
        check_int(
            "port",
            70000,
            minimum=0,
            maximum=65535,
            owner="StreamServer",
            hint="0 picks a free port",
        )
    with pytest.raises(MisconfigurationError, match=r"^priority must be an int, got 'high'\.$"):
        check_int("priority", "high", minimum=None)
    with pytest.raises(SubscriptionError, match="once must be an int >= 1, got 0"):
        check_int("once", 0, error=SubscriptionError)


def test_check_number() -> None:
    assert check_number("min_delta", 0, minimum=0) == 0.0
    assert isinstance(check_number("min_delta", 1, minimum=0), float)
    assert check_number("threshold", None, allow_none=True) is None
    assert check_number("refresh_rate", 60, exclusive_minimum=0, maximum=60) == 60.0
    assert check_number("x", -math.inf) == -math.inf
    for bad in (True, "1", None, math.nan):
        with pytest.raises(MisconfigurationError, match=rf"^x must be a number, got {bad!r}\.$"):
            check_number("x", bad)
    with pytest.raises(
        MisconfigurationError,
        match=r"^Timer\(linger=\.\.\.\) must be a number of seconds >= 0, got -1\.$",
    ):
        check_number("linger", -1, minimum=0, owner="Timer", what="a number of seconds")
    with pytest.raises(MisconfigurationError, match=r"must be a number in \(0, 60\], got 0\.$"):
        check_number("refresh_rate", 0, exclusive_minimum=0, maximum=60)
    with pytest.raises(MisconfigurationError, match=r"must be a number > 0, got 0\.0\.$"):
        check_number("timeout", 0.0, exclusive_minimum=0)


def test_check_choice() -> None:
    assert check_choice("interval", "step", ("step", "epoch")) == "step"
    with pytest.raises(
        MisconfigurationError, match=r"^interval must be 'step' or 'epoch', got 'batch'\.$"
    ):
        check_choice("interval", "batch", ("step", "epoch"))
    with pytest.raises(
        MisconfigurationError,
        match=r"^EarlyStopping\(mode=\.\.\.\) must be 'min' \(lower is better\) or 'max' "
        r"\(higher is better\), got 'up'\.$",
    ):
        check_choice(
            "mode",
            "up",
            {"min": "lower is better", "max": "higher is better"},
            owner="EarlyStopping",
        )
    with pytest.raises(MisconfigurationError, match=r"must be 'a', 'b' or 'c', got \['a'\]"):
        check_choice("x", ["a"], ("a", "b", "c"))


# ---------------------------------------------------------------- bad options


BAD_OPTIONS: list[tuple[str, Callable[[Path], object], str]] = [
    ("patience", lambda p: EarlyStopping("val/loss", patience=-1), "-1"),
    ("patience", lambda p: EarlyStopping("val/loss", patience=True), "True"),
    ("min_delta", lambda p: EarlyStopping("val/loss", min_delta=-0.1), "-0.1"),
    ("mode", lambda p: EarlyStopping("val/loss", mode="up"), "'up'"),  # type: ignore[arg-type]
    ("monitor", lambda p: EarlyStopping(""), "''"),
    ("every_n_steps", lambda p: Checkpoint(p, every_n_steps=-1), "-1"),
    ("every_n_epochs", lambda p: Checkpoint(p, every_n_epochs=0), "0"),
    ("keep_last", lambda p: Checkpoint(p, keep_last=1.5), "1.5"),  # type: ignore[arg-type]
    ("mode", lambda p: Checkpoint(p, mode="best"), "'best'"),  # type: ignore[arg-type]
    ("buffer", lambda p: CSVLogger(p, buffer=0), "0"),
    ("flush_interval", lambda p: CSVLogger(p, flush_interval=-1), "-1"),
    ("overflow", lambda p: JSONLLogger(p, overflow="later"), "'later'"),  # type: ignore[arg-type]
    ("mode", lambda p: JSONLLogger(p, mode="x"), "'x'"),  # type: ignore[arg-type]
    ("logging_interval", lambda p: LearningRateMonitor("batch"), "'batch'"),  # type: ignore[arg-type]
    ("precision", lambda p: MixedPrecision("fp8"), "'fp8'"),  # type: ignore[arg-type]
    ("refresh_rate", lambda p: ProgressBar(refresh_rate=0), "0"),
    ("refresh_rate", lambda p: ProgressBar(refresh_rate=61), "61"),
    ("interval", lambda p: Timer(interval="batch"), "'batch'"),  # type: ignore[arg-type]
    ("duration", lambda p: Timer(duration=-5), "-5"),
    ("port", lambda p: StreamServer(port=70000), "70000"),
    ("client_buffer", lambda p: StreamServer(client_buffer=0), "0"),
    ("max_clients", lambda p: StreamServer(max_clients=True), "True"),
    ("max_frame", lambda p: StreamServer(max_frame=63), "63"),
    ("send_buffer", lambda p: StreamServer(send_buffer=100), "100"),
    ("handshake_timeout", lambda p: StreamServer(handshake_timeout=-1), "-1"),
    ("timeout", lambda p: loopbus.connect("tcp://127.0.0.1:1", timeout=0), "0"),
    ("every", lambda p: EventBus().subscribe(FitStarted, lambda e: None, every=0), "0"),
    ("buffer", lambda p: EventBus().subscribe(FitStarted, print, mode="queued", buffer=0), "0"),
]


@pytest.mark.parametrize(("option", "build", "shown"), BAD_OPTIONS)
def test_bad_options_raise_misconfiguration_naming_the_option(
    option: str, build: Callable[[Path], object], shown: str, tmp_path: Path
) -> None:
    with pytest.raises(MisconfigurationError) as info:
        build(tmp_path)
    message = str(info.value)
    assert option in message
    assert shown in message
    assert message.endswith(".")
    assert traceback.format_exception_only(info.value)[-1].startswith(
        f"loopbus.{type(info.value).__name__}: "
    )


def test_bad_stream_addresses_are_misconfiguration() -> None:
    for bad in ("", "tcp://host", "udp://h:1", "tcp://h:70000"):
        with pytest.raises(MisconfigurationError, match="address"):
            loopbus.stream.parse_address(bad)
    with pytest.raises(MisconfigurationError, match="unknown topic"):
        loopbus.connect("tcp://127.0.0.1:1", topics=["metrics"])
