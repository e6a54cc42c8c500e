"""BatchSizeFinder and find_batch_size on the CPU, with a module that runs out of memory
(raises what torch raises) when a batch is larger than a limit."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import loopbus
from loopbus import MisconfigurationError
from loopbus.plugins.tuning import BatchSizeFinder, find_batch_size, is_out_of_memory

LIMIT = 48
SAMPLES = 512
HOST_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
    "memory: you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
)
HOST_OOM_WINDOWS = (
    "[enforce fail at C:\\actions-runner\\_work\\pytorch\\c10\\core\\impl\\alloc_cpu.cpp:81] "
    "data. DefaultCPUAllocator: not enough memory: you tried to allocate 4294967296 bytes."
)


def cuda_oom(n: int) -> BaseException:
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} MiB")


class Limited(loopbus.Module):
    """A regression whose step fails like an allocation would when the batch holds more
    than ``limit`` samples; it records the size and loss of every step that trained."""

    def __init__(self, limit: int = LIMIT, error: Any = cuda_oom) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.limit = limit
        self.error = error
        self.steps: list[tuple[int, float]] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        n = x.shape[0]
        if n > self.limit:
            raise self.error(n)
        x = F.dropout(x, 0.1, training=self.training)  # draws from the global generator
        loss = F.mse_loss(self.net(x), y)
        self.steps.append((n, float(loss.detach())))
        self.put("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset(samples: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.5
    return TensorDataset(x, y)


def loader(batch_size: int = 2, samples: int = SAMPLES) -> DataLoader[Any]:
    return DataLoader(
        dataset(samples),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
    )


def trainer(*plugins: loopbus.Plugin, **options: Any) -> loopbus.Trainer:
    options.setdefault("max_epochs", 1)
    return loopbus.Trainer(plugins=list(plugins), device="cpu", **options)


def trained(module: Limited, trainer: loopbus.Trainer) -> list[tuple[int, float]]:
    """The steps of the fit after the search (the trials' steps come first)."""
    return module.steps[len(module.steps) - trainer.global_step :]


POWER = [(2, True), (4, True), (8, True), (16, True), (32, True), (64, False)]
BINSEARCH = [*POWER, (48, True), (56, False), (52, False), (50, False), (49, False)]


async def test_power_mode_finds_32_and_training_continues_at_it() -> None:
    torch.manual_seed(0)
    module = Limited()
    finder = BatchSizeFinder("power", margin=0)
    t = trainer(finder)
    await t.fit(module, loader())
    assert finder.trials == POWER
    assert finder.largest_fit == finder.batch_size == 32
    assert t.latest["batch_size_finder/batch_size"].value == 32
    # Training went on at 32: a whole epoch of 512 / 32 batches, and it learnt.
    assert t.global_step == SAMPLES // 32
    steps = trained(module, t)
    assert [n for n, _ in steps] == [32] * (SAMPLES // 32)
    losses = [loss for _, loss in steps]
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])
    assert t.latest["train/loss"].value == pytest.approx(losses[-1])


