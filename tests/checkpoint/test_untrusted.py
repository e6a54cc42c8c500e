"""Completeness markers and ``last.json`` pointers are untrusted input: read only up to
1 MiB, their nesting measured (without recursion) before they are decoded, and decoded
only into typed schemas. One that is too deep, too large or of the wrong shape is a
damaged file: ``load_checkpoint(directory)`` skips it with the usual warning and takes
the newest complete checkpoint; loaded by its path, the checkpoint is refused with an
error naming the file and the problem.

Decoders recurse once per level of nesting, and what stops them is the recursion limit:
a process that raised it (``sys.setrecursionlimit(200_000)``, common advice for deep
models and ``torch.compile``) overflowed its C stack on a 300 kB marker of brackets and
died with a segmentation fault. Those loads run in subprocesses, so a crash is an exit
code, not a dead test session. The measure itself (:func:`loopbus.check_json_nesting`)
is tested here too, fast and in process.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import loopbus
from loopbus import CheckpointError, check_json_nesting
from tests.helpers import ROOT

HEADER = {"format": "loopbus.checkpoint", "format_version": 2, "epoch": 0}
#: About 300 kB of nesting, far deeper than any recursion limit's C stack allows.
DEPTH = 150_000
TOO_DEEP = "nests arrays and objects more than 64 levels deep"


def deep(depth: int = DEPTH) -> bytes:
    return b"[" * depth + b"]" * depth


def with_deep_key(payload: dict[str, Any], depth: int = DEPTH) -> bytes:
    """``payload`` as JSON with one more key ``"x"``, first (a decoder that reads the
    keys it knows skips it), whose value nests ``depth`` levels deep."""
    rest = json.dumps(payload)[1:]
    return b'{"x": ' + deep(depth) + b", " + rest.encode()


def save(directory: Path, step: int) -> Path:
    state = {"loopbus": dict(HEADER, global_step=step), "module": {"w": torch.full((2,), step)}}
    name = f"step={step}.ckpt"
    return loopbus.write_checkpoint(state, directory / name, update_last=True)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    """Complete checkpoints at steps 2 and 4; ``last.json`` names the second."""
    d = tmp_path / "ckpt"
    save(d, 2)
    save(d, 4)
    return d


# ---------------------------------------------------------------- a process that raised its limit

VICTIM = """
import sys, warnings
sys.setrecursionlimit(200_000)
import loopbus
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        state = loopbus.load_checkpoint(sys.argv[1])
    except loopbus.CheckpointError as exc:
        print("error:", exc)
    else:
        print("step:", state["loopbus"]["global_step"])
for warning in caught:
    print("warning:", warning.message)
