import torch
from oracles import build_batch
from sample_pair import sample_pair_group


def test_tokens_align_with_next_token_logprobs():
    batch = build_batch([sample_pair_group()], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 2], [1, 5, 9, 8, 2]]
    # position t predicts token t+1: a's response starts at index 3 -> positions 2, 3
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 1]]
    assert batch.behav_logprobs.tolist() == [[0, 0, -0.5, -0.25], [0, -1.0, 0, -2.0]]
    adv = batch.advantages
    assert adv[0, 2] > 0 and adv[1, 1] < 0 and torch.allclose(adv[0, 2] + adv[1, 1], torch.tensor(0.0))
    assert batch.num_response_tokens == 5
