"""Mixed precision: ``torch.autocast`` for the forward and, for fp16, a ``GradScaler``."""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch

from loopbus import MisconfigurationError, Precision, check_choice

__all__ = ["MixedPrecision"]

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class MixedPrecision(Precision):
    """``Trainer(precision="16-mixed")`` or ``"bf16-mixed"``.

    The forward of every step (training and evaluation) runs under
    ``torch.autocast(device_type, dtype)``; parameters and optimizer state stay fp32.
    Under ``strategy="fsdp"`` the gathered parameters are also cast to ``dtype`` for the
    forward and backward and gradients are reduced in fp32 (FSDP's
    ``MixedPrecisionPolicy``); ``"16-mixed"`` is refused there (its scaler's inf check
    would see one shard).
    ``"16-mixed"`` adds a ``torch.amp.GradScaler`` for the device: the loss is scaled
    before backward, gradients are unscaled before clipping, and steps with inf/NaN
    gradients are skipped while the scale adapts. The scaler's state is this precision's
    state (``state_dict()["scaler"]``), so it is saved with checkpoints.

    Both work on CUDA and on CPU (bf16 is the better choice on CPU). Importing loopbus
    registers both names; pass an instance to configure the scaler::

        Trainer(precision="bf16-mixed")
        Trainer(precision=MixedPrecision("16-mixed", init_scale=2.0**10))

    With ``automatic_optimization = False``, call ``self.manual_backward(loss)`` and step
    through ``self.trainer.precision.step(optimizer)`` so the scaler is applied.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "bf16-mixed",
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ) -> None:
        check_choice("precision", precision, sorted(_DTYPES), owner="MixedPrecision")
        self.name = precision
        self.dtype = _DTYPES[precision]
        # Under FSDP: gathered parameters in this dtype, gradients reduced in fp32.
        self.param_dtype = self.dtype
        self.device_type: str | None = None
        self.init_scale = float(init_scale)
        self.growth_interval = int(growth_interval)
        # The scaler's state is device independent; it is built for the device at setup.
        self._scaler: torch.amp.GradScaler | None = None
        self._scaler_state: dict[str, Any] | None = None
        self._scaler_device: str | None = None

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The grad scaler (fp16 only, once a stage has started), or None."""
        return self._scaler

    def setup(self, device: torch.device) -> None:
        kind = device.type
        if not torch.amp.is_autocast_available(kind):
            raise MisconfigurationError(
                f"precision={self.name!r} needs torch.autocast on {kind!r}, which this torch "
                f"({torch.__version__}) does not support; use precision='32'."
            )
        if self.dtype is torch.bfloat16 and kind == "cuda" and not torch.cuda.is_bf16_supported():
            raise MisconfigurationError(
                f"precision='bf16-mixed' needs a GPU with bfloat16 support, and "
                f"{torch.cuda.get_device_name(device)} has none; use precision='16-mixed'."
            )
        self.device_type = kind
        self.autocast = functools.partial(torch.autocast, device_type=kind, dtype=self.dtype)
        if self.dtype is torch.float16:
            if self._scaler is None or self._scaler_device != kind:
                state = (
                    self._scaler.state_dict() if self._scaler is not None else self._scaler_state
                )
                self._scaler = self._new_scaler(kind)
                if state:
                    self._scaler.load_state_dict(state)
                self._scaler_state = None
                self._scaler_device = kind

    def _new_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(
            device_type, init_scale=self.init_scale, growth_interval=self.growth_interval
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self._scaler is not None:
            self._scaler.scale(loss).backward(**kwargs)  # type: ignore[no-untyped-call]
        else:
            loss.backward(**kwargs)  # type: ignore[no-untyped-call]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._scaler is not None:
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"precision": self.name}
        if self._scaler is not None:
            state["scaler"] = self._scaler.state_dict()
        elif self._scaler_state is not None:
            state["scaler"] = dict(self._scaler_state)
        elif self.dtype is torch.float16:
            # Before the first stage: the state a fresh scaler would have.
            state["scaler"] = self._new_scaler("cpu").state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("precision", self.name)
        if saved != self.name:
            raise ValueError(
                f"this precision state was saved with precision={saved!r}, but the trainer "
                f"uses {self.name!r}; resume with the same precision."
            )
        scaler_state = state_dict.get("scaler")
        if scaler_state is None:
            return
        if self._scaler is not None:
            self._scaler.load_state_dict(scaler_state)
        else:
            self._scaler_state = dict(scaler_state)
