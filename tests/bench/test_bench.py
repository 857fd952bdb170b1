"""The benchmarks' figures are consistent with what they measured: ratios are recomputed from the
reported times and token counts, floors from the reported FLOPs, bytes and machine rates, and the
printed table says what the JSON says. Tiny preset, so the run takes seconds."""

import contextlib
import io
import json
import os
import re

import pytest

from ouro.bench.offline import decode_floor
from ouro.measure.roofline import Roofline
from ouro.measure.step_cost import prefill_cost
from ouro.cli import main
from ouro.models.loader import load_model

N, IN, OUT, CONC = 4, 24, 5, 2


@pytest.fixture(scope="module")
def offline(tiny_checkpoint, tmp_path_factory):
    """(JSON, printed table) of `ouro bench offline` run in-process."""
    out, printed = tmp_path_factory.mktemp("bench") / "r.json", io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "offline", "--model", str(tiny_checkpoint), "--num-prompts", str(N),
                     "--input-len", str(IN), "--output-len", str(OUT), "--max-concurrency", str(CONC),
                     "--compare", "transformers", "--output-json", str(out)])
    assert code == 0
    return json.loads(out.read_text()), printed.getvalue()


def floor_of(flops, nbytes, r):
    return max(flops / r["matmul_flops_per_s"], nbytes / r["copy_bytes_per_s"])


