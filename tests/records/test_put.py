from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest
import torch

from loopbus import Module, Plugin, PutRecord, Trainer, on
from loopbus.events import TrainBatchCompleted
from tests.helpers import TinyModule, make_loader


@pytest.fixture
def module() -> Module:
    m = TinyModule()
    trainer = Trainer(plugins=[])
    m.bind_recorder(trainer.recorder, "TinyModule")
    _RECORDERS[m] = trainer.recorder
    return m


# The recorder each test module's put goes to.
_RECORDERS: weakref.WeakKeyDictionary[Module, Any] = weakref.WeakKeyDictionary()


def pending(m: Module) -> list[Any]:
    return _RECORDERS[m].peek()  # type: ignore[no-any-return]


def test_put_accepts_numbers_and_one_element_tensors(module: Module) -> None:
    module.put("a", 1)
    module.put("b", 2.5)
    module.put("c", True)
    module.put("d", torch.tensor(3.0))
    module.put("e", torch.tensor([4.0]))
    module.put("f", np.float32(5.5))
    module.put("g", np.int64(6))
    module.put_dict({"h": 7, "i": torch.tensor(8)}, destinations="loggers")
    names = [p[0] for p in pending(module)]
    assert names == ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
    assert pending(module)[5][1] == 5.5
    assert type(pending(module)[5][1]) is float
    assert pending(module)[6][1] == 6
    assert type(pending(module)[6][1]) is int
    assert pending(module)[7][2] == ("loggers",)


def test_put_rejects_bad_input_at_the_call_site(module: Module) -> None:
    with pytest.raises(ValueError, match=r"put\('x', \.\.\.\) needs a single number, got a tensor of shape \(3,\)"):
        module.put("x", torch.ones(3))
    with pytest.raises(TypeError, match=r"name must be a non-empty str such as 'train/loss', got 3"):
        module.put(3, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"name must be a non-empty str.*got ''"):
        module.put("", 1.0)
    with pytest.raises(TypeError, match=r"got text 'high'.*custom event"):
        module.put("x", "high")
    with pytest.raises(TypeError, match=r"got a value of type list.*metric.compute\(\)"):
        module.put("x", [1, 2])
    with pytest.raises(TypeError, match=r"got a value of type complex"):
        module.put("x", 1 + 2j)
    with pytest.raises(TypeError, match=r"complex tensor"):
        module.put("x", torch.tensor(1 + 2j))
    with pytest.raises(ValueError, match=r"unknown destination 'logger'; known destinations"):
        module.put("x", 1.0, destinations="logger")
    with pytest.raises(ValueError, match=r"destinations is empty"):
        module.put("x", 1.0, destinations=())
    with pytest.raises(TypeError, match=r"put_dict\(\) needs a mapping"):
        module.put_dict([("a", 1)])  # type: ignore[arg-type]
    assert pending(module) == []


def test_put_does_not_keep_the_autograd_graph_alive(module: Module) -> None:
    w = torch.ones(4, requires_grad=True)
    loss = (w * 2).sum()
    ref = weakref.ref(loss)
    module.put("loss", loss)
    stored = pending(module)[0][1]
    assert not stored.requires_grad
    assert stored.grad_fn is None
    del loss
    assert ref() is None


def test_put_outside_a_run_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"TinyModule.put\('x', \.\.\.\) was called outside a Trainer stage"):
        TinyModule().put("x", 1.0)


class Putter(Plugin):
    """Plugins put too; their records carry the plugin's name as source."""

    @on(TrainBatchCompleted)
    def report(self, event: TrainBatchCompleted) -> None:
        self.put("plugin/step", event.step, destinations="callbacks")


async def test_plugin_puts_are_flushed_with_their_source() -> None:
    trainer = Trainer(max_epochs=1, plugins=[Putter()])
    got: list[PutRecord] = []
    trainer.subscribe(PutRecord, got.append)
    await trainer.fit(TinyModule(), make_loader(n=32))
    plugin_records = [(r.value, r.source) for r in got if r.name == "plugin/step"]
    assert plugin_records == [(1, "Putter"), (2, "Putter")]