async def test_binsearch_finds_the_largest_size_that_fits_less_the_margin() -> None:
    torch.manual_seed(0)
    module = Limited()
    finder = BatchSizeFinder("binsearch")  # margin 0.05
    t = trainer(finder)
    await t.fit(module, loader())
    assert finder.trials == BINSEARCH
    assert len(finder.trials) <= finder.max_trials == 25
    assert finder.largest_fit == LIMIT
    assert finder.batch_size == math.floor(LIMIT * 0.95) == 45
    assert t.latest["batch_size_finder/batch_size"].value == 45
    sizes = [n for n, _ in trained(module, t)]
    assert sizes == [45] * (SAMPLES // 45) + [SAMPLES % 45]


async def test_max_trials_bounds_the_search() -> None:
    module = Limited()
    finder = BatchSizeFinder("binsearch", max_trials=7, margin=0)
    await trainer(finder, max_steps=1).fit(module, loader())
    assert finder.trials == BINSEARCH[:7]
    assert finder.batch_size == 48
    short = BatchSizeFinder("binsearch", max_trials=3, margin=0)
    await trainer(short, max_steps=1).fit(Limited(), loader())
    assert short.trials == BINSEARCH[:3]
    assert short.batch_size == 8


async def test_a_first_size_too_large_is_halved_until_one_fits() -> None:
    finder = BatchSizeFinder("power", init_val=256, margin=0)
    await trainer(finder, max_steps=1).fit(Limited(), loader())
    assert finder.trials == [(256, False), (128, False), (64, False), (32, True)]
    assert finder.batch_size == 32
    bisect = BatchSizeFinder("binsearch", init_val=256, margin=0)
    await trainer(bisect, max_steps=1).fit(Limited(), loader())
    assert bisect.trials[:4] == [(256, False), (128, False), (64, False), (32, True)]
    assert bisect.batch_size == 48


async def test_the_search_stops_at_the_samples_there_are() -> None:
    finder = BatchSizeFinder("power", margin=0)
    await trainer(finder).fit(Limited(), loader(samples=20))
    assert finder.trials == [(2, True), (4, True), (8, True), (16, True), (20, True)]
    assert finder.batch_size == 20


async def test_training_after_the_search_starts_from_the_same_state() -> None:
    """Weights, optimizer state, the global generators (dropout) and the loader's
    generator are put back: the run equals one without the search, at the size found."""
    torch.manual_seed(0)
    searched = Limited()
    t = trainer(BatchSizeFinder("power", margin=0), max_epochs=2)
    await t.fit(searched, loader())

    torch.manual_seed(0)
    plain = Limited()
    await trainer(max_epochs=2).fit(plain, loader(batch_size=32))

    assert trained(searched, t) == plain.steps
    for a, b in zip(searched.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


async def test_a_module_that_keeps_its_optimizer_gets_its_state_back() -> None:
    class Keeps(Limited):
        def __init__(self) -> None:
            super().__init__()
            self.opt = torch.optim.Adam(self.parameters(), lr=0.01)

        def configure_optimizers(self) -> Any:
            return self.opt

    module = Keeps()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    size = await find_batch_size(trainer(), module, loader(), margin=0)
    assert size == 32
    assert module.opt.state_dict()["state"] == {}  # Adam's moments of the trials: gone
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())


async def test_other_errors_propagate_unchanged() -> None:
    error = ValueError("the labels are malformed")
    module = Limited(limit=8, error=lambda n: error)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    t = trainer(BatchSizeFinder())
    with pytest.raises(ValueError, match="malformed") as raised:
        await t.fit(module, loader())
    assert raised.value is error
    assert t.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())

    # A RuntimeError that is not an allocation failure is not taken for one.
    other = RuntimeError("CUDA error: device-side assert triggered")
    with pytest.raises(RuntimeError) as raised_rt:
        await trainer(BatchSizeFinder()).fit(Limited(limit=8, error=lambda n: other), loader())
    assert raised_rt.value is other


@pytest.mark.parametrize("message", [HOST_OOM, HOST_OOM_WINDOWS])
async def test_the_host_allocators_failure_is_out_of_memory(message: str) -> None:
    module = Limited(error=lambda n: RuntimeError(message))
    finder = BatchSizeFinder("binsearch", margin=0)
    t = trainer(finder, max_steps=2)
    await t.fit(module, loader())
    assert finder.trials == BINSEARCH
    assert finder.batch_size == 48
    assert [n for n, _ in trained(module, t)] == [48, 48]


def test_what_counts_as_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError(HOST_OOM))
    assert is_out_of_memory(RuntimeError(HOST_OOM_WINDOWS))
    assert not is_out_of_memory(RuntimeError("out of memory in my own code"))
    assert not is_out_of_memory(RuntimeError("can't allocate memory"))
    assert not is_out_of_memory(MemoryError())
    assert not is_out_of_memory(ValueError(HOST_OOM))


async def test_nothing_fits() -> None:
    module = Limited(limit=0)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    finder = BatchSizeFinder(init_val=4)
    with pytest.raises(RuntimeError, match="no batch size fitted in 3 trials"):
        await trainer(finder).fit(module, loader())
    assert finder.trials == [(4, False), (2, False), (1, False)]
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


async def test_a_loader_factory() -> None:
    data = dataset()
    made: list[int] = []

    def make(batch_size: int) -> DataLoader[Any]:
        made.append(batch_size)
        return DataLoader(data, batch_size=batch_size)

    module = Limited()
    finder = BatchSizeFinder("binsearch", loader=make, margin=0.1)
    t = trainer(finder, max_steps=4)
    await t.fit(module, [(torch.zeros(1, 8), torch.zeros(1, 1))])  # replaced
    assert finder.batch_size == math.floor(48 * 0.9) == 43
    assert made[-1] == 43
    assert [n for n, _ in trained(module, t)] == [43] * 4


