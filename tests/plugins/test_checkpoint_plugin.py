"""The Checkpoint plugin: when it saves, what it keeps, the last pointer, background saves,
and resuming from ``last``."""

from __future__ import annotations

import ast
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import CheckpointError, HandlerError, Plugin, Trainer, on
from loopbus.distributed import SingleProcess
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint, _checkpoint
from tests.ckpt_scenario import Net, make_data

N_TRAIN = 96
BATCH = 8
PER_EPOCH = N_TRAIN // BATCH  # 12


def build(
    checkpoint: Checkpoint,
    *,
    plugins: list[Plugin] | None = None,
    module: Net | None = None,
    **options: Any,
) -> tuple[Trainer, Net, Any, Any]:
    loopbus.seed_everything(3)
    net = module if module is not None else Net()
    train, val = make_data("plain", n_train=N_TRAIN, batch=BATCH)
    options.setdefault("max_epochs", 2)
    trainer = Trainer(plugins=[checkpoint, *(plugins or [])], device="cpu", **options)
    return trainer, net, train, val


def ckpt_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.ckpt"))


def last_name(directory: Path) -> str:
    last = loopbus.latest_checkpoint(directory)
    assert last is not None
    return last.name


class ScriptedAcc(Net):
    """Puts ``val/acc`` from a script, one value per validation run."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values = list(values)
        self.runs = 0

    def validation_step(self, batch: Any, ctx: Any) -> None:
        if ctx.batch_idx == 0 and not self.trainer.sanity_checking:
            self.put("val/acc", self.values[self.runs])
            self.runs += 1


class Crash(Plugin):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    @on(TrainBatchCompleted)
    def crash(self, event: TrainBatchCompleted) -> None:
        if event.step == self.at_step:
            raise RuntimeError("simulated crash")


# ---------------------------------------------------------------- when and what


async def test_every_n_steps_keeps_the_last_k(tmp_path: Path) -> None:
    trainer, module, train, val = build(Checkpoint(tmp_path, every_n_steps=5, keep_last=2))
    await trainer.fit(module, train, val)
    # Saves at steps 5, 10, 15, 20 and at the end (24); the last two remain.
    assert ckpt_names(tmp_path) == ["epoch=1-step=20.ckpt", "epoch=1-step=24.ckpt"]
    assert last_name(tmp_path) == "epoch=1-step=24.ckpt"
    for name in ckpt_names(tmp_path):
        assert (tmp_path / (name + ".complete")).exists()
        assert torch.load(tmp_path / name, weights_only=True)["loopbus"]["global_step"] == int(
            name.split("step=")[1].split(".")[0]
        )


class _TakingTurns(SingleProcess):
    """A strategy whose job writes only the checkpoints due at a step divisible by 10
    (as a fault-tolerant replica group writes only while it has replica rank 0)."""

    trainer: Trainer

    def writes_checkpoints(self) -> bool:
        return self.trainer.global_step % 10 == 0


async def test_a_save_is_skipped_where_another_job_of_the_run_writes_it(tmp_path: Path) -> None:
    strategy = _TakingTurns()
    trainer, module, train, val = build(
        Checkpoint(tmp_path, every_n_steps=5, keep_last=None), strategy=strategy
    )
    strategy.trainer = trainer
    await trainer.fit(module, train, val)
    # Due at steps 5, 10, 15, 20 and at the end (24): this job wrote those at 10 and 20.
    assert ckpt_names(tmp_path) == ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt"]
    assert last_name(tmp_path) == "epoch=1-step=20.ckpt"


async def test_every_epoch_by_default_keep_all(tmp_path: Path) -> None:
    trainer, module, train, val = build(Checkpoint(tmp_path, keep_last=None), max_epochs=3)
    await trainer.fit(module, train, val)
    assert ckpt_names(tmp_path) == [f"epoch={e}-step={12 * (e + 1)}.ckpt" for e in range(3)]
    state = loopbus.load_checkpoint(tmp_path / "epoch=0-step=12.ckpt")
    assert state["loops/fit"]["progress"]["total"]["completed"] == 1
    assert state["loops/fit"]["loops"]["epoch_loop"]["state"]["in_epoch"] is False


async def test_monitor_keeps_the_best_k(tmp_path: Path) -> None:
    values = [0.5, 0.7, 0.6, 0.9, 0.8, 0.1]
    checkpoint = Checkpoint(tmp_path, monitor="val/acc", mode="max", keep_best=2, save_on_end=False)
    trainer, module, train, val = build(checkpoint, module=ScriptedAcc(values), max_epochs=6)
    await trainer.fit(module, train, val)
    # Best two: 0.9 (epoch 3) and 0.8 (epoch 4).
    assert ckpt_names(tmp_path) == ["epoch=3-step=48.ckpt", "epoch=4-step=60.ckpt"]
    assert checkpoint.best_value == 0.9
    assert checkpoint.best_checkpoint_path == tmp_path / "epoch=3-step=48.ckpt"
    assert last_name(tmp_path) == "epoch=4-step=60.ckpt"
    saved = loopbus.load_checkpoint(checkpoint.best_checkpoint_path)
    assert saved["records"]["val/acc"]["value"] == 0.9
    assert saved["plugins/Checkpoint[val/acc]"]["best"] == [
        [0.9, "epoch=3-step=48.ckpt"],
        [0.7, "epoch=1-step=24.ckpt"],
    ]


async def test_lightnings_names_are_deprecated_aliases_that_warn_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_checkpoint, "_WARNED", set())  # no alias has warned yet
    checkpoint = Checkpoint(tmp_path, monitor="val/acc", mode="max", save_on_end=False)
    trainer, module, train, val = build(checkpoint, module=ScriptedAcc([0.5, 0.7]))
    await trainer.fit(module, train, val)
    aliases = {
        "last_model_path": "last_checkpoint_path",
        "best_model_path": "best_checkpoint_path",
        "best_model_score": "best_value",
    }
    for old, new in aliases.items():
        expected = getattr(checkpoint, new)
        assert expected is not None
        with pytest.warns(DeprecationWarning, match=rf"Checkpoint\.{old} .*checkpoint\.{new}\b"):
            assert getattr(checkpoint, old) == expected
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process: silent from now on
            assert getattr(checkpoint, old) == expected
    assert checkpoint.best_value == 0.7
    assert type(checkpoint.last_model_path) is type(Path())  # a plain path, not callable


async def test_a_save_due_to_validation_waits_for_the_batch_boundary(tmp_path: Path) -> None:
    values = [0.5, 0.7, 0.9, 0.8, 0.95, 0.2]
    checkpoint = Checkpoint(
        tmp_path, monitor="val/acc", mode="max", keep_best=None, save_on_end=False
    )
    trainer, module, train, val = build(
        checkpoint, module=ScriptedAcc(values), max_epochs=1, val_check_interval=4
    )
    await trainer.fit(module, train, val)
    # Validations after batches 4, 8, 12 of the epoch; each improved the value.
    assert ckpt_names(tmp_path) == [
        "epoch=0-step=12.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=0-step=8.ckpt",
    ]
    state = loopbus.load_checkpoint(tmp_path / "epoch=0-step=8.ckpt")
    epoch_loop = state["loops/fit"]["loops"]["epoch_loop"]
    # Taken at TrainBatchCompleted of batch 8, after the validation that ran in it.
    assert epoch_loop["progress"]["current"]["completed"] == 8
    assert epoch_loop["loops"]["val_loop"]["progress"]["total"]["completed"] == 2 * 2
    assert state["records"]["val/acc"]["value"] == 0.7


async def test_monitor_that_is_never_put_is_an_error(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, monitor="val/accuracy", mode="max")
    trainer, module, train, val = build(checkpoint)
    with pytest.raises(
        HandlerError,
        match=r"monitor='val/accuracy'.*records put so far are \['train/loss', 'val/loss'\]",
    ):
        await trainer.fit(module, train, val)


def test_options_are_validated(tmp_path: Path) -> None:
    with pytest.raises(loopbus.MisconfigurationError, match="every_n_steps"):
        Checkpoint(tmp_path, every_n_steps=0)
    with pytest.raises(loopbus.MisconfigurationError, match="mode"):
        Checkpoint(tmp_path, monitor="val/acc", mode="maximum")  # type: ignore[arg-type]
    with pytest.raises(loopbus.MisconfigurationError, match="filename"):
        Checkpoint(tmp_path, filename="{epoch}/{step}")
    with pytest.raises(loopbus.MisconfigurationError, match="filename"):
        Checkpoint(tmp_path, filename="{loss}")


# ---------------------------------------------------------------- resume


async def test_resume_from_last_is_exact_and_keeps_managing_files(tmp_path: Path) -> None:
    trainer, module, train, val = build(Checkpoint(tmp_path / "ref", every_n_steps=4, keep_last=2))
    await trainer.fit(module, train, val)
    expected = {k: v.clone() for k, v in module.state_dict().items()}
    expected_files = ckpt_names(tmp_path / "ref")

    directory = tmp_path / "run"
    trainer, module, train, val = build(
        Checkpoint(directory, every_n_steps=4, keep_last=2), plugins=[Crash(at_step=15)]
    )
    with pytest.raises(HandlerError, match="simulated crash"):
        await trainer.fit(module, train, val)
    assert last_name(directory) == "epoch=0-step=12.ckpt"

    trainer, module, train, val = build(Checkpoint(directory, every_n_steps=4, keep_last=2))
    with pytest.warns(UserWarning, match="resuming mid-epoch by skipping"):
        await trainer.fit(module, train, val, ckpt_path="last")
    for name, tensor in expected.items():
        assert torch.equal(module.state_dict()[name], tensor), name
    # The files the crashed run left are managed on: the same two remain.
    assert ckpt_names(directory) == expected_files


async def test_ckpt_path_last_without_a_checkpoint_warns_and_starts_fresh(tmp_path: Path) -> None:
    trainer, module, train, val = build(Checkpoint(tmp_path), max_epochs=1)
    with pytest.warns(
        UserWarning, match=r"ckpt_path='last' but no checkpoint has been written yet"
    ):
        await trainer.fit(module, train, val, ckpt_path="last")
    assert trainer.global_step == PER_EPOCH
    assert ckpt_names(tmp_path) == ["epoch=0-step=12.ckpt"]


async def test_stale_temporaries_are_removed_at_setup(tmp_path: Path) -> None:
    dead = tmp_path / ".epoch=0-step=3.ckpt.tmp-999999999-abcd1234"
    mine = tmp_path / f".epoch=0-step=4.ckpt.tmp-{os.getpid()}-abcd1234"
    live = tmp_path / ".epoch=0-step=5.ckpt.tmp-1-abcd1234"  # pid 1 is alive
    other = tmp_path / "notes.tmp-999999999-x"
    for path in (dead, mine, live, other):
        path.write_bytes(b"partial")
    trainer, module, train, val = build(Checkpoint(tmp_path), max_steps=1)
    await trainer.fit(module, train, val)
    assert not dead.exists()
    assert not mine.exists()
    assert live.exists()
    assert other.exists()


# ---------------------------------------------------------------- background saves


class SlowWrites:
    """Wraps the plugin's writer: slow, and counting how many writes overlap."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float = 0.05) -> None:
        import loopbus.plugins._checkpoint_files as module

        self.real = module.write_checkpoint
        self.delay = delay
        self.active = 0
        self.most = 0
        self.done: list[str] = []
        monkeypatch.setattr(module, "write_checkpoint", self)

    def __call__(self, state: Any, path: Any, **options: Any) -> Path:
        self.active += 1
        self.most = max(self.most, self.active)
        try:
            time.sleep(self.delay)
            result: Path = self.real(state, path, **options)
            self.done.append(Path(path).name)
            return result
        finally:
            self.active -= 1


