"""Fault-tolerant data parallelism on torchft: replica groups that keep training when
one is lost, a lost group that rejoins from a live peer, and every sample trained exactly
once.

The pieces, from torchft (the ``ft`` extra): a *Lighthouse* (``loopbus lighthouse``)
forms a quorum of the replica groups alive at each step; each group runs a ``Manager``
that joins the quorums, averages the gradients over the groups of the quorum (its fault
tolerant all-reduce, after backward), decides whether the step commits
(``should_commit``: no group failed during it and enough took part) and heals a group
that is behind from a live peer (its state sent over HTTP). torchft's own DDP wrapper is
not used: when a peer dies in the middle of its all-reduce it crashes the survivor.

What loopbus adds (see ``docs/distributed.md``, "Fault tolerance"):

* **commit gating**: the step's gate (:class:`_CommitGate`, asked by the training step
  after backward) lets the optimizer, the schedulers, the run's step and the loops'
  counters advance only on a committed step; an aborted step's gradients and records are
  dropped (``StepAborted``) and it runs again, in the same iteration, on the batch the
  next quorum plans;
* **a committed sample cursor**: each step's samples are a pure plan from the cursor,
  the epoch's order, the batch size and the step's ``(replica rank, participants)``
  (:class:`~loopbus.data._sampler.CommittedCursorLoader`), made after the step's quorum;
  the cursor moves only on commit and travels in the healed state, so an aborted step's
  samples are read again and a step that committed with a lost group counted keeps them;
* **checkpoints**: the training loader (the committed cursor) is Stateful, so a
  checkpoint saved through the normal path (the ``Checkpoint`` plugin,
  ``trainer.save_checkpoint``) holds the cursor and the manager's step and committed
  batches (:class:`_Commits`) beside the module, optimizers, schedulers and run state; a
  whole run killed and relaunched with ``fit(..., ckpt_path="last")`` resumes from it
  (a group whose checkpoint is older heals from one whose checkpoint is newer);
* **guards**: ``min_replicas`` defaults to a majority of the replica groups (a warning
  when lowered), and a restarted group that finds neither a live peer with progress nor
  a loaded checkpoint refuses to start from step 0.

A replica group is one process, or several sharding the module with FSDP2 (HSDP:
``torchrun --nproc_per_node=N`` per group; the group's own strategy, an
:class:`~loopbus.distributed.FSDPStrategy`, does everything inside the group). Each
process of a group averages its gradient shard with the processes of the same group rank
in the other groups, heals its shard from the same rank of a live peer group, and reads
its own slice of the group's samples.

Imports ``loopbus.data``, ``loopbus.state`` and the base layer; torchft only when used.
"""

from __future__ import annotations

import atexit
import os
import socket
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import DataLoader

from loopbus.data._sampler import CommittedCursor, CommittedCursorLoader, StepPlan

from .._exceptions import MisconfigurationError
from ..events import ReplicaHealed, ReplicaLost
from ._ddp import shuffles
from ._fsdp import FSDPStrategy
from ._shards import local_part, optimizer_part, optimizer_whole
from ._strategy import SingleProcess, Strategy, launched_distributed

if TYPE_CHECKING:
    from loopbus.distributed._stopping import StopTransport
    from loopbus.state._runstate import RunState
    from loopbus.step._module import Module
    from loopbus.step._optim import LRSchedulers
    from loopbus.step._precision import Precision

__all__ = ["FaultTolerantStrategy", "serve_lighthouse"]

#: The environment a replica group reads when the strategy is not told: the Lighthouse's
#: address (torchft's name), this group's id and the number of groups (torchft's
#: launchers' names), and torchrun's restart count (a group restarted by torchrun).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
GROUP_ENV = "REPLICA_GROUP_ID"
GROUPS_ENV = "NUM_REPLICA_GROUPS"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def _torchft() -> Any:
    try:
        import torchft
    except ImportError as exc:
        raise MisconfigurationError(
            "strategy='ft' needs torchft, which is not installed. Install it with: "
            "pip install 'loopbus[ft]'"
        ) from exc
    return torchft