async def test_the_function_form_returns_the_size_and_trains_nothing() -> None:
    module = Limited()
    t = trainer()
    size = await find_batch_size(t, module, loader(), mode="binsearch", steps_per_trial=1)
    assert size == 45
    assert t.global_step == 0
    assert t.stage is None
    assert len(module.steps) == 6  # one step for each trial that fitted: 2 ... 32, 48
    await t.fit(module, DataLoader(dataset(), batch_size=size))
    assert next(n for n, _ in trained(module, t)) == 45


def test_the_function_form_from_synchronous_code() -> None:
    assert find_batch_size(trainer(), Limited(), loader(), margin=0) == 32


class Digits:
    """A DataModule (Lightning's methods) whose training loader has batches of 2."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self) -> DataLoader[Any]:
        self.calls.append("train_dataloader")
        return loader()

    def val_dataloader(self) -> DataLoader[Any]:
        self.calls.append("val_dataloader")
        return loader()


async def test_a_datamodule_s_loader_is_searched_in_fit_and_by_the_function() -> None:
    torch.manual_seed(0)
    finder = BatchSizeFinder("power", margin=0)
    t = trainer(finder)
    data = Digits()
    await t.fit(Limited(), datamodule=data)
    assert finder.trials == POWER
    assert finder.batch_size == 32
    assert t.global_step == SAMPLES // 32  # trained at the size found
    # The function form readies it as fit does, and takes only its training loader.
    data = Digits()
    size = await find_batch_size(trainer(), Limited(), data, mode="binsearch", steps_per_trial=1)
    assert size == 45
    assert data.calls == ["setup:fit", "train_dataloader"]


async def test_a_loader_without_a_batch_size_needs_a_factory() -> None:
    batches = BatchSampler(SequentialSampler(range(SAMPLES)), batch_size=4, drop_last=False)
    no_size = DataLoader(dataset(), batch_sampler=batches)
    with pytest.raises(MisconfigurationError, match=r"no batch_size.*loader=lambda batch_size"):
        await trainer(BatchSizeFinder()).fit(Limited(), no_size)
    with pytest.raises(MisconfigurationError, match=r"cannot rebuild list.*loader=lambda"):
        await trainer(BatchSizeFinder()).fit(Limited(), [(torch.zeros(2, 8), torch.zeros(2, 1))])

    class MyLoader(DataLoader[Any]):
        pass

    with pytest.raises(MisconfigurationError, match="MyLoader is a subclass"):
        await trainer(BatchSizeFinder()).fit(Limited(), MyLoader(dataset(), batch_size=2))


def test_bad_options() -> None:
    with pytest.raises(MisconfigurationError, match="mode"):
        BatchSizeFinder("linear")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match="init_val"):
        BatchSizeFinder(init_val=0)
    with pytest.raises(MisconfigurationError, match="max_trials"):
        BatchSizeFinder(max_trials=0)
    with pytest.raises(MisconfigurationError, match="steps_per_trial"):
        BatchSizeFinder(steps_per_trial=0)
    with pytest.raises(MisconfigurationError, match="below 1"):
        BatchSizeFinder(margin=1.0)
    with pytest.raises(MisconfigurationError, match="margin"):
        BatchSizeFinder(margin=-0.1)
    with pytest.raises(MisconfigurationError, match="function of the batch size"):
        BatchSizeFinder(loader=32)  # type: ignore[arg-type]


async def test_not_inside_a_stage() -> None:
    finder = BatchSizeFinder()

    class During(loopbus.Plugin):
        error: BaseException | None = None

        @loopbus.on(loopbus.events.FitStarted)
        async def search(self, event: Any) -> None:
            try:
                await finder.search(self.trainer_, Limited(), loader())
            except RuntimeError as exc:
                self.error = exc

        def setup(self, trainer: Any, stage: str) -> None:
            self.trainer_ = trainer

    during = During()
    await trainer(during, max_steps=1).fit(Limited(), loader())
    assert during.error is not None
    assert "before a stage" in str(during.error)


def test_prepare_fit_must_be_async() -> None:
    signature = r"async def prepare_fit\(self, trainer, module, train_data\)"
    with pytest.raises(TypeError, match=signature):

        class Sync(loopbus.Plugin):
            def prepare_fit(self, t: Any, m: Any, data: Any) -> Any:  # type: ignore[override]
                return data


async def test_fast_dev_run_skips_the_search() -> None:
    finder = BatchSizeFinder()
    t = loopbus.Trainer(plugins=[finder], device="cpu", fast_dev_run=2)
    module = Limited()
    await t.fit(module, loader(batch_size=4))
    assert finder.trials == []
    assert finder.batch_size is None
    assert [n for n, _ in module.steps] == [4, 4]
