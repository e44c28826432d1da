import pytest

from replay_buffer.schema import RecordError, Sample, decode, encode, make_group


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
