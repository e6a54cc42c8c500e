"""FSDP for real: ``tests/distributed/fsdp_script.py`` run under ``torchrun`` (2 ranks, gloo, CPU) in
subprocesses, against the same script in one process; and FSDPStrategy's checks of its
options, in this process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import FSDPStrategy, MisconfigurationError, Trainer
from loopbus.checkpoint._format import SHARDED_MARKER
from tests.distributed.fsdp_script import TinyLM
from tests.helpers import ROOT
from tests.torchrun import FSDP_SCRIPT, Scenarios, env, free_port, ok, torchrun

WORLD = 2
#: How far the FSDP loss curve may be from the single-process one of the same global
#: batch (relative, per step): the sums of the gradients are reduced in another order.
#: Measured: 3e-7 over 32 AdamW steps.
CURVE_RTOL = 1e-5

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


#: The scenarios of ``fsdp_script.py`` the tests read, in one launch (each its own
#: folder; the script's ``--scenario`` names what it runs).
RUNS = Scenarios(
    FSDP_SCRIPT,
    {
        "train": ["--scenario", "train"],
        "train-ac-gathered": ["--scenario", "train", "--ac", "--keep-gathered"],
        "train-bf16": ["--scenario", "train", "--precision", "bf16-mixed"],
        "accumulate": ["--scenario", "accumulate"],
        "meta": ["--scenario", "meta"],
        "stop": ["--scenario", "stop"],
        "refusals": ["--scenario", "refusals"],
        "checkpoints": ["--scenario", "checkpoints"],
    },
    nproc=WORLD,
    timeout_s=180,
)


def _summaries(out: Path, scenario: str, ranks: int = WORLD) -> list[dict[str, Any]]:
    """What each rank wrote of ``scenario`` into ``out``, and the gloo threads it still
    had once its process's exit handlers had run."""
    summaries = []
    for rank in range(ranks):
        summary = json.loads((out / f"{scenario}_rank{rank}.json").read_text())
        exit_file = out / f"{scenario}_rank{rank}_exit.json"
        summary["gloo_threads_at_exit"] = json.loads(exit_file.read_text())
        summaries.append(summary)
    return summaries


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    return RUNS.run_once(tmp_path_factory, "fsdp-runs")


def _run(fsdp_runs: Scenarios, sid: str) -> list[dict[str, Any]]:
    """The summaries of scenario ``sid`` of ``RUNS``, one per rank."""
    return _summaries(fsdp_runs.out(sid), RUNS.scenarios[sid][1])


def _single_process(out: Path) -> dict[str, Any]:
    """The ``train`` scenario in one plain process (no torchrun): its summary."""
    cmd = [sys.executable, str(FSDP_SCRIPT), "--out", str(out), "--scenario", "train"]
    ok(
        subprocess.run(
            [*cmd, "--strategy", "single"], env=env(), capture_output=True, text=True, timeout=180
        )
    )
    (summary,) = _summaries(out, "train", ranks=1)
    return summary


@pytest.fixture(scope="module")
def fsdp_run(fsdp_runs: Scenarios) -> list[dict[str, Any]]:
    return _run(fsdp_runs, "train")


def test_a_small_transformer_trains_under_fsdp(fsdp_run: list[dict[str, Any]]) -> None:
    s0, s1 = fsdp_run
    assert (s0["strategy"], s0["world_size"], s0["step"]) == ("fsdp", WORLD, 32)
    assert s0["param_types"] == ["DTensor"]
    losses = s0["losses"]
    assert losses == s1["losses"]  # averaged over the ranks: the global batch's
    assert losses[0] > 3.3  # about ln(32): a uniform guess
    assert sum(losses[-4:]) / 4 < 2.1
    # Validation runs through the sharded module too (every rank over all the data).
    assert s0["val_loss"] == s1["val_loss"] < 2.1
    # A second fit with a new trainer uses the module as sharded, and goes on learning.
    assert s0["again_step"] == 32
    assert max(s0["again_losses"]) < losses[0]
    assert sum(s0["again_losses"][-4:]) / 4 < sum(losses[-4:]) / 4


def test_the_process_group_and_its_threads_are_gone_before_the_interpreter_finalizes(
    fsdp_run: list[dict[str, Any]], checkpoints: tuple[Path, dict[str, Any]]
) -> None:
    # A gloo thread alive into finalization can abort the process at exit (-6) when it
    # lets go of finished work. Under FSDP, torch's DTensor caches keep the device mesh,
    # and with it the group, alive: FSDP's exit hook empties them, so the group is freed
    # and its threads joined while the interpreter is whole.
    _, saved = checkpoints
    for summary in [*fsdp_run, saved]:
        if summary["gloo_threads_at_exit"] is None:
            pytest.skip("this platform does not list a process's threads")
        assert summary["gloo_threads_at_exit"] == []


def test_the_fsdp_loss_curve_matches_one_process_of_the_same_global_batch(
    fsdp_run: list[dict[str, Any]], tmp_path: Path
) -> None:
    single = _single_process(tmp_path)
    assert single["strategy"] == "single"
    assert single["step"] == fsdp_run[0]["step"]
    assert fsdp_run[0]["losses"] == pytest.approx(single["losses"], rel=CURVE_RTOL)


