"""What ``put`` accepts reaches every built-in consumer; what would fail in a consumer
(a stream client's msgpack, the JSON lines and CSV files, TensorBoard, the progress bar)
is refused at the ``put`` call instead, with an error that says what is allowed."""

from __future__ import annotations

import csv
import enum
import importlib.util
import io
import math
import warnings
import weakref
from fractions import Fraction
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import loopbus
from loopbus import Module, PutRecord, Trainer
from loopbus.plugins import CSVLogger, JSONLLogger, ProgressBar, read_csv, read_jsonl
from loopbus.records import _records
from loopbus.stream import record_fields
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import serving

INT_MIN = -(2**63)
INT_MAX = 2**64 - 1


@pytest.fixture
def module() -> Module:
    m = TinyModule()
    trainer = Trainer(plugins=[])
    m.bind_recorder(trainer.recorder, "TinyModule")
    _RECORDERS[m] = trainer.recorder
    return m


# The recorder each test module's put goes to.
_RECORDERS: weakref.WeakKeyDictionary[Module, Any] = weakref.WeakKeyDictionary()


def pending(m: Module) -> list[Any]:
    return _RECORDERS[m].peek()  # type: ignore[no-any-return]


# ---------------------------------------------------------------- (a) refused at put
OUT_OF_RANGE = r"outside the 64-bit range \[-2\*\*63, 2\*\*64 - 1\].*float\(value\)"