"""


def load_in_subprocess(target: Path) -> list[str]:
    """What ``load_checkpoint(target)`` did in a process with a recursion limit of
    200,000: its lines (``step: N``, ``error: ...``, ``warning: ...``)."""
    result = subprocess.run(
        [sys.executable, "-c", VICTIM, str(target)], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    return result.stdout.splitlines()


@pytest.mark.external
def test_a_deep_last_json_is_ignored_and_the_newest_complete_checkpoint_taken(
    directory: Path,
) -> None:
    (directory / "last.json").write_bytes(with_deep_key({"checkpoint": "step=2.ckpt"}))
    lines = load_in_subprocess(directory)
    assert lines[0] == "step: 4"
    assert len(lines) == 2
    assert lines[1].startswith(f"warning: skipped checkpoints in {directory}")
    assert f"last.json: this pointer is ignored: it {TOO_DEEP}" in lines[1]
    assert "the newest complete checkpoint there, step=4.ckpt, is taken instead" in lines[1]


@pytest.mark.external
def test_a_checkpoint_whose_marker_is_deep_is_skipped(directory: Path) -> None:
    marker = directory / "step=4.ckpt.complete"
    marker.write_bytes(with_deep_key(json.loads(marker.read_text())))
    lines = load_in_subprocess(directory)
    assert lines[0] == "step: 2"
    assert (
        "step=4.ckpt: last.json names it, but its completeness marker step=4.ckpt.complete "
        f"is damaged: it {TOO_DEEP}"
    ) in lines[1]
    assert "step=2.ckpt, is taken instead" in lines[1]
    # Loaded by its path, it is refused, naming the marker and the problem.
    lines = load_in_subprocess(directory / "step=4.ckpt")
    assert lines == [
        f"error: the completeness marker {marker} is damaged: it {TOO_DEEP} "
        "(loopbus writes at most 2); it was not decoded. Delete it to load the "
        "checkpoint without the integrity check, or load another checkpoint."
    ]


@pytest.mark.external
def test_a_sharded_checkpoint_whose_marker_is_deep_is_skipped(directory: Path) -> None:
    sharded = directory / "step=9.ckpt"
    sharded.mkdir()
    (sharded / "loopbus.complete").write_bytes(deep())
    (directory / "last.json").write_text(json.dumps({"checkpoint": sharded.name}))
    lines = load_in_subprocess(directory)
    assert lines[0] == "step: 4"
    assert (
        f"step=9.ckpt: last.json names it, but its completeness marker loopbus.complete is "
        f"damaged: it {TOO_DEEP}"
    ) in lines[1]
    lines = load_in_subprocess(sharded)
    assert len(lines) == 1
    assert lines[0].startswith(
        f"error: the completeness marker {sharded / 'loopbus.complete'} is damaged: it {TOO_DEEP}"
    )


# ---------------------------------------------------------------- sizes, shapes, old files


def test_a_pointer_or_marker_over_1_mib_is_damaged_and_not_read(directory: Path) -> None:
    (directory / "last.json").write_bytes(b'{"checkpoint": "step=2.ckpt"}' + b" " * (1 << 20))
    with pytest.warns(
        UserWarning,
        match=r"last\.json: this pointer is ignored: it is larger "
        r"than 1,048,576 bytes.*step=4\.ckpt, is taken instead",
    ):
        assert loopbus.load_checkpoint(directory)["loopbus"]["global_step"] == 4
    marker = directory / "step=4.ckpt.complete"
    marker.write_bytes(marker.read_bytes() + b" " * (1 << 20))
    with pytest.raises(CheckpointError, match=rf"{marker}.*larger than 1,048,576 bytes"):
        loopbus.load_checkpoint(directory / "step=4.ckpt")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
def test_a_pointer_that_is_a_named_pipe_is_not_waited_on(directory: Path) -> None:
    (directory / "last.json").unlink()
    os.mkfifo(directory / "last.json")
    with pytest.warns(
        UserWarning,
        match=r"last\.json: this pointer is ignored: it is not a "
        "regular file",
    ):
        assert loopbus.load_checkpoint(directory)["loopbus"]["global_step"] == 4


@pytest.mark.parametrize(
    ("pointer", "why"),
    [
        (b"[]", r"it is JSON but not of the expected shape \(Expected `object`, got `array`\)"),
        (b'{"step": 4}', r"Object missing required field `checkpoint`"),
        (b'{"checkpoint": 4}', r"Expected `str`, got `int` - at `\$\.checkpoint`"),
        (b'{"checkpoint": "../x.ckpt"}', r"it names '\.\./x\.ckpt', which is not a file name"),
        (b"{", r"it is not valid JSON"),
    ],
)
def test_a_pointer_of_the_wrong_shape_is_ignored(directory: Path, pointer: bytes, why: str) -> None:
    (directory / "last.json").write_bytes(pointer)
    (directory / "step=4.ckpt.complete").unlink()  # so that step 2 is the newest complete
    with pytest.warns(UserWarning, match=rf"last\.json: this pointer is ignored: .*{why}"):
        assert loopbus.latest_checkpoint(directory) == directory / "step=2.ckpt"


def test_without_a_complete_checkpoint_the_damaged_pointer_is_named(directory: Path) -> None:
    (directory / "last.json").write_bytes(deep(100))
    for step in (2, 4):
        (directory / f"step={step}.ckpt.complete").unlink()
    with pytest.raises(
        CheckpointError,
        match=rf"no checkpoint in the directory .*Skipped as not complete: last\.json: this "
        rf"pointer is ignored: it {TOO_DEEP}",
    ):
        loopbus.load_checkpoint(directory)


def test_a_marker_of_the_wrong_shape_is_damaged(directory: Path) -> None:
    marker = directory / "step=4.ckpt.complete"
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps(dict(info, size=str(info["size"]))))
    with pytest.raises(
        CheckpointError,
        match=r"is damaged: it is JSON but not of the expected shape \(Expected "
        r"`int \| null`, got `str` - at `\$\.size`\)",
    ):
        loopbus.load_checkpoint(directory / "step=4.ckpt")
    with pytest.warns(
        UserWarning,
        match=r"step=4\.ckpt: last\.json names it, but its "
        r"completeness marker step=4\.ckpt\.complete is damaged",
    ):
        assert loopbus.load_checkpoint(directory)["loopbus"]["global_step"] == 2


def test_files_as_earlier_and_later_versions_write_them_still_load(directory: Path) -> None:
    # Nulls where a value is unknown, keys this version does not know (nested a little).
    marker = directory / "step=4.ckpt.complete"
    info = json.loads(marker.read_text())
    info.update(epoch=None, created=None, future={"keys": [1, [2, {"x": 3}]]})
    marker.write_text(json.dumps(info, indent=1, sort_keys=True))
    pointer = {"checkpoint": "step=4.ckpt", "created": None, "epoch": None, "global_step": None}
    (directory / "last.json").write_text(json.dumps(dict(pointer, later=[[1]]), indent=1))
    assert loopbus.latest_checkpoint(directory) == directory / "step=4.ckpt"
    assert loopbus.load_checkpoint(directory)["loopbus"]["global_step"] == 4
    # checkpoint_info leaves out what the marker leaves out or sets to null.
    found = loopbus.checkpoint_info(directory / "step=4.ckpt")
    assert found == {k: v for k, v in info.items() if v is not None and k != "future"}


# ---------------------------------------------------------------- the measure


def test_the_bound_is_exact() -> None:
    for opening, closing in ((b"[", b"]"), (b'{"a":', b"}")):
        fits = opening * 64 + b"1" + closing * 64
        assert check_json_nesting(fits) is fits
        with pytest.raises(msgspec.DecodeError, match=TOO_DEEP):
            check_json_nesting(opening * 65 + b"1" + closing * 65)
    assert check_json_nesting(b"[[[]]]", limit=3) == b"[[[]]]"
    with pytest.raises(msgspec.DecodeError, match="more than 2 levels deep"):
        check_json_nesting(b"[[[]]]", limit=2)
    # Depth is nesting, not the number of brackets.
    check_json_nesting(b"[" + b"[], " * 1000 + b"[]]")
    check_json_nesting(b"[" * 64 + b"]" * 64 + b"[" * 64 + b"]" * 64)


def test_brackets_in_strings_do_not_count() -> None:
    check_json_nesting(b'["' + b"[{" * 1000 + b'"]')
    check_json_nesting(b'{"' + b"[" * 100 + b'": "' + b"{" * 100 + b'"}')
    # An escaped quote does not end the string ...
    check_json_nesting(b'["\\"' + b"[" * 100 + b'"]')
    check_json_nesting(b'["\\\\\\"' + b"[" * 100 + b'"]')
    check_json_nesting(b'["\\u0022' + b"[" * 100 + b'"]')
    # ... an escaped backslash before it does.
    with pytest.raises(msgspec.DecodeError, match=TOO_DEEP):
        check_json_nesting(b'["\\\\", ' + b"[" * 100 + b"]" * 101)
    # A string left open runs to the end of the text (the decoder refuses it).
    check_json_nesting(b'["' + b"[" * 100)
    # Text that is not JSON is measured all the same.
    check_json_nesting(b"]" * 100 + b"[" * 64)
    with pytest.raises(msgspec.DecodeError, match=TOO_DEEP):
        check_json_nesting(b"]" * 100 + b"[" * 65)


def _value(rng: random.Random, depth: int) -> Any:
    if depth == 0 or rng.random() < 0.2:
        return rng.choice([1, 2.5, None, True, rng.choice(['"', "\\", "[", "{", "]", 'a\\"['])])
    items = [_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.5:
        return items
    return {rng.choice(["[", "k", '"{', "\\"]) + str(i): v for i, v in enumerate(items)}


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def test_the_measure_agrees_with_the_nesting_of_random_documents() -> None:
    rng = random.Random(7)
    for _ in range(300):
        value = _value(rng, rng.randint(1, 12))
        text = json.dumps(value).encode()
        depth = _depth(value)
        check_json_nesting(text, limit=depth)
        if depth:
            with pytest.raises(msgspec.DecodeError, match="levels deep"):
                check_json_nesting(text, limit=depth - 1)


# ---------------------------------------------------------------- what torch.load builds
#
# torch's weights-only unpickler builds values of any depth without recursion (a loop over
# the pickle's opcodes, with a stack of its own); but what reads the state next recurses:
# ``str()`` of a value in a plugin's load_state_dict, an optimizer's load_state_dict. So
# the state's nesting is bounded when it is loaded, and when it is saved.

CRAFT = """
import sys, threading, torch
state = torch.load(sys.argv[1], weights_only=True)
deep = []
for _ in range(150_000):
    deep = [deep]
