"""Runs several scenarios of one test script in one process (one ``torchrun`` launch, or
plain ``python``), in turn: the launcher's and the workers' start (interpreters, torch's
import, the process group) is paid once for all of them.

    python -m torch.distributed.run --nproc_per_node=2 tests/scenario_worker.py PLAN

PLAN is a JSON file written by ``tests.torchrun.Scenarios``: the script's path, a
per-scenario timeout, and the scenarios, each an id and the script's arguments. The
script must have ``main(argv)``. For each scenario, every rank first waits for the
others (a barrier on the process group, once one exists: a scenario starts on every rank
together), then calls ``main(argv)`` under the timeout, then writes
``<id>.rank<N>.json`` beside the plan: ``{"ok": true}``, or the error and its traceback.

The process group the first scenario's trainer joins stays for the ones after it (a
trainer joins only when none exists), and so does whatever the script imported. A
scenario that fails or outlives its timeout ends the process at once (exit status 1;
a timeout also prints every thread's stack): the ranks of a failed scenario may be
stuck in a collective, and the scenarios after it are reported as not run.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path


def _load(script: Path) -> object:
    name = f"scenario_script_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def main() -> None:
    plan_path = Path(sys.argv[1])
    plan = json.loads(plan_path.read_text())
    rank = int(os.environ.get("RANK", "0"))
    script = _load(Path(plan["script"]))
    for scenario in plan["scenarios"]:
        sid, argv = scenario["id"], scenario["argv"]
        result = plan_path.parent / f"{sid}.rank{rank}.json"
        _barrier()
        print(f"[scenario {sid} rank {rank}] starts: {' '.join(argv)}", flush=True)
        started = time.monotonic()
        faulthandler.dump_traceback_later(plan["timeout_s"], exit=True)
        try:
            script.main(argv)  # type: ignore[attr-defined]
        except BaseException as error:  # reported, then the process ends
            faulthandler.cancel_dump_traceback_later()
            text = "".join(traceback.format_exception(error))
            result.write_text(json.dumps({"ok": False, "error": text}))
            print(f"[scenario {sid} rank {rank}] failed:\n{text}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        faulthandler.cancel_dump_traceback_later()
        seconds = round(time.monotonic() - started, 3)
        result.write_text(json.dumps({"ok": True, "seconds": seconds}))


if __name__ == "__main__":
    main()
