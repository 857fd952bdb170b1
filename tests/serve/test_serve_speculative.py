"""`ouro serve --speculative-algorithm NEXTN` as a real process: the official client gets the
plain engine's greedy text, and /metrics reports the acceptance (SGLang's spec_accept_length)."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.helpers.serve_helpers import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("tiny-py", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
               "--speculative-num-draft-tokens", "3", tmp_path=tmp_path_factory.mktemp("spec_logs"))
    yield s
    s.stop()


@pytest.mark.processes
def test_speculative_server_gives_the_plain_engines_text_and_reports_acceptance(server):
    from ouro import LLM, SamplingParams
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    prompt = "def fibonacci(n):\n    if n < 2:\n"
    want = LLM("tiny-py", max_memory=64 << 20, page_size=16).generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].text
    got = client.completions.create(model=None, prompt=prompt, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want and got.usage.completion_tokens == 20
    deadline = time.monotonic() + 10
    while True:           # the engine's heartbeat, which carries the figures, trails the reply a little
        text = httpx.get(server.base + "/metrics").text
        length = float(re.search(r'^ouro:spec_accept_length\{[^}]*\} (\S+)', text, re.M).group(1))
        if length > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 1.0 < length <= 3.0
    assert re.search(r'^ouro:spec_accept_rate_per_position\{[^}]*position="2"[^}]*\} \S+', text, re.M)
    from ouro.bench.serve import speculative_metrics
    spec = speculative_metrics(server.base)                 # what `ouro bench serve` prints
    assert spec["accept_length"] == length and len(spec["accept_rate_per_position"]) == 2


def test_disaggregated_workers_get_the_same_speculation():
    """`ouro serve --disagg 1P1D --speculative-algorithm NEXTN`: both roles lay their caches out with the
    draft layer and run the same speculation (the transfer itself: tests/engine/test_speculative.py)."""
    from ouro.cli import build_parser
    from ouro.disagg.command import worker_argv
    args = build_parser().parse_args(["serve", "--model", "tiny-py", "--disagg", "1P1D", "--speculative-algorithm", "mtp",
                                      "--speculative-num-steps", "2", "--speculative-canary-min-accept-length", "1.2"])
    for role in ("prefill", "decode"):
        argv = worker_argv(args, role, 30000)
        assert argv[argv.index("--speculative-algorithm") + 1] == "MTP"
        assert argv[argv.index("--speculative-num-steps") + 1] == "2"
        assert argv[argv.index("--speculative-canary-min-accept-length") + 1] == "1.2"
        assert build_parser().parse_args(argv[3:]).speculative_num_steps == 2      # the worker parses it back
    plain = build_parser().parse_args(["serve", "--model", "tiny-py", "--disagg", "1P1D"])
    assert "--speculative-algorithm" not in worker_argv(plain, "prefill", 30000)
