"""Checkpoint files read as untrusted input: what a file is before torch reads a byte of
it, why ``torch.load(..., weights_only=True)`` refused or failed on it, and whether what
it built nests deeper than a checkpoint may.

Only a file that starts as a torch.save container (a zip archive, or a legacy
torch.save file) is handed to torch; anything else is named from its first bytes (an
empty file, a bare pickle, a TorchScript archive, compressed data, a safetensors
file...). When torch fails, the file is inspected to tell damage (torn, truncated,
corrupt) from pickled Python objects that weights-only loading refuses. A pickle is
inspected by parsing its opcodes, never by running it: nothing from the file is built or
imported. What a load built is checked for nesting (at most 100 levels of lists, tuples
and dicts, no container that contains itself): torch's unpickler builds any depth
without recursion, but what reads the state next recurses.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import stat
import zipfile
from collections import deque
from pathlib import Path
from typing import Any, NoReturn

from .._exceptions import CheckpointError
from .._untrusted import MAX_STATE_DEPTH, check_state_nesting

__all__ = ["check_loaded"]


def _short(exc: BaseException) -> str:
    """The first sentence of the telling line of an exception's message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    chosen = next((x for x in lines if "GLOBAL" in x or "Unsupported" in x), None)
    if chosen is None:
        chosen = lines[0] if lines else type(exc).__name__
    end = chosen.find(". ")
    if end > 0:
        chosen = chosen[:end]
    return chosen.rstrip(".")[:300]


# What a file that cannot be a checkpoint is: first the two torch.save containers, then
# a few formats that are often mistaken for one.

#: A zip archive (the torch.save format since PyTorch 1.6) starts with a local file header.
_ZIP_HEAD = b"PK\x03\x04"
#: An empty or a spanned zip archive starts with one of these instead.
_OTHER_ZIP_HEADS = (b"PK\x05\x06", b"PK\x07\x08")
#: A legacy torch.save file (``_use_new_zipfile_serialization=False``) starts with this
#: number (``torch.serialization.MAGIC_NUMBER``) pickled on its own.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_HEADS = tuple(
    {pickle.dumps(_LEGACY_MAGIC, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)}
)
#: The pickles at the start of a legacy file: magic number, protocol version, system
#: info, the object, the storage keys (the storages' bytes follow).
_LEGACY_PICKLES = ("magic number", "protocol version", "system info", "object", "storage keys")
_FOREIGN_HEADS = (
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"ustar", "a tar archive"),  # at offset 257
)
#: Torch's weights-only refusals that mean "this pickle builds objects it does not allow".
_OBJECT_REFUSALS = (
    "GLOBAL",
    "unrecognized function",
    "Can only create new object",
    "Can only build",
    "must be imported",
)
#: Words in torch.load errors that come from the arguments or the machine, not the file.
_NOT_THE_FILE = ("deserialize", "map_location", "device", "memory")
_HEAD_SIZE = 512
_MAX_LINE = 1 << 20
_STRING_OPS = frozenset(
    {
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "UNICODE",
        "SHORT_BINSTRING",
        "BINSTRING",
        "STRING",
    }
)
_AGAIN = "Load another checkpoint, for example the previous one in the same directory."


class _Bounded:
    """A binary file seen by a pickle parser: no read goes past the end of the file, so a
    corrupt length field cannot make it allocate more than the file holds."""

    def __init__(self, file: Any, size: int) -> None:
        self.file = file
        self.size = size

    def read(self, n: int = -1) -> bytes:
        left = max(self.size - self.file.tell(), 0)
        data: bytes = self.file.read(left if n < 0 or n > left else n)
        return data

    def readline(self) -> bytes:
        line: bytes = self.file.readline(_MAX_LINE)
        return line

    def tell(self) -> int:
        pos: int = self.file.tell()
        return pos


def _scan_pickle(stream: Any) -> list[str] | None:
    """Parse one pickle from ``stream`` without running it (opcodes only, nothing is
    built or imported). The globals it names, or None if it is not a complete pickle."""
    found: list[str] = []
    memo: dict[int, str | None] = {}
    recent: deque[str | None] = deque([None, None], maxlen=2)
    try:
        for opcode, arg, _pos in pickletools.genops(stream):
            name = opcode.name
            if name in _STRING_OPS:
                recent.append(arg if isinstance(arg, str) else None)
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(arg) if isinstance(arg, int) else None)
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1]
            elif name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int):
                memo[arg] = recent[-1]
            elif name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", ".", 1))
                recent.append(None)
            elif name == "STACK_GLOBAL":
                module, qualname = recent
                found.append(f"{module or '?'}.{qualname or '?'}")
                recent.append(None)
            else:
                recent.append(None)
    except Exception:  # any malformed stream: truncated, garbage, bad argument
        return None
    return found


