"""The offline `LLM` API on the tiny preset (with its tokenizer)."""

import pytest

from ouro import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), max_memory=64 << 20, page_size=16)


def test_generate_text_and_token_prompts(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text, ids = llm.generate(["Hello there", {"prompt_token_ids": [5, 6, 7]}], greedy)
    assert len(text.token_ids) == 8 and text.finish_reason == "length"
    assert text.text == llm.engine.tokenizer.decode(text.token_ids)
    assert ids.prompt_token_ids == [5, 6, 7]
    assert text.usage["completion_tokens"] == 8 and text.usage["prompt_tokens"] == len(text.prompt_token_ids)
    # greedy is deterministic across calls and batch composition
    again = llm.generate("Hello there", greedy)[0]
    assert again.token_ids == text.token_ids


def test_no_prompts_give_no_results(llm):
    """generate([]) had looped forever naming request ids for no requests (run on a thread, so a
    regression fails here instead of hanging the suite)."""
    import threading
    got = []
    worker = threading.Thread(target=lambda: got.append((llm.generate([], SamplingParams(max_tokens=4)),
                                                         llm.generate([], []))), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and got == [([], [])]
    assert len(llm.generate(["a"], SamplingParams(max_tokens=1))) == 1      # still serving


def test_bytes_and_stop_ids_past_the_vocabulary_are_refused(llm):
    with pytest.raises(TypeError, match="got bytes"):
        llm.generate(b"abc", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="stop_token_ids out of range"):
        llm.generate("abc", SamplingParams(max_tokens=1, stop_token_ids=[3, 10 ** 9]))
    assert len(llm.generate("abc", SamplingParams(max_tokens=1, stop_token_ids=[3]))) == 1


def test_n_and_logprobs(llm):
    p = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=5, logprobs=2, ignore_eos=True)
    (res,) = llm.generate("abc", p)
    assert len(res.outputs) == 3
    for o in res.outputs:
        assert len(o.logprobs) == 5 and all(lp <= 0 for lp in o.logprobs)
        assert all(len(top) == 2 and top[0][1] >= top[1][1] for top in o.top_logprobs)


def test_stop_string_spanning_tokens_is_excluded(llm):
    """Pick two adjacent generated tokens that decode to plain ASCII and stop on the string made of
    the last character of the first and the first character of the second."""
    tok = llm.engine.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in ("The engine", "Serving models", "abc", "Hello there"):
        base = llm.generate(prompt, greedy)[0]
        pieces = [tok.decode([t]) for t in base.token_ids]
        pair = next((j for j in range(len(pieces) - 1)
                     if all(p.isascii() and p.strip() for p in pieces[j:j + 2])), None)
        if pair is not None:
            break
    assert pair is not None, "no ASCII token pair to build a stop string from"
    stop = pieces[pair][-1] + pieces[pair + 1][0]
    start = base.text.find(stop)
    assert 0 <= start < len(tok.decode(base.token_ids[:pair + 1]))
    res = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert res.finish_reason == "stop" and res.outputs[0].stop_reason == stop
    assert res.text == base.text[:start] and stop not in res.text


def test_missing_tokenizer_rejects_text_but_serves_ids(tmp_path):
    from ouro.models.presets import make_model
    make_model("tiny", tmp_path, progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / f).unlink()
    llm = LLM(str(tmp_path), max_memory=64 << 20, page_size=16)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text", SamplingParams(max_tokens=2))