def serve_lighthouse(
    bind: str = "[::]:29510",
    *,
    min_replicas: int = 1,
    join_timeout_ms: int = 60_000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5_000,
) -> Any:
    """Start a torchft Lighthouse on ``bind`` (``host:port``; port 0 picks one) and
    return it (``.address()``, ``.shutdown()``). It forms a quorum once ``min_replicas``
    replica groups ask, waiting up to ``join_timeout_ms`` for the others; a group that
    has not sent a heartbeat for ``heartbeat_timeout_ms`` is left out."""
    from torchft.coordination import LighthouseServer

    _torchft()
    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def _group_strategy(choice: Any) -> Strategy:
    """The strategy inside a replica group: one process, or FSDP2 over the group's
    processes (the default when a launcher starts several)."""
    if choice is None:
        choice = "fsdp" if launched_distributed() else "single"
    if choice == "single":
        return SingleProcess()
    if choice == "fsdp":
        return FSDPStrategy()
    if isinstance(choice, FSDPStrategy):
        return choice
    raise MisconfigurationError(
        "FaultTolerantStrategy(group_strategy=...) takes 'fsdp' or an FSDPStrategy(...) "
        "(a replica group of several processes sharding the module: HSDP), or 'single' "
        f"(a group of one process), got {choice!r}. In-group DDP is not supported."
    )


def _env_or(value: Any, name: str) -> str | None:
    if value is not None:
        return str(value)
    return os.environ.get(name) or None


