"""The trainer's options: typed, frozen groups read by flat names, and the renamed
options' old names kept as deprecated aliases that warn once."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import pytest

import loopbus._renamed
from loopbus import DDPStrategy, FSDPStrategy, MisconfigurationError, Trainer, TrainerOptions
from loopbus.stage._option_groups import GROUPS

#: Each option's default, as declared.
DEFAULTS = {d.name: d.default for d in TrainerOptions.declarations()}

#: Each renamed option: old name, new name, a value.
RENAMES = [
    ("yield_interval", "yield_interval_s", 0.25),
    ("drain_timeout", "drain_timeout_s", 3.0),
    ("process_group_timeout", "process_group_timeout_s", 60.0),
    ("stop_check_interval", "stop_check_interval_s", 0.5),
    ("preemption_grace", "preemption_grace_s", 30.0),
]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no old name warned yet, whatever ran before it."""
    monkeypatch.setattr(loopbus._renamed, "_WARNED", set())


def deprecations(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(("old", "new", "value"), RENAMES)
def test_an_old_trainer_keyword_warns_once_and_sets_the_new_option(
    old: str, new: str, value: float
) -> None:
    with pytest.warns(DeprecationWarning, match=rf"Trainer\({old}=\.\.\.\) is deprecated.*{new}"):
        trainer = Trainer(plugins=[], **{old: value})
    assert getattr(trainer.options, new) == value
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        again = Trainer(plugins=[], **{old: value})
    assert deprecations(record) == []
    assert getattr(again.options, new) == value


def test_the_warning_points_at_the_callers_line() -> None:
    with pytest.warns(DeprecationWarning, match="yield_interval_s") as record:
        Trainer(plugins=[], yield_interval=0.1)
    assert record[0].filename == __file__


@pytest.mark.parametrize(("old", "new", "value"), RENAMES)
def test_an_old_and_a_new_name_together_raise(old: str, new: str, value: float) -> None:
    with pytest.raises(MisconfigurationError, match=rf"both {old}= and {new}="):
        Trainer(plugins=[], **{old: value, new: value})
    with pytest.raises(MisconfigurationError, match=rf"both {old}= and {new}="):
        TrainerOptions.parse(**{old: value, new: value})


def test_the_new_name_at_its_default_still_counts_as_given() -> None:
    with pytest.raises(MisconfigurationError, match=r"both drain_timeout= and drain_timeout_s="):
        Trainer(plugins=[], drain_timeout=1.0, drain_timeout_s=10.0)


@pytest.mark.parametrize("strategy", [DDPStrategy, FSDPStrategy])
def test_strategy_keywords_are_renamed_with_aliases(strategy: Any) -> None:
    name = strategy.__name__
    fresh = strategy(process_group_timeout_s=5, stop_check_interval_s=0)
    assert (fresh.process_group_timeout, fresh._stop_interval) == (5.0, 0.0)
    with pytest.warns(DeprecationWarning, match=rf"{name}\(stop_check_interval=\.\.\.\)"):
        old = strategy(stop_check_interval=0.5)
    assert old._stop_interval == 0.5
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        strategy(stop_check_interval=0.25)
    assert deprecations(record) == []
    with pytest.raises(MisconfigurationError, match="both process_group_timeout= and"):
        strategy(process_group_timeout=5, process_group_timeout_s=1800.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'yield_interval'"):
        strategy(yield_interval=1)


def test_old_attribute_names_read_the_new_ones_with_one_warning() -> None:
    trainer = Trainer(plugins=[], yield_interval_s=0.5, drain_timeout_s=2.0, preemption_grace_s=9)
    with pytest.warns(DeprecationWarning, match=r"Trainer\.yield_interval is deprecated"):
        assert trainer.yield_interval == 0.5
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert trainer.yield_interval == 0.5
    assert deprecations(record) == []
    with pytest.warns(DeprecationWarning, match=r"TrainerOptions\.drain_timeout is deprecated"):
        assert trainer.options.drain_timeout == 2.0
    with pytest.warns(DeprecationWarning, match=r"Trainer\.preemption_grace is deprecated"):
        assert trainer.preemption_grace == 9.0


def test_every_flat_name_is_its_groups_value() -> None:
    options = Trainer(
        plugins=[], max_epochs=3, val_check_interval=2, yield_interval_s=0.1, put_lag=2
    ).options
    seen = set()
    for group, kind in GROUPS.items():
        values = getattr(options, group)
        assert type(values) is kind
        for field in dataclasses.fields(kind):
            assert getattr(options, field.name) == getattr(values, field.name), field.name
            seen.add(field.name)
    assert seen >= set(DEFAULTS)
    assert (options.lengths.max_epochs, options.validation.val_check_interval) == (3, 2)
    assert options.responsiveness.yield_interval_s == 0.1


def test_the_groups_are_frozen_and_slotted() -> None:
    options = TrainerOptions.parse(max_epochs=3)
    for group in GROUPS:
        values = getattr(options, group)
        assert not hasattr(values, "__dict__")
        field = dataclasses.fields(values)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(values, field, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.lengths = options.lengths  # type: ignore[misc]


def test_a_change_replaces_the_group_it_belongs_to() -> None:
    trainer = Trainer(plugins=[], max_epochs=3)
    before = trainer.options
    trainer.max_epochs = 4
    assert trainer.options.lengths.max_epochs == 4
    assert before.lengths.max_epochs == 3
    assert trainer.options.validation is before.validation
    with pytest.raises(AttributeError, match=r"Trainer\.put_lag cannot be changed.*recorder"):
        trainer.put_lag = 1


def test_trainer_defaults_are_the_parsers_defaults() -> None:
    """Trainer hands on only the options it was given; the rest take the parser's
    defaults, which must be the signature's."""
    parameters = inspect.signature(Trainer).parameters
    assert {name: parameters[name].default for name in DEFAULTS} == DEFAULTS
    assert TrainerOptions.parse() == Trainer(plugins=[]).options