@pytest.mark.parametrize(
    ("value", "match"),
    [
        pytest.param(
            2**64,
            r"put\('x', \.\.\.\) got the int 18446744073709551616, " + OUT_OF_RANGE,
            id="2**64",
        ),
        pytest.param(
            -(2**63) - 1, r"got the int -9223372036854775809, " + OUT_OF_RANGE, id="-2**63-1"
        ),
        pytest.param(
            10**30, r"got the int 1000000000000000000000000000000, " + OUT_OF_RANGE, id="10**30"
        ),
        pytest.param(
            np.array(2**70, dtype=object),
            r"got the int 1180591620717411303424, " + OUT_OF_RANGE,
            id="numpy-0d-object",
        ),
        pytest.param(
            Fraction(10**400),
            r"got Fraction\(1000+, 1\), which is too large for a float",
            id="huge-fraction",
        ),
    ],
)
def test_numbers_no_consumer_can_carry_are_refused(module: Module, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        module.put("x", value)
    assert pending(module) == []


class Big(enum.IntEnum):
    HUGE = 2**64


def test_int_subclasses_are_range_checked_too(module: Module) -> None:
    with pytest.raises(ValueError, match=r"got the int 18446744073709551616, " + OUT_OF_RANGE):
        module.put("x", Big.HUGE)
    assert pending(module) == []


class BadRepr:
    """An object whose ``__repr__`` raises (a half-built wrapper, a proxy)."""

    def __repr__(self) -> str:
        raise RuntimeError("repr exploded")


class BadReprText(str):
    def __repr__(self) -> str:
        raise RuntimeError("repr exploded")


class NotStrRepr:
    def __repr__(self) -> Any:
        return 42


def test_a_value_whose_repr_raises_gets_the_same_clear_error(module: Module) -> None:
    unsupported = r"got a value of type {}: <{} object.*put takes numbers"
    with pytest.raises(TypeError, match=unsupported.format("BadRepr", "BadRepr")):
        module.put("x", BadRepr())
    with pytest.raises(TypeError, match=unsupported.format("NotStrRepr", "NotStrRepr")):
        module.put("x", NotStrRepr())
    with pytest.raises(TypeError, match=r"got text <BadReprText object; its __repr__ raised"):
        module.put("x", BadReprText("text"))
    with pytest.raises(TypeError, match=r"name must be a non-empty str .*got <BadRepr object"):
        module.put(BadRepr(), 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"destinations must be .*got <BadRepr object"):
        module.put("x", 1.0, destinations=BadRepr())
    with pytest.raises(TypeError, match=r"put_dict\(\) needs a mapping .*got <BadRepr object"):
        module.put_dict(BadRepr())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got a value of type BadRepr"):
        module.put_dict({"a": 1.0, "b": BadRepr()})
    assert pending(module) == []


def test_a_long_repr_is_cut_short_in_the_error(module: Module) -> None:
    class Long:
        def __repr__(self) -> str:
            return "L" * 10_000

    with pytest.raises(TypeError, match=r"L{800}\.\.\. \(10000 characters\)\. put takes"):
        module.put("x", Long())


CONTROL = r"names are shown on one line.*not allowed.*Replace it.*Rule: a name is"


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        pytest.param(
            "bad\ud800name",
            ValueError,
            r"put\(\) name 'bad\\ud800name' is not valid Unicode text: it has the lone "
            r"surrogate '\\ud800' at index 3, which cannot be encoded as UTF-8.*errors='replace'",
            id="lone-surrogate",
        ),
        pytest.param(
            "\udcff", ValueError, r"lone surrogate '\\udcff' at index 0", id="surrogateescape"
        ),
        pytest.param(
            "a\x00b",
            ValueError,
            r"name 'a\\x00b' has the control character '\\x00' at index 1; " + CONTROL,
            id="NUL",
        ),
        pytest.param(
            "a\nb", ValueError, r"name 'a\\nb' has the control character '\\n'", id="newline"
        ),
        pytest.param("a\rb", ValueError, r"the control character '\\r' at index 1", id="CR"),
        pytest.param("a\tb", ValueError, r"the control character '\\t' at index 1", id="tab"),
        pytest.param(
            "red\x1b[31m", ValueError, r"the control character '\\x1b' at index 3", id="escape"
        ),
        pytest.param("a\x85b", ValueError, r"the control character '\\x85'", id="NEL"),
        pytest.param("a\u2028b", ValueError, r"the control character '\\u2028'", id="LS"),
        pytest.param(
            "n" * 257,
            ValueError,
            r"put\(\) name 'nnnn+'\.\.\. \(257 characters\) is 257 characters long; names may "
            r"have at most 256 characters",
            id="257-chars",
        ),
        pytest.param("n" * 200_000, ValueError, r"200000 characters long", id="200000-chars"),
        pytest.param(
            b"x",
            TypeError,
            r"name must be a non-empty str such as 'train/loss', got b'x'",
            id="bytes",
        ),
    ],
)
def test_names_no_consumer_can_carry_are_refused(
    module: Module, name: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        module.put(name, 1.0)
    with pytest.raises(error, match=match):  # refused every time: never remembered as valid
        module.put(name, torch.tensor(1.0))
    assert pending(module) == []
    assert name not in _records._VALID_NAMES


def _sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        return torch.tensor([[1.0]]).to_sparse_csr()


def _unreadable_tensors() -> list[Any]:
    """Factories of one-element tensors whose ``.item()`` is no real number (or fails)."""
    out = [
        pytest.param(
            lambda: torch.tensor(1 + 2j),
            TypeError,
            r"put\('x', \.\.\.\) got a complex tensor \(torch\.complex64\); put a real number",
            id="complex",
        ),
        pytest.param(
            lambda: torch.tensor(1.0, device="meta"),
            ValueError,
            r"put\('x', \.\.\.\) got a tensor on the meta device, which holds no value",
            id="meta",
        ),
        pytest.param(
            _sparse_csr,
            TypeError,
            r"layout torch\.sparse_csr, which cannot be read as a Python number; put "
            r"value\.to_dense\(\)",
            id="sparse-csr",
        ),
    ]
    for dtype_name in ("uint4", "int4", "bits8", "float4_e2m1fn_x2"):
        dtype = getattr(torch, dtype_name, None)
        if isinstance(dtype, torch.dtype):
            out.append(
                pytest.param(
                    lambda dtype=dtype: torch.zeros((), dtype=dtype),
                    TypeError,
                    rf"dtype torch\.{dtype_name}, which cannot be read as a Python number; put a "
                    r"bool, integer or floating-point tensor",
                    id=dtype_name,
                )
            )
    return out


@pytest.mark.parametrize(("make", "error", "match"), _unreadable_tensors())
def test_tensors_that_cannot_become_a_number_are_refused(
    module: Module, make: Any, error: type[Exception], match: str
) -> None:
    value = make()
    with pytest.raises(error, match=match):
        module.put("x", value)
    assert pending(module) == []


def test_put_dict_puts_all_or_nothing(module: Module) -> None:
    module.put("before", 1)
    with pytest.raises(ValueError, match=r"put\('b', \.\.\.\) got the int 18446744073709551616"):
        module.put_dict({"a": 1.0, "b": 2**64, "c": 3})
    with pytest.raises(ValueError, match=r"lone surrogate"):
        module.put_dict({"a": 1.0, "x\ud800": 2})
    assert [p[0] for p in pending(module)] == ["before"]


def test_accepted_values_are_plain_python_numbers(module: Module) -> None:
    class Color(enum.IntEnum):
        RED = 1

    module.put_dict(
        {
            "int_max": INT_MAX,
            "int_min": INT_MIN,
            "enum": Color.RED,
            "np_float64": np.float64(0.1),
            "np_uint64": np.uint64(INT_MAX),
            "np_int64": np.int64(INT_MIN),
            "np_bool": np.bool_(True),
            "np_0d": np.array(2.5),
            "fraction": Fraction(1, 4),
            "nan": math.nan,
            "n" * 256: 1,  # the longest name allowed
        }
    )
    got = {p[0]: (p[1], type(p[1])) for p in pending(module)}
    assert got["int_max"] == (INT_MAX, int)
    assert got["int_min"] == (INT_MIN, int)
    assert got["enum"] == (1, int)
    assert got["np_float64"] == (0.1, float)
    assert got["np_uint64"] == (INT_MAX, int)
    assert got["np_int64"] == (INT_MIN, int)
    assert got["np_bool"] == (True, bool)
    assert got["np_0d"] == (2.5, float)
    assert got["fraction"] == (0.25, float)
    assert math.isnan(got["nan"][0])
    assert got["n" * 256] == (1, int)


def test_the_cache_of_valid_names_stays_bounded(
    module: Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_records, "_VALID_NAMES", set())
    monkeypatch.setattr(_records, "_VALID_NAMES_LIMIT", 8)
    for i in range(100):
        module.put(f"per_step/{i}", 1.0)
    assert 0 < len(_records._VALID_NAMES) <= 8
    module.put("per_step/0", 2.0)  # forgotten, checked again, still fine
    assert len(pending(module)) == 101


# ---------------------------------------------------------------- property: put's rule
def _deliverable_name(name: str) -> bool:
    """Whether every consumer carries ``name`` unchanged (checked by trying them)."""
    record = PutRecord(name=name, value=1.0, step=1, time=1.0, source="s")
    try:
        wire = msgspec.msgpack.encode(record_fields(record))
        line = msgspec.json.encode(record)
    except (UnicodeEncodeError, OverflowError):
        return False
    if msgspec.msgpack.decode(wire)[1] != name or msgspec.json.decode(line)["name"] != name:
        return False
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["step", name])
    rows = list(csv.reader(io.StringIO(buf.getvalue(), newline="")))
    if rows != [["step", name]]:
        return False
    # One-line displays (progress bar, loopbus watch, the CSV header line) and filters.
    one_line = len(name.splitlines()) <= 1 and not any(
        ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in name
    )
    return one_line and len(name) <= 256