class FaultTolerantStrategy(Strategy):
    """``strategy="ft"``: this process is one replica group of a fault-tolerant data
    parallel run coordinated by a torchft Lighthouse (see the module docstring).

    * ``lighthouse``: the Lighthouse's address (default: ``$TORCHFT_LIGHTHOUSE``);
    * ``replica_group``: this group's id (default: ``$REPLICA_GROUP_ID``, else 0), unique
      among the groups; ``replica_groups``: how many groups the run has (default:
      ``$NUM_REPLICA_GROUPS``, else 1);
    * ``min_replicas``: the fewest groups a step commits with; default a majority of
      ``replica_groups``, so the global batch does not silently halve and two halves of
      a split run cannot both train (a warning says so when set lower);
    * ``timeout_s``: the all-reduce, commit and healing timeout; ``quorum_timeout_s``:
      how long a quorum may take to form;
    * ``seed``: the seed of the shuffled sample order (the same in every group);
    * ``rejoining``: whether this process replaces a lost group (default: torchrun's
      ``$TORCHELASTIC_RESTART_COUNT`` > 0). A rejoining group given no ``ckpt_path``
      resumes from its newest checkpoint (as ``ckpt_path="last"``); one that finds
      neither a peer with progress nor a checkpoint raises instead of training from
      step 0;
    * ``group_strategy``: what runs inside a group: ``"single"`` (one process, the
      default without a launcher), or ``"fsdp"``/an :class:`FSDPStrategy` (the default
      when torchrun starts several processes per group: the module sharded over them,
      HSDP). The group's world, ranks, collectives and checkpoints are its strategy's.

    Only the group of replica rank 0 in the step's quorum saves a checkpoint that falls
    due (:meth:`writes_checkpoints`; the groups hold the same state at a committed step);
    give each group's ``Checkpoint`` plugin a folder of its own, since the writer changes
    when that group is lost. A checkpoint holds the committed cursor and the manager's
    count of commits; ``fit(..., ckpt_path="last")`` resumes from it.
    """

    name = "ft"

    def __init__(
        self,
        *,
        lighthouse: str | None = None,
        replica_group: str | int | None = None,
        replica_groups: int | None = None,
        min_replicas: int | None = None,
        timeout_s: float = 60.0,
        quorum_timeout_s: float = 120.0,
        seed: int = 0,
        rejoining: bool | None = None,
        group_strategy: Literal["single", "fsdp"] | FSDPStrategy | None = None,
    ) -> None:
        self.group = _group_strategy(group_strategy)
        self.lighthouse = _env_or(lighthouse, LIGHTHOUSE_ENV)
        self.replica_group = _env_or(replica_group, GROUP_ENV) or "0"
        groups = int(_env_or(replica_groups, GROUPS_ENV) or 1)
        if groups < 1:
            raise MisconfigurationError(f"replica_groups must be >= 1, got {groups!r}.")
        self.replica_groups = groups
        majority = groups // 2 + 1
        if min_replicas is None:
            min_replicas = majority
        elif not 1 <= min_replicas <= groups:
            raise MisconfigurationError(
                f"min_replicas must be between 1 and replica_groups={groups}, got {min_replicas!r}."
            )
        elif min_replicas < majority:
            warnings.warn(
                f"FaultTolerantStrategy(min_replicas={min_replicas}) is below a majority of "
                f"the {groups} replica groups ({majority}): steps commit with as few as "
                f"{min_replicas} group(s), so the global batch shrinks to "
                f"{min_replicas}/{groups} of its size while groups are lost, and two halves "
                "of a split run could both train. Leave min_replicas unset for a majority.",
                UserWarning,
                stacklevel=2,
            )
        self.min_replicas = int(min_replicas)
        self.timeout_s = float(timeout_s)
        self.quorum_timeout_s = float(quorum_timeout_s)
        self.seed = int(seed)
        if rejoining is None:
            rejoining = int(os.environ.get(RESTART_ENV, "0") or 0) > 0
        self.rejoining = bool(rejoining)
        self._manager: Any = None
        self._store: Any = None  # the group's TCPStore, kept alive with the manager
        self._loader: CommittedCursorLoader | None = None
        self._gate: _CommitGate | None = None
        self._commits = _Commits(lambda: self._manager)

    # ------------------------------------------------------------ set-up
    def setup_environment(self, device: torch.device) -> None:
        _torchft()
        if not self.lighthouse:
            raise MisconfigurationError(
                "strategy='ft' needs the address of a torchft Lighthouse: start one with "
                "`loopbus lighthouse` and pass FaultTolerantStrategy(lighthouse='http://"
                f"host:port') or set ${LIGHTHOUSE_ENV}."
            )
        if launched_distributed() and isinstance(self.group, SingleProcess):
            raise MisconfigurationError(
                "FaultTolerantStrategy(group_strategy='single') runs replica groups of one "
                f"process, but WORLD_SIZE={os.environ['WORLD_SIZE']}: launch each group as "
                "one process, or let the group's processes shard the module "
                "(group_strategy='fsdp')."
            )
        self.group.setup_environment(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)

    # ------------------------------------------------------------ the group's own
    @property
    def sharded_state(self) -> bool:  # type: ignore[override]
        return self.group.sharded_state

    @property
    def saves_window_gradients(self) -> bool:  # type: ignore[override]
        return self.group.saves_window_gradients

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """The processes of this replica group (each group is a world of its own)."""
        return self.group.world_size

    @property
    def global_rank(self) -> int:  # type: ignore[override]
        return self.group.global_rank

    @property
    def local_rank(self) -> int:  # type: ignore[override]
        return self.group.local_rank

    @property
    def distributed(self) -> bool:
        return self.group.distributed

    @property
    def data_parallel_size(self) -> int:
        return self.group.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.group.data_parallel_rank

    def prepare_module(self, module: Module, device: torch.device, precision: Precision) -> None:
        self.group.prepare_module(module, device, precision)

    def prepare_optimizers(
        self, optimizers: list[torch.optim.Optimizer], module: Module
    ) -> list[torch.optim.Optimizer]:
        return self.group.prepare_optimizers(optimizers, module)

    def wrap(self, module: Module, state: RunState) -> Any:
        return self.group.wrap(module, state)

    def unwrap(self) -> None:
        self.group.unwrap()

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.group.no_sync()

    def clip_gradients(
        self, parameters: list[torch.Tensor], value: float, algorithm: Literal["norm", "value"]
    ) -> None:
        self.group.clip_gradients(parameters, value, algorithm)

    def stop_transport(self) -> StopTransport | None:
        return self.group.stop_transport()

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.group.all_gather_object(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return self.group.broadcast_object(obj)

    def barrier(self) -> None:
        self.group.barrier()

    def all_reduce_host(
        self, values: Sequence[float], op: Literal["sum", "max", "min"] = "sum"
    ) -> list[float]:
        return self.group.all_reduce_host(values, op)

    def prepare_train_data(self, data: Any) -> Any:
        """The training loader as a :class:`CommittedCursorLoader` over its dataset,
        batch size and collate function: its batches are planned after each step's
        quorum from the committed cursor."""
        if not isinstance(data, DataLoader) or data.batch_size is None:
            raise MisconfigurationError(
                "strategy='ft' plans each step's samples itself, so the training data must "
                "be a torch DataLoader with a batch_size (and a sampler or shuffle), got "
                f"{type(data).__name__}."
            )
        if data.num_workers:
            raise MisconfigurationError(
                f"strategy='ft' reads the training samples in this process (the loader has "
                f"num_workers={data.num_workers}): each step's samples are known only after "
                "its quorum, so workers cannot fetch ahead. Use num_workers=0."
            )
        sampler = CommittedCursor(
            len(data.dataset),  # type: ignore[arg-type]
            shuffle=shuffles(data.sampler),
            seed=self.seed,
        )
        group = (self.group.global_rank, self.group.world_size)
        self._loader = CommittedCursorLoader(
            data, sampler, self._begin_step, commits=self._commits, group=group
        )
        return self._loader

    def writes_checkpoints(self) -> bool:
        """Whether this group saves the checkpoint due now: only the group of replica
        rank 0 in the last quorum does (the groups hold the same state at a committed
        step); True outside fit."""
        return self._gate is None or self._gate.replica_rank == 0

    def resume_path(self) -> str | None:
        """``"last"`` when this group rejoins the run: the newest checkpoint of its
        ``Checkpoint`` plugin, unless ``fit`` is given a ``ckpt_path``."""
        return "last" if self.rejoining else None

    def step_gate(
        self,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        schedulers: Any,
        state: RunState,
    ) -> _CommitGate:
        if self._loader is None:
            raise MisconfigurationError(
                "strategy='ft' needs its training data prepared before the step is built "
                "(the trainer does this in fit)."
            )
        if self._manager is None:
            self._manager = self._start_manager()
        self._gate = _CommitGate(self, module, optimizers, schedulers, state)
        return self._gate

    def _start_manager(self) -> Any:
        torchft = _torchft()
        # The group's own store for its manager (a fresh one per start, so a restarted
        # group never reads the address its lost manager left), served by its rank 0.
        group, store = self.group, None
        if group.global_rank == 0:
            store = torch.distributed.TCPStore(
                socket.gethostname(), 0, is_master=True, wait_for_workers=False
            )
        host, port = group.broadcast_object(
            (socket.gethostname(), store.port) if store is not None else None
        )
        timeout = timedelta(seconds=self.timeout_s)
        manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_heal_state,
            state_dict=self._heal_state,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # heal before the forward: the plan needs the cursor
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.quorum_timeout_s),
            connect_timeout=timeout,
            rank=group.global_rank,
            world_size=group.world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"replica_group_{self.replica_group}",
        )
        self._store = store
        atexit.register(self.close)
        return manager

    @property
    def manager(self) -> Any:
        """This group's torchft ``Manager`` (None until fit starts)."""
        return self._manager

    def close(self) -> None:
        """Leave the run: stop this group's manager (its server and heartbeats)."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown(wait=False)

    # ------------------------------------------------------------ per step
    def _begin_step(self) -> tuple[int, int]:
        gate = self._gate
        if gate is None:
            raise RuntimeError("a fault-tolerant batch was asked for outside fit")
        return gate.begin_step()

    def average(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` in place over the replica groups of the step's quorum (the
        manager's fault-tolerant all-reduce). A failure is not raised: the manager
        records it and the step does not commit."""
        self._manager.allreduce(tensor).wait()

    @property
    def last_plan(self) -> StepPlan | None:
        """The sample plan of the last committed step (None before the first)."""
        return None if self._gate is None else self._gate.last_plan

    # ------------------------------------------------------------ healing
    def _fitting(self) -> tuple[_CommitGate, CommittedCursorLoader]:
        gate, loader = self._gate, self._loader
        if gate is None or loader is None:
            raise RuntimeError("a replica group's state was asked for outside fit")
        return gate, loader

    def _heal_state(self) -> dict[str, Any]:
        """What a group behind loads from this one (torchft sends it over HTTP)."""
        gate, loader = self._fitting()
        return {
            "group": self.replica_group,
            **gate.state_dict(),
            "cursor": loader.sampler.state_dict(),
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        gate, loader = self._fitting()
        gate.load_state_dict(state)
        loader.sampler.load_state_dict(state["cursor"])
        gate.healed(str(state["group"]))


class _CommitGate:
    """The fault-tolerant step's gate (``loopbus.step._step.StepGate``) over one fit's
    module, optimizers, schedulers and run state: quorums, the cross-group average, the
    commit, healing, and the events of each. The strategy's fit-long parts (its training
    loader and the count of commits) are read from it: one module, one owner."""

    def __init__(
        self,
        strategy: FaultTolerantStrategy,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        schedulers: LRSchedulers,
        state: RunState,
    ) -> None:
        loader = strategy._loader
        assert loader is not None  # (step_gate checked it)
        self.strategy = strategy
        self.commits = strategy._commits
        self.manager = strategy.manager
        self.module = module
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.state = state
        self.loader = loader
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.participants = 0
        self.replica_rank = 0  #: this group's in the last quorum
        self.last_plan: StepPlan | None = None
        self._events: list[tuple[Any, dict[str, Any]]] = []
        self._quorums = 0
        self._started = False  # a quorum that can commit was checked (_check_start)

    def begin_step(self) -> tuple[int, int]:
        """A new quorum for the next step (a group behind heals here); this group's
        replica rank and the number of groups taking part."""
        manager, state = self.manager, self.state
        if self._quorums == 0:
            self.commits.resume(manager, state.step)
        manager.start_quorum()
        rank, participants = manager.participating_rank(), manager.num_participants()
        if not self._started and participants >= self.strategy.min_replicas:
            # The first quorum whose step can commit: it must not start the run afresh
            # (one with fewer groups cannot commit, so it may wait there for a peer).
            self._check_start()
            self._started = True
        self._quorums += 1
        if rank is None:
            raise RuntimeError(
                f"replica group {self.strategy.replica_group} is not a participant of the "
                "quorum; spare replica groups are not supported"
            )
        if 0 < participants < self.participants:
            self._events.append(
                (
                    ReplicaLost,
                    {"lost": self.participants - participants, "participants": participants},
                )
            )
        self.participants, self.replica_rank = participants, rank
        return rank, participants

    def _check_start(self) -> None:
        """A rejoining group refuses to start from step 0 (see the strategy)."""
        strategy = self.strategy
        if strategy.rejoining and self.manager.current_step() == 0 and self.state.step == 0:
            raise MisconfigurationError(
                f"replica group {strategy.replica_group} rejoins the run (rejoining=True, or "
                f"${RESTART_ENV} > 0) but found no live replica group with progress to heal "
                "from and loaded no checkpoint (it looks for the newest one of its "
                "Checkpoint plugin's folder, as fit(..., ckpt_path='last'), when not given "
                "a ckpt_path): it would train from step 0 as if the run were new. Give it "
                "the folder the group saved into (Checkpoint(dirpath=...)) or a "
                "ckpt_path=<file>, or pass rejoining=False to start afresh on purpose."
            )

    def commit(self) -> bool:
        """Average the gradients over the quorum's groups, then whether the step commits
        (every group of this replica group agrees; a failure during the step says no)."""
        with torch.no_grad():
            grads = []  # this process's part of each gradient (a shard under FSDP)
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local_part(p.grad))
            flat = torch.cat([g.reshape(-1) for g in grads])
        self.strategy.average(flat)
        committed = bool(self.manager.should_commit())
        if committed:
            with torch.no_grad():
                offset = 0
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[offset : offset + n].view_as(g))
                    offset += n
        plan = self.loader.settle(committed)
        if committed:
            self.last_plan = plan
        return committed

    def news(self) -> list[tuple[Any, dict[str, Any]]]:
        events, self._events = self._events, []
        return events

    def retry(self) -> Any:
        batch = self.loader.next_batch()
        if batch is None:
            raise RuntimeError(
                "the epoch ended while a fault-tolerant step was being retried: the healed "
                "sample cursor is past the step's samples"
            )
        return batch

    def healed(self, source: str) -> None:
        self._events.append((ReplicaHealed, {"healed_step": self.state.step, "sources": (source,)}))

    # ------------------------------------------------------------ healed state
    def state_dict(self) -> dict[str, Any]:
        """What a peer behind loads: this process's part of the module and optimizer
        state (its shards under FSDP: a peer's same group rank holds the same ones), the
        schedulers and the run state."""
        with torch.no_grad():
            module = {k: local_part(v) for k, v in self.module.state_dict().items()}
        return {
            "module": module,
            "optimizers": [optimizer_part(o) for o in self.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in self.schedulers.configs],
            "run": self.state.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run = state["run"]
        if run["epoch"] < self.state.epoch:
            raise RuntimeError(
                f"replica group {self.strategy.replica_group} would heal from a peer in "
                f"epoch {run['epoch']}, behind its own epoch {self.state.epoch}: a group "
                "heals only from one that is ahead"
            )
        mine, saved = self.module.state_dict(), state["module"]
        if set(mine) != set(saved):
            raise RuntimeError(
                f"replica group {self.strategy.replica_group} would heal from a peer whose "
                f"module has other entries: {sorted(set(mine) ^ set(saved))[:5]}"
            )
        with torch.no_grad():
            for name, value in mine.items():
                local_part(value).copy_(saved[name])
        for optimizer, part in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_whole(optimizer, part))
        for config, saved in zip(self.schedulers.configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        self.state.load_state_dict(run)
        self.schedulers.resumed_at(self.state.step)


class _Commits:
    """The commit state a checkpoint holds (in the training loader's state, see
    :class:`~loopbus.data._sampler.CommittedCursorLoader`): the manager's step and its
    count of committed batches. A checkpoint loads before the manager's first quorum;
    :meth:`resume` applies it there, since the quorum compares the groups' steps."""

    def __init__(self, manager: Callable[[], Any]) -> None:
        self._manager = manager  # the strategy's manager now (None before it starts)
        self.pending: dict[str, int] | None = None

    def state_dict(self) -> dict[str, int]:
        manager = self._manager()
        if manager is None:
            return dict(self.pending or {"step": 0, "batches_committed": 0})
        return {
            "step": int(manager.current_step()),
            "batches_committed": int(manager.batches_committed()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = {
            "step": int(state["step"]),
            "batches_committed": int(state["batches_committed"]),
        }

    def resume(self, manager: Any, step: int) -> None:
        """Before the first quorum: put ``manager`` at the run's ``step`` (as loaded from
        a checkpoint) with the loaded count of committed batches."""
        pending, self.pending = self.pending, None
        if step > manager.current_step():
            batches = (
                manager.batches_committed() if pending is None else pending["batches_committed"]
            )
            manager.load_state_dict({"step": step, "batches_committed": batches})
