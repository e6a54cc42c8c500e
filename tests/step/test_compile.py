"""``Trainer(compile=...)``: the steps compiled once per stage, ``put`` inside compiled
code without a graph break, records as in eager mode, compilations bounded with a short
last batch, checkpoints that load compiled or not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.nn import functional as F

from loopbus import MisconfigurationError, Module, Plugin, PutRecord, Trainer, on
from loopbus.events import CustomEvent, EventBus, TrainBatchCompleted
from loopbus.records._recorder import Recorder
from loopbus.stage._options import compile_optimizer_option, compile_options
from loopbus.state._runstate import RunState
from loopbus.step._step import optimizer_step_for


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    # Compiled code is cached per function; every test starts (and leaves) with none.
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


class CountingBackend:
    """A torch.compile backend that runs the captured graph as it is (the same kernels
    as eager, so weights compare bit for bit) and counts compilations per function."""

    def __init__(self) -> None:
        self.graphs: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append(gm.code)
        return gm.forward

    def count(self, step: str) -> int:
        return sum(1 for code in self.graphs if step in code) if step else len(self.graphs)


class EightPuts(Module):
    """Two layers; the training step puts eight tensors, validation one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.put("train/loss", loss)
        self.put("train/acc", (logits.argmax(-1) == y).float().mean())
        self.put("train/logit_mean", logits.mean())
        self.put("train/logit_max", logits.max())
        self.put("train/w1", self.fc1.weight.norm())
        self.put("train/w2", self.fc2.weight.norm())
        self.put("train/bias", self.fc2.bias.sum(), destinations="loggers")
        self.put("train/count", y.sum(), destinations=("callbacks", "loggers"))
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        self.put("val/loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def batches(sizes: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


Record = tuple[str, int, int, float]


class EveryOtherStep(Plugin):
    """Puts from a handler between steps, on every other step: the records pending when
    a step starts vary, which compiled code must not see (a guard that changes)."""

    @on(TrainBatchCompleted)
    def completed(self, event: TrainBatchCompleted) -> None:
        if event.step % 2:
            self.put("plugin/step", event.step)


async def fit(
    compile: Any,
    train: list[Any],
    val: list[Any] | None = None,
    *,
    epochs: int = 2,
    leak_check: Any = "raise",
    module: EightPuts | None = None,
) -> tuple[EightPuts, list[Record]]:
    module = module or EightPuts()
    trainer = Trainer(
        max_epochs=epochs,
        plugins=[EveryOtherStep()],
        device="cpu",
        compile=compile,
        leak_check=leak_check,
        num_sanity_val_steps=0,
    )
    records: list[Record] = []

    def keep(record: PutRecord) -> None:
        records.append((record.name, record.step, record.epoch, float(record.value)))

    trainer.subscribe(PutRecord, keep, destination="loggers")
    await trainer.fit(module, train, val)
    return module, records


def test_the_option_is_validated() -> None:
    assert compile_options(False) is None
    assert compile_options(None) is None
    assert dict(compile_options(True) or {}) == {}
    assert dict(compile_options({"backend": "aot_eager", "fullgraph": True}) or {}) == {
        "backend": "aot_eager",
        "fullgraph": True,
    }
    assert Trainer(plugins=[], device="cpu").options.compile is None
    with pytest.raises(MisconfigurationError, match="CUDA graphs are not supported"):
        Trainer(plugins=[], device="cpu", compile={"mode": "reduce-overhead"})
    with pytest.raises(MisconfigurationError, match="CUDA graphs are not supported"):
        Trainer(plugins=[], device="cpu", compile="cudagraphs")  # type: ignore[arg-type]
    with pytest.raises(
        MisconfigurationError, match=r"unknown torch.compile option\(s\) \['fulgraph'\]"
    ):
        Trainer(plugins=[], device="cpu", compile={"fulgraph": True})
    with pytest.raises(MisconfigurationError, match="must be True, False or a dict"):
        Trainer(plugins=[], device="cpu", compile=3)  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"'fullgraph'.*True or False"):
        Trainer(plugins=[], device="cpu", compile={"fullgraph": "yes"})
    with pytest.raises(MisconfigurationError, match=r"not a torch\.compile mode"):
        Trainer(plugins=[], device="cpu", compile={"mode": "fast"})
    with pytest.raises(AttributeError, match="cannot be changed after the trainer is built"):
        Trainer(plugins=[], device="cpu").compile = True  # type: ignore[assignment]


