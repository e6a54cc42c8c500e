"""The plugin examples in docs/plugins.md run as written."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import anyio

import loopbus
from tests.helpers import ROOT, TinyModule, make_loader

DOC = ROOT / "docs" / "plugins.md"


def example(marker: str) -> dict[str, Any]:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"one example with {marker!r} in {DOC.name}"
    namespace: dict[str, Any] = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    return namespace


async def test_the_notify_plugin_of_the_guide(tmp_path: Path) -> None:
    notify_cls = example("class Notify")["Notify"]
    logger_cls = example("class SQLiteLogger")["SQLiteLogger"]
    messages: list[str] = []

    async def send(text: str) -> None:
        await anyio.sleep(0.01)  # a slow service
        messages.append(text)

    notify = notify_cls(send, every=2)
    db = tmp_path / "records.db"
    trainer = loopbus.Trainer(max_epochs=5, plugins=[notify, logger_cls(str(db))], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=32), make_loader(n=32))
    assert [m.split(":")[0] for m in messages] == [
        "epoch 1 (step 4)",  # epochs numbered from 0
        "epoch 3 (step 8)",
        "training finished after 5 epochs",
    ]
    assert "train/loss=" in messages[0]
    assert "val/loss=" in messages[0]
    assert notify.state_dict() == {"sent": 3, "dropped": 0}
    con = sqlite3.connect(db)
    try:
        assert con.execute("select count(*), min(step), max(step) from records").fetchone() == (
            20,
            1,
            10,
        )
    finally:
        con.close()
