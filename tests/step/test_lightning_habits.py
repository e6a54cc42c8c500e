"""What a module written for Lightning reaches for: ``self.log`` and ``self.log_dict``
fail with the put lines to write instead, ``self.hparams.lr`` reads, and
``self.device``, ``self.current_epoch`` and ``self.global_step`` are read-only
properties."""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from loopbus import MisconfigurationError, Module, Trainer
from loopbus.events import TrainBatchCompleted
from loopbus.records._destinations import checked_destinations
from tests.helpers import TinyModule, make_loader


class Logs(TinyModule):
    """Calls Lightning's log methods the way a ported module does."""

    def log_accuracy(self, acc: Any) -> None:
        self.log("val/acc", acc, on_epoch=True)

    def log_hidden(self, loss: Any) -> None:
        self.log("train/loss", loss, prog_bar=False, logger=True, sync_dist=True)

    def log_not_logged(self, loss: Any) -> None:
        self.log("train/loss", loss, True, False)  # prog_bar=True, logger=False

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        self.log_dict(metrics, on_step=True)

    def log_display(self, loss: Any) -> None:
        self.log_dict(
            {"train/loss": loss, "train/acc": 0.5, "lr": 0.1, "epoch": 1},
            logger=False,
        )


def _raised(call: Any, *args: Any) -> str:
    with pytest.raises(MisconfigurationError) as info:
        call(*args)
    return str(info.value)


def test_log_shows_the_put_line_written_with_the_callers_arguments() -> None:
    message = _raised(Logs().log_accuracy, torch.tensor(0.5))
    assert message.startswith("Logs.log() is Lightning's; loopbus publishes a record with put")
    assert '\n    self.put("val/acc", acc)\n' in message
    # What on_epoch=True did: a torchmetrics metric, put from the epoch-end handler.
    assert "not aggregated" in message
    assert "torchmetrics" in message
    assert "@loopbus.on(loopbus.events.ValidationCompleted)" in message
    assert 'self.put("val/acc", self.metric.compute())' in message
    assert "destinations" in message


def test_prog_bar_and_logger_become_put_destinations() -> None:
    message = _raised(Logs().log_hidden, torch.tensor(1.0))
    line = re.search(r"self\.put\(\"train/loss\", loss, destinations=(\(.*?\))\)", message)
    assert line is not None, message
    roles = eval(line.group(1))
    assert checked_destinations(roles) == ("callbacks", "external", "loggers")
    assert "sync_dist" in message  # torchmetrics reduces across ranks

    # Positional, in Lightning's order: prog_bar=True, logger=False.
    message = _raised(Logs().log_not_logged, 1.0)
    line = re.search(r"self\.put\(\"train/loss\", loss, destinations=(\(.*?\))\)", message)
    assert line is not None, message
    assert checked_destinations(eval(line.group(1))) == ("callbacks", "external", "progress_bar")

    # The defaults (and prog_bar=True with the logger) are put's default: all of them.
    with pytest.raises(MisconfigurationError) as info:
        Logs().log("x", 1.0, prog_bar=True)
    assert str(info.value).splitlines()[1] == '    self.put("x", 1.0)'


def test_log_without_readable_source_shows_the_values() -> None:
    net = Logs()
    code = compile("net.log('train/loss', 1.5)", "<no source>", "exec")
    with pytest.raises(MisconfigurationError, match=re.escape('self.put("train/loss", 1.5)')):
        exec(code, {"net": net})
    code = compile("net.log('train/loss', tensor)", "<no source>", "exec")
    with pytest.raises(MisconfigurationError, match=re.escape('self.put("train/loss", value)')):
        exec(code, {"net": net, "tensor": torch.ones(())})
    # Called from C (map): the caller's expression is another call, so the values show.
    with pytest.raises(MisconfigurationError, match=re.escape('self.put("a", 2.5)')):
        list(map(net.log, ["a"], [2.5]))


def test_log_dict_shows_put_dict_and_a_few_put_lines() -> None:
    metrics = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    message = _raised(Logs().log_metrics, metrics)
    assert message.startswith("Logs.log_dict() is Lightning's")
    assert "\n    self.put_dict(metrics)\n" in message
    lines = [line.strip() for line in message.splitlines()]
    puts = lines[lines.index("or one put per item:") + 1 :][:4]
    assert puts == [
        'self.put("a", metrics["a"])',
        'self.put("b", metrics["b"])',
        'self.put("c", metrics["c"])',
        "...",
    ]
    assert "not aggregated" in message

    # A dict display: each put takes the value's own expression.
    message = _raised(Logs().log_display, torch.tensor(1.0))
    only = ', destinations=("callbacks", "progress_bar", "external"))'
    assert f'self.put("train/loss", loss{only}' in message
    assert f'self.put("train/acc", 0.5{only}' in message
    assert f'self.put("lr", 0.1{only}' in message
    assert 'self.put("epoch"' not in message  # three, then "..."
    assert "\n    ...\n" in message


