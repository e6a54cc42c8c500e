"""``JSONLLogger``: each put record as a line of JSON; and :func:`read_jsonl` and
:func:`decode_records` to read them back."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from loopbus import (
    PutRecord,
    check_choice,
    check_json_nesting,
    naming_errors,
)

from ._base import Logger
from ._files import (
    _FILE_MODES,
    DEFAULT_NAME,
    VersionedDir,
    _complete_text,
    _continue_after,
    _prepare_file,
    save_dir_of,
    write_hparams_file,
)

__all__ = ["JSONLLogger", "decode_records", "read_jsonl"]

_NONFINITE = {math.inf: "inf", -math.inf: "-inf"}


def _wire(record: PutRecord) -> PutRecord:
    value = record.value
    if type(value) is float and not math.isfinite(value):
        # JSON has no literal for these; write a string that read_jsonl turns back.
        text = _NONFINITE.get(value, "nan")
        return msgspec.structs.replace(record, value=text)
    return record


class JSONLLogger(VersionedDir, Logger):
    """Writes each put record as one line of JSON (msgspec-encoded :class:`PutRecord`,
    tagged ``"type": "PutRecord"``) to ``records.jsonl`` in :attr:`log_dir`
    (``save_dir/loopbus_logs/version_N``, as for :class:`CSVLogger`).

    Non-finite floats, which JSON cannot represent, are written as the strings ``"nan"``,
    ``"inf"`` and ``"-inf"``. :func:`read_jsonl` decodes the file back into
    :class:`PutRecord` objects equal to the ones that were put.

    ``mode`` and resuming work as for :class:`CSVLogger` (a resumed ``fit`` continues
    the file, dropping the lines of steps after the checkpoint's), and so do the
    hyperparameters (``hparams.yaml`` beside the file).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        *,
        filename: str = "records.jsonl",
        name: str = DEFAULT_NAME,
        version: int | str | None = None,
        mode: Literal["w", "a"] = "w",
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        super().__init__(flush_interval=flush_interval, buffer=buffer, overflow=overflow)
        check_choice("mode", mode, _FILE_MODES, owner="JSONLLogger")
        self._init_dir("JSONLLogger", save_dir_of("JSONLLogger", save_dir), name, version)
        self.filename = filename
        self.mode = mode
        self._opened = False
        self._file: io.BufferedWriter | None = None
        self._encoder = msgspec.json.Encoder()

    def __repr__(self) -> str:
        return f"JSONLLogger({str(self._root)!r}, name={self.name!r})"

    @property
    def path(self) -> Path:
        """The JSON lines file: ``filename`` in :attr:`log_dir`."""
        return self.log_dir / self.filename

    def open(self, stage: str) -> None:
        resume = self.resume_step
        if resume is not None:
            _continue_after(self.path, resume, self.resume_time, _jsonl_step_time)
        else:
            _prepare_file(self.path, self._opened or self.mode == "a")
        self._opened = True
        self._file = self.path.open("ab")

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        write_hparams_file(self.path.parent, hparams)

    def write(self, records: Sequence[PutRecord]) -> None:
        assert self._file is not None
        with naming_errors(self.path):
            self._file.write(self._encoder.encode_lines([_wire(r) for r in records]))

    def flush(self) -> None:
        if self._file is not None:
            with naming_errors(self.path):
                self._file.flush()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            with naming_errors(self.path):
                f.close()


_DECODER = msgspec.json.Decoder(PutRecord, strict=False)


class _StepTime(msgspec.Struct):
    step: int = 0
    time: float = 0.0


_STEP_TIME_DECODER = msgspec.json.Decoder(_StepTime)


def _jsonl_step_time(line: bytes) -> tuple[int, float] | None:
    try:
        decoded = _STEP_TIME_DECODER.decode(check_json_nesting(line))
    except msgspec.DecodeError:
        return None  # not a record: kept as it is
    return decoded.step, decoded.time


def decode_records(lines: Iterable[bytes]) -> list[PutRecord]:
    """Decode JSON lines written by :class:`JSONLLogger` into :class:`PutRecord`\\ s.
    Blank lines are skipped; a line that does not decode, or that nests arrays and
    objects more than 64 levels deep (it is not decoded), raises ``msgspec.DecodeError``
    naming its number (the first line is line 1) and the problem."""
    return _decode_lines(lines, "")


def _decode_lines(lines: Iterable[bytes], where: str) -> list[PutRecord]:
    decode = _DECODER.decode
    records: list[PutRecord] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(decode(check_json_nesting(line)))
        except msgspec.DecodeError as exc:
            raise type(exc)(f"{where}line {number}: {exc}") from None
    return records


def read_jsonl(path: str | os.PathLike[str]) -> list[PutRecord]:
    """Read a :class:`JSONLLogger` file back into :class:`PutRecord`\\ s, in the order they
    were put. A torn last line (from a killed run) is ignored; any other line that does
    not decode, or that nests arrays and objects more than 64 levels deep, raises
    ``msgspec.DecodeError`` naming the file, the line's number and the problem."""
    return _decode_lines(_complete_text(path).splitlines(), f"{os.fspath(path)}, ")
