"""Weight bus: trainer rank 0 broadcasts new weights to every engine over one process group."""

from weight_bus.bus import BusError, PublishStats, WeightBus, buckets, flatten, update_due
from weight_bus.receiver import WeightReceiver

__all__ = ["BusError", "PublishStats", "WeightBus", "WeightReceiver", "buckets", "flatten", "update_due"]
