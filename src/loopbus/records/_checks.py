"""What ``put`` accepts: names and values that every consumer (the loggers, the stream,
the progress bar) can carry, checked at the call site with errors that say what to put
instead. :func:`checked` is the whole check, as compiled code traces it; the eager
``put`` inlines its common cases and falls back to the same checks.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = [
    "INT_MAX",
    "INT_MIN",
    "STRIDED",
    "TENSOR_DTYPES",
    "check_int_range",
    "check_tensor",
    "checked",
    "coerce",
    "described",
    "int_out_of_range",
    "validate_name",
]

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling

#: The integers every consumer can carry: msgpack (the stream) encodes ints from -2**63
#: to 2**64 - 1 and nothing beyond; the loggers agree on that range.
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
#: The longest name allowed, in characters: the longest name a stream client can
#: subscribe to exactly (``Subscribe.names`` entries are at most 256 characters), and far
#: below what a CSV reader accepts in a header cell (131072).
_MAX_NAME_LENGTH = 256
STRIDED = torch.strided
#: Tensor dtypes whose ``.item()`` is a Python bool, int (within the 64-bit range) or
#: float. Not: complex, bit-packed and sub-byte dtypes (no ``.item()``).
TENSOR_DTYPES: frozenset[torch.dtype] = frozenset(
    dtype
    for dtype in (
        getattr(torch, dtype_name, None)
        for dtype_name in (
            "bool",
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "int8",
            "int16",
            "int32",
            "int64",
            "float16",
            "bfloat16",
            "float32",
            "float64",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "qint8",
            "quint8",
            "qint32",
        )
    )
    if isinstance(dtype, torch.dtype)
)
_NAME_RULES = (
    f"a name is a non-empty str of at most {_MAX_NAME_LENGTH} characters, valid Unicode "
    "(no lone surrogates), without control characters (U+0000-U+001F, U+007F-U+009F) or "
    "line separators (U+2028, U+2029)"
)


def described(value: object) -> str:
    """``repr(value)`` for an error message, cut short; never raises (a value whose
    ``__repr__`` raises, or returns something else than a str, is named by its type)."""
    try:
        text = repr(value)
    except Exception as error:  # the message is about the value, not its repr
        return f"<{type(value).__qualname__} object; its __repr__ raised {type(error).__name__}>"
    if type(text) is not str:
        return f"<{type(value).__qualname__} object>"
    if len(text) > 1000:
        return f"{text[:800]}... ({len(text)} characters)"
    return text


def _shown(name: str) -> str:
    """``repr(name)``, cut short for very long names."""
    if len(name) <= 80:
        return repr(name)
    return f"{name[:60]!r}... ({len(name)} characters)"


def validate_name(name: Any) -> None:
    """Raise unless ``name`` is a name every consumer can carry (remembers nothing: what
    compiled code calls, where a remembered name would be a guard that changes).

    Lone surrogates cannot be encoded as UTF-8 (the stream, the JSON lines and CSV files,
    TensorBoard all need it); control characters and line separators break the one-line
    displays (the progress bar, ``loopbus watch``) and the CSV header, and could smuggle
    terminal escape sequences.
    """
    if type(name) is not str or not name:
        raise TypeError(
            f"put() name must be a non-empty str such as 'train/loss', got {described(name)}."
        )
    if len(name) > _MAX_NAME_LENGTH:
        raise ValueError(
            f"put() name {_shown(name)} is {len(name)} characters long; names may have at "
            f"most {_MAX_NAME_LENGTH} characters (the longest a stream client can subscribe "
            "to). Use a shorter name."
        )
    if not (name.isascii() and name.isprintable()):
        for index, char in enumerate(name):
            code = ord(char)
            if 0xD800 <= code <= 0xDFFF:
                raise ValueError(
                    f"put() name {_shown(name)} is not valid Unicode text: it has the lone "
                    f"surrogate {char!r} at index {index}, which cannot be encoded as UTF-8 "
                    "(as the loggers and the stream must). This usually comes from bytes "
                    "decoded with errors='surrogateescape'; decode them with "
                    "errors='replace' or fix the name. Rule: " + _NAME_RULES + "."
                )
            if code < 0x20 or 0x7F <= code <= 0x9F or code == 0x2028 or code == 0x2029:
                raise ValueError(
                    f"put() name {_shown(name)} has the control character {char!r} at index "
                    f"{index}; names are shown on one line (progress bar, CSV header, "
                    "loopbus watch), so control characters and line breaks are not allowed. "
                    "Replace it, for example with ' ' or '_'. Rule: " + _NAME_RULES + "."
                )


def int_out_of_range(name: str, value: int) -> ValueError:
    """The error for an int ``value`` no consumer can carry."""
    return ValueError(
        f"put({_shown(name)}, ...) got the int {value!r}, outside the 64-bit range "
        "[-2**63, 2**64 - 1] that every consumer (the stream's msgpack, the loggers) can "
        "carry. Put a number in that range, or float(value) if an approximate value will do."
    )


def check_int_range(name: str, value: int) -> int:
    """``value`` if it is in the 64-bit range every consumer can carry; raise otherwise."""
    if not INT_MIN <= value <= INT_MAX:
        raise int_out_of_range(name, value)
    return value


def check_tensor(name: str, value: torch.Tensor) -> None:
    """Raise unless ``value`` is a one-element tensor that can be read as a Python number."""
    if value.ndim and value.numel() != 1:
        raise ValueError(
            f"put({_shown(name)}, ...) needs a single number, got a tensor of shape "
            f"{tuple(value.shape)}. Reduce it first (for example .mean()), or put each "
            "element under its own name."
        )
    dtype = value.dtype
    if dtype.is_complex:
        raise TypeError(
            f"put({_shown(name)}, ...) got a complex tensor ({dtype}); put a real number, "
            "for example its .abs() or .real."
        )
    if dtype not in TENSOR_DTYPES:
        raise TypeError(
            f"put({_shown(name)}, ...) got a tensor of dtype {dtype}, which cannot be read "
            "as a Python number; put a bool, integer or floating-point tensor (for example "
            "value.float())."
        )
    if value.is_meta:
        raise ValueError(
            f"put({_shown(name)}, ...) got a tensor on the meta device, which holds no "
            "value; put a tensor with data (on the CPU or an accelerator)."
        )
    layout = value.layout
    if layout is not torch.strided and layout is not torch.sparse_coo:
        raise TypeError(
            f"put({_shown(name)}, ...) got a tensor with layout {layout}, which cannot be "
            "read as a Python number; put value.to_dense()."
        )


def coerce(name: str, value: Any) -> float | int | bool:
    """``value`` as an exact ``bool``, ``int`` (in the 64-bit range) or ``float``, or
    raise saying why it cannot be put."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # numpy scalars and 0-d arrays
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):  # int subclasses (IntEnum, ...) as plain ints
        return check_int_range(name, int(value))
    if isinstance(value, float):  # float subclasses (numpy.float64, ...) as plain floats
        return float(value)
    if isinstance(value, numbers.Integral):
        return check_int_range(name, int(value))
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(
                f"put({_shown(name)}, ...) got {described(value)}, which is too large for a "
                "float (the loggers and the stream carry 64-bit floats). Put a smaller number."
            ) from None
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"put({_shown(name)}, ...) got text {described(value)}; put takes numbers (int, float, "
            "bool) or one-element tensors. To publish text, define and publish a custom event."
        )
    raise TypeError(
        f"put({_shown(name)}, ...) got a value of type {type(value).__name__}: "
        f"{described(value)}. put "
        "takes numbers (int, float, bool) or one-element tensors; for a torchmetrics Metric, "
        "put metric.compute()."
    )


def checked(name: Any, value: Any) -> Any:
    """``value`` as a put keeps it, after every check of ``name`` and ``value`` and
    nothing remembered: what compiled code calls, where a remembered name would be a
    guard that changes. A tensor is detached, and also copied while compiled code traces
    it: a graph output that is a view of another output or of an input (the loss that the
    step also returns, an element of a parameter) is rebuilt by torch's runtime after
    every call of the compiled step, in Python; a one-element copy is a store in a kernel
    the compiler generates anyway."""
    validate_name(name)
    if isinstance(value, _Tensor):
        check_tensor(name, value)
        value = value.detach()
        if _is_compiling():
            value = value.clone()
        return value
    if type(value) is int:
        return check_int_range(name, value)
    if type(value) is not float and type(value) is not bool:
        return coerce(name, value)
    return value
