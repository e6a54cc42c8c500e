"""A stage works from both kinds of code: called from synchronous code (a plain script,
the first line every Lightning user writes) it runs to completion and returns its result;
called while an event loop runs (async code, a notebook cell, a task group) it returns
the coroutine to await. Lightning's argument names are answered with loopbus's, and an
evaluation stage without a module uses the module of the last stage."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import torch

import loopbus
from loopbus import MisconfigurationError, Trainer
from loopbus.plugins import Checkpoint
from tests.helpers import ROOT, TinyModule, make_loader


@pytest.mark.external
def test_a_plain_script_trains_with_fit_called_as_a_function(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import warnings
            warnings.simplefilter("error")  # a coroutine never awaited would fail here
            from loopbus import Trainer
            from tests.helpers import TinyModule, make_loader

            module = TinyModule()
            trainer = Trainer(max_epochs=2, plugins=[], device="cpu")
            out = trainer.fit(module, make_loader(64, 16), make_loader(32, 16))
            assert out is None
            metrics = trainer.validate(module, make_loader(32, 16))
            tested = trainer.test(make_loader(32, 16))  # the fitted module
            predictions = trainer.predict(module, [b[0] for b in make_loader(32, 16)])
            print(trainer.global_step, sorted(metrics), sorted(tested), len(predictions))
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["8", "['val/loss']", "['test/loss']", "2"]
    assert "never awaited" not in result.stderr


def test_sync_calls_in_process_return_the_stage_results() -> None:
    module = TinyModule()
    trainer = Trainer(max_steps=3, plugins=[], device="cpu")
    assert trainer.fit(module, make_loader(64, 16)) is None
    assert trainer.global_step == 3
    assert set(trainer.validate(module, make_loader(32, 16))) == {"val/loss"}


async def test_inside_a_running_loop_a_stage_returns_an_awaitable() -> None:
    module = TinyModule()
    trainer = Trainer(max_steps=2, plugins=[], device="cpu")
    call = trainer.fit(module, make_loader(64, 16))
    assert inspect.isawaitable(call)
    assert trainer.global_step == 0  # nothing ran before the await
    await call
    assert trainer.global_step == 2
    async with anyio.create_task_group() as tg:  # a task group takes it as a coroutine
        tg.start_soon(trainer.validate, module, make_loader(32, 16))
    assert "val/loss" in trainer.latest


def test_a_notebook_style_running_loop_awaits_it() -> None:
    """A notebook cell runs inside an asyncio loop that is already running: the call
    returns what the cell awaits."""
    import asyncio

    trainer = Trainer(max_steps=2, plugins=[], device="cpu")

    async def cell() -> object:
        call = trainer.fit(TinyModule(), make_loader(64, 16))
        assert inspect.iscoroutine(call)
        return await call

    assert asyncio.run(cell()) is None
    assert trainer.global_step == 2


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_loopbus_run_still_runs_a_stage_on_either_backend(backend: str) -> None:
    trainer = Trainer(max_steps=2, plugins=[], device="cpu")
    loopbus.run(trainer.fit, TinyModule(), make_loader(64, 16), backend=backend)
    assert trainer.global_step == 2


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda t, m, d: t.fit(m, train_dataloaders=d), r"`train_dataloaders` is Lightning's name; .*train_data"),
        (lambda t, m, d: t.fit(m, d, val_dataloaders=d), r"`val_dataloaders` .*val_data"),
        (lambda t, m, d: t.fit(model=m, train_data=d), r"`model` .*first argument"),
        (lambda t, m, d: t.validate(m, dataloaders=d), r"`dataloaders` .*trainer.validate\(module, data\)"),
        (lambda t, m, d: t.test(m, d, verbose=False), r"results_table=False"),
        (lambda t, m, d: t.predict(m, d, return_predictions=True), r"always returns"),
        (lambda t, m, d: t.fit(m, d, max_epoch=2), r"`max_epoch` is not an argument of fit\(\)"),
    ],
)
def test_lightning_argument_names_are_answered_with_loopbus_names(call: object, expected: str) -> None:
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    with pytest.raises(TypeError, match=expected):
        call(trainer, TinyModule(), make_loader(32, 16))  # type: ignore[operator]
    assert trainer.stage is None


async def test_test_with_ckpt_path_best_and_no_module_uses_the_fitted_one(tmp_path: Path) -> None:
    module = TinyModule()
    checkpoint = Checkpoint(tmp_path, monitor="val/loss", every_n_epochs=1)
    trainer = Trainer(max_epochs=3, plugins=[checkpoint], device="cpu", num_sanity_val_steps=0)
    await trainer.fit(module, make_loader(64, 16), make_loader(32, 16))
    best = checkpoint.best_checkpoint_path
    assert best is not None
    with torch.no_grad():  # move away from every saved state: only loading "best" restores it
        for parameter in module.parameters():
            parameter.add_(1.0)
    result = await trainer.test(make_loader(32, 16), ckpt_path="best")
    assert set(result) == {"test/loss"}
    # The fitted module now holds the best checkpoint's weights.
    expected = TinyModule.load_from_checkpoint(best).state_dict()
    for name, value in module.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert set(await trainer.test(data=make_loader(32, 16))) == {"test/loss"}


def test_an_evaluation_without_a_module_before_any_stage_says_what_to_pass() -> None:
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    with pytest.raises(MisconfigurationError, match=r"trainer.test\(module, data\)"):
        trainer.test(make_loader(32, 16))
