"""Events, records and the bus. Imports neither torch nor the engine."""

from __future__ import annotations

from .._exceptions import fixup_module_metadata as _fixup_module_metadata
from ._bus import EventBus as EventBus
from ._delivery import DESTINATIONS as DESTINATIONS
from ._delivery import on as on
from ._subscription import Subscription as Subscription
from ._types import AdvanceCompleted as AdvanceCompleted
from ._types import AdvanceStarted as AdvanceStarted
from ._types import AfterBackward as AfterBackward
from ._types import BeforeOptimizerStep as BeforeOptimizerStep
from ._types import CustomEvent as CustomEvent
from ._types import EpochCompleted as EpochCompleted
from ._types import EpochStarted as EpochStarted
from ._types import Event as Event
from ._types import ExceptionRaised as ExceptionRaised
from ._types import FitCompleted as FitCompleted
from ._types import FitStarted as FitStarted
from ._types import LoopEvent as LoopEvent
from ._types import PredictBatchCompleted as PredictBatchCompleted
from ._types import PredictBatchStarted as PredictBatchStarted
from ._types import PredictCompleted as PredictCompleted
from ._types import PredictStarted as PredictStarted
from ._types import PreemptionRequested as PreemptionRequested
from ._types import PutRecord as PutRecord
from ._types import ReplicaHealed as ReplicaHealed
from ._types import ReplicaLost as ReplicaLost
from ._types import RunCompleted as RunCompleted
from ._types import RunSkipped as RunSkipped
from ._types import RunStarted as RunStarted
from ._types import StepAborted as StepAborted
from ._types import Teardown as Teardown
from ._types import TestBatchCompleted as TestBatchCompleted
from ._types import TestBatchStarted as TestBatchStarted
from ._types import TestCompleted as TestCompleted
from ._types import TestStarted as TestStarted
from ._types import TrainBatchCompleted as TrainBatchCompleted
from ._types import TrainBatchStarted as TrainBatchStarted
from ._types import TrainEpochCompleted as TrainEpochCompleted
from ._types import TrainEpochStarted as TrainEpochStarted
from ._types import ValidationBatchCompleted as ValidationBatchCompleted
from ._types import ValidationBatchStarted as ValidationBatchStarted
from ._types import ValidationCompleted as ValidationCompleted
from ._types import ValidationStarted as ValidationStarted

__all__ = [
    "DESTINATIONS",
    "AdvanceCompleted",
    "AdvanceStarted",
    "AfterBackward",
    "BeforeOptimizerStep",
    "CustomEvent",
    "EpochCompleted",
    "EpochStarted",
    "Event",
    "EventBus",
    "ExceptionRaised",
    "FitCompleted",
    "FitStarted",
    "LoopEvent",
    "PredictBatchCompleted",
    "PredictBatchStarted",
    "PredictCompleted",
    "PredictStarted",
    "PreemptionRequested",
    "PutRecord",
    "ReplicaHealed",
    "ReplicaLost",
    "RunCompleted",
    "RunSkipped",
    "RunStarted",
    "StepAborted",
    "Subscription",
    "Teardown",
    "TestBatchCompleted",
    "TestBatchStarted",
    "TestCompleted",
    "TestStarted",
    "TrainBatchCompleted",
    "TrainBatchStarted",
    "TrainEpochCompleted",
    "TrainEpochStarted",
    "ValidationBatchCompleted",
    "ValidationBatchStarted",
    "ValidationCompleted",
    "ValidationStarted",
    "on",
]

_fixup_module_metadata(__name__, globals())
