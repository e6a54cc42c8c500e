"""Weight averaging: an exponential moving average (EMA) or the equal average of
snapshots (SWA) of the module's weights, kept during ``fit`` on
``torch.optim.swa_utils.AveragedModel``, used for validation and saved as the
checkpoints' module weights, and the module's weights once ``fit`` is over.

Written against the public API only, like a user's plugin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

from loopbus import MisconfigurationError, Plugin, check_choice, check_int, check_number, on
from loopbus.events import FitCompleted, TrainBatchCompleted, ValidationCompleted, ValidationStarted

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["WeightAveraging"]

_KINDS: dict[Literal["ema", "swa"], str] = {
    "ema": "an exponential moving average, weighted by decay",
    "swa": "the equal average of every snapshot taken",
}
_DECAY = "the EMA keeps decay of the average and takes 1 - decay of the new weights"


def _weights_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s parameters and buffers under the same names, in the same
    order, shared where the module shares them, without its code or other attributes
    (the trainer it is bound to, its metrics, its data): what the averaged weights are
    kept in. The copy's parameters need no gradients."""
    persistent = set(module.state_dict())
    copies: dict[int, torch.nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}

    def copy(source: torch.nn.Module, prefix: str) -> torch.nn.Module:
        if id(source) in copies:
            return copies[id(source)]
        target = copies[id(source)] = torch.nn.Module()
        for name, param in source.named_parameters(recurse=False):
            if id(param) not in tensors:
                tensors[id(param)] = torch.nn.Parameter(param.detach().clone(), False)
            target.register_parameter(name, tensors[id(param)])  # type: ignore[arg-type]
        for name, buffer in source.named_buffers(recurse=False):
            if id(buffer) not in tensors:
                tensors[id(buffer)] = buffer.detach().clone()
            target.register_buffer(
                name, tensors[id(buffer)], persistent=prefix + name in persistent
            )
        for name, child in source.named_children():
            target.add_module(name, copy(child, f"{prefix}{name}."))
        return target

    return copy(module, "")


def _check_copy(module: torch.nn.Module, copy: torch.nn.Module) -> None:
    """The copy must hold what the module's state dict holds, in the same order (the
    averaging pairs the two by position)."""
    lazy = [n for n, p in module.named_parameters() if torch.nn.parameter.is_lazy(p)]
    if lazy:
        raise MisconfigurationError(
            f"WeightAveraging cannot average uninitialized (lazy) parameters: {lazy[:5]}. "
            "Run a forward pass (or give the layers their sizes) before fit."
        )
    extra = sorted(set(module.state_dict()) ^ set(copy.state_dict()))
    names = [n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()]
    same = names == ([n for n, _ in copy.named_parameters()], [n for n, _ in copy.named_buffers()])
    if extra or not same:
        raise MisconfigurationError(
            f"WeightAveraging cannot copy the weights of {type(module).__name__}: its state "
            f"dict holds entries that are not parameters or buffers ({extra[:5]}, such as "
            "get_extra_state), which it does not average yet."
        )