async def test_background_saves_are_durable_when_fit_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = SlowWrites(monkeypatch, delay=0.1)
    checkpoint = Checkpoint(tmp_path, every_n_steps=3, keep_last=None, background=True)
    trainer, module, train, val = build(checkpoint, max_epochs=1)
    await trainer.fit(module, train, val)
    assert writes.most == 1, "more than one save was in flight"
    # The end-of-fit save is at step 12 too: it gets a name of its own.
    saved = [f"epoch=0-step={s}.ckpt" for s in (3, 6, 9, 12)] + ["epoch=0-step=12-v1.ckpt"]
    assert writes.done == saved
    assert ckpt_names(tmp_path) == sorted(saved)
    # Written from a host copy taken at the step: the weights are those of that step.
    final = loopbus.load_checkpoint(tmp_path / "epoch=0-step=12.ckpt")
    for name, tensor in module.state_dict().items():
        assert torch.equal(final["module"][name], tensor)
    third = loopbus.load_checkpoint(tmp_path / "epoch=0-step=3.ckpt")
    assert not torch.equal(third["module"]["net.0.weight"], module.state_dict()["net.0.weight"])


async def test_a_failed_background_write_fails_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import loopbus.plugins._checkpoint_files as module_under_test

    def broken(state: Any, path: Any, **options: Any) -> Path:
        raise CheckpointError(f"could not write the checkpoint {path}: disk full")

    monkeypatch.setattr(module_under_test, "write_checkpoint", broken)
    checkpoint = Checkpoint(tmp_path, every_n_steps=5, background=True)
    trainer, module, train, val = build(checkpoint, max_epochs=1)
    with pytest.raises(
        (CheckpointError, HandlerError), match=r"background checkpoint save .* failed.*disk full"
    ):
        await trainer.fit(module, train, val)


