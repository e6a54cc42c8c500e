"""The run's state has one owner, checkpoints are composed from a registry of Stateful
parts, and a refused call changes nothing."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import CheckpointError, MisconfigurationError, Plugin, Trainer, on
from loopbus.events import FitStarted, TrainBatchCompleted
from loopbus.state import RunState
from tests.ckpt_scenario import STATEFUL_WARNING, Net, SaveAtStep, make_data

SRC = Path(loopbus.__file__).parent


# ---------------------------------------------------------------- one writer


def test_state_fields_are_read_only() -> None:
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    for name in ("global_step", "current_epoch", "should_stop", "stop_reason", "stage"):
        with pytest.raises(AttributeError):
            setattr(trainer, name, 1)
    for name in RunState.__slots__:  # every field, public or not, refuses a write
        with pytest.raises(AttributeError, match="read-only"):
            setattr(trainer.state, name, 1)
    with pytest.raises(AttributeError):
        trainer.state.anything_else = 1  # type: ignore[attr-defined]


def _assigned_attributes(path: Path) -> list[tuple[int, str, str]]:
    """(line, object expression, attribute) of every attribute assignment whose object
    is not ``self`` or ``cls``."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        found += [
            (node.lineno, ast.unparse(sub.value), sub.attr)
            for target in targets
            for sub in ast.walk(target)
            if isinstance(sub, ast.Attribute)
            and not (isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"))
        ]
    return found


# The state's fields refuse a write at run time (above); what the engine's modules must
# not write either are the trainer's views of them (and the state's private fields).
RUN_STATE_FIELDS = {name for name in RunState.__slots__ if name.startswith("_")} | {
    "global_step",
    "current_epoch",
    "should_stop",
    "stop_reason",
    "stop_requested",
}

# Private attributes a module may set on objects it creates itself (the object's class
# lives in that module): a scope's links, a subscription's streams, torch's state-dict
# metadata on a copy.
SAME_MODULE_PRIVATE = {
    "state/_scope.py": {"_parent", "_borrowed"},
    "events/_bus.py": {"_send", "_recv", "_done"},
    "checkpoint/_write.py": {"_metadata"},
}


def test_no_module_outside_the_run_state_assigns_its_fields() -> None:
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "state/_runstate.py":
            continue
        for line, obj, attr in _assigned_attributes(path):
            if attr in RUN_STATE_FIELDS:
                offences.append(f"{rel}:{line}: {obj}.{attr} = ...")
    assert not offences, "the run state is written outside RunState:\n" + "\n".join(offences)


def test_no_module_assigns_private_attributes_of_another_object() -> None:
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        allowed = SAME_MODULE_PRIVATE.get(rel, set())
        for line, obj, attr in _assigned_attributes(path):
            if attr.startswith("_") and not attr.startswith("__") and attr not in allowed:
                offences.append(f"{rel}:{line}: {obj}.{attr} = ...")
    assert not offences, "private attributes written from outside:\n" + "\n".join(offences)


async def test_request_stop_goes_through_the_state() -> None:
    class StopAtTwo(Plugin):
        @on(TrainBatchCompleted)
        def batch(self, event: TrainBatchCompleted) -> None:
            if event.step == 2:
                self.trainer.request_stop("two is enough")

        def setup(self, trainer: Trainer, stage: str) -> None:
            self.trainer = trainer

    loopbus.seed_everything(0)
    module = Net()
    train, _ = make_data("plain")
    trainer = Trainer(max_epochs=1, plugins=[StopAtTwo()], device="cpu")
    await trainer.fit(module, train)
    assert trainer.global_step == trainer.state.step == 2
    assert trainer.should_stop
    assert trainer.state.stop_requested
    assert trainer.stop_reason == trainer.state.stop_reason == "two is enough"
    assert trainer.stage is None
    # The next stage starts without the stop request.
    await trainer.validate(module, make_data("plain")[1])
    assert not trainer.should_stop