def _describe(head: bytes, size: int) -> str:
    """What a file that is not a torch file looks like, from its first bytes."""
    for magic, what in _FOREIGN_HEADS:
        at = 257 if magic == b"ustar" else 0
        if head[at : at + len(magic)] == magic:
            return f"it is {what}"
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[3:4] != b"0":
        return "it is bzip2-compressed data"
    if len(head) > 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8:
        return "it is a safetensors file; read it with safetensors.torch.load_file()"
    for cut in range(4):  # the head may end inside a multi-byte character
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text and all(c.isprintable() or c in "\t\n\r\f\v" for c in text):
            first = text.strip().splitlines()[0][:40] if text.strip() else ""
            return f"it looks like a text file, starting with {first!r}"
        break
    return f"it starts with the bytes {head[:16]!r}"


_WRITTEN_BY = (
    "loopbus checkpoints are written by Trainer.save_checkpoint(), the Checkpoint plugin "
    "or write_checkpoint()."
)


def _not_torch(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot load {file}: it is not a torch checkpoint (not a zip archive, the torch.save "
        f"format, and not a legacy torch.save file either; {what}). {_WRITTEN_BY}"
    )


def _foreign_zip(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot load {file}: it is not a torch checkpoint: it is a zip archive but not a "
        f"torch.save file ({what}). {_WRITTEN_BY}"
    )


def _bare_pickle(file: Path, handle: Any, size: int) -> CheckpointError | None:
    """The error for a bare pickle (pickle.dump, not torch.save), or None if the file is
    not one. The pickle is parsed, never run."""
    handle.seek(0)
    found = _scan_pickle(_Bounded(handle, size))
    if found is None:
        return None
    if found:
        names = ", ".join(dict.fromkeys(found))
        return CheckpointError(
            f"refusing to load {file}: it is not a torch checkpoint but a bare pickle "
            "(written by pickle.dump, not torch.save) that holds pickled Python objects "
            f"({names}). Nothing from the file was run: loopbus never unpickles such a "
            "file. If you trust its source, read it yourself."
        )
    return CheckpointError(
        f"cannot load {file}: it is not a torch checkpoint but a bare pickle (written by "
        "pickle.dump, not torch.save). loopbus never unpickles such a file; if you trust "
        "its source, read it yourself."
    )


def _torn(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot read the checkpoint {file}: it is torn or truncated (an interrupted write or "
        f"copy) or otherwise corrupt: {what}. {_AGAIN}"
    )


def _sniff(file: Path) -> str:
    """``"zip"`` or ``"legacy"``: the torch.save container ``file`` starts with. Raises
    :class:`CheckpointError` for anything else, before torch reads a byte of it."""
    try:
        st = file.stat()
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"cannot load {file}: it is not a regular file.")
        with open(file, "rb") as handle:
            head = handle.read(_HEAD_SIZE)
            if not head:
                raise CheckpointError(
                    f"cannot load {file}: it is empty (0 bytes), so it is not a checkpoint; "
                    f"an interrupted copy or a write that never started leaves such a file. "
                    f"{_AGAIN}"
                )
            if head.startswith(_ZIP_HEAD):
                return "zip"
            if head.startswith(_OTHER_ZIP_HEADS):
                raise _zip_problem(file) or _foreign_zip(file, "it has no members")
            if head.startswith(_LEGACY_HEADS):
                return "legacy"
            if len(head) >= 4 and any(h.startswith(head) for h in _LEGACY_HEADS):
                raise _torn(
                    file,
                    f"it has only {len(head)} bytes, the start of a legacy torch.save file",
                )
            if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
                error = _bare_pickle(file, handle, st.st_size)
                if error is not None:
                    raise error
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {file}: {exc}") from exc
    raise _not_torch(file, _describe(head, st.st_size))


def _zip_problem(file: Path) -> CheckpointError | None:
    """What is wrong with the zip archive ``file`` as a torch.save file: damaged, another
    kind of archive, TorchScript, or a corrupt member. None if nothing is found."""
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError):
        return _torn(
            file,
            "it starts as a zip archive (the torch.save format) but its end, the zip "
            "central directory, is missing or damaged",
        )
    with archive:
        names = archive.namelist()
        if not names:
            return _foreign_zip(file, "it is empty")
        prefix = names[0].split("/", 1)[0]
        if "/" not in names[0]:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            return _foreign_zip(
                file, f"it holds {shown}, where a torch.save archive holds <name>/data.pkl"
            )
        if f"{prefix}/constants.pkl" in names:
            return CheckpointError(
                f"cannot load {file}: it is a TorchScript archive (torch.jit.save), not a "
                "torch.save checkpoint; load it with torch.jit.load()."
            )
        data = f"{prefix}/data.pkl"
        if data not in names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            return _foreign_zip(file, f"it holds {shown} but no {data}")
        try:
            pickled = archive.read(data)
        except Exception as exc:  # a bad CRC, a damaged header, a decompression error
            return _torn(file, f"its member {data} cannot be read ({exc})")
        if _scan_pickle(_Bounded(io.BytesIO(pickled), len(pickled))) is None:
            return _torn(file, f"its member {data} is not a complete pickle")
        try:
            bad = archive.testzip()
        except Exception as exc:
            return _torn(file, f"a member of its zip archive cannot be read ({exc})")
        if bad is not None:
            return _torn(file, f"its member {bad} fails its CRC-32 check")
    return None