class WeightAveraging(Plugin):
    """Keeps an average of the module's weights during ``fit``: an exponential moving
    average (``kind="ema"``, ``WeightAveraging.ema(decay)``) or the equal average of
    the snapshots (``kind="swa"``, ``WeightAveraging.swa()``).

    The average is updated after the optimizer step of every ``every_n_steps``-th step
    (``trainer.global_step % every_n_steps == 0``), once more than ``start_step`` steps
    are done and from epoch ``start_epoch`` on. The first update copies the weights; an
    EMA then moves by ``avg = decay * avg + (1 - decay) * w``, SWA keeps the running
    mean of the snapshots. With ``use_buffers`` (default) buffers such as BatchNorm's
    running statistics are averaged too; otherwise they are the module's at the last
    update, and ``update_bn=loader`` recomputes the BatchNorm statistics of the average
    with one pass over ``loader`` when ``fit`` ends (``torch.optim.swa_utils.update_bn``:
    batches are tensors or tuples whose first item is the module's input).

    Once averaging has begun: each validation during ``fit`` runs with the averaged
    weights (training goes on with the module's own); every checkpoint holds the
    averaged weights as the module's (what ``test(ckpt_path="best")`` and
    ``Module.load_from_checkpoint`` load) and the module's own weights in this plugin's
    state, so a resumed ``fit`` continues exactly; and when ``fit`` ends the module is
    given the averaged weights (after the final checkpoint), so ``test`` and ``predict``
    use them.

    Under DDP every rank keeps the same average (the ranks' parameters are equal after
    each step). Under FSDP it refuses to start.
    """

    def __init__(
        self,
        kind: Literal["ema", "swa"] = "ema",
        *,
        decay: float | None = None,
        every_n_steps: int = 1,
        start_step: int = 0,
        start_epoch: int = 0,
        use_buffers: bool = True,
        update_bn: Iterable[Any] | None = None,
    ) -> None:
        owner = "WeightAveraging"
        self.kind: Literal["ema", "swa"] = check_choice("kind", kind, _KINDS, owner=owner)
        if kind == "swa" and decay is not None:
            raise MisconfigurationError(
                f"WeightAveraging(kind='swa', decay={decay!r}): SWA weighs every snapshot "
                "equally and has no decay; leave decay out, or use kind='ema'."
            )
        #: The EMA's decay (None for SWA).
        self.decay = None if kind == "swa" else check_number(
            "decay", 0.999 if decay is None else decay, minimum=0, maximum=1, owner=owner,
            hint=_DECAY,
        )
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1, owner=owner)
        self.start_step = check_int("start_step", start_step, minimum=0, owner=owner)
        self.start_epoch = check_int("start_epoch", start_epoch, minimum=0, owner=owner)
        if not isinstance(use_buffers, bool):
            raise MisconfigurationError(
                f"WeightAveraging(use_buffers=...) must be True or False, got {use_buffers!r}."
            )
        self.use_buffers = use_buffers
        if update_bn is not None and (isinstance(update_bn, (bool, str)) or not hasattr(
            update_bn, "__iter__"
        )):
            raise MisconfigurationError(
                f"WeightAveraging(update_bn=...) is the loader to recompute the BatchNorm "
                f"statistics with when fit ends (usually the training loader: "
                f"update_bn=train_loader), or None; got {update_bn!r}."
            )
        self.update_bn = update_bn
        self._trainer: TrainerView | None = None
        self._module: torch.nn.Module | None = None
        self._averaged: AveragedModel | None = None
        self._last_step = -1
        # The module's own weights while it holds the averaged ones (a validation).
        self._backup: dict[str, Any] | None = None
        # Whether checkpoints save the averaged weights as the module's.
        self._saves_average = False

    @classmethod
    def ema(cls, decay: float = 0.999, **options: Any) -> WeightAveraging:
        """An exponential moving average of the weights (Lightning's EMAWeightAveraging)."""
        return cls("ema", decay=decay, **options)

    @classmethod
    def swa(cls, **options: Any) -> WeightAveraging:
        """The equal average of the weights' snapshots (stochastic weight averaging)."""
        return cls("swa", **options)

    def __repr__(self) -> str:
        decay = "" if self.decay is None else f", decay={self.decay}"
        return f"WeightAveraging({self.kind!r}{decay}, every_n_steps={self.every_n_steps})"

    # ------------------------------------------------------------ what it holds
    @property
    def averaged_model(self) -> AveragedModel | None:
        """The ``AveragedModel`` of the last ``fit`` (its ``module`` holds the averaged
        weights under the module's names), or None before one."""
        return self._averaged

    @property
    def n_averaged(self) -> int:
        """How many snapshots the average holds (0 before the first update)."""
        return 0 if self._averaged is None else int(self._averaged.n_averaged)

    @property
    def last_step(self) -> int:
        """The ``global_step`` of the last update (-1 before the first)."""
        return self._last_step

    # ------------------------------------------------------------ lifecycle
    def setup(self, trainer: TrainerView, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if strategy.sharded_state:
            raise MisconfigurationError(
                f"WeightAveraging does not work under strategy={strategy.name!r} yet: it keeps "
                "a whole copy of the module's weights on every rank and saves it as the "
                "module's, but there each rank holds only its shards of the parameters. Use "
                "strategy='ddp' when the module fits on one device, or average the shards "
                "yourself in a plugin of your own."
            )
        if self.update_bn is not None and trainer.world_size > 1:
            raise MisconfigurationError(
                f"WeightAveraging(update_bn=...) under {trainer.world_size} ranks would give "
                "each rank BatchNorm statistics of its own data, and the ranks' averages would "
                "differ. Use use_buffers=True (the default), which averages the statistics."
            )
        module = trainer.module
        assert module is not None
        copy = _weights_copy(module)
        _check_copy(module, copy)
        multi_avg_fn = (
            None if self.decay is None else get_ema_multi_avg_fn(self.decay)  # type: ignore[no-untyped-call]
        )
        self._averaged = AveragedModel(
            copy, multi_avg_fn=multi_avg_fn, use_buffers=self.use_buffers
        )
        self._trainer, self._module = trainer, module
        self._last_step, self._backup, self._saves_average = -1, None, False

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        if stage != "fit":
            return
        if self._backup is not None and self._module is not None:  # a validation that failed
            self._module.load_state_dict(self._backup)
            self._backup = None
        if self._saves_average:
            trainer.checkpoint_weights_from(None)
            self._saves_average = False
        self._trainer = self._module = None

    # ------------------------------------------------------------ averaging
    def _due(self, trainer: TrainerView) -> bool:
        step = trainer.global_step
        return (
            step != self._last_step
            and step > self.start_step
            and step % self.every_n_steps == 0
            and trainer.current_epoch >= self.start_epoch
        )

    def update(self) -> None:
        """Add the module's current weights to the average now (the plugin calls it after
        the optimizer step of each step that is due)."""
        trainer, module, averaged = self._trainer, self._module, self._averaged
        if trainer is None or module is None or averaged is None:
            raise RuntimeError("WeightAveraging.update() works while fit runs.")
        averaged.update_parameters(module)
        self._last_step = trainer.global_step
        if not self._saves_average:
            trainer.checkpoint_weights_from(averaged.module)
            self._saves_average = True

    @on(TrainBatchCompleted)
    def _after_step(self, event: TrainBatchCompleted) -> None:
        if self._trainer is not None and self._due(self._trainer):
            self.update()

    @on(ValidationStarted)
    def _validation_started(self, event: ValidationStarted) -> None:
        trainer, module, averaged = self._trainer, self._module, self._averaged
        if trainer is None or module is None or averaged is None:
            return
        # A validation due after a batch runs before that batch's TrainBatchCompleted:
        # the step it follows is averaged first.
        if self._due(trainer):
            self.update()
        if self.n_averaged and self._backup is None:
            self._backup = {k: v.detach().clone() for k, v in module.state_dict().items()}
            module.load_state_dict(averaged.module.state_dict())

    @on(ValidationCompleted)
    def _validation_completed(self, event: ValidationCompleted) -> None:
        if self._backup is not None and self._module is not None:
            self._module.load_state_dict(self._backup)
            self._backup = None

    @on(FitCompleted, priority=-50)
    def _recompute_batch_norm(self, event: FitCompleted) -> None:
        """Before the ``Checkpoint`` plugin's final save (priority -100): the average's
        BatchNorm statistics from one pass over ``update_bn``."""
        module, averaged = self._module, self._averaged
        if self.update_bn is None or module is None or averaged is None or not self.n_averaged:
            return
        own = {k: v.detach().clone() for k, v in module.state_dict().items()}
        module.load_state_dict(averaged.module.state_dict())
        device = next(iter(module.parameters()), torch.empty(0)).device
        update_bn(self.update_bn, module, device=device)
        averaged.module.load_state_dict(module.state_dict())
        module.load_state_dict(own)

    @on(FitCompleted, priority=-200)
    def _use_average(self, event: FitCompleted) -> None:
        """After the final save: the module keeps the averaged weights."""
        module, averaged = self._module, self._averaged
        if module is None or averaged is None or not self.n_averaged:
            return
        module.load_state_dict(averaged.module.state_dict())
        if self._trainer is not None and self._saves_average:
            self._trainer.checkpoint_weights_from(None)
            self._saves_average = False

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        current = None
        if self._saves_average and self._module is not None:
            # The checkpoint's module entry holds the average: keep the module's own here.
            current = self._backup if self._backup is not None else self._module.state_dict()
        return {
            "kind": self.kind,
            "decay": self.decay,
            "n_averaged": self.n_averaged,
            "last_step": self._last_step,
            "current": current,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("kind") != self.kind:
            raise ValueError(
                f"this WeightAveraging state was saved for kind={state_dict.get('kind')!r}, "
                f"but this plugin averages with kind={self.kind!r}; give the restored plugin "
                "the same kind, or start its average afresh."
            )
        self._last_step = int(state_dict["last_step"])
        trainer, module, averaged = self._trainer, self._module, self._averaged
        if trainer is None or module is None or averaged is None:
            return  # outside fit: the module's weights are the checkpoint's (averaged) ones
        n = int(state_dict["n_averaged"])
        current = state_dict.get("current")
        if n and current is not None:
            # The checkpoint's module entry (the average) was loaded into the module,
            # or straight into the average if it was being saved from there already.
            if not self._saves_average:
                averaged.module.load_state_dict(module.state_dict())
                trainer.checkpoint_weights_from(averaged.module)
                self._saves_average = True
            module.load_state_dict(current)
        elif not n and self._saves_average:
            trainer.checkpoint_weights_from(None)
            self._saves_average = False
        averaged.n_averaged.fill_(n)
