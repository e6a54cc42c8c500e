"""WeightAveraging: EMA and SWA of the weights, validation on the average, the average
in checkpoints (best checkpoint for test, exact resume), DDP and FSDP."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import update_bn

from loopbus import MisconfigurationError, SingleProcess, Trainer, load_checkpoint, on
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint
from loopbus.plugins.tuning import WeightAveraging
from tests.helpers import TinyModule, make_loader
from tests.torchrun import env

SCRIPT = Path(__file__).resolve().parent / "_averaging_script.py"
KEY = "plugins/WeightAveraging"

Weights = dict[str, torch.Tensor]


def _clone(module: torch.nn.Module) -> Weights:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _equal(a: Weights, b: Weights) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Recorder(TinyModule):
    """Records its weights after every optimizer step, at the start of every training
    step, and in every validation step (outside the sanity check)."""

    def __init__(self) -> None:
        super().__init__()
        self.after_step: dict[int, Weights] = {0: _clone(self)}
        self.at_training: dict[int, Weights] = {}
        self.at_validation: list[tuple[int, Weights]] = []
        self.at_test: list[Weights] = []

    @on(TrainBatchCompleted)
    def _snapshot(self, event: TrainBatchCompleted) -> None:
        self.after_step[self.trainer.global_step] = _clone(self)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.at_training.setdefault(self.trainer.global_step, _clone(self))
        return super().training_step(batch, ctx)

    def validation_step(self, batch: Any, ctx: Any) -> None:
        if not self.trainer.sanity_checking:
            self.at_validation.append((self.trainer.global_step, _clone(self)))
        super().validation_step(batch, ctx)

    def test_step(self, batch: Any, ctx: Any) -> None:
        self.at_test.append(_clone(self))
        super().test_step(batch, ctx)


def _ema(snapshots: dict[int, Weights], steps: list[int], decay: float) -> Weights:
    """The EMA by hand: the first snapshot, then avg + (1 - decay) * (w - avg)."""
    average: Weights | None = None
    for step in steps:
        w = snapshots[step]
        if average is None:
            average = {k: v.clone() for k, v in w.items()}
        else:
            average = {k: torch.lerp(average[k], w[k], 1 - decay) for k in average}
    assert average is not None
    return average


def _mean(snapshots: dict[int, Weights], steps: list[int]) -> Weights:
    return {k: torch.stack([snapshots[s][k] for s in steps]).mean(0) for k in snapshots[steps[0]]}


async def test_ema_equals_the_ema_by_hand_and_validation_runs_on_it() -> None:
    module = Recorder()
    averaging = WeightAveraging.ema(0.8, every_n_steps=2)
    # 6 batches an epoch, validation after the 3rd and 6th: after steps 3, 6, 9, ...,
    # inside the batch, before its TrainBatchCompleted (a step that is due, 6, 12, 18,
    # is averaged before the validation sees the average).
    trainer = Trainer(max_epochs=3, val_check_interval=3, plugins=[averaging], device="cpu")
    await trainer.fit(module, make_loader(n=96), make_loader(n=32))
    assert trainer.global_step == 18
    assert (averaging.n_averaged, averaging.last_step) == (9, 18)
    snapshots = module.after_step
    expected = _ema(snapshots, list(range(2, 19, 2)), 0.8)
    assert averaging.averaged_model is not None
    assert _equal(_clone(averaging.averaged_model.module), expected)
    # After fit the module holds the average.
    assert _equal(_clone(module), expected)

    # Validation saw the average of the steps so far, two batches each time.
    seen = [step for step, _ in module.at_validation]
    assert seen == [s for s in range(3, 19, 3) for _ in range(2)]
    for step, weights in module.at_validation:
        assert _equal(weights, _ema(snapshots, list(range(2, step + 1, 2)), 0.8)), step
        assert not _equal(weights, snapshots[step])
    # ... and training went on with the module's own weights.
    for step, weights in module.at_training.items():
        assert _equal(weights, snapshots[step]), step


async def test_swa_is_the_running_mean_of_the_snapshots_from_its_start() -> None:
    module = Recorder()
    averaging = WeightAveraging.swa(start_step=3, start_epoch=1, every_n_steps=1)
    trainer = Trainer(max_epochs=3, plugins=[averaging], device="cpu")
    await trainer.fit(module, make_loader(n=64), make_loader(n=32))
    # Epoch 0 is steps 1-4: start_epoch=1 leaves it out; then every step.
    steps = list(range(5, 13))
    assert (averaging.n_averaged, averaging.last_step) == (len(steps), 12)
    expected = _mean(module.after_step, steps)
    for key, value in _clone(module).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6)
    # The epoch-end validations: none averaged yet after epoch 0, then the running mean.
    by_step = dict(module.at_validation)
    assert _equal(by_step[4], module.after_step[4])  # the module's own weights
    partial = _mean(module.after_step, list(range(5, 9)))
    for key, value in by_step[8].items():
        torch.testing.assert_close(value, partial[key], rtol=0, atol=1e-6)


class BatchNormNet(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
        )


async def test_update_bn_recomputes_the_statistics_of_the_average(tmp_path: Path) -> None:
    module = BatchNormNet()
    data = make_loader(n=64)
    averaging = WeightAveraging.swa(use_buffers=False, update_bn=data)
    trainer = Trainer(
        max_epochs=2, plugins=[averaging, Checkpoint(tmp_path, every_n_steps=100)], device="cpu"
    )
    await trainer.fit(module, data)
    assert averaging.n_averaged == 8
    # The statistics are those of one pass with the averaged weights.
    expected = copy.deepcopy(module)
    update_bn(data, expected)
    assert _equal(_clone(module), _clone(expected))
    # The final checkpoint holds them as the module's weights.
    final = load_checkpoint(tmp_path / "last.json")
    assert _equal(final["module"], _clone(module))
    assert not _equal(final[KEY]["current"], _clone(module))


async def test_checkpoints_hold_the_average_and_best_tests_it(tmp_path: Path) -> None:
    module = Recorder()
    averaging = WeightAveraging.ema(0.5)
    checkpoint = Checkpoint(tmp_path, monitor="val/loss", keep_best=1, keep_last=None)
    trainer = Trainer(max_epochs=3, plugins=[averaging, checkpoint], device="cpu")
    await trainer.fit(module, make_loader(n=64), make_loader(n=32))
    best = checkpoint.best_checkpoint_path
    assert best is not None
    saved = load_checkpoint(best)
    step = saved["loopbus"]["global_step"]
    # Lightning's layout: the module's entry is the average, the plugin keeps the
    # module's own weights.
    assert _equal(saved["module"], _ema(module.after_step, list(range(1, step + 1)), 0.5))
    assert _equal(saved[KEY]["current"], module.after_step[step])
    assert (saved[KEY]["n_averaged"], saved[KEY]["last_step"]) == (step, step)

    await trainer.test(module, make_loader(n=32), ckpt_path="best")
    assert module.at_test
    assert all(_equal(weights, saved["module"]) for weights in module.at_test)


@pytest.mark.parametrize("kind", ["ema", "swa"])
async def test_a_resumed_fit_ends_with_the_same_average(tmp_path: Path, kind: str) -> None:
    def plugins(folder: Path, **options: Any) -> list[Any]:
        averaging = (
            WeightAveraging.ema(0.7, every_n_steps=2)
            if kind == "ema"
            else WeightAveraging.swa(start_step=2, use_buffers=False)
        )
        return [averaging, Checkpoint(folder, **options)]

    data = make_loader(n=64, shuffle=True)
    torch.manual_seed(1)
    whole = plugins(tmp_path / "whole", every_n_steps=5, keep_last=None)
    await Trainer(max_epochs=3, plugins=whole, device="cpu").fit(
        BatchNormNet(), data, make_loader(n=32)
    )
    interrupted = tmp_path / "whole" / "epoch=1-step=5.ckpt"
    assert interrupted.exists()

    torch.manual_seed(2)  # another initialisation: the checkpoint decides
    resumed = plugins(tmp_path / "resumed")
    module = BatchNormNet()
    with pytest.warns(UserWarning, match="resuming mid-epoch"):  # a plain DataLoader
        await Trainer(max_epochs=3, plugins=resumed, device="cpu").fit(
            module, data, make_loader(n=32), ckpt_path=interrupted
        )
    first, second = whole[0], resumed[0]
    assert (second.n_averaged, second.last_step) == (first.n_averaged, first.last_step)
    assert first.averaged_model is not None
    assert second.averaged_model is not None
    assert _equal(_clone(second.averaged_model), _clone(first.averaged_model))
    assert _equal(_clone(module), _clone(first.averaged_model.module))


async def test_a_sharded_checkpoint_holds_the_average_and_resumes_exactly(tmp_path: Path) -> None:
    data = make_loader(n=64)
    module = Recorder()
    whole = [WeightAveraging.ema(0.6), Checkpoint(tmp_path / "whole", every_n_steps=3, keep_last=None, sharded=True)]
    await Trainer(max_epochs=2, plugins=whole, device="cpu").fit(module, data)
    interrupted = tmp_path / "whole" / "epoch=0-step=3.ckpt"
    assert interrupted.is_dir()
    saved = load_checkpoint(interrupted)
    assert _equal(saved["module"], _ema(module.after_step, [1, 2, 3], 0.6))
    assert _equal(saved[KEY]["current"], module.after_step[3])

    resumed = [WeightAveraging.ema(0.6), Checkpoint(tmp_path / "resumed", sharded=True)]
    again = Recorder()
    with pytest.warns(UserWarning, match="resuming mid-epoch"):
        await Trainer(max_epochs=2, plugins=resumed, device="cpu").fit(
            again, data, ckpt_path=interrupted
        )
    assert resumed[0].n_averaged == whole[0].n_averaged == 8
    assert _equal(_clone(again), _clone(module))

    await Trainer(plugins=[], device="cpu").test(again, make_loader(n=16), ckpt_path=interrupted)
    assert _equal(again.at_test[0], saved["module"])


async def test_before_the_first_update_checkpoints_hold_the_module_weights(tmp_path: Path) -> None:
    module = Recorder()
    averaging = WeightAveraging.swa(start_step=100)
    trainer = Trainer(max_steps=3, plugins=[averaging], device="cpu")
    await trainer.fit(module, make_loader(n=64), make_loader(n=32))
    assert averaging.n_averaged == 0
    assert _equal(_clone(module), module.after_step[3])  # nothing to hand over
    state = load_checkpoint(trainer.save_checkpoint(tmp_path / "early.ckpt"))
    assert state[KEY]["current"] is None
    assert _equal(state["module"], module.after_step[3])


class _ShardedLikeFSDP(SingleProcess):
    name = "fsdp-like"
    sharded_state = True


async def test_a_strategy_that_shards_the_weights_is_refused() -> None:
    trainer = Trainer(
        max_steps=2, plugins=[WeightAveraging.ema()], strategy=_ShardedLikeFSDP(), device="cpu"
    )
    with pytest.raises(MisconfigurationError, match=r"strategy='fsdp-like'.*shards.*'ddp'"):
        await trainer.fit(TinyModule(), make_loader(n=32))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kind": "polyak"}, r"kind.*'ema'.*'swa'"),
        ({"decay": 1.5}, r"decay.*1"),
        ({"decay": -0.1}, r"decay"),
        ({"decay": "0.9"}, r"decay"),
        ({"kind": "swa", "decay": 0.9}, r"SWA.*no decay"),
        ({"every_n_steps": 0}, r"every_n_steps"),
        ({"start_step": -1}, r"start_step"),
        ({"start_epoch": 1.5}, r"start_epoch"),
        ({"use_buffers": "yes"}, r"use_buffers.*True or False"),
        ({"update_bn": True}, r"update_bn.*loader"),
        ({"update_bn": 3}, r"update_bn.*loader"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        WeightAveraging(**options)


def test_update_bn_under_ddp_is_refused_at_setup() -> None:
    class TwoRanks:
        world_size = 2
        strategy = SingleProcess()

    plugin = WeightAveraging(update_bn=[torch.zeros(2, 4)])
    with pytest.raises(MisconfigurationError, match="use_buffers=True"):
        plugin.setup(TwoRanks(), "fit")  # type: ignore[arg-type]


# ---------------------------------------------------------------- DDP (torchrun)
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.external
@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_two_ddp_ranks_keep_the_same_average_as_one_process(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        str(SCRIPT),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env(tests=True), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rank in ranks:
        assert rank["world_size"] == 2
        assert rank["n_averaged"] == rank["steps"] // 2
    assert _equal(ranks[0]["averaged"], ranks[1]["averaged"])
    assert _equal(ranks[0]["module"], ranks[1]["module"])
    # The EMA by hand over rank 0's snapshots (the ranks' weights are the same).
    snapshots = {int(k): v for k, v in ranks[0]["snapshots"].items()}
    steps = list(range(2, ranks[0]["steps"] + 1, 2))
    assert _equal(ranks[0]["averaged"], _ema(snapshots, steps, 0.75))
    assert all(_equal(v, ranks[1]["snapshots"][k]) for k, v in ranks[0]["snapshots"].items())
    summary = json.loads((tmp_path / "fsdp.json").read_text())
    assert "strategy='fsdp'" in summary["refusal"]
