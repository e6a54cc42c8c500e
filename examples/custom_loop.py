"""A loop written from scratch: events, scopes and state come with the base class.

    python examples/custom_loop.py

``GradientDescent`` minimises a function with plain tensors. It keeps per-iteration
values in the iteration scope (dropped for it), the running best in the run scope, and
publishes its own custom event when it improves; a subscriber prints progress.
"""

from __future__ import annotations

from typing import Any

import anyio
import torch

from loopbus import Event, EventBus, Loop, Scope
from loopbus.events import AdvanceCompleted


class Improved(Event, frozen=True, kw_only=True):
    iteration: int
    value: float


class GradientDescent(Loop[torch.Tensor]):
    """Minimise ``fn`` from ``x0`` for ``steps`` iterations."""

    def __init__(self, steps: int = 100, lr: float = 0.1) -> None:
        super().__init__()
        self.steps = steps
        self.lr = lr

    @property
    def done(self) -> bool:
        return self.progress.current.completed >= self.steps

    async def on_run_start(self, ctx: Scope, fn: Any, x0: torch.Tensor) -> None:
        ctx.borrow("fn", fn)  # owned by the caller, not by this run
        ctx.x = x0.clone().requires_grad_(True)
        ctx.best = float("inf")

    async def advance(self, ctx: Scope) -> None:
        ctx.value = ctx.fn(ctx.x)  # iteration scope: dropped after this iteration
        (grad,) = torch.autograd.grad(ctx.value, ctx.x)
        with torch.no_grad():
            ctx.x -= self.lr * grad

    async def on_advance_end(self, ctx: Scope) -> None:
        value = ctx.value.item()
        if value < ctx.best:
            ctx.parent.best = value         # the run scope keeps the best so far
            assert self.bus is not None
            await self.bus.publish(Improved(iteration=self.progress.current.ready, value=value))

    async def on_run_end(self, ctx: Scope) -> torch.Tensor:
        return ctx.detach("x").detach()     # hand the result to the caller


async def main() -> torch.Tensor:
    bus = EventBus()
    loop = GradientDescent(steps=50, lr=0.1)
    loop.attach(bus=bus)
    bus.subscribe(Improved, lambda e: print(f"iteration {e.iteration:3d}: f = {e.value:.6f}"), every=10)
    bus.subscribe(AdvanceCompleted, lambda e: None, loop="gradient_descent")  # generic events too

    def rosenbrock_ish(x: torch.Tensor) -> torch.Tensor:
        return ((x - torch.tensor([1.0, -2.0])) ** 2).sum()

    result = await loop.run(rosenbrock_ish, torch.zeros(2))
    print("minimum at", [round(v, 4) for v in result.tolist()])
    print("state:", loop.state_dict()["progress"]["total"])
    return result


if __name__ == "__main__":
    anyio.run(main)