class HeldWrites:
    """Wraps the plugin's writer: the write of the save at step ``s`` waits, in its worker
    thread, until the test opens gate ``s``, then notes the last training step that had
    completed by then. The wait has a deadline only so that a step that waits for the
    write (which would never be opened) fails instead of hanging."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import loopbus.plugins._checkpoint_files as module

        self.real = module.write_checkpoint
        self.completed: list[int] = []  # training steps, appended on the event loop
        self.released_after: dict[int, int] = {}
        self._gates: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        monkeypatch.setattr(module, "write_checkpoint", self)

    def gate(self, step: int) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(step, threading.Event())

    def __call__(self, state: Any, path: Any, **options: Any) -> Path:
        step = int(Path(path).stem.rsplit("=", 1)[1])
        if not self.gate(step).wait(timeout=60):
            raise AssertionError(
                f"the write of the save at step {step} was never let go: the training "
                "steps after it did not run while it was in flight"
            )
        self.released_after[step] = self.completed[-1]
        result: Path = self.real(state, path, **options)
        return result


class Overlap(Plugin):
    """Around the Checkpoint plugin's handler (``Checkpoint.delivery.priority`` is -100):
    just before it (-99), at a save step, keep a copy of the weights; just after it (-101),
    note the step and let the write of the save ``every - 1`` steps back (or, at the last
    step, every write still held) go."""

    def __init__(self, writes: HeldWrites, module: Net, every: int, last: int) -> None:
        self.writes = writes
        self.module = module
        self.every = every
        self.last = last
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    @on(TrainBatchCompleted, priority=-99)
    def before(self, event: TrainBatchCompleted) -> None:
        if event.step % self.every == 0:
            self.weights[event.step] = {
                name: tensor.detach().clone() for name, tensor in self.module.state_dict().items()
            }

    @on(TrainBatchCompleted, priority=-101)
    def after(self, event: TrainBatchCompleted) -> None:
        self.writes.completed.append(event.step)
        saved = event.step - (self.every - 1)
        if saved > 0 and saved % self.every == 0:
            self.writes.gate(saved).set()
        if event.step == self.last:
            for step in self.weights:
                self.writes.gate(step).set()


async def test_background_save_blocks_the_step_only_for_the_host_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Saves at steps 4, 8 and 12. The write of each is held until the three steps after it
    # have completed (the last one's, until the run's last step): were the step to wait for
    # the write, those steps could never run. What the step did wait for is the host copy:
    # each file holds the weights of its own step, although the write happened after later
    # steps had changed them.
    every, last = 4, 13
    writes = HeldWrites(monkeypatch)
    module = Net()
    overlap = Overlap(writes, module, every, last)
    checkpoint = Checkpoint(
        tmp_path, every_n_steps=every, keep_last=None, background=True, save_on_end=False
    )
    trainer, module, train, val = build(
        checkpoint, plugins=[overlap], module=module, max_steps=last
    )
    await trainer.fit(module, train, val)
    assert writes.completed == list(range(1, last + 1))
    # The write of step 4 was let go only after step 7 had completed, and so on.
    assert writes.released_after == {4: 7, 8: 11, 12: 13}
    assert ckpt_names(tmp_path) == [f"epoch=0-step={s}.ckpt" for s in (12, 4, 8)]
    final = module.state_dict()
    for step, weights in overlap.weights.items():
        saved = loopbus.load_checkpoint(tmp_path / f"epoch=0-step={step}.ckpt")
        for name, tensor in weights.items():
            assert torch.equal(saved["module"][name], tensor), (step, name)
        assert not torch.equal(weights["net.0.weight"], final["net.0.weight"]), step


# ---------------------------------------------------------------- written like user code


def test_the_plugin_imports_only_public_names() -> None:
    source = Path(loopbus.plugins.__file__).with_name("_checkpoint.py")
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("loopbus"):
            assert node.module in ("loopbus", "loopbus.events"), node.module
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert not alias.name.startswith("loopbus.") or alias.name == "loopbus.events"
