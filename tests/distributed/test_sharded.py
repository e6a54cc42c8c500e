"""Sharded checkpoints under DDP and FSDP for real: ``tests/distributed/ddp_script.py
--sharded`` (``--strategy fsdp``: the model itself sharded) under ``torchrun`` (gloo, CPU).
Every rank writes its shards through torch.distributed.checkpoint into one directory;
kill -9 at any point (also inside an asynchronous save) resumes bit-identical from the
last complete checkpoint; a checkpoint taken on 4 ranks resumes on 2 and one taken on 2
resumes on 4, training every sample of the interrupted epoch once."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus.checkpoint._format import SHARDED_MARKER
from tests.torchrun import DDP_SCRIPT, Scenarios, env, launch, ok, same, weights
from tests.torchrun import summary as _summary

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

N_TRAIN = 512
BATCH = 16
#: 2 epochs of 16 steps on 2 ranks; a sharded checkpoint every 10 steps, 2 kept.
COMMON = ("--epochs", "2", "--ckpt", "10", "--sharded", "--keep-last", "2")
#: Where the killed runs die: a point drawn once (seeded), and inside the writer
#: thread of the asynchronous save of step 20 (rank 1 dies while writing its shards).
KILLS = [("--kill-at", str(random.Random(27).randrange(5, 32)))]
KILLS.append(("--kill-in-save", "20"))
STRATEGIES = ["ddp", "fsdp"]


def _optimizer(out: Path, rank: int) -> dict[str, Any]:
    return torch.load(out / f"optimizer_rank{rank}.pt", weights_only=True)  # type: ignore[no-any-return]


def _same_optimizer_state(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]) for i in a
    )


def _step_of(checkpoint: Path | None) -> int:
    if checkpoint is None:
        return 0
    return int(json.loads((checkpoint / SHARDED_MARKER).read_text())["global_step"])


#: The sharded-checkpoint job never killed, on 2 DDP ranks and on 2 FSDP ranks: the
#: references the killed runs (here and in tests/storage) must match bit for bit, run
#: in one launch once per session (the ``uninterrupted`` fixtures, tests/conftest.py).
REFERENCES = Scenarios(DDP_SCRIPT, {"ddp": list(COMMON), "fsdp": [*COMMON, "--strategy", "fsdp"]})


@pytest.mark.external
@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kill", KILLS, ids=lambda k: f"{k[0][2:]}-{k[1]}")
def test_killed_sharded_job_resumes_bit_identical(
    request: pytest.FixtureRequest, tmp_path: Path, kill: tuple[str, str], strategy: str
) -> None:
    uninterrupted = request.getfixturevalue(
        "uninterrupted_fsdp" if strategy == "fsdp" else "uninterrupted"
    )
    common = (*COMMON, "--strategy", strategy)
    killed = tmp_path / "killed"
    proc = launch(killed, *common, *kill)
    assert proc.returncode != 0
    directory = killed / "ckpt_sharded"
    last = loopbus.latest_checkpoint(directory) if directory.exists() else None
    if kill[0] == "--kill-in-save":
        # The interrupted save left no checkpoint: at most its temporary directory (rank 0,
        # alive when its save fails, removes it; one a killed writer left stays until the
        # next run's start removes it).
        names = [p.name for p in directory.iterdir()]
        assert "epoch=1-step=20.ckpt" not in names, names
        assert all(n.startswith(".epoch=1-step=20.ckpt.tmp-") for n in names if "20" in n), names
        assert last is not None
        assert _step_of(last) == 10
    assert last is None or (last / SHARDED_MARKER).is_file()
    step = _step_of(last)
    # A kill that lands after a background save completed its checkpoint but before it
    # moved last.json leaves that checkpoint complete and unnamed: the resume follows the
    # pointer (to the one before), and the checkpoint is kept, never replaced or removed
    # (the resumed run names its own save of that step apart). Seen under load only.
    # A temporary directory that got its marker but not its rename is no checkpoint: the
    # resumed run removes it as its dead writer's.
    unnamed = sorted(
        p.name
        for p in (directory.iterdir() if directory.exists() else [])
        if not p.name.startswith(".") and (p / SHARDED_MARKER).is_file() and _step_of(p) > step
    )
    ok(launch(killed, *common, "--resume"))
    # The resumed job loaded the last complete checkpoint (or started afresh).
    assert torch.load(killed / "loaded_rank0.pt", weights_only=True)["step"] == step
    for rank in (0, 1):
        assert same(weights(uninterrupted, rank), weights(killed, rank))
        assert _same_optimizer_state(
            _optimizer(uninterrupted, rank)["state"], _optimizer(killed, rank)["state"]
        )
    assert _summary(killed, 0)["step"] == _summary(uninterrupted, 0)["step"] == 32
    # The dead writers' temporaries are gone; whole directories were kept and removed.
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["epoch=1-step=30.ckpt", "epoch=1-step=32.ckpt", "last.json", *unnamed]
    )


def test_a_sharded_checkpoint_consolidates_in_one_process(
    uninterrupted: Path, tmp_path: Path
) -> None:
    last = loopbus.latest_checkpoint(uninterrupted / "ckpt_sharded")
    assert last is not None
    info = json.loads((last / SHARDED_MARKER).read_text())
    assert (info["world_size"], info["strategy"]) == (2, "ddp")
    # Each rank wrote shards (DCP spreads the replicated DDP tensors over the ranks).
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(info["files"])
    out = loopbus.consolidate_checkpoint(last, tmp_path / "full.ckpt")
    state = torch.load(out, weights_only=True)
    assert same(state["module"], weights(uninterrupted, 0))
    assert _same_optimizer_state(
        state["optimizers/0"]["state_dict"]["state"], _optimizer(uninterrupted, 0)["state"]
    )
    assert len(state["rng"]["ranks"]) == 2


def test_resuming_mid_epoch_in_one_process_is_refused(uninterrupted: Path, tmp_path: Path) -> None:
    # A checkpoint of 2 DDP ranks taken inside an epoch, resumed by one plain process:
    # its loader keeps no position in samples, so the epoch cannot continue exactly.
    directory = tmp_path / "ckpt_sharded"
    directory.mkdir()
    source = uninterrupted / "ckpt_sharded" / "epoch=1-step=30.ckpt"
    (directory / source.name).symlink_to(source, target_is_directory=True)
    proc = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), "--out", str(tmp_path), *COMMON, "--resume"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "taken inside an epoch on 2 rank(s) and this run has 1" in proc.stderr


def _trained(out: Path, ranks: int) -> list[dict[str, Any]]:
    entries = []
    for rank in range(ranks):
        path = out / f"samples_rank{rank}.jsonl"
        entries += [json.loads(line) for line in path.read_text().splitlines()]
        path.unlink()
    return entries


@pytest.mark.external
@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("before", "after", "every", "kill_at"),
    [
        # 8 steps an epoch on 4 ranks: saved at step 4, 256 samples into the epoch.
        pytest.param(4, 2, 4, 6, id="4-to-2"),
        # 16 steps an epoch on 2 ranks: saved at step 12, 384 samples into the epoch.
        pytest.param(2, 4, 6, 14, id="2-to-4"),
    ],
)
def test_resume_at_another_world_size(
    tmp_path: Path, before: int, after: int, every: int, kill_at: int, strategy: str
) -> None:
    resume_at_another_world_size(
        tmp_path, tmp_path / "ckpt_sharded", before, after, every, kill_at, strategy
    )


def resume_at_another_world_size(
    tmp_path: Path,
    directory: Any,
    before: int,
    after: int,
    every: int,
    kill_at: int,
    strategy: str,
    *options: str,
) -> None:
    """Kill a job of ``before`` ranks that saves sharded checkpoints into ``directory``
    (a folder, or a URL with ``options`` naming it) every ``every`` steps at step
    ``kill_at``; resume it on ``after`` ranks: every sample of the interrupted epoch is
    trained once, and the run finishes."""
    common = ("--epochs", "2", "--sharded", "--sync-save", "--record", "--ckpt", str(every))
    common += ("--strategy", strategy, *options)
    proc = launch(tmp_path, *common, "--kill-at", str(kill_at), nproc=before, timeout=180)
    assert proc.returncode != 0
    last = loopbus.latest_checkpoint(directory)
    info = loopbus.checkpoint_info(last) if last is not None else None
    assert info is not None
    saved_step = info["global_step"]
    assert saved_step == kill_at // every * every
    saved = loopbus.load_checkpoint(last)  # consolidated here, in one process
    assert (info["layout"], info["strategy"], info["world_size"]) == ("sharded", strategy, before)
    consumed = before * BATCH * saved_step
    assert saved["data/sampler"]["consumed"] == consumed
    # What the checkpoint holds of the interrupted epoch: the batches before it.
    kept = [e for e in _trained(tmp_path, before) if e["epoch"] == 0 and e["step"] < saved_step]

    ok(launch(tmp_path, *common, "--resume", nproc=after, timeout=180))
    for rank in range(after):
        loaded = torch.load(tmp_path / f"loaded_rank{rank}.pt", weights_only=True)
        assert loaded["step"] == saved_step
        assert same(loaded["module"], saved["module"])
        assert _same_optimizer_state(
            loaded["optimizer"], saved["optimizers/0"]["state_dict"]["state"]
        )
    resumed = [e for e in _trained(tmp_path, after) if e["epoch"] == 0]
    first = [i for e in kept for i in e["idx"]]
    rest = [i for e in resumed for i in e["idx"]]
    # The uninterrupted run trains each sample once in the epoch, in the order of
    # DistributedSampler's permutation: the checkpoint holds its first `consumed`, the
    # resumed run the others, each once.
    order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(0)).tolist()
    assert sorted(first) == sorted(order[:consumed])
    assert sorted(rest) == sorted(order[consumed:])
    assert sorted(first + rest) == list(range(N_TRAIN))
    # The run finishes: the rest of the epoch and one more on `after` ranks.
    left = (N_TRAIN - consumed) // (after * BATCH)
    assert _summary(tmp_path, 0)["step"] == saved_step + left + N_TRAIN // (after * BATCH)
    assert (_summary(tmp_path, 0)["world_size"], _summary(tmp_path, 0)["strategy"]) == (
        after,
        strategy,
    )


def test_a_checkpoint_between_epochs_resumes_in_one_process(
    uninterrupted: Path, tmp_path: Path
) -> None:
    # Taken by 2 DDP ranks when fit ended (between epochs), resumed by one plain process
    # for a third epoch: DCP reads the shards of both ranks, rank 0's generators apply.
    directory = tmp_path / "ckpt_sharded"
    directory.mkdir()
    source = uninterrupted / "ckpt_sharded" / "epoch=1-step=32.ckpt"
    (directory / source.name).symlink_to(source, target_is_directory=True)
    options = ("--epochs", "3", "--ckpt", "10", "--sharded", "--keep-last", "2")
    proc = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), "--out", str(tmp_path), *options, "--resume"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    ok(proc)
    loaded = torch.load(tmp_path / "loaded_rank0.pt", weights_only=True)
    assert loaded["step"] == 32
    assert same(loaded["module"], weights(uninterrupted, 0))
    summary = _summary(tmp_path, 0)
    assert (summary["strategy"], summary["step"]) == ("single", 32 + N_TRAIN // BATCH)
