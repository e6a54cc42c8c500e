"""The ``loopbus`` command: ``loopbus watch`` against a real run, as a subprocess, and
``loopbus consolidate`` of a sharded checkpoint or of a folder of them."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.streams.text
import msgspec
import pytest
import torch

import loopbus
from loopbus import Plugin, PutRecord, Trainer, on
from loopbus.__main__ import main
from loopbus.checkpoint._format import SHARDED_MARKER
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint
from tests.ckpt_scenario import Net, make_data
from tests.helpers import ROOT, TinyModule, make_loader
from tests.plugins.stream_helpers import serving

WATCH = [sys.executable, "-m", "loopbus", "watch"]


@pytest.mark.external
async def test_watch_jsonl_prints_decodable_lines_for_every_record() -> None:
    async with serving(
        TinyModule(), max_epochs=2, train=make_loader(64), val=make_loader(32)
    ) as run:
        async with await anyio.open_process(
            [*WATCH, "--jsonl", run.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as process:
            await run.wait_for_subscribers(1)
            run.gate.go.set()
            assert process.stdout is not None
            assert process.stderr is not None
            with anyio.fail_after(120):
                output = b"".join([chunk async for chunk in process.stdout])
                errors = b"".join([chunk async for chunk in process.stderr])
                code = await process.wait()
    assert code == 0, errors.decode()
    lines = output.splitlines()
    assert len(lines) == len(run.captured) == 2 * (4 + 2)
    records = [msgspec.json.decode(line, type=PutRecord) for line in lines]
    assert records == run.expected
    seqs = [msgspec.json.decode(line)["seq"] for line in lines]
    assert seqs == list(range(len(lines)))


@pytest.mark.external
async def test_watch_table_shows_each_name() -> None:
    async with serving(
        TinyModule(), max_epochs=2, train=make_loader(64), val=make_loader(32)
    ) as run:
        async with await anyio.open_process(
            [*WATCH, "--events", "--names", "train/*,val/*", run.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as process:
            await run.wait_for_subscribers(1)
            run.gate.go.set()
            assert process.stdout is not None
            with anyio.fail_after(120):
                output = b"".join([chunk async for chunk in process.stdout]).decode()
                code = await process.wait()
    assert code == 0
    last = {r.name: r for r in run.captured}
    for name in ("train/loss", "val/loss"):
        assert name in output
        assert f"{last[name].value:.6g}" in output
    assert "12 records" in output
    assert "ended: the fit stage ended" in output


class _HoldAfterFirstBatch(Plugin):
    """Holds the run after its first training batch until ``go``."""

    def __init__(self) -> None:
        self.held = anyio.Event()
        self.go = anyio.Event()

    @on(TrainBatchCompleted)
    async def hold(self, event: TrainBatchCompleted) -> None:
        if not self.held.is_set():
            self.held.set()
            await self.go.wait()


@pytest.mark.external
@pytest.mark.parametrize("mode", [["--jsonl"], []], ids=["jsonl", "table"])
async def test_watch_writes_each_line_as_it_arrives_into_a_pipe(mode: list[str]) -> None:
    hold = _HoldAfterFirstBatch()
    async with serving(TinyModule(), train=make_loader(64), plugins=(hold,)) as run:
        async with await anyio.open_process(
            [*WATCH, *mode, run.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as process:
            await run.wait_for_subscribers(1)
            run.gate.go.set()
            assert process.stdout is not None
            assert process.stderr is not None
            lines = anyio.streams.text.TextReceiveStream(process.stdout)
            with anyio.fail_after(60):
                await hold.held.wait()
                first = ""
                while "\n" not in first:  # the run is held: this line came while it runs
                    first += await lines.receive()
            assert not run.done.is_set()
            hold.go.set()
            with anyio.fail_after(120):
                rest = "".join([chunk async for chunk in lines])
                errors = b"".join([chunk async for chunk in process.stderr])
                code = await process.wait()
    assert code == 0, errors.decode()
    output = (first + rest).splitlines()
    if mode:
        assert msgspec.json.decode(output[0])["name"] == "train/loss"
        assert len(output) == len(run.captured) == 4
    else:
        assert output[0].startswith("train/loss = ")
        assert output[0].endswith("(step 1, epoch 0)")
        assert len([line for line in output if line.startswith("train/loss = ")]) == 4
        assert "4 records" in first + rest  # the table as it ended, after the lines


def test_watch_reports_unreachable_and_bad_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["watch", "--jsonl", f"127.0.0.1:{port}"]) == 1
    assert f"could not connect to tcp://127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["watch", "ftp://example.com:21"]) == 2
    assert "scheme 'ftp'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["watch"])  # ADDRESS is required
    assert "the following arguments are required: address" in capsys.readouterr().err


def test_console_script_is_declared() -> None:
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("loopbus") == "loopbus.__main__:main"


def test_digits_demo_serves_its_records(capfd: pytest.CaptureFixture[str]) -> None:
    examples = str(ROOT / "examples")
    sys.path.insert(0, examples)
    try:
        import digits

        digits.main(["--epochs", "1", "--serve", "tcp://127.0.0.1:0"])
    finally:
        sys.path.remove(examples)
    err = capfd.readouterr().err
    assert "loopbus: streaming records on tcp://127.0.0.1:" in err
    assert "watch them with: loopbus watch tcp://127.0.0.1:" in err


# ---------------------------------------------------------------- loopbus consolidate


def _fit_with_checkpoints(directory: Path, *, sharded: bool) -> dict[str, torch.Tensor]:
    """Two epochs of 8 steps, a checkpoint every 4 steps into ``directory``; the final
    weights."""
    loopbus.seed_everything(5)
    net = Net()
    train, val = make_data("plain", n_train=64, batch=8)
    plugin = Checkpoint(directory, sharded=sharded, every_n_steps=4, keep_last=3)
    trainer = Trainer(max_epochs=2, plugins=[plugin], device="cpu")
    loopbus.run(trainer.fit, net, train, val)
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A Checkpoint plugin's folder of sharded checkpoints (with its last.json), and the
    run's final weights."""
    directory = tmp_path_factory.mktemp("cli-sharded") / "ckpt"
    return directory, _fit_with_checkpoints(directory, sharded=True)


