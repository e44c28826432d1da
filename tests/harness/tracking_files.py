"""What a job's experiment tracking writes, read back: a job spec writing into a given output_dir, its
TensorBoard event files through TensorBoard's EventAccumulator, and the history rows of its W&B offline runs."""

import glob
import json
import struct
import time

import jobspec


def tracking_spec(out, wandb=True, **extra) -> jobspec.JobSpec:
    """The job "trk" writing into `out`, W&B (offline) on or off, with `extra` top-level sections."""
    raw = {"name": "trk", "output_dir": str(out), "tracking": {"wandb": {"enabled": wandb}}, **extra}
    return jobspec.from_dict(raw)


def tb_events(out):
    """The TensorBoard events under out/tensorboard, every scalar and tensor loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def wandb_history(out, timeout_s: float = 60.0) -> list[dict]:
    """The history rows of every W&B offline run under out/wandb (their `.wandb` files: W&B's record
    log, 32 KiB blocks of checksum/length/type-framed protobuf records after a 7-byte header).
    `run.finish()` returns before wandb-core's writer has flushed the file (seen: 7 bytes, the header,
    right after it), so each file is read again until it ends with its run's `exit` record, for at most
    timeout_s."""
    paths = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    deadline = time.monotonic() + timeout_s
    rows = []
    for path in paths:
        while True:
            kinds, found = _records(path)
            if "exit" in kinds:
                break
            assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s:.0f} s: {kinds}"
            time.sleep(0.2)
        rows += found
    return rows


def _records(path) -> tuple[list[str], list[dict]]:
    """(every record's type, the history rows) of one `.wandb` file as it is now."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    kinds, rows = [], []
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            buf = chunk
        elif kind in (3, 4):
            buf += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            kinds.append(rec.WhichOneof("record_type"))
            if kinds[-1] == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                )
    return kinds, rows
