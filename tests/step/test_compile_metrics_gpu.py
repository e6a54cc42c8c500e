"""``Trainer(compile=...)`` with torchmetrics on CUDA, through inductor: the README's
classifier validates compiled (sanity check included) with the eager accuracy, a metric
update in ``training_step`` compiles a bounded number of times, and ``target="forward"``
trains as the eager module does. Skipped without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from loopbus import Trainer

from .test_compile_metrics import Classifier, _fresh_dynamo, batches  # noqa: F401

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # inductor's advice (TF32 matmuls, online softmax) depends on the card: not ours.
    pytest.mark.filterwarnings("ignore::UserWarning:torch._inductor"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]


async def fit(module: Classifier, compile: Any, train: list[Any], val: list[Any] | None, **kw: Any) -> Trainer:
    trainer = Trainer(plugins=[], device="cuda", compile=compile, **kw)
    await trainer.fit(module, train, val)
    return trainer


def compiled_frames() -> int:
    return int(counters["frames"]["ok"])


async def test_the_readme_classifier_validates_compiled_on_cuda() -> None:
    trainer = await fit(Classifier(), True, batches(4), batches(2), max_epochs=2)
    short = compiled_frames()
    eager = await fit(Classifier(), False, batches(4), batches(2), max_epochs=2)
    assert trainer.latest["val/acc"].value == pytest.approx(eager.latest["val/acc"].value)
    # Compilations do not grow with the steps: twice the batches, as many frames.
    torch._dynamo.reset()
    counters.clear()
    await fit(Classifier(), True, batches(8), batches(4), max_epochs=2)
    assert compiled_frames() == short
    assert sum(counters["recompiles"].values()) <= 2


async def test_a_metric_update_in_training_step_compiles_a_bounded_number_of_times_on_cuda() -> None:
    module = Classifier(train_metric="micro")
    await fit(module, {"backend": "inductor", "optimizer": False}, batches(12), None, max_epochs=1)
    assert 1 <= compiled_frames() <= 4
    assert sum(counters["recompiles"].values()) <= 2
    eager = Classifier(train_metric="micro")
    await fit(eager, False, batches(12), None, max_epochs=1)
    assert module.train_acc is not None
    assert eager.train_acc is not None
    assert float(module.train_acc.compute()) == pytest.approx(float(eager.train_acc.compute()))


async def test_target_forward_trains_as_eager_on_cuda() -> None:
    module = Classifier(train_metric="macro")
    await fit(module, {"target": "forward"}, batches(10), batches(2), max_epochs=1)
    assert 1 <= compiled_frames() <= 2
    eager = Classifier(train_metric="macro")
    await fit(eager, False, batches(10), batches(2), max_epochs=1)
    for (name, p), q in zip(module.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    assert "forward" not in vars(module)
