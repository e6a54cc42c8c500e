"""Checkpoints in the engine: what a checkpoint holds, exact resume (mid-epoch included),
safe loading and the errors a bad checkpoint gets."""

from __future__ import annotations

import math
import pickle
import random
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import loopbus
from loopbus import (
    CheckpointError,
    CheckpointMismatch,
    HandlerError,
    MisconfigurationError,
    Plugin,
    Trainer,
    on,
)
from loopbus.events import EpochCompleted, TrainBatchCompleted
from loopbus.plugins import Checkpoint
from tests.ckpt_scenario import STATEFUL_WARNING, Net, make_data

pytestmark = pytest.mark.filterwarnings(f"ignore:{STATEFUL_WARNING}:UserWarning")

N_TRAIN = 96
BATCH = 8
PER_EPOCH = N_TRAIN // BATCH  # 12
EPOCHS = 3
SKIP_WARNING = "resuming mid-epoch by skipping"


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Deep equality of checkpoint values: tensors with torch.equal (and equal dtypes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype, f"{where}: {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{where}: {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b).__name__}"
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float), f"{where}: nan vs {b!r}"
        assert math.isnan(b), f"{where}: nan vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class Counter(Plugin):
    """A stateful plugin: counts batches and keeps a tensor."""

    def __init__(self) -> None:
        self.batches = 0
        self.total = torch.zeros(2)

    @on(TrainBatchCompleted)
    def count(self, event: TrainBatchCompleted) -> None:
        self.batches += 1
        self.total += 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "total": self.total.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = int(state_dict["batches"])
        self.total = state_dict["total"].clone()


class SaveAt(Plugin):
    """Saves a checkpoint at the n-th TrainBatchCompleted (counted over the run) or at the
    end of an epoch, then lets ``crash_after`` more batches run and raises."""

    delivery = loopbus.Delivery(priority=-50)

    def __init__(
        self,
        path: Path,
        *,
        batch: int | None = None,
        epoch: int | None = None,
        crash_after: int = 2,
    ) -> None:
        self.path = path
        self.batch = batch
        self.epoch = epoch
        self.crash_after = crash_after
        self.seen = 0
        self.saved_at: int | None = None
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    def _batch(self, event: TrainBatchCompleted) -> None:
        assert self.trainer is not None
        self.seen += 1
        if self.seen == self.batch:
            self.trainer.save_checkpoint(self.path)
            self.saved_at = self.seen
        if self.saved_at is not None and self.seen == self.saved_at + self.crash_after:
            raise RuntimeError("simulated crash")

    @on(EpochCompleted)
    def _epoch(self, event: EpochCompleted) -> None:
        assert self.trainer is not None
        if event.epoch == self.epoch:
            self.trainer.save_checkpoint(self.path)
            self.saved_at = self.seen


def build(
    loader: str = "plain",
    plugins: list[Plugin] | None = None,
    *,
    accumulate: int = 2,
    val_every: int | None = None,
    n_out_hidden: int = 32,
    **trainer_options: Any,
) -> tuple[Trainer, Net, Any, Any]:
    loopbus.seed_everything(7)
    module = Net(hidden=n_out_hidden)
    train, val = make_data(loader, n_train=N_TRAIN, batch=BATCH)
    trainer = Trainer(
        max_epochs=EPOCHS,
        accumulate_grad_batches=accumulate,
        val_check_interval=val_every,
        plugins=[Counter(), *(plugins or [])],
        device="cpu",
        **trainer_options,
    )
    return trainer, module, train, val


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------- exact resume

RESUME_POINTS = {
    # name: (SaveAt options, extra build options, mid-epoch?)
    "mid-epoch": ({"batch": PER_EPOCH + 4}, {}, True),
    "mid-accumulation-window": ({"batch": PER_EPOCH + 5}, {}, True),
    "last-batch-of-epoch": ({"batch": PER_EPOCH}, {}, True),
    "epoch-end": ({"epoch": 0}, {}, False),
    "after-validation": ({"batch": PER_EPOCH + 6}, {"val_every": 3}, True),
}


