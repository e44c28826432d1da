"""Grammar-constrained decoding in the built-in engine (regex / json_schema / ebnf through xgrammar): the
runner's greedy output equals an oracle that masks the HF model's logits with xgrammar step by step,
with its reported logprobs the masked ones; sampled outputs match their grammar; constrained and free
rows share batches; HTTP: invalid grammars are a 400 that queues nothing, n > 1 gets one matcher per
sample, streaming ends where the grammar does, and the metrics count it all."""

from __future__ import annotations

import re

import http_calls
import httpx
import pytest
import torch
import xgrammar as xgr
from sse_stream import stream_objects
from tiny_engine_model import build_noisy_model, greedy_reference

from generator_fleet.engine import EngineServer
from generator_fleet.engine.grammar import GrammarBackend, GrammarError
from generator_fleet.engine.request import Request, SamplingParams
from generator_fleet.engine.runner import Runner

CONTEXT = 256
API_KEY = "grammar-test-key"
REGEXES = [r"[0-9]{3}\+1=", r"(12|345)+=?", r"=[0-9]*", r"[1-3]+\+[4-6]+=[0-9]{1,2}"]
EBNF = 'root ::= num "+" num "=" num\nnum ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar") / "m"
    m, tok = build_noisy_model(path, seed=5)
    return path, m, tok


@pytest.fixture(scope="module")
def runner(model):
    path, _, _ = model
    r = Runner(str(path), context_length=CONTEXT)
    r.start()
    yield r
    r.stop()


def constrained_reference(
    model, tokenizer, eos: set[int], prompt: list[int], kind: str, text: str, n: int
) -> tuple[list[int], list[float]]:
    """Greedy decoding without a cache: the HF model's logits masked with xgrammar's bitmask for the
    tokens so far, argmax, the masked log-softmax's logprob; stops after a stop token or when the
    matcher terminates."""
    vocab = model.get_output_embeddings().weight.shape[0]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=sorted(eos))
    compiler = xgr.GrammarCompiler(info)
    compiled = {
        "regex": compiler.compile_regex,
        "ebnf": compiler.compile_grammar,
        "json_schema": compiler.compile_json_schema,
    }[kind](text)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()[None].clone()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            tok = int(logits[0].argmax())
            lps.append(float(torch.log_softmax(logits[0], -1)[tok]))
            assert matcher.accept_token(tok)
            ids.append(tok)
            out.append(tok)
            if tok in eos or matcher.is_terminated():
                break
    return out, lps


def greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def test_greedy_constrained_rows_equal_the_masked_oracle_in_one_batch_with_free_rows(model, runner):
    _, m, tok = model
    prompt = tok.encode("12+34=")
    cases = [("regex", r) for r in REGEXES] + [("ebnf", EBNF)]
    futs = [
        runner.submit(Request(f"g{i}", prompt, greedy(), constraint=runner.grammar.constraint(k, t)))
        for i, (k, t) in enumerate(cases)
    ]
    free = [
        runner.submit(
            Request(f"f{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
        )
        for i, p in enumerate([prompt, tok.encode("7+8=")])
    ]
    outs = [f.result(60) for f in futs]
    for (kind, text), c in zip(cases, outs, strict=True):
        ref_ids, ref_lps = constrained_reference(m, tok, runner.eos_token_ids, prompt, kind, text, 24)
        assert c.output_ids == ref_ids, (kind, text)
        assert c.output_logprobs == pytest.approx(ref_lps, abs=1e-4), (kind, text)
        assert c.finish_reason == {"type": "stop", "matched": c.output_ids[-1]}
        body = tok.decode(c.output_ids[:-1])
        pattern = text if kind == "regex" else r"[1-9][0-9]?\+[1-9][0-9]?=[1-9][0-9]?"
        assert re.fullmatch(pattern, body), (pattern, body)
    # Unconstrained rows of the same batches are untouched by the masks.
    assert [f.result(60).output_ids for f in free] == [
        greedy_reference(m, p, 12) for p in (prompt, tok.encode("7+8="))
    ]


def test_the_grammar_differs_from_free_greedy_and_forced_tokens_have_logprob_zero(model, runner):
    _, m, tok = model
    prompt = tok.encode("5+5=")
    free = greedy_reference(m, prompt, 6)
    forced = "=" * 6  # a fixed string: every token forced
    assert tok.decode(free) != forced
    c = runner.submit(
        Request("forced", prompt, greedy(), constraint=runner.grammar.constraint("regex", re.escape(forced)))
    ).result(60)
    assert tok.decode(c.output_ids[:-1]) == forced
    assert c.output_ids[-1] in runner.eos_token_ids
    # SGLang reports the masked distribution's logprobs: a token that was the only choice has logprob 0.
    assert c.output_logprobs == pytest.approx([0.0] * len(c.output_ids), abs=1e-6)


def test_sampled_constrained_outputs_match_with_penalties_seeds_and_top_k(runner, model):
    _, _, tok = model
    prompt = tok.encode("3+4=")
    pattern = r"[0-9]{2,4}=\+?"
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=3, top_p=0.9),
        dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5),
        dict(temperature=1.0, sampling_seed=7),
        dict(temperature=1.0, min_new_tokens=2),
    ]
    futs = []
    for i, s in enumerate(settings * 4):
        c = runner.grammar.constraint("regex", pattern)
        futs.append(
            runner.submit(Request(f"s{i}", prompt, SamplingParams(max_new_tokens=16, **s), constraint=c))
        )
    for f in futs:
        c = f.result(60)
        assert c.finish_reason["type"] == "stop", c.finish_reason
        assert re.fullmatch(pattern, tok.decode(c.output_ids[:-1])), tok.decode(c.output_ids)


