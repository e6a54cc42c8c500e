"""ModelParallelStrategy for real: ``tests/distributed/tp_script.py`` under ``torchrun`` (4
ranks, gloo, CPU): tensor and sequence parallelism on ``tp`` with FSDP2 on the
data-parallel dimensions, against a one-process reference; its checkpoint resumed on other
layouts (2 ranks of FSDP, one process); and the strategy's checks of its mesh sizes, in
this process."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from loopbus import MisconfigurationError, ModelParallelStrategy, Trainer
from loopbus.distributed._model_parallel import mesh_shape
from tests.torchrun import Scenarios

SCRIPT = Path(__file__).with_name("tp_script.py")
WORLD = 4
#: How far the losses of a mesh may be from the one-process run of the same global
#: batches (absolute, per step): the gradients are summed in another order. Measured:
#: 4.8e-7 over 16 AdamW steps on (dp=2, tp=2), clipped at 0.5.
LOSS_ATOL = 1e-5
#: How far the weights may be, after those 16 steps. AdamW divides each gradient by its
#: own running magnitude, so a difference in the last bits of a nearly zero gradient
#: moves a weight by up to the learning rate (3e-3) a step. Measured: 6.7e-5.
WEIGHT_ATOL = 5e-4

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

MESH_2x2 = ["--tp", "2", "--dp-shard", "2"]
HSDP = ["--tp", "1", "--dp-shard", "2", "--dp-replicate", "2"]
TP_4 = ["--tp", "4", "--dp-shard", "1"]

#: The 4-rank scenarios, in one launch: ``train`` saves the checkpoint the ``resume-*``
#: ones (after it) load.
RUNS = Scenarios(
    SCRIPT,
    {
        "train": ["--scenario", "train", "--save", *MESH_2x2],
        "hsdp": ["--scenario", "train", *HSDP],
        "meta": ["--scenario", "meta", *MESH_2x2],
        "refusals": ["--scenario", "refusals", *MESH_2x2],
        "bf16": ["--scenario", "train", *MESH_2x2, "--precision", "bf16-mixed"],
        "resume-2x2": ["--scenario", "resume", *MESH_2x2],
        "resume-tp4": ["--scenario", "resume", *TP_4],
        "resume-hsdp": ["--scenario", "resume", *HSDP],
    },
    nproc=WORLD,
    timeout_s=180,
)


def _summaries(runs: Scenarios, sid: str, ranks: int = WORLD) -> list[dict[str, Any]]:
    out = runs.out(sid)
    scenario = runs.scenarios[sid][1]
    return [json.loads((out / f"{scenario}_rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="session")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    return RUNS.run_once(tmp_path_factory, "tp-runs")


@pytest.fixture(scope="session")
def other_layouts(
    tp_runs: Scenarios, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    """The 2x2 checkpoint resumed under FSDP over 2 ranks and in one process: two
    launches that only read the checkpoint, so they run side by side."""
    ckpt = str(tp_runs.out("train") / "ckpt")
    layouts = {"resume-fsdp2": (2, "fsdp"), "resume-single": (0, "single")}

    def resume(sid: str) -> list[dict[str, Any]]:
        nproc, strategy = layouts[sid]
        runs = Scenarios(
            SCRIPT,
            {sid: ["--scenario", "resume", "--strategy", strategy, "--ckpt", ckpt]},
            nproc=nproc,
            timeout_s=180,
        )
        runs.run_once(tmp_path_factory, f"tp-{sid}")
        return _summaries(runs, sid, max(nproc, 1))

    with ThreadPoolExecutor(len(layouts)) as pool:
        return dict(zip(layouts, pool.map(resume, layouts), strict=True))


@pytest.mark.external
@pytest.mark.parametrize("sid", ["train", "hsdp"])
def test_a_mesh_trains_like_one_process(tp_runs: Scenarios, sid: str) -> None:
    summaries = _summaries(tp_runs, sid)
    s0 = summaries[0]
    assert s0["step"] == 16
    assert s0["mesh"][0] == ["dp_replicate", "dp_shard", "tp"]
    assert s0["mesh_seen"]  # configure_model got trainer.strategy.mesh
    assert s0["param_types"] == ["DTensor"]
    assert s0["keys_match"]
    assert s0["max_loss_diff"] <= LOSS_ATOL
    assert s0["max_weight_diff"] <= WEIGHT_ATOL
    # Clipping mattered: the unclipped run's losses are far from these.
    assert s0["unclipped_loss_diff"] > 100 * LOSS_ATOL
    assert all(s["losses"] == s0["losses"] for s in summaries)


#: bf16-mixed against the float32 one-process run: bf16 parameters in forward and
#: backward, float32 gradients reduced and float32 weights stepped. Measured: 1.9e-3 in
#: the loss over the 16 steps.
BF16_LOSS_ATOL = 1e-2


@pytest.mark.external
def test_mixed_precision_composes_with_the_mesh(tp_runs: Scenarios) -> None:
    # The trainer's precision="bf16-mixed" on (dp=2, tp=2), as FSDPStrategy takes it.
    for summary in _summaries(tp_runs, "bf16"):
        assert summary["param_types"] == ["DTensor"]
        assert summary["param_dtypes"] == ["torch.float32"]  # the weights the optimizer steps
        assert 0 < summary["max_loss_diff"] < BF16_LOSS_ATOL  # bf16 did compute
        assert summary["max_loss_diff"] < summary["unclipped_loss_diff"]  # clipped


@pytest.mark.external
def test_tensor_parallel_peers_read_the_same_samples(tp_runs: Scenarios) -> None:
    summaries = _summaries(tp_runs, "train")
    # (dp=2, tp=2): ranks 0 and 1 are replica 0's tp peers, ranks 2 and 3 replica 1's.
    assert [s["data_parallel"] for s in summaries] == [[2, 0], [2, 0], [2, 1], [2, 1]]
    s0, s1, s2, s3 = (s["samples"] for s in summaries)
    assert s0 == s1
    assert s2 == s3
    seen = sorted(i for batch in s0 + s2 for i in batch)
    assert seen == list(range(256))  # the replicas read every sample once
    hsdp = [s["data_parallel"] for s in _summaries(tp_runs, "hsdp")]
    assert hsdp == [[4, 0], [4, 1], [4, 2], [4, 3]]


@pytest.mark.external
def test_a_module_on_meta_is_initialised_whole_before_it_is_split(tp_runs: Scenarios) -> None:
    for summary in _summaries(tp_runs, "meta"):
        assert summary["keys_match"]
        assert summary["equal_at_start"]
        assert not summary["meta_left"]


@pytest.mark.external
def test_what_the_strategy_refuses(tp_runs: Scenarios) -> None:
    refusals = _summaries(tp_runs, "refusals")[0]
    assert "num_replicas=4 with rank=0" in refusals["whole_world_sampler"]
    assert "data-parallel replica 0 of 2" in refusals["whole_world_sampler"]
    assert "configure_model(mesh)" in refusals["split_on_meta"]


@pytest.mark.external
@pytest.mark.parametrize("sid", ["resume-2x2", "resume-tp4", "resume-hsdp"])
def test_a_2x2_checkpoint_resumes_exactly_on_4_ranks(tp_runs: Scenarios, sid: str) -> None:
    for summary in _summaries(tp_runs, sid):
        _resumed(summary)


@pytest.mark.external
@pytest.mark.parametrize("sid", ["resume-fsdp2", "resume-single"])
def test_a_2x2_checkpoint_resumes_exactly_on_other_world_sizes(
    other_layouts: dict[str, list[dict[str, Any]]], sid: str
) -> None:
    for summary in other_layouts[sid]:
        _resumed(summary)


def _resumed(summary: dict[str, Any]) -> None:
    assert summary["weights_equal"]
    assert summary["optimizer_equal"]
    assert summary["optimizer_entries"] > 0
    assert summary["consolidated_equal"]
    assert summary["step"] == 32  # and it trained its second epoch
    assert summary["losses"]


# -- in this process: the mesh's sizes


@pytest.mark.parametrize(
    ("world", "sizes", "shape"),
    [
        (4, {"tp": 2, "dp_shard": -1, "dp_replicate": 1}, (1, 2, 2)),
        (8, {"tp": 2, "dp_shard": 2, "dp_replicate": 2}, (2, 2, 2)),
        (4, {"tp": 4, "dp_shard": -1, "dp_replicate": 1}, (1, 1, 4)),
        (4, {"tp": 1, "dp_shard": -1, "dp_replicate": 2}, (2, 2, 1)),
    ],
)
def test_mesh_sizes_fill_the_world(
    world: int, sizes: dict[str, int], shape: tuple[int, ...]
) -> None:
    assert mesh_shape(world, **sizes) == shape


@pytest.mark.parametrize(
    ("world", "sizes", "message"),
    [
        (4, {"tp": 3}, r"tp \* dp_replicate = 3 does not divide the world size"),
        (4, {"tp": 2, "dp_shard": 4}, r"a mesh of 8 ranks, but the world has 4"),
        (8, {"tp": 2, "dp_replicate": 3}, r"tp \* dp_replicate = 6 does not divide"),
        (4, {"tp": 0}, r"ModelParallelStrategy\(tp=\.\.\.\) must be a whole number"),
        (4, {"tp": 2.0}, r"whole number of ranks >= 1, got 2\.0"),
        (4, {"tp": 2, "dp_shard": 0}, r"dp_shard=\.\.\.\) must be .* or -1"),
        (4, {"tp": 2, "dp_replicate": -1}, r"dp_replicate=\.\.\.\) must be a whole number"),
    ],
)
def test_bad_mesh_sizes_are_refused(world: int, sizes: dict[str, Any], message: str) -> None:
    options = {"dp_shard": -1, "dp_replicate": 1, **sizes}
    with pytest.raises(MisconfigurationError, match=message):
        mesh_shape(world, **options)


def test_sizes_that_fit_no_world_are_refused_when_the_strategy_is_made() -> None:
    with pytest.raises(MisconfigurationError, match=r"dp_shard=\.\.\.\) must be"):
        ModelParallelStrategy(tp=2, dp_shard=-2)


def test_sizes_that_do_not_fit_the_launched_world_are_refused_by_the_trainer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A world of 4 as torchrun announces it; the mesh is checked before any group is joined.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    strategy = ModelParallelStrategy(tp=3)
    with pytest.raises(MisconfigurationError, match=r"tp \* dp_replicate = 3 does not divide"):
        strategy.data_parallel_size  # noqa: B018
    with pytest.raises(MisconfigurationError, match=r"cannot cover 4 ranks"):
        Trainer(strategy=strategy, plugins=[])