@pytest.mark.parametrize("loader", ["plain", "stateful", "custom-sampler"])
@pytest.mark.parametrize("point", list(RESUME_POINTS))
async def test_resume_is_exact(tmp_path: Path, loader: str, point: str) -> None:
    save_options, build_options, mid_epoch = RESUME_POINTS[point]
    trainer, module, train, val = build(loader, **build_options)
    await trainer.fit(module, train, val)
    expected = weights(module)
    expected_counter = trainer.plugins[0].state_dict()
    assert trainer.global_step == EPOCHS * PER_EPOCH // 2

    path = tmp_path / "run.ckpt"
    saver = SaveAt(path, **save_options)
    trainer, module, train, val = build(loader, [saver], **build_options)
    with pytest.raises(HandlerError, match="simulated crash"):
        await trainer.fit(module, train, val)
    if point == "mid-accumulation-window":
        assert torch.load(path, weights_only=True)["grads"], "no pending gradients were saved"

    trainer, module, train, val = build(loader, **build_options)
    if mid_epoch and loader != "stateful":
        with pytest.warns(UserWarning, match=SKIP_WARNING):
            await trainer.fit(module, train, val, ckpt_path=path)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", STATEFUL_WARNING)
            await trainer.fit(module, train, val, ckpt_path=path)
    assert trainer.global_step == EPOCHS * PER_EPOCH // 2
    for name, tensor in expected.items():
        assert torch.equal(module.state_dict()[name], tensor), f"{name} differs after resume"
    assert_same(trainer.plugins[0].state_dict(), expected_counter, "Counter state")


async def test_resume_from_the_end_of_a_finished_fit_continues_with_more_epochs(
    tmp_path: Path,
) -> None:
    trainer, module, train, val = build(accumulate=1)
    trainer.max_epochs = 4
    await trainer.fit(module, train, val)
    expected = weights(module)

    trainer, module, train, val = build(accumulate=1)
    trainer.max_epochs = 2
    await trainer.fit(module, train, val)
    path = trainer.save_checkpoint(tmp_path / "end.ckpt")
    trainer, module, train, val = build(accumulate=1)
    trainer.max_epochs = 4
    await trainer.fit(module, train, val, ckpt_path=path)
    assert trainer.current_epoch == 3
    for name, tensor in expected.items():
        assert torch.equal(module.state_dict()[name], tensor), name


# ---------------------------------------------------------------- round trip


async def _trained_trainer(tmp_path: Path, loader: str) -> tuple[Trainer, Path]:
    saver = SaveAt(tmp_path / "a.ckpt", batch=PER_EPOCH + 5)
    trainer, module, train, val = build(loader, [saver])
    with pytest.raises(HandlerError, match="simulated crash"):
        await trainer.fit(module, train, val)
    return trainer, tmp_path / "a.ckpt"


@pytest.mark.parametrize("loader", ["plain", "stateful"])
async def test_round_trip_of_every_component(tmp_path: Path, loader: str) -> None:
    _, path = await _trained_trainer(tmp_path, loader)
    saved = loopbus.load_checkpoint(path)
    # Every component is there, with real content.
    assert saved["optimizers/0"]["state_dict"]["state"], "no momentum buffers"
    assert "momentum_buffer" in saved["optimizers/0"]["state_dict"]["state"][0]
    assert saved["lr_schedulers/0"]["state_dict"]["last_epoch"] == 1
    assert saved["plugins/Counter"]["batches"] == PER_EPOCH + 5
    train_state = saved["loops/fit"]["loops"]["epoch_loop"]
    assert train_state["progress"]["current"]["completed"] == 5
    assert train_state["state"]["in_epoch"] is True
    assert set(saved["rng"]) >= {"python", "torch"}
    assert saved["records"]["train/loss"]["step"] == saved["loopbus"]["global_step"]
    assert ("data/train" in saved) == (loader == "stateful")
    assert saved["run"] == {"step": saved["loopbus"]["global_step"], "epoch": 1}
    assert saved["loopbus"]["parts"] == [k for k in saved if k != "loopbus"]
    assert saved["grads"], "mid accumulation window: gradients pending"

    # Load into a fresh run that has its optimizers configured, and save again.
    trainer, module, train, val = build(loader, max_steps=1)
    await trainer.fit(module, train, val)
    mismatch = trainer.load_state_dict(saved)
    assert isinstance(mismatch, CheckpointMismatch)
    assert not mismatch, str(mismatch)
    again = loopbus.load_checkpoint(trainer.save_checkpoint(tmp_path / "b.ckpt"))
    assert again["loopbus"].pop("created") >= saved["loopbus"].pop("created")
    assert_same(again, saved, "checkpoint")


