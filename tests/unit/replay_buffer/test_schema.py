import msgspec
import pytest

from replay_buffer.schema import (
    DEFAULT_TEMPERATURE,
    SCHEMA_VERSION,
    RecordError,
    Sample,
    decode,
    encode,
    make_group,
)


def _sample(versions=(3, 4), mask=(1, 1)) -> Sample:
    n = len(versions)
    return Sample.build(
        prompt_ids=[1, 5],
        response_ids=[7] * n,
        loss_mask=list(mask),
        behavior_logprobs=[-0.5] * n,
        token_versions=list(versions),
        reward=1.0,
        finish_reason="stop",
    )


def test_round_trip_and_version_span():
    g = make_group("job", "p1", [_sample((3, 4)), _sample((2, 5))])
    assert (g.min_version, g.max_version) == (2, 5)
    assert decode(encode(g)) == g


def test_masked_tokens_do_not_count_for_versions():
    g = make_group("job", "p1", [_sample((7, -1), mask=(1, 0))])
    assert (g.min_version, g.max_version) == (7, 7)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda g: setattr(g.samples[0], "loss_mask", b"\x01\x01\x01"), r"samples\[0\]\.loss_mask: length 3"),
        (lambda g: setattr(g.samples[0], "loss_mask", b"\x01\x02"), r"samples\[0\]\.loss_mask: values"),
        (lambda g: setattr(g.samples[0], "response_ids", b"\x00" * 9), r"response_ids: 9 bytes"),
        (lambda g: setattr(g.samples[0], "finish_reason", "boom"), "finish_reason"),
        (lambda g: setattr(g, "schema_version", 99), "schema_version"),
        (lambda g: setattr(g, "samples", []), "empty group"),
    ],
)
def test_invalid_records_are_rejected_with_reason(mutate, reason):
    g = make_group("job", "p1", [_sample()])
    mutate(g)
    with pytest.raises(RecordError, match=reason):
        decode(encode(g))


def test_garbage_bytes_raise_record_error():
    with pytest.raises(RecordError, match="decode"):
        decode(b"\x93not msgpack of a group")


def test_packed_fields_round_trip_values():
    s = _sample((3, 4))
    assert s.view("response_ids").tolist() == [7, 7] and len(s) == 2
    assert s.view("behavior_logprobs").tolist() == [-0.5, -0.5]
    assert s.view("token_versions").tolist() == [3, 4] and s.view("loss_mask").tolist() == [1, 1]


class _OldSample(msgspec.Struct):
    """A sample as records carried it before they recorded temperature and prompt length."""

    prompt_ids: bytes
    response_ids: bytes
    loss_mask: bytes
    behavior_logprobs: bytes
    token_versions: bytes
    reward: float
    finish_reason: str
    num_turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0


class _OldGroup(msgspec.Struct):
    group_id: str
    job_id: str
    prompt_id: str
    samples: list[_OldSample]
    min_version: int
    max_version: int
    created_at: float
    schema_version: int = SCHEMA_VERSION


def test_samples_record_temperature_and_prompt_length():
    s = Sample.build(
        prompt_ids=[1, 5, 6],
        response_ids=[7, 8],
        loss_mask=[1, 1],
        behavior_logprobs=[-0.5, -0.5],
        token_versions=[0, 0],
        reward=1.0,
        finish_reason="stop",
        temperature=0.7,
    )
    assert (s.temperature, s.prompt_len, s.num_prompt_tokens) == (0.7, 3, 3)
    back = decode(encode(make_group("job", "p1", [s]))).samples[0]
    assert (back.temperature, back.prompt_len) == (0.7, 3)


def test_old_record_without_the_fields_decodes_with_the_documented_defaults():
    new = _sample()
    old = _OldSample(**{f: getattr(new, f) for f in _OldSample.__struct_fields__})
    data = msgspec.msgpack.encode(_OldGroup("g", "job", "p1", [old], 3, 4, 0.0))
    assert b"temperature" not in data and b"prompt_len" not in data
    (s,) = decode(data).samples
    assert s.temperature == DEFAULT_TEMPERATURE == 1.0
    assert s.prompt_len == -1
    assert s.num_prompt_tokens == 2  # counted from prompt_ids


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("prompt_len", 5, r"samples\[0\]\.prompt_len: 5 != prompt_ids 2"),
        ("temperature", -0.5, r"samples\[0\]\.temperature"),
        ("temperature", float("nan"), r"samples\[0\]\.temperature"),
    ],
)
def test_bad_temperature_or_prompt_length_is_rejected(field, value, reason):
    g = make_group("job", "p1", [_sample()])
    setattr(g.samples[0], field, value)
    with pytest.raises(RecordError, match=reason):
        decode(encode(g))
