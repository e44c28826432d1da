"""Hand-made groups: two samples (rewards 1 and 0, one masked response token) for batch tests, and the
smallest group of a job and prompt for the buffer's bookkeeping tests."""

from replay_buffer import GroupRecord, Sample, make_group


def sample_pair_group() -> GroupRecord:
    a = Sample.build(
        prompt_ids=[1, 5, 6],
        response_ids=[7, 2],
        loss_mask=[1, 1],
        behavior_logprobs=[-0.5, -0.25],
        token_versions=[0, 0],
        reward=1.0,
        finish_reason="stop",
    )
    b = Sample.build(
        prompt_ids=[1, 5],
        response_ids=[9, 8, 2],
        loss_mask=[1, 0, 1],
        behavior_logprobs=[-1.0, 0.0, -2.0],
        token_versions=[0, -1, 0],
        reward=0.0,
        finish_reason="stop",
    )
    return make_group("j", "p", [a, b])


def one_token_group(job: str, prompt_id: str = "p") -> GroupRecord:
    """Two copies of a one-token sample (reward 1) for `prompt_id` of `job`."""
    s = Sample.build(
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        behavior_logprobs=[-0.1],
        token_versions=[0],
        reward=1.0,
        finish_reason="stop",
    )
    return make_group(job, prompt_id, [s, s])