async def test_log_in_a_step_fails_the_stage_with_the_put_line() -> None:
    class Ported(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            loss = super().training_step(batch, ctx)
            self.log("train/loss", loss, prog_bar=True)
            return loss

    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    with pytest.raises(MisconfigurationError, match=re.escape('self.put("train/loss", loss)')):
        await trainer.fit(Ported(), make_loader(n=16))


class Net(TinyModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1, name: str = "net") -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


def test_hparams_read_as_attributes_and_stay_a_read_only_mapping() -> None:
    net = Net(hidden=4)
    hparams = net.hparams
    assert hparams.lr == 0.1
    assert hparams.hidden == 4
    assert hparams["name"] == "net"
    assert isinstance(hparams, Mapping)
    assert dict(hparams) == {"hidden": 4, "lr": 0.1, "name": "net"}
    assert hparams == {"hidden": 4, "lr": 0.1, "name": "net"}
    assert hparams == Net(hidden=4).hparams
    assert hparams != Net(hidden=5).hparams
    assert "lr" in hparams
    assert len(hparams) == 3
    assert "hidden" in dir(hparams)

    with pytest.raises(AttributeError, match=r"Net\.hparams has no 'lrr' \(did you mean 'lr'\?\)"):
        _ = hparams.lrr
    with pytest.raises(AttributeError, match=r"it holds \['hidden', 'lr', 'name'\]"):
        _ = hparams.dropout
    assert getattr(hparams, "dropout", None) is None
    with pytest.raises(AttributeError, match=r"Net\.hparams is read-only.*self\.lr = "):
        hparams.lr = 0.5
    with pytest.raises(AttributeError, match="read-only"):
        del hparams.lr
    with pytest.raises(TypeError):
        hparams["lr"] = 0.5
    assert hparams.lr == 0.1


def test_hparams_of_a_module_that_kept_none() -> None:
    hparams = TinyModule().hparams
    assert dict(hparams) == {}
    assert not hparams
    with pytest.raises(AttributeError, match=r"empty.*save_hyperparameters\(\) in TinyModule"):
        _ = hparams.lr


def test_hparams_copy_and_pickle() -> None:
    net = Net(lr=0.2)
    again = pickle.loads(pickle.dumps(net.hparams))
    assert again == net.hparams
    assert again.lr == 0.2
    assert copy.deepcopy(net.hparams) == net.hparams
    assert copy.deepcopy(net).hparams.lr == 0.2
    with pytest.raises(AttributeError, match=r"Net\.hparams has no 'hiden'"):
        _ = again.hiden


def test_device_is_that_of_the_parameters_or_buffers() -> None:
    assert TinyModule().device == torch.device("cpu")
    assert Module().device == torch.device("cpu")  # nothing in it

    class Buffered(Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(2, device="meta"))

    assert Buffered().device == torch.device("meta")
    with torch.device("meta"):
        on_meta = TinyModule()
    assert on_meta.device == torch.device("meta")
    assert on_meta.to_empty(device="cpu").device == torch.device("cpu")

    with pytest.raises(AttributeError, match=r"TinyModule\.device is read-only.*\.to\(device\)"):
        on_meta.device = torch.device("cpu")


async def test_current_epoch_and_global_step_are_the_trainers() -> None:
    seen: list[tuple[int, int, int, int]] = []

    class Counts(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            trainer = self.trainer
            seen.append(
                (self.global_step, trainer.global_step, self.current_epoch, trainer.current_epoch)
            )
            return super().training_step(batch, ctx)

    net = Counts()
    assert (net.global_step, net.current_epoch) == (0, 0)  # no trainer attached
    trainer = Trainer(max_epochs=2, plugins=[], device="cpu")
    await trainer.fit(net, make_loader(n=32))
    assert [(s, e) for s, _, e, _ in seen] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert all(mine == theirs for mine, theirs, _, _ in seen)
    assert all(mine == theirs for _, _, mine, theirs in seen)
    assert trainer.global_step == 4
    assert (net.global_step, net.current_epoch) == (0, 0)  # detached when the stage ends

    with pytest.raises(AttributeError, match=r"Counts\.global_step is read-only"):
        net.global_step = 3
    with pytest.raises(AttributeError, match=r"Counts\.current_epoch is read-only"):
        net.current_epoch = 1


async def test_a_module_copied_or_pickled_during_a_stage_leaves_the_trainer_behind() -> None:
    # An averaged model made with copy.deepcopy in a handler, or torch.save of the whole
    # module mid-fit: the copy has the weights, not the trainer or its recorder.
    module = TinyModule()
    trainer = Trainer(max_steps=2, plugins=[])
    copies: list[Any] = []

    def keep_a_copy(event: Any) -> None:
        copies.append(copy.deepcopy(module))
        copies.append(pickle.loads(pickle.dumps(module)))

    trainer.subscribe(TrainBatchCompleted, keep_a_copy, once=1)
    await trainer.fit(module, make_loader())
    assert len(copies) == 2
    for made in copies:
        assert type(made) is TinyModule
        assert made.state_dict().keys() == module.state_dict().keys()
        with pytest.raises(RuntimeError, match="not attached to a running Trainer"):
            _ = made.trainer
        with pytest.raises(RuntimeError, match="outside a Trainer stage"):
            made.put("loss", 1.0)
    # The module itself was bound through the stage and is unbound after it.
    with pytest.raises(RuntimeError, match="outside a Trainer stage"):
        module.put("loss", 1.0)