async def test_rng_states_round_trip() -> None:
    import numpy as np

    from loopbus.checkpoint._rng_state import capture_rng, restore_rng

    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0]
    assert a[1] == b[1]
    assert torch.equal(a[2], b[2])
    assert set(state) >= {"python", "numpy", "torch"}


async def test_an_epoch_snapshot_takes_what_the_loader_order_can_depend_on() -> None:
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from loopbus.checkpoint._rng_state import capture_epoch_rng, epoch_rng_state, restore_epoch_rng
    from tests.ckpt_scenario import PythonAndNumpyShuffle

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(4))

    data = TensorDataset(torch.arange(8.0))
    torch_only = [[1, 2], (1, 2), DataLoader(data, batch_size=2, shuffle=True)]
    every = [
        DataLoader(data, batch_size=2, sampler=PythonAndNumpyShuffle(8)),
        DataLoader(Stream(), batch_size=2),
        iter([1, 2]),
    ]
    for loader in torch_only + every:
        snapshot = capture_epoch_rng(loader)
        plain = epoch_rng_state(snapshot)
        assert plain is not None
        expected = {"torch"} if loader in torch_only else {"python", "numpy", "torch"}
        assert set(plain["rng"]) == expected, f"{loader!r}: {sorted(plain['rng'])}"
        assert epoch_rng_state(plain) is plain  # a loaded (plain) one stays as it is
        # Both forms put the generators they hold back where they were.
        first = (random.random(), torch.rand(2))
        for form in (snapshot, plain):
            restore_epoch_rng(form, loader)
            again = (random.random(), torch.rand(2))
            assert torch.equal(first[1], again[1])
            assert (first[0] == again[0]) == (loader not in torch_only)


# ---------------------------------------------------------------- weights_only


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
async def test_every_checkpoint_loads_with_weights_only(tmp_path: Path, precision: str) -> None:
    if precision != "32" and not hasattr(loopbus.plugins, "MixedPrecision"):
        pytest.skip(f"precision {precision!r} comes with loopbus.plugins.MixedPrecision")
    checkpoint = Checkpoint(tmp_path / "plugin", every_n_steps=5, background=True, keep_last=None)
    trainer, module, train, val = build("stateful", [checkpoint], precision=precision)
    trainer.max_epochs = 1
    await trainer.fit(module, train, val)
    written = [trainer.save_checkpoint(tmp_path / "sync.ckpt")]
    written.append(await trainer.save_checkpoint_async(tmp_path / "async.ckpt"))
    written += sorted((tmp_path / "plugin").glob("*.ckpt"))
    assert len(written) >= 4
    for path in written:
        state = torch.load(path, weights_only=True)
        assert state["loopbus"]["format_version"] == 2
        assert state["precision"]["name"] == precision
    if precision == "16-mixed":
        assert "scaler" in state["precision"]["state_dict"]


