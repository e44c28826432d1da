"""Weight bus: trainer rank 0 broadcasts new weights to every engine over one process group (backend
ipc: hands them to engines on its host by CUDA IPC / shared memory).

Importing the package is cheap (no torch): its names load from their modules on first use.

May import: common, models, replay_buffer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "BusError": "weight_bus.errors",
    "PublishStats": "weight_bus.stats",
    "WeightBus": "weight_bus.bus",
    "update_due": "weight_bus.bus",
    "buckets": "weight_bus.packing",
    "flatten": "weight_bus.packing",
    "WeightReceiver": "weight_bus.receiver",
    "EngineClient": "weight_bus.engine_client",
    "continue_engines": "weight_bus.engine_client",
}

__all__ = [
    "BusError",
    "EngineClient",
    "PublishStats",
    "WeightBus",
    "WeightReceiver",
    "buckets",
    "continue_engines",
    "flatten",
    "update_due",
]

if TYPE_CHECKING:
    from weight_bus.bus import WeightBus, update_due
    from weight_bus.engine_client import EngineClient, continue_engines
    from weight_bus.errors import BusError
    from weight_bus.packing import buckets, flatten
    from weight_bus.receiver import WeightReceiver
    from weight_bus.stats import PublishStats


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'weight_bus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
