"""Weight bus: trainer rank 0 broadcasts new weights to every engine over one process group.

The names below load on first use, so `weight_bus.config` and `weight_bus.schema` import without torch.
"""

import importlib

_NAMES = {
    "BusError": "weight_bus.bus",
    "PublishStats": "weight_bus.bus",
    "WeightBus": "weight_bus.bus",
    "buckets": "weight_bus.bus",
    "flatten": "weight_bus.bus",
    "update_due": "weight_bus.bus",
    "WeightReceiver": "weight_bus.receiver",
}

__all__ = ["BusError", "PublishStats", "WeightBus", "WeightReceiver", "buckets", "flatten", "update_due"]


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'weight_bus' has no attribute {name!r}")
