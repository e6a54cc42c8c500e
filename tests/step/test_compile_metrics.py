"""``Trainer(compile=...)`` with real modules: torchmetrics metrics run eagerly inside
compiled steps (the README's classifier validates with ``compile=True``, a metric
update in ``training_step`` compiles a bounded number of times), ``compile={"target":
...}`` compiles only the module's call or a submodule, and the module is left as it was
after the stage."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from torch.nn import functional as F

from loopbus import MisconfigurationError, Module, Trainer, on
from loopbus.events import ValidationCompleted
from loopbus.stage._options import compile_options

# A graph break (at a metric's update) resumes compiled code with the logits, a tensor
# that is not a leaf, as an input; the compiler's check of its .grad warns.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
)

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


class Classifier(Module):
    """The README's classifier (smaller), with an optional training metric."""

    def __init__(self, train_metric: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        )
        self.acc = MulticlassAccuracy(num_classes=3)
        self.train_acc = (
            None if train_metric is None else MulticlassAccuracy(num_classes=3, average=train_metric)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if self.train_acc is not None:
            self.train_acc.update(logits, y)
        self.put("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        self.acc(self(x), y)  # the metric's forward: update and batch value

    @on(ValidationCompleted)
    def report(self, event: ValidationCompleted) -> None:
        self.put("val/acc", self.acc.compute())
        self.acc.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def metric_methods(module: torch.nn.Module) -> dict[str, Any]:
    """What the instances of the module's metrics hold for their methods."""
    return {
        f"{name}.{method}": sub.__dict__.get(method)
        for name, sub in module.named_modules()
        if isinstance(sub, torchmetrics.Metric)
        for method in ("update", "forward", "compute", "reset")
    }


async def fit(
    module: Classifier, compile: Any, train: list[Any], val: list[Any] | None, **kw: Any
) -> Trainer:
    trainer = Trainer(plugins=[], device="cpu", compile=compile, **kw)
    await trainer.fit(module, train, val)
    return trainer


async def test_the_readme_classifier_validates_compiled_with_its_sanity_check() -> None:
    module = Classifier()
    before = metric_methods(module)
    backend = CompileCounter()
    trainer = await fit(module, {"backend": backend}, batches(4), batches(2), max_epochs=2)
    eager = await fit(Classifier(), False, batches(4), batches(2), max_epochs=2)
    assert trainer.latest["val/acc"].value == pytest.approx(eager.latest["val/acc"].value)
    assert backend.frame_count <= 6  # training and validation steps, no more per step
    assert metric_methods(module) == before  # the metrics' wrappers are gone


async def test_a_metric_update_in_training_step_compiles_a_bounded_number_of_times() -> None:
    # A micro average keeps Python counters the compiled step would guard on: one
    # compilation per step until torch's limit, were the metric traced.
    module = Classifier(train_metric="micro")
    backend = CompileCounter()
    await fit(module, {"backend": backend, "optimizer": False}, batches(12), None, max_epochs=1)
    assert backend.frame_count <= 3
    assert not counters["recompiles"] or sum(counters["recompiles"].values()) <= 2
    eager = Classifier(train_metric="micro")
    await fit(eager, False, batches(12), None, max_epochs=1)
    assert module.train_acc is not None
    assert eager.train_acc is not None
    assert module.train_acc.compute() == pytest.approx(eager.train_acc.compute())


async def test_target_forward_compiles_only_the_module_call_and_trains_as_eager() -> None:
    module = Classifier(train_metric="macro")
    before = metric_methods(module)
    backend = CompileCounter()
    await fit(module, {"backend": backend, "target": "forward"}, batches(10), batches(2), max_epochs=1)
    # The module's call, with and without gradients (training, validation); the steps
    # and the optimizer step run eagerly.
    assert 1 <= backend.frame_count <= 2
    assert backend.op_count <= 2 * 3  # linear, relu, linear: nothing of the loss or the metric
    eager = Classifier(train_metric="macro")
    await fit(eager, False, batches(10), batches(2), max_epochs=1)
    for (name, p), q in zip(module.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert "forward" not in vars(module)  # left uncompiled
    assert metric_methods(module) == before


async def test_a_submodule_target_is_compiled_for_the_stage_only() -> None:
    module = Classifier()
    backend = CompileCounter()
    await fit(module, {"backend": backend, "target": "net.0"}, batches(3), None, max_epochs=1)
    assert backend.frame_count == 1  # the first linear only
    assert backend.op_count == 1
    assert all("forward" not in vars(sub) for sub in module.modules())


async def test_an_unknown_target_lists_the_submodules() -> None:
    with pytest.raises(MisconfigurationError, match=r"no submodule 'encoder'.*'net', 'net.0'"):
        await fit(Classifier(), {"target": "encoder"}, batches(1), None, max_epochs=1)


def test_the_target_option_is_validated() -> None:
    assert dict(compile_options({"target": "forward"}) or {}) == {"target": ("forward",)}
    assert dict(compile_options({"target": ["net", "net.0"]}) or {}) == {
        "target": ("net", "net.0")
    }
    assert dict(compile_options({"target": "steps"}) or {}) == {}
    for bad in ("", 3, [], ["steps", "net"], [".net"]):
        with pytest.raises(MisconfigurationError, match="target"):
            compile_options({"target": bad})
