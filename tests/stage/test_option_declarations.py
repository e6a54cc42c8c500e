"""Each trainer option is declared once, and everything else is made from, or tested
against, the declaration: ``Trainer``'s signature, the trainer's attributes,
``TrainerOptions.replace``, the deprecated old names, the reference table, the tuning
tools' trial trainers. ``Trainer(name=value)`` and ``trainer.name = value`` take one
path: the same options, or the same error."""

from __future__ import annotations

import ast
import inspect
import math
import pickle
import re
import types
import warnings
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import loopbus
import loopbus._renamed
from loopbus import MisconfigurationError, Trainer, TrainerOptions
from loopbus.plugins.tuning import BatchSizeFinder, LRFinder, find_lr
from loopbus.plugins.tuning._lr_finder import _sweep_trainer
from loopbus.stage import _options
from tests.helpers import ROOT, TinyModule, make_loader

DECLARATIONS = {d.name: d for d in TrainerOptions.declarations()}
MUTABLE = [name for name, d in DECLARATIONS.items() if d.mutable]
FIXED = [name for name, d in DECLARATIONS.items() if not d.mutable]
DERIVED = ["defaulted_epochs", "compile_optimizer"]
RENAMED = {d.renamed_from: name for name, d in DECLARATIONS.items() if d.renamed_from}