# ---------------------------------------------------------------- a refused call


def _stateful(n_train: int = 64) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", STATEFUL_WARNING)
        return make_data("stateful", n_train=n_train)[0]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


class Intruder(Plugin):
    """Calls a second fit at step 2 (refused) and takes the state at step 4."""

    def __init__(self, intrude: bool) -> None:
        self.intrude = intrude
        self.saved: dict[str, Any] = {}

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    async def batch(self, event: TrainBatchCompleted) -> None:
        if event.step == 2 and self.intrude:
            with pytest.raises(RuntimeError, match="already running 'fit'"):
                await self.trainer.fit(Net(), _stateful(n_train=32))
        if event.step == 4:
            self.saved.update(self.trainer.state_dict(to_host=True))


async def test_a_refused_second_fit_changes_nothing() -> None:
    """A second fit while one runs is refused; before the fix it set the training data
    on its way, so the running fit's later checkpoints saved the other loader's
    position."""
    saved = []
    for intrude in (False, True):
        loopbus.seed_everything(0)
        spy = Intruder(intrude)
        trainer = Trainer(max_steps=5, plugins=[spy], device="cpu")
        await trainer.fit(Net(), _stateful())
        assert trainer.global_step == 5
        saved.append(spy.saved)
    # The position saved at step 4 is the running loader's, exactly as without the
    # refused call.
    assert _same(saved[1]["data/train"], saved[0]["data/train"])
    assert saved[1]["run"] == saved[0]["run"] == {"step": 4, "epoch": 0}


async def test_a_refused_call_keeps_the_resume_plan(tmp_path: Path) -> None:
    loopbus.seed_everything(0)
    module = Net()
    train, _ = make_data("plain")
    trainer = Trainer(max_steps=3, plugins=[], device="cpu")
    await trainer.fit(module, train)
    path = trainer.save_checkpoint(tmp_path / "a.ckpt")

    plans: list[Any] = []

    class Caller(Plugin):
        def setup(self, trainer: Trainer, stage: str) -> None:
            self.trainer = trainer

        @on(FitStarted)
        async def started(self, event: FitStarted) -> None:
            plans.append(self.trainer.state.resume)
            with pytest.raises(RuntimeError, match="already running"):
                await self.trainer.validate(module, train)
            plans.append(self.trainer.state.resume)

    trainer = Trainer(max_steps=5, plugins=[Caller()], device="cpu")
    await trainer.fit(Net(), make_data("plain")[0], ckpt_path=path)
    assert plans[0] is not None
    assert plans[0] is plans[1]
    assert plans[0].step == 3
    assert trainer.global_step == 5
    assert trainer.state.resume is None  # consumed


# ---------------------------------------------------------------- the registry


