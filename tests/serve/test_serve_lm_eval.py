"""lm-eval's `local-completions` model against a real `ouro serve`: a multiple-choice task, a
rolling-loglikelihood (perplexity) task and a generation task, defined here in YAML over local
JSON files. lm-eval finds the tokenizer through the server (`/tokenizer_info`, `/tokenize`,
`/detokenize`: no local copy), scores with `echo` + `logprobs` + `max_tokens: 1` over batched
token-id prompts, and every score it reads equals the offline engine's `prompt_logprobs` sum over
the same tokens to 1e-5 per token; every generation equals offline greedy decoding."""

import json
import os

import pytest

from tests.helpers.serve_helpers import Server, idle

pytestmark = pytest.mark.processes

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test extra: pip install -e '.[test]'")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm_eval[api]")

PER_TOKEN = 1e-5
MC = [{"question": "def add(a, b):\n    return", "choices": ["a + b", "a - b", "None"], "answer": 0},
      {"question": "import", "choices": ["os", "sys", "banana"], "answer": 0},
      {"question": "for i in", "choices": ["range(10):", "list:", "5"], "answer": 0},
      {"question": "class Queue", "choices": [":", "(object):", "= 3"], "answer": 1},
      {"question": "x =", "choices": ["[]", "{}", "None", "0"], "answer": 2}]
PPL = [{"text": "def read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()\n"},
       {"text": "import os\nimport sys\n\n\ndef main():\n    print(sys.argv)\n"},
       {"text": "x = [i * i for i in range(10)]\n"}]
GEN = [{"prompt": "def read_lines(path):\n", "target": "    with open(path) as f:"},
       {"prompt": "import os\n", "target": "import sys"},
       {"prompt": "class Stack:\n    def __init__(self):\n", "target": "        self.items = []"}]
COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
"""
TASKS = {
    "ouro_mc": (MC, """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""),
    "ouro_ppl": (PPL, """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""),
    "ouro_gen": (GEN, """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")}


def write_tasks(root) -> str:
    for name, (rows, body) in TASKS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(f"task: {name}\n" + COMMON.format(data=data, cache=root / "hf") + body)
    return str(root)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("tiny-py", tmp_path=tmp_path_factory.mktemp("lm_eval_logs"))
    yield s
    s.stop()


def run_lm_eval(server, tasks_dir):
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager
    lm = get_model("local-completions")(model="tiny-py", base_url=server.base + "/v1/completions", batch_size=4,
                                        num_concurrent=1, max_retries=1, max_length=512)
    assert lm.tokenizer_backend == "remote"        # found through /tokenizer_info: no local tokenizer
    out = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), task_manager=TaskManager(include_path=tasks_dir),
                                  log_samples=True, bootstrap_iters=0, random_seed=0)
    return lm, out


def offline_scores(llm, prompts_and_starts):
    """By the offline engine: the sum of each prompt's logprobs from position `start` on, the count
    of those tokens, and whether each of them was the most likely one (lm-eval's is_greedy)."""
    from ouro import SamplingParams
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in prompts_and_starts],
                        SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1))
    scores = []
    for (ids, start), o in zip(prompts_and_starts, outs):
        assert o.token_ids == [] and o.prompt_token_ids == ids
        entries = [(o.prompt_logprobs[p], t) for p, t in enumerate(ids) if p >= start]
        scores.append((sum(e[t] for e, t in entries), len(entries), all(e[t] == max(e.values()) for e, t in entries)))
    return scores


def test_lm_eval_local_completions_equals_the_offline_engine(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm, out = run_lm_eval(server, write_tasks(tmp_path))
    from lm_eval import utils
    from ouro import LLM, SamplingParams
    llm = LLM("tiny-py", max_memory=64 << 20, page_size=16)
    samples = out["samples"]

    # multiple choice: one (context, continuation) per choice, scored with echo over token ids
    mc = [(s["doc_id"], req, resp[0]) for s in samples["ouro_mc"] for req, resp in zip(s["arguments"], s["resps"])]
    assert len(mc) == sum(len(d["choices"]) for d in MC)
    pairs = [lm._encode_pair(req[0], req[1]) for _, req, _ in mc]
    want = offline_scores(llm, [(ctx + cont, len(ctx)) for ctx, cont in pairs])
    for (_, req, (got, greedy)), (ll, n, offline_greedy) in zip(mc, want):
        assert abs(got - ll) <= PER_TOKEN * n and greedy == offline_greedy, (req, got, ll, greedy)
    assert out["results"]["ouro_mc"]["sample_len"] == len(MC)

    # rolling loglikelihood: each document in windows after the prefix token, every token scored
    assert lm.prefix_token_id is not None
    for s in samples["ouro_ppl"]:
        text = s["arguments"][0][0]
        windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length - 1,
            context_len=1)]
        scored = offline_scores(llm, [(ctx + cont, len(ctx)) for ctx, cont in windows])
        ll, n = sum(x for x, _, _ in scored), sum(k for _, k, _ in scored)
        assert n == len(lm.tok_encode(text)) and abs(s["resps"][0][0] - ll) <= PER_TOKEN * n, (text, s["resps"], ll)
    assert out["results"]["ouro_ppl"]["bits_per_byte,none"] > 0

    # generation: greedy, cut at the task's stop string, as the offline engine decodes it
    for s in samples["ouro_gen"]:
        context, kwargs = s["arguments"][0]
        want = llm.generate({"prompt_token_ids": lm.tok_encode(context)}, SamplingParams(
            temperature=0, max_tokens=kwargs["max_gen_toks"], stop=kwargs["until"]))[0]
        assert s["resps"][0][0] == want.text, (context, s["resps"], want.text)
    assert idle(server), server.metrics()