state["plugins/Checkpoint"]["recent"] = deep
sys.setrecursionlimit(1_000_000)
threading.stack_size(512 << 20)  # the pickler recurses: a thread with room for it
thread = threading.Thread(target=torch.save, args=(state, sys.argv[2]))
thread.start()
thread.join()
"""

RESUME = """
import sys, warnings
sys.setrecursionlimit(200_000)
import loopbus
from loopbus.plugins import Checkpoint
from tests.helpers import TinyModule, make_loader
warnings.simplefilter("ignore")
trainer = loopbus.Trainer(
    max_steps=4, plugins=[Checkpoint(sys.argv[2])], device="cpu", enable_model_summary=False
)
try:
    loopbus.run(trainer.fit, TinyModule(), make_loader(), ckpt_path=sys.argv[1])
except loopbus.CheckpointError as exc:
    print("error:", exc)
"""


@pytest.mark.external
def test_resuming_from_a_checkpoint_that_nests_deep_is_refused_not_a_crash(
    tmp_path: Path,
) -> None:
    from loopbus.plugins import Checkpoint
    from tests.helpers import TinyModule, make_loader

    trainer = loopbus.Trainer(
        max_steps=2,
        plugins=[Checkpoint(tmp_path / "saved", every_n_steps=2, save_on_end=False)],
        device="cpu",
        enable_model_summary=False,
    )
    loopbus.run(trainer.fit, TinyModule(), make_loader())
    saved = loopbus.latest_checkpoint(tmp_path / "saved")
    assert saved is not None
    crafted = tmp_path / "deep.ckpt"
    subprocess.run([sys.executable, "-c", CRAFT, str(saved), str(crafted)], check=True, timeout=240)
    result = subprocess.run(
        [sys.executable, "-c", RESUME, str(crafted), str(tmp_path / "resumed")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.startswith(
        f"error: refusing to load {crafted}: it nests lists, tuples and dicts more than 100 "
        "levels deep (at ['plugins/Checkpoint']['recent'][0][0][0][0][0][0]...(89 more)..."
    )


def test_a_state_that_contains_itself_is_refused(tmp_path: Path) -> None:
    looped: list[Any] = [1]
    looped.append(looped)
    path = tmp_path / "looped.ckpt"
    torch.save({"loopbus": dict(HEADER, global_step=1), "x": {"y": looped}}, path)
    with pytest.raises(
        CheckpointError,
        match=rf"refusing to load {path}: it holds a list that contains itself \(at "
        r"\['x'\]\['y'\]\[1\]\)",
    ):
        loopbus.load_checkpoint(path)


def nested(levels: int) -> Any:
    """A state whose lists and dicts nest ``levels`` deep (the state is level 1)."""
    value: Any = []
    for i in range(levels - 2):
        value = [value] if i % 2 else {"k": value}
    return {"loopbus": dict(HEADER, global_step=1), "x": value}


def test_a_state_nested_deeper_than_a_checkpoint_may_is_refused_when_saved(
    tmp_path: Path,
) -> None:
    path = loopbus.write_checkpoint(nested(100), tmp_path / "fits.ckpt")
    assert loopbus.load_checkpoint(path)["loopbus"]["global_step"] == 1
    with pytest.raises(
        CheckpointError,
        match=r"cannot save checkpoint \(for deep\.ckpt\): it nests lists, tuples and dicts "
        r"more than 100 levels deep \(at checkpoint \(for deep\.ckpt\)\['x'\]\['k'\]\[0\]",
    ):
        loopbus.write_checkpoint(nested(101), tmp_path / "deep.ckpt")
    assert not (tmp_path / "deep.ckpt").exists()
    # Written by other means, it is refused when it loads.
    torch.save(nested(101), tmp_path / "deep.ckpt")
    with pytest.raises(CheckpointError, match=r"more than 100 levels deep \(at \['x'\]\['k'\]"):
        loopbus.load_checkpoint(tmp_path / "deep.ckpt")


def test_the_measure_of_states() -> None:
    from collections import OrderedDict

    from loopbus._untrusted import check_state_nesting

    check_state_nesting(nested(100))
    check_state_nesting(torch.zeros(3))  # not a container: nothing to measure
    with pytest.raises(ValueError, match=r"more than 100 levels deep \(at \['x'\]"):
        check_state_nesting(nested(101))
    # Shared containers are measured once: 2**100 paths, 100 containers.
    shared: Any = [1]
    for _ in range(99):
        shared = [shared, shared]
    check_state_nesting(shared)
    with pytest.raises(ValueError, match="more than 100 levels deep"):
        check_state_nesting([shared])
    # Keys that are tuples, and an OrderedDict's attributes, are measured too.
    key: Any = ()
    for _ in range(100):
        key = (key,)
    with pytest.raises(ValueError, match=r"more than 100 levels deep \(at \['a'\] \(a key\)"):
        check_state_nesting({"a": {key: 1}})
    ordered: Any = OrderedDict(w=1)
    ordered._metadata = nested(99)
    with pytest.raises(ValueError, match=r"more than 100 levels deep \(at \['m'\]\._metadata"):
        check_state_nesting({"m": ordered})
    with pytest.raises(ValueError, match="more than 3 levels deep"):
        check_state_nesting([[[[]]]], limit=3)
    check_state_nesting([[[]]], limit=3)


# ---------------------------------------------------------------- a sharded checkpoint's index


class _Ran:
    """Unpickled, it would create the folder ``flag``."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.flag),))


