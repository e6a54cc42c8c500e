"""FSDP: the module sharded over the ranks with torch's FSDP2 (``fully_shard``).

Every rank holds a shard (about ``1/world_size``) of each parameter, of its gradient and
of the optimizer state; a shard unit's parameters are all-gathered just before its
forward (and again for its backward) and freed after, and gradients are reduce-scattered.
Nothing here shards by hand: :class:`FSDPStrategy` chooses the shard units and calls
``fully_shard`` on them, bottom-up, then on the root.

What it adds to the shared data-parallel part (:class:`~loopbus.distributed._ddp.DataParallel`:
the process group, the ``DistributedSampler``, the collective stop):

* ``prepare_module`` shards the module when a stage starts, before
  ``configure_optimizers``, so the optimizers see the sharded parameters (DTensors); a
  module built on the ``meta`` device is materialised one shard unit at a time;
* the module's ``training_step``, ``validation_step``, ``test_step`` and
  ``predict_step`` are registered as FSDP forward methods
  (``register_fsdp_forward_method``), so the root unit's parameters are gathered around
  each of them whatever they call;
* the non-final micro-batches of an accumulation window run with
  ``set_requires_gradient_sync(False)`` (gradients accumulate unsharded, locally, and are
  reduce-scattered on the window's last backward);
* clipping is torch's, over DTensor gradients: the norm is the global one.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from loopbus.step._params import own_class

from .._exceptions import MisconfigurationError
from ._ddp import DEFAULT_STOP_CHECK_S, DEFAULT_TIMEOUT_S, DataParallel

# torch.distributed.fsdp is imported where it is used: importing it costs about half a
# second, which a run without FSDP should not pay.
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from loopbus.step._module import Module
    from loopbus.step._precision import Precision

__all__ = ["FSDPStrategy"]

_log = logging.getLogger("loopbus")

#: Which submodules become shard units: classes, or a predicate over submodules.
Units = Sequence[type[torch.nn.Module]] | Callable[[torch.nn.Module], bool]

#: The module's methods FSDP treats as forwards (the root's parameters are gathered
#: around each).
_FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
#: The modules whose forward methods are registered already (by any FSDPStrategy).
_FORWARD_REGISTERED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


class FSDPStrategy(DataParallel):
    """``strategy="fsdp"``: the module fully sharded over the ranks with torch's FSDP2.

    * ``units``: which submodules become shard units (each ``fully_shard``-ed on its own,
      so only one unit's parameters are gathered at a time): a list of module classes
      (e.g. your transformer block class), or a callable ``units(submodule) -> bool``.
      Default: every direct child of the module that holds parameters. The module itself
      is always the root unit (the parameters no unit holds).
    * ``reshard_after_forward``: free a unit's gathered parameters after its forward
      (``True``, the default: least memory, a second all-gather in backward) or keep them
      until backward (``False``: one all-gather per step, more memory); an int reshards to
      that many ranks (see ``fully_shard``).
    * ``mp_policy``: a ``torch.distributed.fsdp.MixedPrecisionPolicy``. Default: from the
      trainer's ``precision``: ``"bf16-mixed"`` computes with bf16 parameters and reduces
      gradients in fp32 (the sharded parameters and the optimizer stay fp32); ``"32"``
      changes nothing.
    * ``cpu_offload``: keep the sharded parameters, gradients and optimizer state in host
      memory (``CPUOffloadPolicy``); the optimizer steps on the CPU. For a CUDA device.
    * ``activation_checkpointing``: recompute each unit's activations in backward instead
      of keeping them (torch's ``checkpoint`` applied to every unit); the module's
      parameter names do not change.
    * ``process_group_timeout_s``, ``stop_check_interval_s``: as the trainer's options of
      the same names (a strategy object carries its own); their old names
      (``process_group_timeout``, ``stop_check_interval``) are deprecated aliases.

    A module built on the ``meta`` device (``with torch.device("meta"): model = Net()``)
    never exists whole: each unit in turn is given memory (``to_empty``) on the device,
    initialised by the ``reset_parameters()`` of each of its layers (in module order, as
    a normal construction does; same seed on every rank, so every rank draws the same
    values), and sharded, which frees the full tensors. See ``docs/distributed.md``.
    """

    name = "fsdp"
    sharded_state = True

    def __init__(
        self,
        units: Units | None = None,
        *,
        reshard_after_forward: bool | int = True,
        mp_policy: MixedPrecisionPolicy | None = None,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        process_group_timeout_s: float = DEFAULT_TIMEOUT_S,
        stop_check_interval_s: float = DEFAULT_STOP_CHECK_S,
        **renamed: Any,
    ) -> None:
        super().__init__(process_group_timeout_s, stop_check_interval_s, **renamed)
        self.units = _check_units(units)
        if type(reshard_after_forward) is not bool and (
            type(reshard_after_forward) is not int or reshard_after_forward < 2
        ):
            raise MisconfigurationError(
                "FSDPStrategy(reshard_after_forward=...) must be True, False or a number of "
                f"ranks >= 2 to reshard to, got {reshard_after_forward!r}."
            )
        self.reshard_after_forward = reshard_after_forward
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
            raise MisconfigurationError(
                "FSDPStrategy(mp_policy=...) must be a "
                "torch.distributed.fsdp.MixedPrecisionPolicy or None (from the trainer's "
                f"precision), got {type(mp_policy).__name__}."
            )
        self.mp_policy = mp_policy
        for flag, value in (
            ("cpu_offload", cpu_offload),
            ("activation_checkpointing", activation_checkpointing),
        ):
            if not isinstance(value, bool):
                raise MisconfigurationError(
                    f"FSDPStrategy({flag}=...) must be True or False, got {value!r}."
                )
        self.cpu_offload = cpu_offload
        self.activation_checkpointing = activation_checkpointing
        # The module sharded last (an FSDPModule by then).
        self._sharded: torch.nn.Module | None = None
        self._mesh: DeviceMesh | None = None

    # ------------------------------------------------------------ the module
    def prepare_module(self, module: Module, device: torch.device, precision: Precision) -> None:
        """Shard ``module`` (once per module): its units bottom-up, then the root; a module
        on the ``meta`` device is materialised unit by unit on ``device``. A module already
        sharded (by an earlier trainer, or by your own ``fully_shard`` calls) is used as
        it is."""
        if self._sharded is module:
            return
        if precision.scaler is not None:
            raise MisconfigurationError(
                f"precision={precision.name!r} scales the loss with a GradScaler, whose "
                "inf/NaN check would see only this rank's shard of the gradients under "
                "strategy='fsdp' (the ranks could disagree on skipping a step). Use "
                "precision='bf16-mixed' (no scaler) or '32'."
            )
        if self.cpu_offload and device.type != "cuda":
            raise MisconfigurationError(
                "FSDPStrategy(cpu_offload=True) moves parameters between host and a CUDA "
                f"device, but the trainer runs on {str(device)!r}; the parameters already "
                "live in host memory there: leave cpu_offload off."
            )
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        if not isinstance(module, FSDPModule):
            meta = self._lay_out(module, device)
            options = self._shard_options(device, precision)
            units = _find_units(module, self.units)
            self._shard(module, units, device, meta, options)
        if module not in _FORWARD_REGISTERED:
            for name in _FORWARD_METHODS:
                register_fsdp_forward_method(module, name)
            _FORWARD_REGISTERED.add(module)
        self._sharded = module

    def _lay_out(self, module: Module, device: torch.device) -> bool:
        """Before sharding: move ``module`` to ``device``, unless it is on the ``meta``
        device (materialised unit by unit while it is sharded). Whether it is on meta."""
        meta = _on_meta(module)
        if not meta:
            module.to(device)
        return meta

    def _fsdp_mesh(self, device: torch.device) -> DeviceMesh:
        """The ranks ``fully_shard`` shards over: all of them, in one dimension."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device.type, (self.world_size,))
        return self._mesh

    def _shard_options(self, device: torch.device, precision: Precision) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        policy = self.mp_policy
        if policy is None:
            dtype = precision.param_dtype
            policy = (
                MixedPrecisionPolicy()
                if dtype is None
                else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            )
        return {
            "mesh": self._fsdp_mesh(device),
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": policy,
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }

    def _shard(
        self,
        root: torch.nn.Module,
        units: list[torch.nn.Module],
        device: torch.device,
        meta: bool,
        options: dict[str, Any],
    ) -> None:
        """Walk the module tree: materialise each layer on the way down (meta: in module
        order, the order a constructor initialises them in), ``fully_shard`` each unit on
        the way up (innermost first, the root last), with activation checkpointing on the
        units when asked. A unit is sharded as soon as its last layer is materialised,
        which frees its full tensors: only one unit (and what the root holds itself)
        exists whole at a time."""
        from torch.distributed.fsdp import fully_shard

        chosen = {id(u) for u in units}
        checkpoint: Callable[[torch.nn.Module], Any] | None = None
        if self.activation_checkpointing:
            from torch.distributed._composable.checkpoint_activation import checkpoint

        def visit(module: torch.nn.Module, path: str) -> None:
            if meta:
                _materialise(module, ".".join(filter(None, (type(root).__name__, path))), device)
            for name, child in module.named_children():
                visit(child, f"{path}.{name}" if path else name)
            if id(module) in chosen:
                if checkpoint is not None:
                    checkpoint(module)
                fully_shard(module, **options)

        visit(root, "")
        fully_shard(root, **options)
        _free_device_meshes_at_exit()

    def prepare_optimizers(
        self, optimizers: list[torch.optim.Optimizer], module: Module
    ) -> list[torch.optim.Optimizer]:
        """Refuse an optimizer that holds a tensor that is not one of the sharded module's
        parameters (one built over parameters captured before sharding)."""
        current = {id(p) for p in module.parameters()}
        for index, optimizer in enumerate(optimizers):
            for group in optimizer.param_groups:
                if any(id(p) not in current for p in group["params"]):
                    raise MisconfigurationError(
                        f"optimizer {index} ({type(optimizer).__name__}) of "
                        f"{own_class(module).__name__} holds tensors that are not the module's "
                        "parameters after sharding: under strategy='fsdp' the parameters "
                        "are replaced by their shards (DTensors) before "
                        "configure_optimizers runs. Build the optimizer there from "
                        "self.parameters(), not from a list kept in __init__."
                    )
        return optimizers

    _manual_why = (
        "its backward would run inside the root unit's forward, before FSDP has "
        "registered the hooks that reduce-scatter the root's gradients. Use automatic "
        "optimization (return the loss from training_step)."
    )

    def _wrap(self, module: Module) -> Any:
        return module.training_step

    @property
    def module(self) -> FSDPModule | None:
        """The sharded module, once a stage has started."""
        return self._sharded  # type: ignore[return-value]

    def no_sync(self) -> AbstractContextManager[None]:
        module = self._sharded
        if module is None:
            return nullcontext()
        return _without_gradient_sync(module)  # type: ignore[arg-type]


#: torch's DTensor caches, as (module, attribute path of a function that empties one).
#: Each keeps every device mesh it has seen alive, and a mesh keeps its process group.
_DTENSOR_CACHES = (
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
    (
        "torch.distributed.tensor._api",
        "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear",
    ),
    ("torch._C", "_clear_DTensor_sharding_propagator_cache"),
)


@functools.cache
def _free_device_meshes_at_exit() -> None:
    """Once per process, when FSDP first shards: at exit, empty torch's DTensor caches
    and collect. The caches keep every device mesh they have seen alive, and a mesh keeps
    its process group: a gloo group alive into the interpreter's finalization can abort
    the process (see ``_ddp._leave_process_group``). It works in either order with the
    trainer's own handler (which destroys a group the trainer created): a destroyed group
    that a mesh still holds is freed with the mesh. The same goes for a group the user
    created and destroyed."""
    atexit.register(_free_device_meshes)


def _free_device_meshes() -> None:
    """Empty torch's DTensor caches, then collect the meshes they held. The caches are
    torch's internals: only modules already imported are looked at, and a cache that is
    not where this torch keeps it is skipped (the exit is then as it was)."""
    for module_name, path in _DTENSOR_CACHES:
        target: Any = sys.modules.get(module_name)
        for name in path.split("."):
            target = getattr(target, name, None)
        if callable(target):
            try:
                target()
            except Exception:  # best effort at exit: never fail the exit
                _log.debug("could not empty %s.%s", module_name, path, exc_info=True)
    gc.collect()


@contextmanager
def _without_gradient_sync(module: FSDPModule) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _check_units(units: Units | None) -> Units | None:
    if units is None or (callable(units) and not isinstance(units, type)):
        return units
    if isinstance(units, type):
        raise MisconfigurationError(
            f"FSDPStrategy(units=...) takes a list of module classes, got the class "
            f"{units.__name__} alone: write units=[{units.__name__}]."
        )
    if not isinstance(units, (list, tuple)) or not units:
        raise MisconfigurationError(
            "FSDPStrategy(units=...) must be a non-empty list of torch.nn.Module classes "
            "(e.g. [Block]) or a callable submodule -> bool, got "
            f"{units!r}."
        )
    for cls in units:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise MisconfigurationError(
                "FSDPStrategy(units=...) must list torch.nn.Module classes, got "
                f"{cls!r} in {units!r}."
            )
    return tuple(units)


def _find_units(root: torch.nn.Module, units: Units | None) -> list[torch.nn.Module]:
    """The submodules (not the root) that become shard units, in module order."""
    if units is None:
        return list(_children_with_parameters(root))
    if callable(units) and not isinstance(units, tuple):
        return [m for m in root.modules() if m is not root and units(m)]
    classes = tuple(units)
    found = [m for m in root.modules() if m is not root and isinstance(m, classes)]
    if not found:
        names = ", ".join(cls.__name__ for cls in classes)
        raise MisconfigurationError(
            f"FSDPStrategy(units=[{names}]): {type(root).__name__} has no submodule of "
            "these classes, so nothing but the root would be sharded. Name the classes "
            "of its repeated blocks, or leave units out (every child with parameters)."
        )
    return found


def _children_with_parameters(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The default units: every child that holds parameters; the items of a
    ``ModuleList``/``ModuleDict`` (containers without a forward of their own) instead of
    the container."""
    for child in module.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            yield from _children_with_parameters(child)
        elif any(True for _ in child.parameters()):
            yield child


def _on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module, recurse=True))


def _tensors(module: torch.nn.Module, recurse: bool) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


def _materialise(module: torch.nn.Module, where: str, device: torch.device) -> None:
    """Give the ``meta`` parameters and buffers ``module`` holds itself memory on
    ``device``, initialised by its own ``reset_parameters()``."""
    if not any(t.is_meta for t in _tensors(module, recurse=False)):
        return
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise MisconfigurationError(
            f"{where} ({type(module).__name__}) was built on the meta device but has no "
            "reset_parameters() to initialise the parameters and buffers it holds itself; "
            "define one (as torch's layers do), or build the module on a real device."
        )
    module.to_empty(device=device, recurse=False)
    reset()