async def test_eight_puts_compile_fullgraph_with_records_as_in_eager() -> None:
    backend = CountingBackend()
    train = batches([6, 6, 6, 4])
    # The step alone (the optimizer's compiled step breaks its graph by torch's design).
    compiled, got = await fit({"backend": backend, "fullgraph": True, "optimizer": False}, train)
    assert counters["graph_break"] == {}
    assert backend.count("") >= 1  # it did compile
    eager, expected = await fit(False, train)
    assert [r[:3] for r in got] == [r[:3] for r in expected]
    # Two epochs of four steps, eight puts each, and the plugin's every other step.
    assert len(got) == 2 * 4 * 8 + 4
    assert backend.count("") <= 2  # the short last batch: once more, whatever is pending
    assert [r[0] for r in got[:8]] == [
        "train/loss",
        "train/acc",
        "train/logit_mean",
        "train/logit_max",
        "train/w1",
        "train/w2",
        "train/bias",
        "train/count",
    ]
    # The captured graph runs the eager kernels: values and weights agree exactly.
    assert [r[3] for r in got] == [r[3] for r in expected]
    for name, value in eager.state_dict().items():
        assert torch.equal(compiled.state_dict()[name], value), name


# torch's inductor imports a module that calls the deprecated torch.jit.script_method.
@pytest.mark.external
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
async def test_inductor_matches_eager_within_tolerance() -> None:
    train = batches([6, 6, 6])
    compiled, got = await fit({"fullgraph": True}, train, epochs=1, leak_check=None)
    eager, expected = await fit(False, train, epochs=1, leak_check=None)
    # fullgraph=True: the step compiled whole. The optimizer step (compiled too, "auto")
    # has torch's own two breaks around it, which keep its update out of autograd.
    assert counters["graph_break"]
    assert all("User-inserted graph break" in reason for reason in counters["graph_break"])
    assert [r[:3] for r in got] == [r[:3] for r in expected]
    # Fused kernels reorder float sums: agreement within 1e-5 over three steps.
    for (_, _, _, a), (_, _, _, b) in zip(got, expected, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], value, rtol=1e-5, atol=1e-5)


async def test_a_short_last_batch_compiles_at_most_twice_per_fit() -> None:
    backend = CountingBackend()
    # Three epochs, each ending on a short batch; validation of yet other sizes.
    train = batches([8, 8, 8, 5])
    val = batches([7, 7, 3], seed=1)
    await fit({"backend": backend, "optimizer": False}, train, val, epochs=3)
    train_graphs = sum(1 for code in backend.graphs if "cross_entropy" in code and "argmax" in code)
    val_graphs = len(backend.graphs) - train_graphs
    assert 1 <= train_graphs <= 2
    assert 1 <= val_graphs <= 2


class BrokenGraph(EightPuts):
    """Puts on both sides of a graph break, and a put_dict."""

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.put("before", loss)
        torch._dynamo.graph_break()
        self.put_dict({"after/a": loss * 2, "after/b": loss * 3})
        self.put("after/c", 1.5)
        return loss


# torch's compiler reads .grad of the non-leaf loss when it resumes after the break.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
async def test_puts_around_a_graph_break_keep_their_order() -> None:
    train = batches([5, 5, 5])
    _, got = await fit({"backend": "eager"}, train, module=BrokenGraph())
    assert sum(counters["graph_break"].values()) >= 1
    _, expected = await fit(False, train, module=BrokenGraph())
    assert got == expected
    assert [r[0] for r in got[:5]] == ["before", "after/a", "after/b", "after/c", "plugin/step"]


async def test_a_bad_put_inside_compiled_code_raises_the_eager_error() -> None:
    class BadName(EightPuts):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            loss = super().training_step(batch, ctx)
            self.put("bad\nname", loss)
            return loss

    trainer = Trainer(max_steps=1, plugins=[], device="cpu", compile={"backend": "eager"})
    with pytest.raises(ValueError, match="has the control character"):
        await trainer.fit(BadName(), batches([4]))


def test_compiled_code_hands_out_copies_not_views() -> None:
    """A put value that is the step's own loss, or a view of a parameter, would be an
    output aliasing another output or an input: torch rebuilds such outputs in Python
    after every call of the compiled step. Compiled code hands out a copy instead."""

    class Views(EightPuts):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.put("loss", loss)
            self.put("bias0", self.fc2.bias[0])
            return loss

    module = Views()
    recorder = Recorder(RunState(), EventBus())
    recorder.use_device(torch.device("cpu"), compiled=True)
    module.bind_recorder(recorder, "train")
    step = torch.compile(module.training_step, backend="aot_eager", fullgraph=True)
    loss = recorder.run_compiled(step, batches([4])[0], None)
    (_, put_loss, _, _), (_, put_bias, _, _) = recorder.peek()
    for value, of in ((put_loss, loss), (put_bias, module.fc2.bias)):
        assert value._base is None
        assert not value.requires_grad
        assert value.untyped_storage().data_ptr() != of.untyped_storage().data_ptr()
    assert put_loss.item() == loss.item()
    assert put_bias.item() == module.fc2.bias[0].item()
    # Eager puts keep the cheaper detached view (no copy).
    recorder.use_device(torch.device("cpu"), compiled=False)
    recorder.discard_pending()
    module.put("loss", loss)
    assert recorder.peek()[0][1].untyped_storage().data_ptr() == loss.untyped_storage().data_ptr()