class Evil:
    """Unpickling this runs code (touches a file)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (Path.touch, (self.target,))


@pytest.mark.parametrize("container", ["torch", "pickle"])
async def test_pickled_objects_are_refused_and_never_run(tmp_path: Path, container: str) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    payload = {
        "loopbus": {"format": "loopbus.checkpoint", "format_version": 1},
        "x": Evil(sentinel),
    }
    if container == "torch":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(
        CheckpointError, match=r"refusing to load .*evil\.ckpt.*pickled Python objects"
    ):
        loopbus.load_checkpoint(path)
    trainer, module, train, val = build()
    with pytest.raises(CheckpointError, match="pickled Python objects"):
        await trainer.fit(module, train, val, ckpt_path=path)
    assert not sentinel.exists(), "unpickling ran code from the file"


class Sloppy(Plugin):
    def state_dict(self) -> dict[str, Any]:
        return {"when": object()}


class Extra(Counter):
    pass


async def test_state_that_is_not_plain_is_refused_at_save_naming_the_component(
    tmp_path: Path,
) -> None:
    trainer, module, train, val = build(plugins=[Sloppy()], max_steps=1)
    await trainer.fit(module, train, val)
    with pytest.raises(
        CheckpointError,
        match=r"cannot save checkpoint\['plugins/Sloppy'\]\['when'\]: it is a value of type object.*tensors and Python primitives",
    ):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


async def test_two_plugins_with_one_state_key_are_saved_apart(tmp_path: Path) -> None:
    trainer, module, train, val = build(plugins=[Counter()], max_steps=1)
    await trainer.fit(module, train, val)
    state = trainer.state_dict()
    assert "plugins/Counter" in state
    assert "plugins/Counter#2" in state


# ---------------------------------------------------------------- errors


@pytest.fixture
async def good_checkpoint(tmp_path: Path) -> Path:
    trainer, module, train, val = build(max_steps=3)
    await trainer.fit(module, train, val)
    return trainer.save_checkpoint(tmp_path / "good.ckpt")


async def test_missing_file(tmp_path: Path, good_checkpoint: Path) -> None:
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(
        CheckpointError, match=r"no checkpoint at .*nope\.ckpt.*does not exist.*good\.ckpt"
    ):
        loopbus.load_checkpoint(missing)
    trainer, module, train, val = build()
    with pytest.raises(CheckpointError, match=r"nope\.ckpt"):
        await trainer.fit(module, train, val, ckpt_path=missing)


async def test_truncated_file_with_marker(tmp_path: Path, good_checkpoint: Path) -> None:
    file = anyio.Path(good_checkpoint)
    data = await file.read_bytes()
    await file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"good\.ckpt is torn or truncated.*marker records"):
        loopbus.load_checkpoint(good_checkpoint)


async def test_truncated_file_without_marker(tmp_path: Path, good_checkpoint: Path) -> None:
    data = await anyio.Path(good_checkpoint).read_bytes()
    copy = tmp_path / "copied.ckpt"
    await anyio.Path(copy).write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"copied\.ckpt: it is torn or truncated"):
        loopbus.load_checkpoint(copy)


async def test_corrupted_byte_is_caught_by_the_marker(good_checkpoint: Path) -> None:
    file = anyio.Path(good_checkpoint)
    data = bytearray(await file.read_bytes())
    data[len(data) // 3] ^= 0xFF
    await file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"good\.ckpt is corrupted: its CRC-32"):
        loopbus.load_checkpoint(good_checkpoint)


async def test_newer_format_is_refused(tmp_path: Path, good_checkpoint: Path) -> None:
    state = torch.load(good_checkpoint, weights_only=True)
    state["loopbus"]["format_version"] = 99
    future = tmp_path / "future.ckpt"
    torch.save(state, future)
    with pytest.raises(
        CheckpointError, match=r"future\.ckpt was written by a newer loopbus.*format 99.*Upgrade"
    ):
        loopbus.load_checkpoint(future)


async def test_foreign_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    with pytest.raises(
        CheckpointError, match=r"weights\.pt is not a loopbus checkpoint.*module\.load_state_dict"
    ):
        loopbus.load_checkpoint(path)


async def test_shape_mismatch_names_file_and_parameter(good_checkpoint: Path) -> None:
    trainer, module, train, val = build(n_out_hidden=16)
    with pytest.raises(
        CheckpointError,
        match=r"(?s)good\.ckpt does not match.*module: 'net\.0\.weight' has shape \(32, 4\) in the checkpoint but \(16, 4\)",
    ):
        await trainer.fit(module, train, val, ckpt_path=good_checkpoint)
    assert trainer.global_step == 0


async def test_plugin_missing_from_checkpoint_and_the_reverse(good_checkpoint: Path) -> None:
    trainer, module, train, val = build(plugins=[Extra()])
    with pytest.raises(
        CheckpointError,
        match=r"(?s)plugins/Extra: this run has it but the checkpoint has no state",
    ):
        await trainer.fit(module, train, val, ckpt_path=good_checkpoint)

    loopbus.seed_everything(7)
    module = Net()
    train, val = make_data("plain", n_train=N_TRAIN, batch=BATCH)
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=2, plugins=[], device="cpu")
    with pytest.raises(
        CheckpointError,
        match=r"(?s)plugins/Counter: the checkpoint has state for it but this run has no such part",
    ):
        await trainer.fit(module, train, val, ckpt_path=good_checkpoint)


async def test_stateful_loader_state_without_a_stateful_loader(tmp_path: Path) -> None:
    trainer, module, train, val = build("stateful", max_steps=3)
    await trainer.fit(module, train, val)
    path = trainer.save_checkpoint(tmp_path / "s.ckpt")
    trainer, module, train, val = build("plain")
    with pytest.raises(
        CheckpointError,
        match=r"(?s)s\.ckpt does not match.*data/train.*not stateful.*strict=False",
    ):
        await trainer.fit(module, train, val, ckpt_path=path)


async def test_optimizer_class_mismatch(good_checkpoint: Path) -> None:
    class AdamNet(Net):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters())

    loopbus.seed_everything(7)
    module = AdamNet()
    train, val = make_data("plain", n_train=N_TRAIN, batch=BATCH)
    trainer = Trainer(max_epochs=1, plugins=[Counter()], device="cpu")
    with pytest.raises(
        CheckpointError,
        match=r"optimizers/0: a torch\.optim\.sgd\.SGD in the checkpoint but a torch\.optim\.adam\.Adam",
    ) as info:
        await trainer.fit(module, train, val, ckpt_path=good_checkpoint)
    assert "lr_schedulers/0: the checkpoint has state for it but this run has no such part" in str(
        info.value
    )


async def test_strict_false_loads_what_matches_and_lists_the_rest(good_checkpoint: Path) -> None:
    saved = loopbus.load_checkpoint(good_checkpoint)

    trainer, module, train, val = build(plugins=[Extra()], n_out_hidden=16)
    with pytest.warns(
        UserWarning,
        match=r"(?s)ckpt_strict=False.*plugins/Extra.*'net\.0\.weight' has shape.*optimizers/0: holds state",
    ):
        await trainer.fit(module, train, val, ckpt_path=good_checkpoint, ckpt_strict=False)

    # Directly: the report lists each problem; what matched was loaded.
    trainer, module, train, val = build(plugins=[Extra()], n_out_hidden=16, max_steps=1)
    await trainer.fit(module, train, val)
    mismatch = trainer.load_state_dict(saved, strict=False)
    assert mismatch
    assert any("net.0.weight" in m for m in mismatch.mismatched)
    assert any("Extra" in m for m in mismatch.missing)
    assert any("optimizers" in m for m in mismatch.mismatched)
    assert torch.equal(module.state_dict()["net.3.bias"], saved["module"]["net.3.bias"])
    assert trainer.plugins[0].batches == saved["plugins/Counter"]["batches"]
    assert trainer.global_step == saved["loopbus"]["global_step"]


async def test_load_state_dict_before_fit_explains_how_to_resume(good_checkpoint: Path) -> None:
    trainer = Trainer(plugins=[], device="cpu")
    with pytest.raises(CheckpointError, match=r"no module yet.*ckpt_path"):
        trainer.load_state_dict(loopbus.load_checkpoint(good_checkpoint))
    with pytest.raises(CheckpointError, match="no module yet"):
        trainer.state_dict()


async def test_ckpt_path_last_needs_a_checkpoint_plugin() -> None:
    trainer, module, train, val = build()
    with pytest.raises(MisconfigurationError, match="ckpt_path='last' needs a plugin"):
        await trainer.fit(module, train, val, ckpt_path="last")


async def test_directory_and_pointer_paths(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "ck", every_n_steps=2)
    trainer, module, train, val = build(plugins=[checkpoint], max_steps=5)
    await trainer.fit(module, train, val)
    newest = loopbus.latest_checkpoint(tmp_path / "ck")
    assert newest is not None
    assert newest.name == "epoch=0-step=5.ckpt"
    by_dir = loopbus.load_checkpoint(tmp_path / "ck")
    by_pointer = loopbus.load_checkpoint(tmp_path / "ck" / "last.json")
    assert by_dir["loopbus"]["global_step"] == by_pointer["loopbus"]["global_step"] == 5
    with pytest.raises(CheckpointError, match="no checkpoint in the directory"):
        loopbus.load_checkpoint(tmp_path)