def test_a_shard_index_that_names_other_objects_is_refused_and_nothing_runs(
    tmp_path: Path,
) -> None:
    # DCP pickles its shard index (.metadata) and reads it with pickle.load: loopbus reads
    # it allowing only the classes an index is made of.
    from loopbus.plugins import Checkpoint
    from tests.helpers import TinyModule, make_loader

    def trainer(directory: Path) -> loopbus.Trainer:
        plugin = Checkpoint(directory, every_n_steps=2, save_on_end=False, sharded=True)
        return loopbus.Trainer(
            max_steps=2, plugins=[plugin], device="cpu", enable_model_summary=False
        )

    loopbus.run(trainer(tmp_path / "saved").fit, TinyModule(), make_loader())
    sharded = loopbus.latest_checkpoint(tmp_path / "saved")
    assert sharded is not None
    assert loopbus.load_checkpoint(sharded)["loopbus"]["global_step"] == 2
    flag = tmp_path / "ran"
    index = sharded / ".metadata"
    index.write_bytes(pickle.dumps(_Ran(flag)))
    marker = sharded / "loopbus.complete"
    info = json.loads(marker.read_text())
    info["files"][".metadata"] = index.stat().st_size  # as complete as can be
    marker.write_text(json.dumps(info))
    refused = rf"refusing the shard index {index} of a sharded checkpoint: UnpicklingError: it "
    refused += r"names \w+\.mkdir, which a shard index does not hold\. Nothing from it was run"
    with pytest.raises(CheckpointError, match=refused):
        loopbus.load_checkpoint(sharded)
    with pytest.raises(CheckpointError, match=refused):
        loopbus.run(
            trainer(tmp_path / "resumed").fit, TinyModule(), make_loader(), ckpt_path=sharded
        )
    assert not flag.exists()