def test_token_counts_and_ratio(offline):
    r, _ = offline
    o, t = r["ouro"], r["transformers"]
    assert o["output_tokens"] == t["output_tokens"] == N * OUT
    assert o["output_tok_s"] == pytest.approx(N * OUT / o["seconds"])
    assert o["input_tok_s"] == pytest.approx(N * IN / o["seconds"])
    assert t["output_tok_s"] == pytest.approx(N * OUT / t["seconds"])
    assert r["ratio"] == pytest.approx((N * OUT / o["seconds"]) / (N * OUT / t["seconds"]))
    assert r["same_tokens"] == 1.0          # greedy outputs agree with transformers on the tiny preset
    # the totals are the waves' sums (ouro's wave, then transformers' on the same prompts)
    assert [w["prompts"] for w in r["waves"]] == [CONC] * (N // CONC)
    assert o["seconds"] == pytest.approx(sum(w["ouro_s"] for w in r["waves"]))
    assert t["seconds"] == pytest.approx(sum(w["transformers_s"] for w in r["waves"]))


def test_step_times_add_up(offline):
    o = offline[0]["ouro"]
    s = o["steps"]
    assert 0 < o["decode_steps_timed"] <= s["decode_only"]
    assert 1 <= s["with_prefill"] <= N          # each prompt is prefilled in one step (24 tokens < 2048)
    assert s["with_prefill_s"] + s["decode_only_s"] <= o["seconds"]


def test_floors_follow_from_reported_numbers(offline, tiny_checkpoint):
    r, _ = offline
    f, p = r["decode_floor"], r["prefill"]
    assert f["batch"] == CONC and IN + 1 <= f["context"] <= IN + OUT - 1   # tokens a decoded token sees
    assert f["floor_s"] == pytest.approx(floor_of(f["flops"], f["weight_bytes"] + f["cache_bytes"] + f["activation_bytes"], r))
    assert r["decode_step_over_floor"] == pytest.approx(r["ouro"]["decode_step_s"] / f["floor_s"])
    assert p["floor_s"] == pytest.approx(floor_of(p["flops"], p["bytes"], r))
    assert p["over_floor"] == pytest.approx(p["seconds"] / p["floor_s"])
    # the benchmark's floors are the step accounting at the reported shapes and rates
    model = load_model(tiny_checkpoint)
    roof = Roofline(flops_per_s=r["matmul_flops_per_s"], bytes_per_s=r["copy_bytes_per_s"])
    again = decode_floor(model, roof, f["context"], CONC)
    assert (again["flops"], again["weight_bytes"], again["cache_bytes"], again["activation_bytes"]) == \
        pytest.approx((f["flops"], f["weight_bytes"], f["cache_bytes"], f["activation_bytes"]))
    assert p["flops"] == prefill_cost(model, IN).flops


def shown(pattern, text, *values):
    """The numbers `pattern` captures in `text` are `values` printed to the digits shown."""
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in the printed table:\n{text}"
    for printed, value in zip(m.groups(), values, strict=True):
        digits = len(printed.partition(".")[2])
        assert printed == f"{value:.{digits}f}", (pattern, printed, value)


def test_printed_table_matches_json(offline):
    r, text = offline
    o, t, f, p = r["ouro"], r["transformers"], r["decode_floor"], r["prefill"]
    shown(r"ouro +([\d.]+) s +input +([\d.]+) tok/s +output +([\d.]+)", text,
          o["seconds"], o["input_tok_s"], o["output_tok_s"])
    shown(r"transformers +([\d.]+) s +input +([\d.]+) tok/s +output +([\d.]+)", text,
          t["seconds"], t["input_tok_s"], t["output_tok_s"])
    shown(r"ouro / transformers\): ([\d.]+)x; identical greedy outputs: (\d+)%", text,
          r["ratio"], 100 * r["same_tokens"])
    shown(r"decode step \(batch (\d+), context (\d+)\): ([\d.]+) ms .*?floor ([\d.]+) ms", text,
          CONC, f["context"], 1e3 * o["decode_step_s"], 1e3 * f["floor_s"])
    shown(r"prefill of (\d+) tokens: ([\d.]+) ms; floor ([\d.]+) ms", text,
          IN, 1e3 * p["seconds"], 1e3 * p["floor_s"])
    shown(r"per wave \(ouro s / transformers s\): ([\d.]+) / ([\d.]+), ([\d.]+) / ([\d.]+)", text,
          *[w[k] for w in r["waves"] for k in ("ouro_s", "transformers_s")])


def test_prefill_bench(tiny_checkpoint):
    from ouro.bench.prefill import bench_prefill, format_prefill
    r = bench_prefill(tiny_checkpoint, input_len=40, repeats=1, compare=True, progress=False)
    assert r["ratio"] == pytest.approx(r["transformers_s"] / r["ouro_s"])
    assert r["flops"] == prefill_cost(load_model(tiny_checkpoint), 40).flops
    assert r["floor_s"] == pytest.approx(floor_of(r["flops"], r["bytes"], r))
    assert r["ouro_over_floor"] == pytest.approx(r["ouro_s"] / r["floor_s"])
    text = format_prefill(r)
    shown(r"ouro +([\d.]+) s", text, r["ouro_s"])
    shown(r"transformers +([\d.]+) s", text, r["transformers_s"])
    shown(r"speed-up +([\d.]+)x", text, r["ratio"])
    shown(r"floor +([\d.]+) s", text, r["floor_s"])


def test_prefill_breakdown_from_the_command_line(tiny_checkpoint, tmp_path):
    """`ouro bench prefill --breakdown`: the engine's prefill with the flags' engine settings
    (W8A8 here), the table printed and the JSON written with every part."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "prefill", "--model", str(tiny_checkpoint), "--breakdown", "--num-prompts", "2",
                   "--input-len", "24", "--repeats", "1", "--quantization", "w8a8",
                   "--output-json", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and r["quantization"] == "w8a8" and r["batch"] == 2 and r["tokens"] == 48
    text = out.getvalue()
    assert "quantization w8a8" in text and "prefill of 2 x 24 tokens" in text
    for row in r["rows"]:
        assert f"| {row['part']} | {row['ms']:.1f} |" in text


@pytest.mark.processes
@pytest.mark.slow
def test_prefill_cp_bench_times_both_sides_after_checking_them(tiny_checkpoint):
    """`ouro bench prefill --cp 2`: real ranks on both sides, a peak per rank, and the CP logits
    checked against one rank's before a ratio is printed."""
    from ouro.bench.prefill_cp import bench_prefill_cp, format_prefill_cp
    r = bench_prefill_cp(tiny_checkpoint, input_len=150, cp=2, repeats=1, progress=False)
    assert r["rel_rms_vs_reference"] <= 1e-4 and r["rel_rms_vs_cp1"] <= 1e-3 and r["speedup"] == r["cp1_s"] / r["cp_s"] > 0
    assert r["reference_threads"] == max(1, (os.cpu_count() or 1) // 2)
    assert len(r["cp1_peak_bytes"]) == 1 and len(r["cp_peak_bytes"]) == 2 and min(r["cp_peak_bytes"]) > 1 << 20
    text = format_prefill_cp(r)
    assert f"{r['speedup']:.2f}x" in text and "per rank" in text


@pytest.mark.parametrize("quiet", [False, True])
def test_disable_tqdm_hides_the_offline_bar(tiny_checkpoint, capsys, quiet):
    """--disable-tqdm is every kind's (benchmarks/llama_cpp_compare.py passes it to `bench offline`),
    and it hides the waves' bar; without it the bar is drawn."""
    code = main(["bench", "offline", "--model", str(tiny_checkpoint), "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "2", "--max-concurrency", "2", *(["--disable-tqdm"] if quiet else [])])
    assert code == 0
    assert ("waves (ouro" in capsys.readouterr().err) is not quiet