def test_each_rank_holds_its_share_of_parameters_and_optimizer_state(
    fsdp_run: list[dict[str, Any]],
) -> None:
    bound = 1 / WORLD + 0.10
    for summary in fsdp_run:
        for what in ("param_bytes", "optimizer_bytes"):
            local, full = summary[what]
            assert full > 0
            assert local / full <= bound, (what, local, full)
    # Together the ranks hold everything (nothing is dropped; the shards here need no
    # padding: every sharded dimension is even).
    assert sum(s["param_bytes"][0] for s in fsdp_run) == fsdp_run[0]["param_bytes"][1]


def test_activation_checkpointing_and_keeping_units_gathered_compute_the_same_steps(
    fsdp_run: list[dict[str, Any]], fsdp_runs: Scenarios
) -> None:
    # Recomputing activations in backward (activation_checkpointing=True) and keeping a
    # unit's parameters gathered from forward to backward (reshard_after_forward=False)
    # change what is kept in memory, not what is computed.
    s0, _ = _run(fsdp_runs, "train-ac-gathered")
    assert s0["losses"] == fsdp_run[0]["losses"]


def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_shards(
    fsdp_run: list[dict[str, Any]], fsdp_runs: Scenarios
) -> None:
    s0, _ = _run(fsdp_runs, "train-bf16")
    assert s0["compute_dtypes"] == ["torch.bfloat16"]  # gathered weights, cast by FSDP
    assert s0["param_dtypes"] == ["torch.float32"]  # the sharded parameters
    assert fsdp_run[0]["compute_dtypes"] == ["torch.float32"]
    assert sum(s0["losses"][-4:]) / 4 < 2.1
    assert s0["losses"] == pytest.approx(fsdp_run[0]["losses"], rel=0.02)


def test_accumulation_and_clipping_equal_a_hand_written_fsdp_loop(fsdp_runs: Scenarios) -> None:
    for summary in _run(fsdp_runs, "accumulate"):
        assert summary["step"] == 16  # 64 micro-batches a rank, windows of 4
        assert summary["moved"] > 0.01  # it trained
        assert summary["identical"], summary["max_abs_diff"]


def test_a_module_built_on_meta_is_materialised_like_a_normal_one(fsdp_runs: Scenarios) -> None:
    s0, s1 = _run(fsdp_runs, "meta")
    for summary in (s0, s1):
        assert summary["keys_match"]
        assert summary["equal_at_start"]
        assert not summary["meta_left"]
    assert sum(s0["losses"][-4:]) / 4 < 2.1


def test_a_stop_on_one_rank_stops_both_and_loggers_act_on_rank_zero(fsdp_runs: Scenarios) -> None:
    s0, s1 = _run(fsdp_runs, "stop")
    # Asked by a handler after step 5, sent at boundary 5, read at boundary 6
    # (stop_check_interval_s=0), as under DDP.
    assert s0["step"] == s1["step"] == 6
    assert s1["stop_reason"] == "rank 1 asked at step 5"
    assert s0["stop_reason"] == "rank 1 asked at step 5 (on rank 1)"
    assert s0["weights"] == s1["weights"]
    assert (s0["logged"], s1["logged"]) == (True, False)


@pytest.fixture(scope="module")
def refusals(fsdp_runs: Scenarios) -> dict[str, str]:
    s0, s1 = _run(fsdp_runs, "refusals")
    assert s0 == s1
    return s0


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("manual", "ManualLM uses manual optimization, which strategy='fsdp' does not support"),
        ("fp16", "precision='16-mixed' scales the loss with a GradScaler"),
        ("no_unit", r"FSDPStrategy(units=[Conv2d]): TinyLM has no submodule of these classes"),
        ("no_reset", "LMWithNoReset.extra (NoReset) was built on the meta device but has no "
         "reset_parameters()"),
        ("stale_optimizer", "optimizer 0 (AdamW) of _StaleOptimizer holds tensors that are "
         "not the module's parameters after sharding"),
    ],
)  # fmt: skip
def test_what_fsdp_refuses_is_refused_clearly(
    refusals: dict[str, str], case: str, message: str
) -> None:
    assert message in refusals[case]
    # The user's class, not the subclass fully_shard makes of it.
    assert not re.search(r"FSDP(ManualLM|_StaleOptimizer|TinyLM)", refusals[case])


@pytest.fixture(scope="module")
def checkpoints(fsdp_runs: Scenarios) -> tuple[Path, dict[str, Any]]:
    out = fsdp_runs.out("checkpoints")
    s0, s1 = _run(fsdp_runs, "checkpoints")
    assert s0 == s1
    return out, s0


def test_save_checkpoint_under_fsdp_writes_a_sharded_checkpoint(
    checkpoints: tuple[Path, dict[str, Any]],
) -> None:
    _, summary = checkpoints
    saved = Path(summary["saved"])
    info = json.loads((saved / SHARDED_MARKER).read_text())
    assert (info["strategy"], info["world_size"]) == ("fsdp", WORLD)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(info["files"])
    # No full dict of the run exists on one rank: state_dict() says what to use instead.
    assert summary["state_dict"].startswith("trainer.state_dict() under strategy='fsdp'")
    assert "trainer.save_checkpoint(path)" in summary["state_dict"]


