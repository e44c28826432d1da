"""The model on a node that does not have `model.path`: the driver (on the head, which has the model)
puts the directory's files other than the weights — config, tokenizer, generation config, chat template
— into the job's Redis hash `model_files`; an engine or rollout worker on a node without the directory
writes them to a node-local cache and starts from there. A built-in engine then starts with random
weights and waits in the registry's joining set, taking no rollout traffic, until the weight bus gave it
the trainer's current weights (the path every engine joining mid-job takes; a trainer waiting for its
first batch publishes to joining engines: `bus.idle_sync_s`).

What cannot start this way, and so still needs the model on its node (a shared file system or a copy at
the same path): trainer ranks (they load the weights), a LoRA job's engines (the bus sends the adapter
only, never the base weights), and `engine: sglang` servers (a subprocess of their own)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from replay_buffer.client import connect
from replay_buffer.keys import JobKeys

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz")
"""Files that hold weights: never shipped (the weight bus carries the weights)."""
MAX_BYTES = 64 << 20
"""Most bytes of non-weight files shipped (a tokenizer is a few MiB); a larger directory is not shipped."""
CACHE = "slipstream-models"
"""Folder under the node's temp directory that holds shipped model directories, one per job and content."""


def shippable(path: str | Path) -> dict[str, bytes]:
    """The files of model directory `path` other than weights, {relative path: bytes}; empty if they
    exceed MAX_BYTES."""
    root = Path(path)
    files: dict[str, bytes] = {}
    total = 0
    for f in sorted(root.rglob("*")):
        if not f.is_file() or f.name.endswith(WEIGHT_SUFFIXES) or f.name.startswith("."):
            continue
        total += f.stat().st_size
        if total > MAX_BYTES:
            log.warning(
                "model %s: its files other than weights exceed %d MiB; nodes without it will not get them",
                root,
                MAX_BYTES >> 20,
            )
            return {}
        files[str(f.relative_to(root))] = f.read_bytes()
    return files


def publish(r, job: str, path: str | Path) -> int:
    """Driver: the job's `model_files` hash holds `path`'s shippable files (replacing what it held).
    Returns the bytes stored."""
    files = shippable(path)
    key = JobKeys(job).model_files
    pipe = r.pipeline(transaction=True)
    pipe.delete(key)
    if files:
        pipe.hset(key, mapping=files)
    pipe.execute()
    size = sum(len(v) for v in files.values())
    log.info("model files for nodes without %s: %d files, %d bytes in Redis", path, len(files), size)
    return size


def node_name() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only for the message
        pass
    return os.uname().nodename


def missing(path: str, who: str, why: str = "") -> FileNotFoundError:
    return FileNotFoundError(
        f"{who}: model.path {path} does not exist on node {node_name()}{why}: give this node the model at "
        "the same path (a shared file system or a copy; docs/multinode.md)"
    )


def local_model(path: str, who: str, redis_url: str, job: str, *, need_weights: str = "") -> tuple[str, bool]:
    """Where this process loads the model from, and whether the weights are there: `path` itself when
    this node has it; else, unless `need_weights` says why this process needs the weights from disk, a
    node-local copy of the files the driver shipped (no weights). Raises FileNotFoundError naming the path
    and the node otherwise (transformers would take a missing directory for a hub repo id)."""
    if not os.path.isabs(path) or os.path.exists(path):
        return path, True
    if need_weights:
        raise missing(path, who, f" and {need_weights}")
    raw = connect(redis_url).hgetall(JobKeys(job).model_files)
    files = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
    if not files:
        raise missing(path, who, " and the driver shipped none of its files")
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    dest = Path(tempfile.gettempdir()) / CACHE / job / digest.hexdigest()[:16]
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=dest.parent))
        for rel, data in files.items():
            target = (tmp / rel).resolve()
            if not target.is_relative_to(tmp.resolve()):
                raise ValueError(f"model file {rel!r} points outside the model directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        try:
            tmp.rename(dest)  # atomic: another process of this node may have won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "%s: model.path %s is not on node %s: its config and tokenizer (%d files) came from the head into %s",
        who,
        path,
        node_name(),
        len(files),
        dest,
    )
    return str(dest), False
