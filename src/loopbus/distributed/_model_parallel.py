"""Model parallelism on a named device mesh: each layer's matrices split over the ``tp``
dimension (tensor parallelism, applied by the module's own ``configure_model(mesh)``),
and the module sharded with FSDP2 over the data-parallel dimensions (``dp_shard``, or
``(dp_replicate, dp_shard)`` for HSDP).

:class:`ModelParallelStrategy` is :class:`~loopbus.distributed._fsdp.FSDPStrategy` with
another mesh: the same shard units, mixed precision, activation checkpointing and
sharded checkpoints. What it adds:

* the mesh ``(dp_replicate, dp_shard, tp)``, built when the trainer joins the process
  group, its sizes checked against the world size (:func:`mesh_shape`);
* before sharding, a module on the ``meta`` device is materialised whole and
  initialised (so its weights are the normally built model's with the same seed, and
  are split after), then ``module.configure_model(mesh)`` lays out its layers;
* the data is split over the data-parallel replicas, not the ranks: tensor-parallel
  peers read the same batch (``data_parallel_size``, ``data_parallel_rank``);
* clipping takes the norm of every gradient, whatever mesh its DTensor lives on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from loopbus.step._params import own_class

from .._exceptions import MisconfigurationError
from ._ddp import DEFAULT_STOP_CHECK_S, DEFAULT_TIMEOUT_S
from ._fsdp import FSDPStrategy, Units, _free_device_meshes_at_exit, _materialise, _on_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from loopbus.step._module import Module

__all__ = ["MESH_DIMS", "ModelParallelStrategy", "mesh_shape"]

#: The names of the mesh's dimensions, outermost first: ranks next to each other (one
#: node) are tensor-parallel peers.
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def mesh_shape(world_size: int, *, tp: int, dp_shard: int, dp_replicate: int) -> tuple[int, ...]:
    """The sizes of ``MESH_DIMS`` for ``world_size`` ranks (``dp_shard=-1``: the ranks
    that ``tp`` and ``dp_replicate`` leave), or a ``MisconfigurationError`` that says
    which sizes would fit."""
    _check_sizes(tp, dp_shard, dp_replicate)
    owner = "ModelParallelStrategy"
    if dp_shard == -1:
        if world_size % (tp * dp_replicate):
            raise MisconfigurationError(
                f"{owner}(tp={tp}, dp_replicate={dp_replicate}) cannot cover {world_size} "
                f"ranks: tp * dp_replicate = {tp * dp_replicate} does not divide the world "
                f"size. Choose tp and dp_replicate whose product divides {world_size}, or "
                "launch a multiple of it."
            )
        dp_shard = world_size // (tp * dp_replicate)
    if dp_replicate * dp_shard * tp != world_size:
        raise MisconfigurationError(
            f"{owner}(tp={tp}, dp_shard={dp_shard}, dp_replicate={dp_replicate}) is a mesh "
            f"of {dp_replicate * dp_shard * tp} ranks, but the world has {world_size}: the "
            "product of the three sizes must equal the world size. Pass dp_shard=-1 to "
            "take the ranks the others leave, or launch that many processes."
        )
    return (dp_replicate, dp_shard, tp)


def _check_sizes(tp: Any, dp_shard: Any, dp_replicate: Any) -> None:
    """Refuse sizes that fit no world: not whole numbers, or below 1 (-1 for dp_shard)."""
    owner = "ModelParallelStrategy"
    for name, value, least in (("tp", tp, 1), ("dp_replicate", dp_replicate, 1)):
        if type(value) is not int or value < least:
            raise MisconfigurationError(
                f"{owner}({name}=...) must be a whole number of ranks >= 1, got {value!r}."
            )
    if type(dp_shard) is not int or (dp_shard < 1 and dp_shard != -1):
        raise MisconfigurationError(
            f"{owner}(dp_shard=...) must be a whole number of ranks >= 1, or -1 for the "
            f"ranks tp and dp_replicate leave, got {dp_shard!r}."
        )


class ModelParallelStrategy(FSDPStrategy):
    """Tensor parallelism inside the layers and FSDP2 over the data-parallel ranks, on a
    named ``DeviceMesh`` of dimensions ``("dp_replicate", "dp_shard", "tp")``.

    * ``tp``: ranks each layer's matrices are split over. The module's
      ``configure_model(self, mesh)`` applies the split (``parallelize_module`` on
      ``mesh["tp"]`` with ``ColwiseParallel``, ``RowwiseParallel``,
      ``SequenceParallel``); it is called once per module, after the module is on its
      device and initialised, before ``configure_optimizers``.
    * ``dp_shard``: ranks the parameters, gradients and optimizer state are sharded over
      (FSDP2); -1 (default): every rank ``tp`` and ``dp_replicate`` leave.
    * ``dp_replicate``: copies of that sharded model (HSDP: sharded within a copy,
      gradients all-reduced between copies); 1 (default): plain FSDP over ``dp_shard``.
    * ``units``, ``reshard_after_forward``, ``mp_policy``, ``cpu_offload``,
      ``activation_checkpointing``, ``process_group_timeout_s``,
      ``stop_check_interval_s``: as :class:`~loopbus.FSDPStrategy`'s.

    The training data is split over the ``dp_replicate * dp_shard`` data-parallel
    replicas, not over the ranks: the ``tp`` peers of a replica read the same batch. A
    module built on the ``meta`` device is materialised whole on each rank and
    initialised before ``configure_model`` splits it (with the same seed on every rank
    its weights are the normally built model's). See ``docs/distributed.md``.
    """

    name = "model-parallel"

    def __init__(
        self,
        tp: int,
        dp_shard: int = -1,
        dp_replicate: int = 1,
        units: Units | None = None,
        *,
        reshard_after_forward: bool | int = True,
        mp_policy: MixedPrecisionPolicy | None = None,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        process_group_timeout_s: float = DEFAULT_TIMEOUT_S,
        stop_check_interval_s: float = DEFAULT_STOP_CHECK_S,
    ) -> None:
        _check_sizes(tp, dp_shard, dp_replicate)  # against the world size at setup
        super().__init__(
            units,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
            process_group_timeout_s=process_group_timeout_s,
            stop_check_interval_s=stop_check_interval_s,
        )
        self.tp = tp
        self.dp_shard = dp_shard
        self.dp_replicate = dp_replicate
        self._device_mesh: DeviceMesh | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes of ``("dp_replicate", "dp_shard", "tp")`` in this world."""
        return mesh_shape(
            self.world_size, tp=self.tp, dp_shard=self.dp_shard, dp_replicate=self.dp_replicate
        )

    @property
    def mesh(self) -> DeviceMesh | None:
        """The named device mesh, once the trainer has joined the process group (None
        before): ``mesh["tp"]``, ``mesh["dp_shard"]``, ``mesh["dp_replicate"]``."""
        return self._device_mesh

    @property
    def data_parallel_size(self) -> int:
        replicate, shard, _ = self.shape
        return replicate * shard

    @property
    def data_parallel_rank(self) -> int:
        mesh = self._device_mesh
        if mesh is None:  # the ranks are laid out row-major, tp innermost
            return self.global_rank // self.shape[2]
        replicate, shard, _ = (mesh.get_local_rank(dim) for dim in MESH_DIMS)
        return replicate * mesh.size(MESH_DIMS.index("dp_shard")) + shard

    def setup_environment(self, device: torch.device) -> None:
        """Check the mesh's sizes against the world size, join the process group (as DDP
        and FSDP do), then build the mesh."""
        self.shape  # noqa: B018 (raises for sizes that do not fit the world)
        super().setup_environment(device)
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._device_mesh = init_device_mesh(device.type, self.shape, mesh_dim_names=MESH_DIMS)
            _free_device_meshes_at_exit()

    def _built_mesh(self) -> DeviceMesh:
        mesh = self._device_mesh
        if mesh is None:
            raise MisconfigurationError(
                "ModelParallelStrategy has no device mesh yet: hand it to a Trainer "
                "(Trainer(strategy=ModelParallelStrategy(...))), which joins the process "
                "group and builds the mesh, before a stage starts."
            )
        return mesh

    def _fsdp_mesh(self, device: torch.device) -> DeviceMesh:
        """The data-parallel dimensions: ``dp_shard``, or ``(dp_replicate, dp_shard)``
        (HSDP) when the model is replicated too."""
        mesh = self._built_mesh()
        if self.shape[0] == 1:
            return mesh["dp_shard"]
        return mesh["dp_replicate", "dp_shard"]

    def _lay_out(self, module: Module, device: torch.device) -> bool:
        """Put the module on ``device`` whole (materialising and initialising a module on
        the ``meta`` device, in module order), then let it split its layers over the
        mesh. Nothing is left on meta for FSDP to materialise."""
        from torch.distributed.tensor import DTensor

        name = own_class(module).__name__
        if _on_meta(module):
            if any(isinstance(p, DTensor) for p in module.parameters()):
                raise MisconfigurationError(
                    f"{name} is on the meta device with parameters split over a mesh "
                    "already: initialised after the split, every rank would draw the same "
                    "values for its own block (DTensor's random ops fall back to each "
                    "rank's generator on the CPU). Apply tensor parallelism in "
                    f"{name}.configure_model(mesh) instead; ModelParallelStrategy "
                    "initialises the whole module before it calls it."
                )
            for path, layer in module.named_modules():
                _materialise(layer, ".".join(filter(None, (name, path))), device)
        else:
            module.to(device)
        module.configure_model(self._built_mesh())
        if _on_meta(module):
            raise MisconfigurationError(
                f"{name}.configure_model(mesh) left parameters or buffers on the meta "
                "device; build the module's layers in __init__ (on the meta device if it "
                "must not exist whole), and only split them in configure_model."
            )
        return False

    def clip_gradients(
        self, parameters: list[torch.Tensor], value: float, algorithm: Literal["norm", "value"]
    ) -> None:
        """Clip to the norm of every gradient over every rank: the DTensor gradients of
        each mesh (the tensor-parallel layers' live on the data-parallel and ``tp``
        dimensions, the others' on the data-parallel ones) give one norm each, combined
        into the global one."""
        if algorithm != "norm":
            super().clip_gradients(parameters, value, algorithm)
            return
        from torch.distributed.tensor import DTensor

        # Group by mesh: DTensor ops refuse operands on different meshes.
        groups: dict[Any, list[torch.Tensor]] = {}
        for p in parameters:
            if p.grad is not None:
                mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
                groups.setdefault(mesh, []).append(p)
        if not groups:
            return
        norms = []
        for params in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, value, total)
