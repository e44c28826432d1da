from model_zoo.tiny_tools import build_tokenizer
from replay_buffer import Sample
from trainer.trainer import render_sample


def test_render_sample_labels_model_and_context_segments():
    tok = build_tokenizer()
    enc = tok.encode
    resp = enc("<tool_call>x</tool_call>") + enc("\n<|im_start|>tool\n4<|im_end|>\n") + enc("ok")
    n1, n2 = len(enc("<tool_call>x</tool_call>")), len(enc("\n<|im_start|>tool\n4<|im_end|>\n"))
    mask = [1] * n1 + [0] * n2 + [1] * len(enc("ok"))
    s = Sample.build(
        prompt_ids=enc("Q?"),
        response_ids=resp,
        loss_mask=mask,
        behavior_logprobs=[0.0] * len(resp),
        token_versions=[0] * len(resp),
        reward=1.0,
        finish_reason="stop",
    )
    text = render_sample(tok, s)
    assert text.splitlines()[0] == "[prompt] Q?"
    assert (
        "[model] <tool_call>x</tool_call>" in text and "[context] \n<|im_start|>tool\n4<|im_end|>\n" in text
    )
    assert text.endswith("[model] ok")