def strategy_for(annotation: Any) -> st.SearchStrategy[Any] | None:
    """Values of ``annotation`` where it is made of simple types (None otherwise)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return st.sampled_from(get_args(annotation))
    if origin in (Union, types.UnionType):
        parts = [s for s in map(strategy_for, get_args(annotation)) if s is not None]
        return st.one_of(parts) if parts else None
    simple: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        bool: st.booleans(),
        int: st.integers(min_value=-3, max_value=10**6),
        float: st.floats(allow_nan=True, allow_infinity=True),
        str: st.text(max_size=6),
    }
    return simple.get(annotation)


#: Values no option should take (or only some): mistakes a user or a config file makes.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=5),
    st.floats(min_value=-2, max_value=2),
    st.sampled_from(["", "auto", "-1", "1", "none", [], {}, (1,), object()]),
)


def values_for(name: str) -> st.SearchStrategy[Any]:
    """The declared examples, values of the declared type, and junk."""
    declaration = DECLARATIONS[name]
    parts = [st.sampled_from(declaration.examples), JUNK]
    typed = strategy_for(declaration.type)
    if typed is not None:
        parts.append(typed)
    return st.one_of(parts)


def outcome(build: Callable[[], Trainer]) -> tuple[Any, Any]:
    """("ok", the options) or (the error's type, its message)."""
    try:
        return "ok", build().options
    except Exception as error:
        return type(error), str(error)


def assigned(name: str, value: Any) -> Trainer:
    trainer = Trainer(plugins=[])
    setattr(trainer, name, value)
    return trainer


@pytest.mark.parametrize("name", MUTABLE)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_building_and_assigning_take_one_path(name: str, data: st.DataObject) -> None:
    value = data.draw(values_for(name), label=name)
    built = outcome(lambda: Trainer(plugins=[], **{name: value}))
    set_later = outcome(lambda: assigned(name, value))
    assert built == set_later


@pytest.mark.parametrize("name", FIXED)
def test_a_fixed_option_is_built_with_and_refused_later(name: str) -> None:
    declaration = DECLARATIONS[name]
    for value in declaration.examples:
        trainer = Trainer(plugins=[], **{name: value})
        if name in _options.NOT_ATTRIBUTES:  # trainer.strategy: the strategy object
            assert trainer.options.strategy == value
            continue
        before = trainer.options
        with pytest.raises(AttributeError, match=rf"Trainer\.{name} cannot be changed") as info:
            setattr(trainer, name, value)
        assert declaration.fixed_because in str(info.value)
        assert trainer.options is before


@pytest.mark.parametrize("name", DERIVED)
def test_a_derived_value_is_read_not_set(name: str) -> None:
    trainer = Trainer(plugins=[], max_epochs=2)
    assert getattr(trainer, name) == getattr(trainer.options, name)
    with pytest.raises(AttributeError, match=rf"Trainer\.{name} cannot be set: .*follows"):
        setattr(trainer, name, True)
    with pytest.raises(TypeError, match=rf"'{name}' is no option but follows from"):
        Trainer(plugins=[], **{name: True})


@pytest.mark.parametrize("name", list(DECLARATIONS))
def test_every_option_is_checked(name: str) -> None:
    with pytest.raises(MisconfigurationError, match=name):
        Trainer(plugins=[], **{name: object()})


@pytest.mark.parametrize("value", [-1.0, -0.5, "10", True, math.nan])
def test_drain_timeout_is_a_number_of_seconds(value: Any) -> None:
    message = rf"drain_timeout_s must be a number of seconds >= 0, got {re.escape(repr(value))}"
    with pytest.raises(MisconfigurationError, match=message):
        Trainer(plugins=[], drain_timeout_s=value)
    trainer = Trainer(plugins=[])
    with pytest.raises(MisconfigurationError, match=message):
        trainer.drain_timeout_s = value
    assert Trainer(plugins=[], drain_timeout_s=0).drain_timeout_s == 0.0


def test_max_steps_alone_means_no_epoch_limit_however_it_is_given() -> None:
    built = Trainer(plugins=[], max_steps=100)
    later = Trainer(plugins=[])
    assert later.defaulted_epochs
    later.max_steps = 100
    assert (later.max_epochs, later.max_steps, later.defaulted_epochs) == (math.inf, 100, False)
    assert later.options == built.options
    later.max_steps = None  # neither given again: the default 1000 epochs
    assert (later.max_epochs, later.defaulted_epochs) == (1000, True)
    assert later.options == Trainer(plugins=[]).options


def test_fast_dev_run_wins_however_a_limit_is_given() -> None:
    built = Trainer(plugins=[], fast_dev_run=2, max_epochs=5, limit_train_batches=10)
    later = Trainer(plugins=[], fast_dev_run=2)
    later.max_epochs = 5
    later.limit_train_batches = 10
    assert later.options == built.options
    assert (later.max_epochs, later.limit_train_batches) == (1, 2)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_the_options_as_given_build_the_same_options(data: st.DataObject) -> None:
    names = data.draw(st.sets(st.sampled_from(list(DECLARATIONS)), max_size=6), label="names")
    given_values = {name: data.draw(st.sampled_from(DECLARATIONS[name].examples)) for name in names}
    first = Trainer(plugins=[], **given_values).options
    assert Trainer(plugins=[], **first.given).options == first
    assert TrainerOptions.parse(**first.given) == first


def test_the_signature_is_the_declarations() -> None:
    parameters = inspect.signature(Trainer).parameters
    options = {
        name: p.default
        for name, p in parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("plugins", "precision")
    }
    assert options == {name: d.default for name, d in DECLARATIONS.items()}


def test_the_trainer_and_its_options_offer_the_same_names() -> None:
    trainer = Trainer(plugins=[])
    fields = set(DECLARATIONS) | set(DERIVED)
    on_options = {name for name in fields if hasattr(trainer.options, name)}
    on_trainer = {
        name for name in fields if isinstance(getattr(Trainer, name, None), _options.Option)
    }
    assert on_options == fields
    # trainer.strategy is the strategy object the option was resolved to.
    assert on_options - on_trainer == {"strategy"} == _options.NOT_ATTRIBUTES
    assert trainer.options.strategy == "auto"
    assert isinstance(trainer.strategy, loopbus.Strategy)
    for name in on_trainer:
        assert getattr(trainer, name) == getattr(trainer.options, name), name


def typed_names(cls_name: str) -> set[str]:
    """The names in the ``if TYPE_CHECKING:`` block of ``cls_name`` in ``_options``."""
    tree = ast.parse(inspect.getsource(_options))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    block = next(n for n in cls.body if isinstance(n, ast.If))
    names: set[str] = set()
    for node in block.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_the_typed_names_for_editors_are_the_declarations() -> None:
    fields = set(DECLARATIONS) | set(DERIVED)
    assert typed_names("TrainerOptions") == fields
    assert typed_names("OptionAttributes") == fields - {"strategy"} | set(RENAMED)


# ---------------------------------------------------------------- old names
@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No old name warned yet, whatever ran before."""
    monkeypatch.setattr(loopbus._renamed, "_WARNED", set())


@pytest.mark.usefixtures("fresh_warnings")
@pytest.mark.parametrize(("old", "new"), list(RENAMED.items()))
def test_old_names_still_work_with_a_deprecation_warning(old: str, new: str) -> None:
    value = DECLARATIONS[new].examples[-1]
    with pytest.warns(DeprecationWarning, match=rf"Trainer\({old}=\.\.\.\) is deprecated.*{new}"):
        trainer = Trainer(plugins=[], **{old: value})
    assert getattr(trainer.options, new) == value
    with pytest.warns(DeprecationWarning, match=rf"Trainer\.{old} is deprecated.*{new}"):
        assert getattr(trainer, old) == value
    with pytest.warns(DeprecationWarning, match=rf"TrainerOptions\.{old} is deprecated"):
        assert getattr(trainer.options, old) == value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if DECLARATIONS[new].mutable:
            setattr(trainer, old, DECLARATIONS[new].default)
            assert getattr(trainer, new) == DECLARATIONS[new].default
        else:
            with pytest.raises(AttributeError, match=rf"Trainer\.{new} cannot be changed"):
                setattr(trainer, old, value)


def test_the_strategies_keep_their_own_old_names() -> None:
    assert set(loopbus._renamed.RENAMED.items()) <= set(RENAMED.items())


# ---------------------------------------------------------------- the reference
def trainer_entry() -> str:
    text = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    start = text.index("### `loopbus.Trainer`\n")
    return text[start : text.index("\n### ", start + 1)]


def shown(default: Any) -> str:
    return f'"{default}"' if isinstance(default, str) else repr(default)


@pytest.mark.parametrize("name", list(DECLARATIONS))
def test_the_reference_table_has_each_option_with_its_default(name: str) -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", trainer_entry(), re.M))
    assert name in rows, f"docs/reference.md's Trainer table has no row for {name}"
    assert rows[name] == shown(DECLARATIONS[name].default), name
    old = DECLARATIONS[name].renamed_from
    assert old is None or f"`{old}`" in trainer_entry()


# ---------------------------------------------------------------- trial trainers
#: A run's options, none of them at its default.
RUN = {
    "max_epochs": 7,
    "limit_train_batches": 3,
    "limit_val_batches": 0.5,
    "val_check_interval": 5,
    "check_val_every_n_epoch": 2,
    "accumulate_grad_batches": 2,
    "gradient_clip_val": 1.0,
    "gradient_clip_algorithm": "value",
    "device": "cpu",
    "leak_check": "warn",
    "yield_interval_s": 0.01,
    "drain_timeout_s": 3.0,
    "prefetch": 1,
    "device_prefetch": 0,
    "put_lag": 2,
    "process_group_timeout_s": 60.0,
    "stop_check_interval_s": 0.5,
    "preemption_exit_code": 3,
    "preemption_grace_s": 5.0,
}
#: What a trial changes: its length, and no sanity check, summary, preemption, dev run.
TRIAL = {
    "max_epochs",
    "max_steps",
    "defaulted_epochs",
    "num_sanity_val_steps",
    "enable_model_summary",
    "preemption",
    "fast_dev_run",
    "strategy",  # the run's strategy object, not the option it was resolved from
}


class Seen(TinyModule):
    """Keeps the options of each trainer that trained it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[TrainerOptions] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.seen.append(self.trainer.options)  # type: ignore[attr-defined]
        return super().training_step(batch, ctx)


def assert_a_trial_of(trainer: Trainer, trial: TrainerOptions) -> None:
    fields = (set(DECLARATIONS) | set(DERIVED)) - TRIAL
    assert {n: getattr(trial, n) for n in fields} == {
        n: getattr(trainer.options, n) for n in fields
    }
    assert (trial.num_sanity_val_steps, trial.enable_model_summary) == (0, False)
    assert (trial.preemption, trial.fast_dev_run) == (False, 0)
    assert trial.strategy is trainer.strategy


def test_the_lr_sweep_trains_with_every_option_of_the_run() -> None:
    trainer = Trainer(plugins=[], **RUN)
    module = Seen()
    find_lr(trainer, module, make_loader(), num_training=3)
    assert module.seen
    assert_a_trial_of(trainer, module.seen[0])
    assert module.seen[0].max_steps == 3


def test_the_lr_sweep_runs_eagerly() -> None:
    trainer = Trainer(plugins=[], device="cpu", compile={"backend": "eager"})
    sweep = _sweep_trainer(trainer, LRFinder(num_training=3), trainer.precision, [])
    assert sweep.options.compile is None
    assert (sweep.options.device, sweep.strategy) == (trainer.options.device, trainer.strategy)


async def test_the_batch_size_trials_train_with_every_option_of_the_run() -> None:
    trainer = Trainer(plugins=[], **RUN)
    module = Seen()
    await BatchSizeFinder(max_trials=2, steps_per_trial=1).search(trainer, module, make_loader())
    assert module.seen
    assert_a_trial_of(trainer, module.seen[0])
    assert (module.seen[0].max_steps, module.seen[0].max_epochs) == (1, math.inf)


def test_the_options_as_given_are_read_only_and_travel() -> None:
    options = Trainer(plugins=[], max_steps=-1, fast_dev_run=True).options
    assert (options.given["max_steps"], options.given["fast_dev_run"]) == (math.inf, 1)
    with pytest.raises(TypeError):
        options.given["max_steps"] = 3  # type: ignore[index]
    copied = pickle.loads(pickle.dumps(options))
    assert copied == options
    assert copied.given == options.given