async def _legs(tmp_path: Path, compiles: list[Any]) -> tuple[EightPuts, list[Path]]:
    """Fit two steps, then resume for one more step from the last checkpoint, leg after
    leg, each leg compiled with its entry of ``compiles`` (False: eager)."""
    train = batches([6, 6, 6, 6])
    path: Path | None = None
    paths: list[Path] = []
    module = EightPuts()
    for leg, compile in enumerate(compiles):
        trainer = Trainer(max_steps=2 + leg, plugins=[], device="cpu", compile=compile)
        module = EightPuts()
        await trainer.fit(module, train, ckpt_path=path)
        assert trainer.global_step == 2 + leg
        path = trainer.save_checkpoint(tmp_path / f"leg{leg}-{bool(compile)}.ckpt")
        paths.append(path)
    return module, paths


async def test_checkpoints_load_compiled_and_uncompiled_both_ways(tmp_path: Path) -> None:
    aot = {"backend": "aot_eager"}
    mixed, paths = await _legs(tmp_path / "mixed", [aot, False, aot])
    for path in paths:
        saved = torch.load(path, weights_only=True)["module"]
        assert not [key for key in saved if "_orig_mod" in key]
        assert set(saved) == set(mixed.state_dict())
    eager, _ = await _legs(tmp_path / "eager", [False, False, False])
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(mixed.state_dict()[name], value, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the optimizer step
class OptimizerGraphs(CountingBackend):
    """Counts the graphs of the optimizer's step apart (the training step's graphs
    compute a cross entropy; no validation runs here)."""

    def optimizer(self) -> int:
        return sum(1 for code in self.graphs if "cross_entropy" not in code)


class Scheduled(EightPuts):
    """EightPuts with a learning rate that a per-epoch scheduler changes."""

    def __init__(self, lr: float | torch.Tensor) -> None:
        super().__init__()
        self.lr = lr

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5),
        }


async def test_the_optimizer_step_is_compiled_too_and_trains_as_in_eager() -> None:
    backend = OptimizerGraphs()
    train = batches([6, 6, 6, 4])
    compiled, got = await fit({"backend": backend}, train, epochs=3)
    # Twice: the first step creates the momentum buffers, every later step of the three
    # epochs reuses the second graph.
    assert backend.optimizer() == 2
    eager, expected = await fit(False, train, epochs=3)
    assert got == expected
    for name, value in eager.state_dict().items():
        assert torch.equal(compiled.state_dict()[name], value), name
    # Kept eager on request: no optimizer graph.
    eager_optimizer = OptimizerGraphs()
    await fit({"backend": eager_optimizer, "optimizer": False}, train)
    assert eager_optimizer.optimizer() == 0
    assert eager_optimizer.count("") >= 1


async def test_a_scheduled_tensor_learning_rate_compiles_the_optimizer_once() -> None:
    backend = OptimizerGraphs()
    train = batches([6, 6, 6])
    compiled, got = await fit(
        {"backend": backend}, train, epochs=3, module=Scheduled(torch.tensor(0.1))
    )
    assert backend.optimizer() == 2  # the scheduler fills the tensor: no recompilation
    eager, expected = await fit(False, train, epochs=3, module=Scheduled(0.1))
    assert [r[:3] for r in got] == [r[:3] for r in expected]
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], value, rtol=1e-6, atol=1e-7)


async def test_a_scheduled_float_learning_rate_keeps_the_optimizer_eager() -> None:
    backend = OptimizerGraphs()
    train = batches([6, 6])
    with pytest.warns(UserWarning, match=r"stays eager: its learning rate is a Python number"):
        await fit({"backend": backend}, train, module=Scheduled(0.1))
    assert backend.optimizer() == 0
    with pytest.raises(MisconfigurationError, match=r"lr=torch.tensor\(0.01\)"):
        await fit({"backend": backend, "optimizer": True}, train, module=Scheduled(0.1))


async def test_compile_optimizer_true_says_what_cannot_be_compiled() -> None:
    class Manual(EightPuts):
        automatic_optimization = False

        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            loss = super().training_step(batch, ctx)
            optimizer = self.optimizers()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

    with pytest.raises(MisconfigurationError, match="steps its optimizers itself"):
        await fit({"backend": "eager", "optimizer": True}, batches([4]), module=Manual())


