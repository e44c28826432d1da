"""Replay buffer: group records on a Redis Stream with staleness-bounded, at-least-once consumption.

May import: common.
"""

from replay_buffer.keys import JobKeys
from replay_buffer.producer import BufferProducer
from replay_buffer.schema import GroupRecord, RecordError, Sample, decode, encode, make_group
from replay_buffer.stream import Entry, ReplayBuffer

__all__ = [
    "BufferProducer",
    "Entry",
    "GroupRecord",
    "JobKeys",
    "RecordError",
    "ReplayBuffer",
    "Sample",
    "decode",
    "encode",
    "make_group",
]