@settings(max_examples=300, deadline=None)
@given(
    name=st.text(
        alphabet=st.characters(codec=None, exclude_categories=()),
        min_size=1,
        max_size=300,
    )
    | st.sampled_from(["val/ß/损失", "a b", "x" * 256, "x" * 257, "\ud800", "a\nb", "a,b"])
)
def test_put_accepts_a_name_exactly_when_every_consumer_carries_it(name: str) -> None:
    m = TinyModule()
    trainer = Trainer(plugins=[])
    m.bind_recorder(trainer.recorder, "TinyModule")
    try:
        m.put(name, 1.0)
    except ValueError:
        accepted = False
    else:
        accepted = True
    assert accepted == _deliverable_name(name), name


@settings(max_examples=300, deadline=None)
@given(
    value=st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([INT_MIN, INT_MAX, INT_MIN - 1, INT_MAX + 1])
)
def test_put_accepts_an_int_exactly_when_msgpack_carries_it(value: int) -> None:
    m = TinyModule()
    trainer = Trainer(plugins=[])
    m.bind_recorder(trainer.recorder, "TinyModule")
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        carried = False
    else:
        carried = True
    if carried:
        m.put("x", value)
        m.put("x", np.array(value, dtype=object))
    else:
        with pytest.raises(ValueError, match=OUT_OF_RANGE):
            m.put("x", value)


# ---------------------------------------------------------------- (b) end to end
class Putter(TinyModule):
    """Puts ``items`` (name, value) at every training step."""

    def __init__(self, items: list[tuple[str, Any, Any]]) -> None:
        super().__init__()
        self.items = items

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        for name, value, _ in self.items:
            self.put(name, value)
        return loss


