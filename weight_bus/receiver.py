"""Engine side of the weight bus: join update groups and receive broadcast tensors (blocking calls;
the engine runs them off its event loop)."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from weight_bus.group import DEFAULT_TIMEOUT_S, broadcast, dtype_from_name, new_group, shutdown_group
from weight_bus.schema import InitWeightsUpdateGroup, UpdateWeightsFromDistributed

log = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"


class WeightReceiver:
    """Holds the engine's update groups by name (several may coexist, as in recent SGLang)."""

    def __init__(self, device: str | torch.device = "cpu", tp_rank: int = 0) -> None:
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.broken: set[str] = set()
        """Groups a receive failed on (a peer died, the sender left): their later receives fail at once
        instead of each waiting out the group timeout; the bus builds a new group."""

    def init_group(self, req: InitWeightsUpdateGroup) -> None:
        if req.group_name in self.groups:
            raise ValueError(f"group {req.group_name!r} already exists; destroy it first")
        rank = req.rank_offset + self.tp_rank
        self.groups[req.group_name] = new_group(
            req.master_address,
            int(req.master_port),
            rank,
            req.world_size,
            req.backend,
            req.group_name,
            req.timeout_s or DEFAULT_TIMEOUT_S,
        )
        log.info(
            "joined weight group %s as rank %d/%d (%s)", req.group_name, rank, req.world_size, req.backend
        )

    def destroy(self, group_name: str) -> None:
        """Leave a group; the bus drops one this way after a peer died in it and rebuilds without it."""
        group = self.groups.pop(group_name, None)
        self.broken.discard(group_name)
        if group is None:
            raise ValueError(f"no group {group_name!r}")
        shutdown_group(group)

    def receive(self, req: UpdateWeightsFromDistributed) -> list[tuple[str, torch.Tensor]]:
        """Receive the tensors named in `req` from rank 0; returns (name, tensor) in order."""
        group = self.groups.get(req.group_name)
        if group is None:
            raise ValueError(f"no weight update group {req.group_name!r}; call /init_weights_update_group")
        if req.group_name in self.broken:
            raise RuntimeError(f"weight update group {req.group_name!r} failed earlier; it must be rebuilt")
        try:
            return self._receive(group, req)
        except Exception:
            # Whatever failed, this engine and rank 0 no longer agree on which broadcast comes next.
            self.broken.add(req.group_name)
            raise

    def _receive(
        self, group: dist.ProcessGroup, req: UpdateWeightsFromDistributed
    ) -> list[tuple[str, torch.Tensor]]:
        if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        dtypes = [dtype_from_name(d) for d in req.dtypes]
        if req.load_format == FLATTENED_BUCKET:
            sizes = [math.prod(s) * d.itemsize for s, d in zip(req.shapes, dtypes, strict=True)]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            broadcast(group, flat)
            parts = flat.split(sizes)
            return [
                (name, part.view(dtype).view(shape))
                for name, part, dtype, shape in zip(req.names, parts, dtypes, req.shapes, strict=True)
            ]
        if req.load_format is not None:
            raise ValueError(f"load_format {req.load_format!r}: expected null or {FLATTENED_BUCKET!r}")
        out = []
        for name, shape, dtype in zip(req.names, req.shapes, dtypes, strict=True):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            broadcast(group, t)
            out.append((name, t))
        return out