def test_the_grad_scaler_keeps_the_optimizer_eager() -> None:
    class Schedulers:
        per_step = False
        configured = False

    optimizer = torch.optim.SGD(EightPuts().parameters(), lr=0.1)
    common: dict[str, Any] = {"compile": {}, "schedulers": Schedulers()}
    assert optimizer_step_for(optimizer, policy="auto", scaler=object(), **common) == (
        optimizer.step
    )
    with pytest.raises(MisconfigurationError, match="grad scaler"):
        optimizer_step_for(optimizer, policy=True, scaler=object(), **common)
    assert optimizer_step_for(optimizer, policy=False, scaler=None, **common) == optimizer.step
    assert optimizer_step_for(optimizer, policy="auto", scaler=None, **common) != optimizer.step


async def test_auto_compiles_only_torch_optimizers() -> None:
    class Custom(torch.optim.SGD):
        """A subclass (a library's optimizer would be the same): its step may call what
        torch's compiler cannot trace."""

    class WithCustom(EightPuts):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return Custom(self.parameters(), lr=0.1)

    backend = OptimizerGraphs()
    await fit({"backend": backend}, batches([6, 6]), module=WithCustom())
    assert backend.optimizer() == 0
    forced = OptimizerGraphs()
    await fit({"backend": forced, "optimizer": True}, batches([6, 6]), module=WithCustom())
    assert forced.optimizer() >= 1


def test_the_optimizer_option_is_validated() -> None:
    assert dict(compile_options({"backend": "eager", "optimizer": False}) or {}) == {
        "backend": "eager"
    }
    assert compile_optimizer_option({"optimizer": True}) is True
    assert compile_optimizer_option({}) == "auto"
    assert compile_optimizer_option(True) == "auto"
    with pytest.raises(MisconfigurationError, match=r"'optimizer'.*got 'yes'"):
        Trainer(compile={"optimizer": "yes"})


class Marker(CustomEvent, frozen=True, kw_only=True):
    """Published by the step between two puts."""

    label: str = ""


class PublishesBetweenPuts(EightPuts):
    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.put("before", loss)
        self.trainer.publish(Marker(label="between"))
        self.put("after", loss * 2)
        return loss


# torch's compiler reads .grad of the loss where the step resumes after the publish's
# graph break, which warns (the loss is no leaf); torch's own.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
async def test_an_event_published_inside_a_compiled_step_keeps_its_place() -> None:
    async def order(compile: Any) -> list[tuple[str, int]]:
        seen: list[tuple[str, int]] = []
        trainer = Trainer(max_epochs=1, plugins=[], device="cpu", compile=compile)
        trainer.subscribe(PutRecord, lambda r: seen.append((r.name, r.step)))
        trainer.subscribe(Marker, lambda e: seen.append((e.label, e.step)))
        await trainer.fit(PublishesBetweenPuts(), batches([4, 4, 4]))
        return seen

    expected = await order(False)
    assert expected[:3] == [("before", 1), ("between", 0), ("after", 1)]
    assert await order({"backend": "eager"}) == expected


class ReadsTheBatchIndex(EightPuts):
    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        if ctx.batch_idx % 4 == 0:
            loss = loss * 1.0
        return loss * (1 + 0 * ctx.batch_idx)


class CountsOnTheModule(EightPuts):
    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return super().training_step(batch, ctx) * (1 + 0 * self.calls)


async def test_python_numbers_in_the_step_and_how_often_they_compile() -> None:
    train = batches([4] * 12)
    backend = CountingBackend()
    await fit(
        {"backend": backend, "optimizer": False}, train, epochs=1, module=ReadsTheBatchIndex()
    )
    # The first index, then dynamic; the branch once more for its other way.
    assert backend.count("") <= 3
    counting = CountingBackend()
    await fit(
        {"backend": counting, "optimizer": False}, train, epochs=1, module=CountsOnTheModule()
    )
    assert counting.count("") == 8  # again at every step, up to torch's limit


async def test_compiled_steps_run_in_the_worker_thread() -> None:
    train = batches([6, 6, 4])
    module = EightPuts()
    trainer = Trainer(
        max_epochs=2,
        plugins=[],
        device="cpu",
        compile={"backend": "aot_eager"},
        executor="thread",
        num_sanity_val_steps=0,
    )
    names: list[tuple[str, int]] = []
    trainer.subscribe(PutRecord, lambda r: names.append((r.name, r.step)), destination="loggers")
    await trainer.fit(module, train)
    eager, expected = await fit(False, train, leak_check=None)
    assert names == [(r[0], r[1]) for r in expected if r[0] != "plugin/step"]
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(module.state_dict()[name], value, rtol=1e-5, atol=1e-6)