def test_an_fsdp_checkpoint_consolidates_into_a_plain_module(
    checkpoints: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, summary = checkpoints
    full = loopbus.consolidate_checkpoint(summary["saved"], tmp_path / "full.ckpt")
    state = torch.load(full, weights_only=True)
    expected = torch.load(out / "by-hand-full.pt", weights_only=True)
    plain = TinyLM()  # unsharded, in this process
    plain.load_state_dict(state["module"])
    assert state["module"].keys() == expected.keys()
    assert all(torch.equal(plain.state_dict()[k], expected[k]) for k in expected)
    assert state["loopbus"]["module_class"].endswith(".TinyLM")  # not FSDPTinyLM
    # AdamW's state for every parameter, keyed by position as torch.optim saves it.
    parameters = len(list(plain.parameters()))
    assert set(state["optimizers/0"]["state_dict"]["state"]) == set(range(parameters))


def test_weights_load_into_an_fsdp_module_and_other_units_resume(
    checkpoints: tuple[Path, dict[str, Any]],
) -> None:
    _, summary = checkpoints
    assert summary["validate"]  # validate(ckpt_path=...) under FSDP: the saved weights
    assert summary["validate_units"]  # and into other shard units (DCP maps them)
    assert summary["resumed_step"] == 8  # resumed at step 4, one more epoch of 4


def test_a_ddp_sharded_checkpoint_resumes_under_fsdp(
    checkpoints: tuple[Path, dict[str, Any]],
) -> None:
    _, summary = checkpoints
    assert summary["ddp_to_fsdp"]
    assert summary["ddp_to_fsdp_step"] == 4


def test_a_file_checkpoint_loads_its_weights_but_does_not_resume_under_fsdp(
    checkpoints: tuple[Path, dict[str, Any]],
) -> None:
    _, summary = checkpoints
    assert summary["file_weights"]
    message = summary["file_resume"]
    assert "ddp-file.ckpt is a checkpoint file (full tensors)" in message
    assert "Resume it under strategy='ddp' or in one process" in message


class _Block(torch.nn.Module):
    pass


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"units": _Block}, r"the class _Block alone: write units=\[_Block\]"),
        ({"units": []}, "must be a non-empty list of torch.nn.Module classes"),
        ({"units": ["Block"]}, "must list torch.nn.Module classes, got 'Block'"),
        ({"units": [int]}, "must list torch.nn.Module classes, got <class 'int'>"),
        ({"reshard_after_forward": 1}, "True, False or a number of ranks >= 2"),
        ({"reshard_after_forward": "yes"}, "True, False or a number of ranks >= 2"),
        ({"mp_policy": "bf16"}, "must be a torch.distributed.fsdp.MixedPrecisionPolicy"),
        ({"cpu_offload": 1}, r"FSDPStrategy\(cpu_offload=...\) must be True or False"),
        ({"activation_checkpointing": "on"}, "must be True or False, got 'on'"),
    ],
)
def test_bad_fsdp_options_are_refused_when_the_strategy_is_built(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        FSDPStrategy(**options)


def test_fsdp_options_that_are_accepted() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    strategy = FSDPStrategy(
        [_Block], reshard_after_forward=False, mp_policy=policy, activation_checkpointing=True
    )
    assert strategy.units == (_Block,)
    assert (strategy.name, strategy.sharded_state, strategy.mp_policy) == ("fsdp", True, policy)
    assert FSDPStrategy(lambda m: isinstance(m, _Block)).units is not None
    assert not Trainer(plugins=[]).strategy.sharded_state


def test_fsdp_outside_a_launcher_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(MisconfigurationError, match="strategy='fsdp' needs the environment"):
        Trainer(strategy="fsdp", device="cpu", plugins=[])
    with pytest.raises(MisconfigurationError, match="strategy='fsdp' needs the environment"):
        Trainer(strategy=FSDPStrategy(), device="cpu", plugins=[])


@pytest.mark.external
def test_the_fsdp_example_trains_under_torchrun(tmp_path: Path) -> None:
    example = ROOT / "examples" / "fsdp_transformer.py"
    cmd = torchrun(
        f"--nproc_per_node={WORLD}", f"--master_port={free_port()}", str(example),
        "--meta", "--epochs", "2", "--samples", "1024", "--layers", "2",
        "--ckpt", str(tmp_path / "ckpt"),
    )  # fmt: skip
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180)
    ok(proc)
    losses = [
        float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if "mean loss" in line
    ]
    assert len(losses) == 2  # printed by rank 0 only
    assert losses[1] < 0.6 * losses[0]
    last = loopbus.latest_checkpoint(tmp_path / "ckpt")  # a sharded checkpoint an epoch
    assert last is not None
    assert last.name == "epoch=1-step=32.ckpt"
    info = json.loads((last / SHARDED_MARKER).read_text())
    assert (info["strategy"], info["world_size"]) == ("fsdp", WORLD)