def test_ignore_eos_finishes_when_the_matcher_terminates_and_length_cuts_it_short(runner, model):
    _, _, tok = model
    prompt = tok.encode("1+1=")
    c = runner.submit(
        Request(
            "ie",
            prompt,
            SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True),
            constraint=runner.grammar.constraint("regex", "12="),
        )
    ).result(60)
    assert tok.decode(c.output_ids[:-1]) == "12=" and c.output_ids[-1] in runner.eos_token_ids
    assert c.finish_reason == {"type": "stop", "matched": c.output_ids[-1]}
    c = runner.submit(
        Request("len", prompt, greedy(2), constraint=runner.grammar.constraint("regex", "12345"))
    ).result(60)
    assert tok.decode(c.output_ids) == "12" and c.finish_reason == {"type": "length", "length": 2}


def test_compile_cache_is_bounded_and_errors_carry_xgrammars_message(model):
    _, _, tok = model
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id}, cache_size=2)
    compiled, errors = [], []
    backend.on_compile.append(lambda kind, s: compiled.append(kind))
    backend.on_compile_error.append(errors.append)
    a = backend.compile("regex", "1+")
    assert backend.compile("regex", "1+") is a and compiled == ["regex"]
    backend.compile("regex", "2+")
    backend.compile("ebnf", 'root ::= "1"')
    assert backend.cached == 2
    assert backend.compile("regex", "1+") is not a  # evicted, compiled again
    with pytest.raises(GrammarError, match=r"invalid regex: Regex parsing error.*parenthesis is not closed"):
        backend.compile("regex", "(12")
    with pytest.raises(GrammarError, match='invalid ebnf: .*Rule "num" is not defined'):
        backend.compile("ebnf", "root ::= num")
    with pytest.raises(GrammarError, match="invalid json_schema"):
        backend.compile("json_schema", "{not json")
    assert errors == ["regex", "ebnf", "json_schema"]


# ---- over HTTP -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model):
    path, _, _ = model
    s = EngineServer(str(path), api_key=API_KEY, context_length=CONTEXT).start()
    yield s
    s.stop()


def _post(server, body: dict, path: str = "/generate") -> httpx.Response:
    return http_calls.post(
        server.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    )


def _metric(server, name: str, **labels) -> float:
    text = http_calls.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_http_regex_n_samples_batch_and_metrics(server):
    before = _metric(server, "slipstream_engine_grammar_requests_total", kind="regex")
    pattern = r"[1-4]{2}\+[5-9]="
    body = {
        "text": ["12+", "9+9="],
        "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "n": 3, "regex": pattern},
        "return_logprob": True,
    }
    r = _post(server, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out) == 6
    for o in out:
        assert re.fullmatch(pattern, o["text"]), o["text"]  # the stop token is trimmed from text
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
    assert _metric(server, "slipstream_engine_grammar_requests_total", kind="regex") == before + 6
    assert _metric(server, "slipstream_engine_grammar_compile_seconds_count", kind="regex") >= 1
    assert _metric(server, "slipstream_engine_grammar_mask_seconds_count") > 0