def _same(got: Any, expected: Any) -> bool:
    """Equal values of the same type; NaN equals NaN, and -0.0 keeps its sign."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, float):
        if math.isnan(expected):
            return math.isnan(got)
        return got == expected and math.copysign(1.0, got) == math.copysign(1.0, expected)
    return bool(got == expected)


def _float32(value: Any) -> float:
    """What TensorBoard stores for ``value`` (a float32)."""
    return torch.tensor(float(value), dtype=torch.float64).to(torch.float32).item()


class Color(enum.IntEnum):
    RED = 7


_UINT64 = getattr(torch, "uint64", None)

CASES: dict[str, list[tuple[str, Any, Any]]] = {
    "ints-at-the-edges": [
        ("int/max_int64", 2**63 - 1, 2**63 - 1),
        ("int/max_uint64", INT_MAX, INT_MAX),
        ("int/min_int64", INT_MIN, INT_MIN),
        ("int/zero", 0, 0),
        ("int/minus_one", -1, -1),
    ],
    "floats": [
        ("float/nan", math.nan, math.nan),
        ("float/inf", math.inf, math.inf),
        ("float/-inf", -math.inf, -math.inf),
        ("float/-0", -0.0, -0.0),
        ("float/tiny", 5e-324, 5e-324),
        ("float/max", 1.7976931348623157e308, 1.7976931348623157e308),
        ("float/tenth", 0.1, 0.1),
        ("float/integral", 3.0, 3.0),
    ],
    "bools": [("bool/true", True, True), ("bool/false", False, False)],
    "names": [
        ("val/ß/损失", 1.5, 1.5),
        ("name with spaces", 2, 2),
        ("  padded  ", 3, 3),
        ('comma, "quote"; semi', 4.0, 4.0),
        ("emoji 🙂 and RTL עברית", 5, 5),
        ("glob[*]?", 6, 6),
        ("n" * 256, 7, 7),
    ],
    "tensors": [
        ("t/int64_max", torch.tensor(2**63 - 1), 2**63 - 1),
        ("t/int64_min", torch.tensor(-(2**63)), -(2**63)),
        ("t/uint8", torch.tensor(255, dtype=torch.uint8), 255),
        ("t/bool", torch.tensor(True), True),
        ("t/float16_nan", torch.tensor(math.nan, dtype=torch.float16), math.nan),
        ("t/float16_inf", torch.tensor(math.inf, dtype=torch.float16), math.inf),
        ("t/bfloat16", torch.tensor(1.5, dtype=torch.bfloat16), 1.5),
        ("t/int_0d", torch.tensor(7), 7),
        ("t/one_element", torch.tensor([0.25]), 0.25),
        ("t/grad", torch.tensor(2.0, requires_grad=True) * 1, 2.0),
        ("t/float8", torch.tensor(1.5).to(torch.float8_e4m3fn), 1.5),
    ]
    + ([("t/uint64_max", torch.tensor(INT_MAX, dtype=_UINT64), INT_MAX)] if _UINT64 else []),
    "numpy-and-subclasses": [
        ("np/float64", np.float64(0.1), 0.1),
        ("np/float32", np.float32(0.5), 0.5),
        ("np/int64_min", np.int64(INT_MIN), INT_MIN),
        ("np/uint64_max", np.uint64(INT_MAX), INT_MAX),
        ("np/bool", np.bool_(False), False),
        ("py/int_enum", Color.RED, 7),
        ("py/fraction", Fraction(1, 8), 0.125),
    ],
}
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.mark.parametrize("case", list(CASES))
async def test_accepted_values_reach_every_consumer_unchanged(case: str, tmp_path: Path) -> None:
    items = CASES[case]
    plugins: list[Any] = [
        CSVLogger(tmp_path, name="", version=""),
        JSONLLogger(tmp_path, name="", version=""),
    ]
    progress = io.StringIO()
    plugins.append(ProgressBar(file=progress))
    if HAS_TENSORBOARD:
        from loopbus.plugins import TensorBoardLogger

        plugins.append(TensorBoardLogger(tmp_path / "tb", name="", version=""))
    steps = 2
    async with serving(
        Putter(items), train=make_loader(16 * steps), plugins=tuple(plugins), device="cpu"
    ) as run:
        async with loopbus.connect(run.address) as stream:
            run.gate.go.set()
            with anyio.fail_after(60):
                received = [item async for item in stream]
        assert stream.gaps == 0
    assert run.server.errors == 0
    assert run.server.dropped == 0
    streamed = [item for item in received if isinstance(item, PutRecord)]
    assert len(streamed) == len(received)  # records only: no gap notice

    names = [name for name, _, _ in items]
    expected = [(name, want) for _ in range(steps) for name, _, want in items]

    def check(got: list[tuple[str, Any]], where: str) -> None:
        assert [n for n, _ in got] == [n for n, _ in expected], where
        for (name, value), (_, want) in zip(got, expected, strict=True):
            assert _same(value, want), f"{where}: {name!r} came back as {value!r}, put {want!r}"

    # The stream client.
    check([(r.name, r.value) for r in streamed if r.name in names], "stream")
    # The JSON lines file.
    logged = read_jsonl(tmp_path / "records.jsonl")
    check([(r.name, r.value) for r in logged if r.name in names], "JSONLLogger")
    # The CSV file: one row per step, a column per name.
    rows = read_csv(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    check([(name, row[name]) for row in rows for name in names], "CSVLogger")
    # The progress bar: one plain line per epoch, naming every record.
    text = progress.getvalue()
    assert text.count("\n") == 1, text
    for name in names:
        assert name in text
    # TensorBoard: the tag is the name, the value its float32.
    if HAS_TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        for name, _, want in items:
            values = [e.value for e in acc.Scalars(name)]
            assert len(values) == steps
            for value in values:
                assert _same(value, _float32(want)), f"TensorBoard: {name!r}: {value!r}"
