"""Files that cannot be checkpoints: each gets a CheckpointError that names the file and
says what it actually is (empty, not a torch file, a torch file holding pickled objects,
torn or truncated, ...), and nothing that is not a torch.save file is ever unpickled."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import random
import re
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import CheckpointError

HEADER = {"format": "loopbus.checkpoint", "format_version": 2, "global_step": 3, "epoch": 0}

#: What unpickling one of the files below would record.
RAN: list[Any] = []


class Opaque:
    """A custom class: torch.save pickles it as a Python object."""

    def __init__(self) -> None:
        self.x = 1

    def __setstate__(self, state: dict[str, Any]) -> None:
        RAN.append(state)
        self.__dict__.update(state)


def _state() -> dict[str, Any]:
    return {"loopbus": dict(HEADER), "module": {"w": torch.arange(4.0)}}


def _torch_bytes(obj: Any, *, legacy: bool = False) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue()


def _good() -> bytes:
    return _torch_bytes(_state())


def _legacy_good() -> bytes:
    return _torch_bytes(_state(), legacy=True)


def _cut(data: bytes, at: float | int) -> bytes:
    """``data`` cut at a fraction of its length, or at a byte count (negative: from the
    end)."""
    end = int(len(data) * at) if isinstance(at, float) else at
    return data[:end]


def _random(size: int, seed: int) -> Callable[[], bytes]:
    return lambda: random.Random(seed).randbytes(size)


def _zip_with_text() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("readme.txt", "not a checkpoint\n")
    return buffer.getvalue()


def _zip_without_data_pkl() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def _torchscript() -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # TorchScript is deprecated on recent torch versions
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buffer)
    return buffer.getvalue()


def _safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\0\0\0\0"


# (id, the file's bytes, the problem the message must state after "<name>: ", whether
# torch.load (weights-only) is called on the file at all: never for a file that does not
# start as a torch.save container)
BAD_FILES: list[tuple[str, Callable[[], bytes], str, bool]] = [
    ("empty", lambda: b"", r"it is empty \(0 bytes\)", False),
    *[
        (
            f"random-{size}",
            _random(size, seed),
            r"it is not a torch checkpoint \(not a zip archive, the torch\.save format, and "
            r"not a legacy torch\.save file either; it starts with the bytes",
            False,
        )
        for size, seed in [(10, 0), (1000, 1), (100_000, 2)]
    ],
    (
        "hello-world",
        lambda: b"hello world",
        r"it is not a torch checkpoint \(not a zip archive.*"
        r"it looks like a text file, starting with 'hello world'\)",
        False,
    ),
    (
        "gzip",
        lambda: gzip.compress(_good()),
        r"it is not a torch checkpoint \(.*it is gzip-compressed data\)",
        False,
    ),
    (
        "safetensors",
        _safetensors,
        r"it is not a torch checkpoint \(.*it is a safetensors file",
        False,
    ),
    (
        "zip-with-text",
        _zip_with_text,
        r"it is not a torch checkpoint: it is a zip archive but not a torch\.save file "
        r"\(it holds readme\.txt, where a torch\.save archive holds <name>/data\.pkl\)",
        True,
    ),
    (
        "zip-without-data-pkl",
        _zip_without_data_pkl,
        r"it is not a torch checkpoint: it is a zip archive but not a torch\.save file "
        r"\(it holds archive/version but no archive/data\.pkl\)",
        True,
    ),
    (
        "empty-zip",
        lambda: b"PK\x05\x06" + bytes(18),
        r"it is not a torch checkpoint: it is a zip archive but not a torch\.save file "
        r"\(it is empty\)",
        False,
    ),
    (
        "torchscript",
        _torchscript,
        r"it is a TorchScript archive \(torch\.jit\.save\), not a torch\.save checkpoint",
        True,
    ),
    (
        "torch-custom-class",
        lambda: _torch_bytes({"loopbus": dict(HEADER), "obj": Opaque()}),
        r"it is a torch file but holds pickled Python objects that weights_only loading "
        r"refuses \(.*GLOBAL .*Opaque.*\)\. Nothing from the file was run",
        True,
    ),
    (
        "legacy-torch-custom-class",
        lambda: _torch_bytes({"loopbus": dict(HEADER), "obj": Opaque()}, legacy=True),
        r"it is a torch file but holds pickled Python objects that weights_only loading "
        r"refuses \(.*GLOBAL .*Opaque.*\)\. Nothing from the file was run",
        True,
    ),
    (
        "bare-pickle-of-objects",
        lambda: pickle.dumps({"loopbus": dict(HEADER), "obj": Opaque()}),
        r"it is not a torch checkpoint but a bare pickle \(written by pickle\.dump, not "
        r"torch\.save\) that holds pickled Python objects \(.*Opaque\)\. Nothing from the file "
        r"was run",
        False,
    ),
    (
        "bare-pickle-protocol-2",
        lambda: pickle.dumps({"obj": Opaque()}, protocol=2),
        r"it is not a torch checkpoint but a bare pickle .*pickled Python objects \(.*Opaque",
        False,
    ),
    (
        "bare-pickle-of-plain-values",
        lambda: pickle.dumps({"loopbus": dict(HEADER), "w": [1.0, 2.0]}),
        r"it is not a torch checkpoint but a bare pickle \(written by pickle\.dump, not "
        r"torch\.save\)\. loopbus never unpickles such a file",
        False,
    ),
    *[
        (
            f"truncated-{label}",
            lambda at=at: _cut(_good(), at),
            r"it is torn or truncated \(an interrupted write or copy\) or otherwise corrupt: "
            r"it starts as a zip archive \(the torch\.save format\) but its end, the zip "
            r"central directory, is missing or damaged",
            True,  # a zip header: torch.load opens it (and reads no pickle)
        )
        for label, at in [
            ("4-bytes", 4),
            ("at-10%", 0.1),
            ("at-50%", 0.5),
            ("at-90%", 0.9),
            ("less-100-bytes", -100),
            ("less-1-byte", -1),
        ]
    ],
    *[
        (
            f"legacy-truncated-{label}",
            lambda at=at: _cut(_legacy_good(), at),
            rf"it is torn or truncated \(an interrupted write or copy\) or otherwise corrupt: "
            rf"{problem}",
            label != "8-bytes",  # less than the legacy header: never handed to torch
        )
        for label, at, problem in [
            ("8-bytes", 8, r"it has only 8 bytes, the start of a legacy torch\.save file"),
            ("at-30%", 0.3, r"it is a legacy torch\.save file whose .* pickle is incomplete"),
            ("at-60%", 0.6, r"it is a legacy torch\.save file whose .* pickle is incomplete"),
            (
                "less-1-byte",
                -1,
                r"it is a legacy torch\.save file whose tensor data ends early",
            ),
        ]
    ],
    (
        "legacy-torch-plain-dict",
        lambda: _torch_bytes({"w": torch.ones(2), "step": 3}, legacy=True),
        r"is not a loopbus checkpoint \(it has no 'loopbus' header; top-level keys: "
        r"\['step', 'w'\]\)",
        True,
    ),
]


@pytest.mark.parametrize(
    ("make", "problem", "torch_reads"),
    [pytest.param(make, problem, reads, id=name) for name, make, problem, reads in BAD_FILES],
)
def test_a_file_that_cannot_be_a_checkpoint_gets_an_error_naming_it_and_its_problem(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[], bytes],
    problem: str,
    torch_reads: bool,
) -> None:
    path = tmp_path / "bad-file.ckpt"
    path.write_bytes(make())
    RAN.clear()
    real_load = torch.load
    loads: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}:? {problem}") as info:
        loopbus.load_checkpoint(path)
    assert not RAN, "unpickling ran code from the file"
    assert loads == ([True] if torch_reads else []), "only weights-only torch.load calls"
    if "pickled Python objects" not in problem:
        assert "pickled Python objects" not in str(info.value)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        pytest.param(b"", r"it is empty \(0 bytes\)", id="empty"),
        pytest.param(b"hello world", r"it is not a torch checkpoint", id="hello-world"),
        pytest.param(b"PK", r"it is not a torch checkpoint", id="two-bytes"),
    ],
)
def test_the_message_names_the_file_given_as_a_string_or_a_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, problem: str
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("odd name.pt").write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"odd name\.pt: {problem}"):
        loopbus.load_checkpoint("odd name.pt")


def test_a_directory_without_checkpoints(tmp_path: Path) -> None:
    empty = tmp_path / "run"
    empty.mkdir()
    with pytest.raises(
        CheckpointError,
        match=rf"no checkpoint in the directory {re.escape(str(empty))}: it is a directory "
        r"without checkpoints \(it has no last\.json pointer and no complete checkpoint file",
    ):
        loopbus.load_checkpoint(empty)
    # A checkpoint without its marker is not picked on its own; the message names it.
    (empty / "manual.ckpt").write_bytes(_good())
    with pytest.raises(
        CheckpointError,
        match=r"directory without checkpoints.*It holds manual\.ckpt without completeness "
        r"markers; pass one of them explicitly",
    ):
        loopbus.load_checkpoint(empty)
    assert loopbus.load_checkpoint(empty / "manual.ckpt")["loopbus"]["global_step"] == 3


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_path_that_is_not_a_regular_file(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe.ckpt"
    os.mkfifo(pipe)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(pipe))}: it is not a regular file"):
        loopbus.load_checkpoint(pipe)


def test_an_empty_file_with_a_marker_is_reported_against_the_marker(tmp_path: Path) -> None:
    path = loopbus.write_checkpoint(_state(), tmp_path / "a.ckpt")
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"a\.ckpt is torn or truncated.*marker records"):
        loopbus.load_checkpoint(path)
    # Without the check against the marker, the file itself is described.
    with pytest.raises(CheckpointError, match=r"a\.ckpt: it is empty"):
        loopbus.load_checkpoint(path, verify=False)


def test_good_checkpoints_still_load(tmp_path: Path) -> None:
    state = _state()
    path = loopbus.write_checkpoint(state, tmp_path / "ck" / "good.ckpt", update_last=True)
    for where in (path, str(path), tmp_path / "ck", tmp_path / "ck" / "last.json"):
        loaded = loopbus.load_checkpoint(where)
        assert loaded["loopbus"] == HEADER
        assert torch.equal(loaded["module"]["w"], state["module"]["w"])
    # A plain torch.save file with a loopbus header loads too, in either container.
    for legacy in (False, True):
        other = tmp_path / f"plain-{legacy}.ckpt"
        other.write_bytes(_torch_bytes(_state(), legacy=legacy))
        assert loopbus.load_checkpoint(other)["loopbus"]["global_step"] == 3