def _copy(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy, symlinks=True)
    return copy


def _sharded_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if loopbus.is_sharded_checkpoint(p))


def test_consolidate_a_folder_takes_its_newest_complete_sharded_checkpoint(
    sharded_folder: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder, final = sharded_folder
    assert (folder / "last.json").is_file()
    assert len(_sharded_dirs(folder)) >= 2
    newest = loopbus.latest_checkpoint(folder)
    assert newest is not None
    assert loopbus.is_sharded_checkpoint(newest)
    out = tmp_path / "full.ckpt"
    assert main(["consolidate", str(folder), str(out)]) == 0
    captured = capsys.readouterr()
    assert f"consolidating its newest complete sharded checkpoint, {newest.name} (step 16)" in (
        captured.err
    )
    assert f"wrote {out}" in captured.out
    state = torch.load(out, weights_only=True)
    assert state["loopbus"]["consolidated"]["from"] == newest.name
    assert all(torch.equal(state["module"][k], v) for k, v in final.items())


def test_consolidate_a_folder_skips_an_incomplete_newest_checkpoint(
    sharded_folder: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = _copy(sharded_folder[0], tmp_path)
    named = json.loads((folder / "last.json").read_text())["checkpoint"]
    (folder / named / SHARDED_MARKER).unlink()  # the newest, which last.json names
    steps = {
        p.name: json.loads((p / SHARDED_MARKER).read_text())["global_step"]
        for p in _sharded_dirs(folder)
        if (p / SHARDED_MARKER).is_file()
    }
    top = max(steps.values())
    (expected,) = [name for name, step in steps.items() if step == top]
    out = tmp_path / "full.ckpt"
    assert main(["consolidate", str(folder), str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{named}: last.json names it, but it has no completeness marker" in err
    assert f"its newest complete sharded checkpoint, {expected} (step {top})" in err
    assert torch.load(out, weights_only=True)["loopbus"]["consolidated"]["from"] == expected

    # Without the pointer, the newest complete one by its marker's step.
    (folder / "last.json").unlink()
    assert main(["consolidate", str(folder), str(tmp_path / "again.ckpt")]) == 0
    assert f"sharded checkpoint, {expected} (step {top})" in capsys.readouterr().err


def test_consolidate_a_sharded_checkpoint_itself(
    sharded_folder: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder, _ = sharded_folder
    one = _sharded_dirs(folder)[0]
    out = tmp_path / "one.ckpt"
    assert main(["consolidate", str(one), str(out)]) == 0
    captured = capsys.readouterr()
    assert "folder of checkpoints" not in captured.err
    assert torch.load(out, weights_only=True)["loopbus"]["consolidated"]["from"] == one.name


def test_consolidate_a_folder_without_a_sharded_checkpoint_says_what_it_holds(
    sharded_folder: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    files = tmp_path / "files"
    _fit_with_checkpoints(files, sharded=False)
    out = tmp_path / "full.ckpt"
    assert main(["consolidate", str(files), str(out)]) == 1
    err = capsys.readouterr().err
    names = sorted(p.name for p in files.glob("*.ckpt"))
    assert names
    assert f"{files} holds no complete sharded checkpoint: it holds {len(names)} " in err
    assert names[0] in err
    assert "load one directly" in err
    assert "Pass a sharded checkpoint's directory" in err
    assert not out.exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["consolidate", str(empty), str(out)]) == 1
    err = capsys.readouterr().err
    assert "holds no complete sharded checkpoint: it holds no checkpoint at all." in err

    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    one = _sharded_dirs(sharded_folder[0])[0]
    shutil.copytree(one, incomplete / one.name)
    (incomplete / one.name / SHARDED_MARKER).unlink()
    assert main(["consolidate", str(incomplete), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"incomplete sharded checkpoint(s): {one.name} (" in err
    assert not out.exists()