def test_http_ebnf_and_streaming_end_where_the_grammar_does(server):
    sp = {"max_new_tokens": 20, "temperature": 0.0, "ebnf": EBNF}
    whole = _post(server, {"text": "12+34=", "sampling_params": sp})
    assert whole.status_code == 200, whole.text
    text = whole.json()["text"]
    assert re.fullmatch(r"[1-9][0-9]?\+[1-9][0-9]?=[1-9][0-9]?", text), text
    chunks = stream_objects(server.url, {"text": "12+34=", "sampling_params": sp, "stream": True}, API_KEY)
    assert chunks[-1]["text"] == text
    assert chunks[-1]["meta_info"]["finish_reason"] == whole.json()["meta_info"]["finish_reason"]


def test_http_invalid_grammars_are_a_400_with_xgrammars_message_and_queue_nothing(server):
    errors = _metric(server, "slipstream_engine_grammar_compile_errors_total")
    done = _metric(server, "sglang:num_requests_total")
    for key, value, message in (
        ("regex", "(12", "parenthesis is not closed"),
        ("ebnf", "root ::= nothing_here", 'Rule "nothing_here" is not defined'),
        ("json_schema", "{not json", "Failed to parse JSON"),
    ):
        r = _post(server, {"text": ["1+", "2+"], "sampling_params": {"max_new_tokens": 4, key: value}})
        assert r.status_code == 400, r.text
        text = r.json()["error"]["message"]
        assert text.startswith(f"invalid {key}: ") and message in text, text
    assert _metric(server, "slipstream_engine_grammar_compile_errors_total") == errors + 3
    assert _metric(server, "sglang:num_requests_total") == done  # nothing was queued
    r = _post(server, {"text": "1+", "sampling_params": {"regex": "1", "ebnf": 'root ::= "1"'}})
    assert r.status_code == 400 and "Only one of regex, json_schema, or ebnf" in r.text
    r = _post(server, {"text": "1+", "sampling_params": {"structural_tag": '{"format": {}}'}})
    assert r.status_code == 400 and "structural_tag is not supported" in r.text


def test_a_grammar_no_token_can_continue_aborts_only_its_request(runner, model):
    _, m, tok = model
    prompt = tok.encode("12+34=")
    # The arithmetic tokenizer has no letters: after "1" the regex needs an "a" that no token gives.
    stuck = runner.submit(
        Request("stuck", prompt, greedy(8), constraint=runner.grammar.constraint("regex", "1a+"))
    )
    free = runner.submit(
        Request("free", prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    )
    c = stuck.result(60)
    assert c.finish_reason["type"] == "abort"
    assert "no token of the model's vocabulary can continue the regex" in c.finish_reason["message"]
    assert tok.decode(c.output_ids) == "1" and len(c.output_logprobs) == 1
    assert free.result(60).output_ids == greedy_reference(m, prompt, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constrained_rows_of_cuda_graph_steps_equal_the_masked_oracle(model):
    """On CUDA the decode step is a captured graph that samples every row itself; rows with a grammar are
    sampled again from their masked logits (fp32, so the CPU oracle's tokens are the reference)."""
    path, m, tok = model
    r = Runner(str(path), device="cuda", dtype=torch.float32, context_length=CONTEXT)
    assert r.graphs is not None
    r.start()
    try:
        prompt = tok.encode("12+34=")
        cases = [("regex", x) for x in REGEXES] + [("ebnf", EBNF)]
        futs = [
            r.submit(Request(f"g{i}", prompt, greedy(), constraint=r.grammar.constraint(k, t)))
            for i, (k, t) in enumerate(cases)
        ]
        free = [  # graph-sampled rows (greedy and temperature) in the same batches
            r.submit(
                Request("fg", prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
            ),
            r.submit(
                Request("ft", prompt, SamplingParams(max_new_tokens=12, temperature=0.8, ignore_eos=True))
            ),
        ]
        for (kind, text), f in zip(cases, futs, strict=True):
            c = f.result(120)
            ref_ids, ref_lps = constrained_reference(m, tok, r.eos_token_ids, prompt, kind, text, 24)
            assert c.output_ids == ref_ids, (kind, text)
            assert c.output_logprobs == pytest.approx(ref_lps, abs=1e-3), (kind, text)
        assert free[0].result(120).output_ids == greedy_reference(m, prompt, 12)
        assert len(free[1].result(120).output_ids) == 12
        assert r.graphs.graphs, "no decode step ran as a CUDA graph"
    finally:
        r.stop()
