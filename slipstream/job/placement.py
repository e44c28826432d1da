"""Where a colocated job's actors run (`placement: colocated`): engine i and trainer rank i share one
device, and every one of them is on one host, so the weight bus hands weights over in place (CUDA IPC
handles, shared memory on CPU) instead of through a group.

- cuda: one Ray placement group of one {"GPU": 1} bundle per trainer rank, STRICT_PACK (one node).
  Trainer rank i and engine i each take half of bundle i's GPU (`num_gpus=0.5`, slime and verl's way),
  so Ray never puts them on different GPUs and sets the same CUDA_VISIBLE_DEVICES for both. A
  replacement engine goes into its predecessor's bundle, a restarted trainer rank into its own. Every
  trainer rank hands the weights to the engine on its own GPU (an engine sees only its GPU, and a CUDA-IPC
  handle opens only there: weight_bus/rank_handoff.py); rank 0 pauses and continues them all.
- cpu: no GPU resources; every actor is pinned to the driver's node (shared memory is per host).

A disaggregated job has no `Colocation`: the pools reserve whole GPUs per actor as before.
"""

from __future__ import annotations

import logging
from typing import Any

from common.config import RAY_BUILTIN_RESOURCES
from jobspec import JobSpec
from weight_bus.config import ASYNC_MEM_FRACTION

log = logging.getLogger("slipstream.job.placement")

SHARE = 0.5
"""The part of a bundle's GPU each of its two actors (the engine, the trainer rank) reserves."""
READY_TIMEOUT_S = 60.0
"""How long the placement group may take to be reserved before the job fails (Ray would wait forever)."""


class Colocation:
    """A colocated job's reservation: `engine(i)` and `trainer(i)` are the Ray actor options that put
    engine i and trainer rank i on device slot i. Nothing is reserved before `reserve`."""

    def __init__(self, cuda: bool, slots: int = 1, cpus_per_engine: float = 0) -> None:
        """`cuda`: one GPU per slot (`slots` of them), else the driver's host; `cpus_per_engine`: the
        CPUs each engine reserves, held in its slot's bundle."""
        self.cuda = cuda
        self.slots = slots if cuda else 1
        self.cpus_per_engine = cpus_per_engine
        self.pg = None
        self.node_id: str | None = None

    def reserve(self) -> None:
        """Reserve the slots (idempotent); RuntimeError, naming what is missing, if Ray cannot."""
        import ray

        if self.pg is not None or self.node_id is not None:
            return
        if not self.cuda:
            self.node_id = ray.get_runtime_context().get_node_id()
            log.info("colocated on cpu: engines and trainer ranks pinned to node %s", self.node_id)
            return
        from ray.util.placement_group import placement_group

        per_node = max(
            (n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")),
            default=0,
        )
        if per_node < self.slots:
            raise RuntimeError(
                f"placement colocated: {self.slots} trainer ranks need {self.slots} GPUs on one node "
                f"(engines share them), but the largest node has {per_node:g} "
                "(trainer.num_trainers, generators.num_engines)"
            )
        bundle = {"GPU": 1}
        if cpus := self.cpus_per_engine:  # the engine's CPUs come out of its bundle
            bundle["CPU"] = cpus
        self.pg = placement_group([dict(bundle) for _ in range(self.slots)], strategy="STRICT_PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeError(
                f"placement colocated: Ray could not reserve {self.slots} GPUs on one node within "
                f"{READY_TIMEOUT_S:.0f} s (other jobs hold them?)"
            )
        log.info(
            "colocated on cuda: placement group of %d GPU bundles (engine + trainer rank each)", self.slots
        )

    def _options(self, slot: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        self.reserve()
        if self.cuda:
            return {
                "num_gpus": SHARE,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=slot % self.slots
                ),
            }
        return {
            "num_gpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(self.node_id, soft=False),
        }

    def engine(self, slot: int) -> dict[str, Any]:
        """Ray options of the engine on slot `slot` (its GPU share, or the driver's node)."""
        return self._options(slot)

    def trainer(self, rank: int) -> dict[str, Any]:
        """Ray options of trainer rank `rank` (the GPU share of its bundle, or the driver's node)."""
        return self._options(rank)

    def close(self) -> None:
        """Give the reservation back (after every actor in it stopped)."""
        import ray

        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception as e:  # Ray already shut down: nothing is held
                log.warning("removing the colocated placement group: %s", e)
            self.pg = None
        self.node_id = None


def engine_spec(spec: JobSpec) -> JobSpec:
    """`spec` with the generators section a colocated engine launches with: on the async schedule on
    cuda, an engine's memory share left null becomes weight_bus.config.ASYNC_MEM_FRACTION (its KV pool
    is sized to leave the trainer the rest); on the sync schedule an SGLang server gets
    --enable-memory-saver (without it, it cannot release its memory)."""
    import msgspec

    g = spec.generators
    if spec.schedule == "async" and spec.trainer.device == "cuda":
        if g.engine == "builtin" and g.mem_fraction_static is None:
            g = msgspec.structs.replace(g, mem_fraction_static=ASYNC_MEM_FRACTION)
        elif g.engine == "sglang" and g.sglang.mem_fraction_static is None:
            g = msgspec.structs.replace(
                g, sglang=msgspec.structs.replace(g.sglang, mem_fraction_static=ASYNC_MEM_FRACTION)
            )
    elif spec.schedule == "sync" and g.engine == "sglang" and not g.sglang.enable_memory_saver:
        g = msgspec.structs.replace(g, sglang=msgspec.structs.replace(g.sglang, enable_memory_saver=True))
    return spec if g is spec.generators else msgspec.structs.replace(spec, generators=g)


def colocation(spec: JobSpec) -> Colocation | None:
    """The job's Colocation if its placement is colocated, else None: one slot per trainer rank."""
    if spec.placement != "colocated":
        return None
    return Colocation(
        spec.trainer.device == "cuda", spec.trainer.num_trainers, spec.generators.cpus_per_engine
    )


def require_resources(key: str, wanted: dict[str, float]) -> None:
    """RuntimeError, naming `key` (`generators.resources`), unless some alive Ray node has every resource
    in `wanted`, each at least in the amount asked for: Ray would keep the actors pending forever."""
    import ray

    if not wanted:
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if any(all(n["Resources"].get(k, 0) >= v for k, v in wanted.items()) for n in nodes):
        return
    have = {
        n.get("NodeManagerAddress", "?"): sorted(k for k in n["Resources"] if k not in RAY_BUILTIN_RESOURCES)
        for n in nodes
    }
    raise RuntimeError(
        f"{key}: no node of the Ray cluster has {wanted} (the nodes' custom resources: {have}; start a "
        "node with `ray start --resources '{\"NAME\": AMOUNT}' ...`)"
    )