def _legacy_problem(file: Path) -> CheckpointError | None:
    """The error for a legacy torch.save file whose pickles are incomplete, or None."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            stream = _Bounded(handle, size)
            for part in _LEGACY_PICKLES:
                if _scan_pickle(stream) is None:
                    return _torn(
                        file,
                        f"it is a legacy torch.save file whose {part} pickle is incomplete "
                        "or damaged",
                    )
    except OSError as exc:
        return CheckpointError(f"cannot read the checkpoint {file}: {exc}")
    return None


def _refusal(exc: BaseException) -> str:
    """Torch's reason for a weights-only refusal, without its advice."""
    text = " ".join(str(exc).split())
    key = "WeightsUnpickler error:"
    at = text.find(key)
    if at >= 0:
        text = text[at + len(key) :]
    for advice in (" Please use", " Check the documentation"):
        cut = text.find(advice)
        if cut > 0:
            text = text[:cut]
    return text.strip().rstrip(".") or type(exc).__name__


def _load_failed(file: Path, container: str, exc: Exception) -> NoReturn:
    """Raise why torch.load failed on a file that starts as a torch.save container: the
    file is inspected (parsed, never unpickled) to tell damage from refused objects."""
    problem = _zip_problem(file) if container == "zip" else _legacy_problem(file)
    if problem is not None:
        raise problem from exc
    if isinstance(exc, pickle.UnpicklingError):
        reason = _refusal(exc)
        if any(key in reason for key in _OBJECT_REFUSALS):
            raise CheckpointError(
                f"refusing to load {file}: it is a torch file but holds pickled Python "
                f"objects that weights_only loading refuses ({reason}). Nothing from the "
                "file was run. loopbus checkpoints hold only tensors and Python primitives; "
                "if this is another kind of file and you trust its source, read it yourself "
                "with torch.load(..., weights_only=False)."
            ) from None
        # Torch's own writer emits nothing else that a weights-only load refuses.
        raise _torn(file, f"torch cannot read its pickled data ({reason})") from exc
    if container == "legacy" and (isinstance(exc, EOFError) or "EOF" in str(exc)):
        raise _torn(
            file, f"it is a legacy torch.save file whose tensor data ends early ({_short(exc)})"
        ) from exc
    if isinstance(exc, (OSError, MemoryError)) or any(k in str(exc) for k in _NOT_THE_FILE):
        raise CheckpointError(
            f"cannot load the checkpoint {file}: torch.load failed ({type(exc).__name__}: "
            f"{_short(exc)})."
        ) from exc
    # A damaged zip directory or record that Python's zipfile module tolerates.
    raise _torn(file, f"torch cannot read it ({type(exc).__name__}: {_short(exc)})") from exc


def check_loaded(state: Any, file: os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` if what ``torch.load`` built from ``file`` nests
    deeper than a checkpoint may (or holds a container that contains itself): torch's
    unpickler builds any depth without recursion, but what reads the state next
    recurses, and a process that raised its recursion limit would overflow its stack."""
    try:
        check_state_nesting(state)
    except ValueError as exc:
        raise CheckpointError(
            f"refusing to load {file}: {exc}. loopbus never writes such a checkpoint (a state "
            f"that nests more than {MAX_STATE_DEPTH} levels is refused when it is saved): the "
            "file was modified or comes from elsewhere."
        ) from None