class Ema:
    """A user's exponential moving average of the weights: Stateful, not a plugin."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.updates = 0

    def update(self, module: torch.nn.Module) -> None:
        with torch.no_grad():
            for k, v in module.state_dict().items():
                self.shadow[k].mul_(0.9).add_(v, alpha=0.1)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": dict(self.shadow), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.updates = int(state["updates"])


class EmaNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.ema = Ema(self)

    @on(TrainBatchCompleted)
    def _update(self, event: TrainBatchCompleted) -> None:
        self.ema.update(self)


async def test_a_registered_stateful_object_is_saved_and_restored(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    loopbus.seed_everything(0)
    module = EmaNet()
    trainer = Trainer(max_steps=6, plugins=[SaveAtStep(path, 3)], device="cpu")
    trainer.register_stateful("ema", module.ema)
    await trainer.fit(module, make_data("plain")[0])
    reference = {k: v.clone() for k, v in module.ema.shadow.items()}
    assert module.ema.updates == 6
    assert loopbus.load_checkpoint(path)["user/ema"]["updates"] == 3

    loopbus.seed_everything(99)
    resumed = EmaNet()
    trainer = Trainer(max_steps=6, plugins=[SaveAtStep(tmp_path / "unused.ckpt", 0)], device="cpu")
    trainer.register_stateful("ema", resumed.ema)
    with pytest.warns(UserWarning, match="skipping the 3 batches"):
        await trainer.fit(resumed, make_data("plain")[0], ckpt_path=path)
    assert resumed.ema.updates == 6
    for k, v in reference.items():
        assert torch.equal(resumed.ema.shadow[k], v), k

    # A run that does not register it is told what is in the checkpoint and not here.
    trainer = Trainer(max_steps=6, plugins=[SaveAtStep(tmp_path / "unused.ckpt", 0)], device="cpu")
    with pytest.raises(CheckpointError, match=r"user/ema: the checkpoint has state for it"):
        await trainer.fit(EmaNet(), make_data("plain")[0], ckpt_path=path)


def test_register_stateful_validates() -> None:
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    with pytest.raises(MisconfigurationError, match="state_dict"):
        trainer.register_stateful("x", object())  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match="without '/'"):
        trainer.register_stateful("a/b", Ema(Net()))
    trainer.register_stateful("x", ema := Ema(Net()))
    trainer.register_stateful("x", ema)  # the same object again is fine
    with pytest.raises(MisconfigurationError, match="already registered as 'x'"):
        trainer.register_stateful("x", Ema(Net()))


class Tally(Plugin):
    """Counts batches; two instances have the same state_key."""

    def __init__(self, weight: int) -> None:
        self.weight = weight
        self.total = 0

    @on(TrainBatchCompleted)
    def batch(self, event: TrainBatchCompleted) -> None:
        self.total += self.weight

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = state["total"]


async def test_two_plugins_of_one_class_keep_separate_state(tmp_path: Path) -> None:
    loopbus.seed_everything(0)
    trainer = Trainer(max_steps=4, plugins=[Tally(1), Tally(10)], device="cpu")
    await trainer.fit(Net(), make_data("plain")[0])
    path = trainer.save_checkpoint(tmp_path / "a.ckpt")
    saved = loopbus.load_checkpoint(path)
    assert saved["plugins/Tally"] == {"total": 4}
    assert saved["plugins/Tally#2"] == {"total": 40}

    first, second = Tally(1), Tally(10)
    trainer = Trainer(max_steps=6, plugins=[first, second], device="cpu")
    await trainer.fit(Net(), make_data("plain")[0], ckpt_path=path)
    assert (first.total, second.total) == (6, 60)


async def test_stateful_parts_is_the_registry(tmp_path: Path) -> None:
    loopbus.seed_everything(0)
    trainer = Trainer(max_steps=2, plugins=[Tally(1)], device="cpu")
    trainer.register_stateful("ema", Ema(Net()))
    await trainer.fit(Net(), _stateful())
    parts = trainer.stateful_parts()
    assert list(parts) == [
        "run",
        "rng",
        "module",
        "hparams",
        "optimizers/0",
        "lr_schedulers/0",
        "precision",
        "loops/fit",
        "loops/validate",
        "loops/test",
        "loops/predict",
        "plugins/Tally",
        "data/train",
        "grads",
        "records",
        "user/ema",
    ]
    assert all(isinstance(p, loopbus.Stateful) for p in parts.values())
    state = trainer.state_dict()
    assert [k for k in state if k != "loopbus"] == list(parts)
    assert state["loopbus"]["parts"] == list(parts)


async def test_an_old_format_is_refused_naming_its_version(tmp_path: Path) -> None:
    loopbus.seed_everything(0)
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    await trainer.fit(Net(), make_data("plain")[0])
    state = trainer.state_dict()
    state["loopbus"]["format_version"] = 1
    path = tmp_path / "old.ckpt"
    torch.save(state, path)
    with pytest.raises(
        CheckpointError, match=r"old\.ckpt uses checkpoint format 1.*reads format 2"
    ):
        loopbus.load_checkpoint(path)
