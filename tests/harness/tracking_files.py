"""What a job's experiment tracking writes, read back: a job spec writing into a given output_dir, its
TensorBoard event files through TensorBoard's EventAccumulator, and the history rows of its W&B offline runs."""

import glob
import json
import struct

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


def wandb_history(out) -> list[dict]:
    """The history rows of every W&B offline run under out/wandb (their `.wandb` files: W&B's record
    log, 32 KiB blocks of checksum/length/type-framed protobuf records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B"
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
                if rec.WhichOneof("record_type") == "history":
                    rows.append(
                        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                    )
    return rows
