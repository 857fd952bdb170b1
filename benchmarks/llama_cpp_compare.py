"""ouro against llama.cpp on the same checkpoint: decode tokens/s at batch 1 and 16, ouro float32
against llama.cpp f32 and ouro W8A8 against llama.cpp q8_0, interleaved, medians of --rounds.

Procedure (docs/results.md, "llama.cpp side by side", has it with today's figures):

  1. the llama.cpp source that `pip download llama-cpp-python==0.3.36` brings (the sdist; its
     vendor/llama.cpp has the glm5-next architecture; if pip hangs building metadata, curl the
     sdist URL that https://pypi.org/pypi/llama-cpp-python/0.3.36/json lists):
       pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llp
       mkdir -p /tmp/llama-src && tar xzf /tmp/llp/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama-src
       SRC=/tmp/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp
  2. a CPU build of the two benchmark tools:
       cmake -S $SRC -B /tmp/llama-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
       cmake --build /tmp/llama-build -j2 --target llama-bench llama-batched-bench
  3. the checkpoint to f32 and q8_0 GGUF with that tree's unmodified convert_hf_to_gguf.py
     (--convert $SRC; `converter_dir` and CONVERT below say what is adjusted), then the comparison:
       python benchmarks/llama_cpp_compare.py --convert $SRC --gguf-dir /tmp/gguf --model small \\
           --llama-bin-dir /tmp/llama-build/bin
     (later runs: the same without --convert)

For each B in --batches, both sides decode B sequences of --input-len random prompt tokens for
--output-len tokens on --threads threads. llama.cpp: `llama-batched-bench -npp 128 -ntg 64 -npl B`,
its S_TG (B x TG tokens over the generation steps' time). ouro: `ouro bench offline --dtype float32
--num-prompts B --max-concurrency B [--quantization w8a8 [--quantization-ignore "*.kv_b_proj"]]`,
B x (decode-only steps) over their time.
Both are means over the decode steps, prefill excluded. Run it on a quiet machine: the load average
is printed with the table. Not imported by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (label, GGUF type, ouro's flags); q8_0 quantises the output matrix too, as the third row's ouro does
PAIRS = (("float32", "f32", ()), ("W8A8 / q8_0", "q8_0", ("--quantization", "w8a8")),
         ("W8A8 + head / q8_0", "q8_0", ("--quantization", "w8a8", "--quantization-ignore", "*.kv_b_proj")))

# the converter, run with one adjustment: ouro's presets ship a random test tokenizer whose
# pre-tokenizer hash llama.cpp does not know; it is written as "gpt-2" (no effect on decode speed)
CONVERT = """
import runpy, sys
src = {src!r}
sys.path[:0] = [src, src + "/gguf-py"]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def lenient(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = lenient
sys.argv = ["convert_hf_to_gguf.py"] + {argv!r}
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def converter_dir(model_dir: Path, out: Path) -> Path:
    """The checkpoint's files linked into `out` with config.json written again by this ouro, so a
    cached preset written before the original GLM keys (linear_attn_config, first_k_dense_replace,
    mla_use_nope, mhc, the DSA spelling) carries the keys llama.cpp's converter reads."""
    from ouro.config.model import ModelConfig
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    raw = json.loads((model_dir / "config.json").read_text())
    config = ModelConfig.from_hf(model_dir)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(raw.get("vision_config")), indent=2))
    return out


def convert(src: Path, model_dir: Path, gguf_dir: Path, name: str) -> None:
    gguf_dir.mkdir(parents=True, exist_ok=True)
    hf = converter_dir(model_dir, gguf_dir / f"{name}-hf")
    for _, kind, _ in PAIRS:
        target = gguf_dir / f"{name}-{kind}.gguf"
        argv = [str(hf), "--outtype", kind, "--outfile", str(target)]
        print(f"converting {model_dir} -> {target}", flush=True)
        subprocess.run([sys.executable, "-c", CONVERT.format(src=str(src), argv=argv)], check=True)


def llama_tok_s(bin_dir: Path, gguf: Path, batch: int, a) -> float:
    ctx = max(4096, batch * (a.input_len + a.output_len))
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(a.threads), "-c", str(ctx),
           "-npp", str(a.input_len), "-ntg", str(a.output_len), "-npl", str(batch), "--output-format", "jsonl"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 and "-nr" not in cmd:
        # this llama.cpp's CPU weight repacking fails to schedule some q8_0 graphs of glm5-next
        # (GGML_ASSERT(*cur_backend_id != -1) at load): its own switch off (-nr) is how it runs then
        print(f"llama.cpp failed on {gguf.name} (exit {run.returncode}): running it with --no-repack", flush=True)
        run = subprocess.run(cmd + ["-nr"], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return rows[-1]["speed_tg"]


def ouro_tok_s(model: str, batch: int, flags: tuple[str, ...], a) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "ouro.cli", "bench", "offline", "--model", model, "--dtype", "float32",
               "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--num-prompts", str(batch),
               "--max-concurrency", str(batch), "--disable-tqdm", "--output-json", str(path)]
        cmd += list(flags)
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads),
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
        steps = json.loads(path.read_text())["ouro"]["steps"]
    return batch * steps["decode_only"] / steps["decode_only_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin-dir", type=Path, required=True, help="holds llama-batched-bench (the build's bin/)")
    p.add_argument("--gguf-dir", type=Path, required=True, help="holds MODEL-f32.gguf and MODEL-q8_0.gguf")
    p.add_argument("--model", default="small", help="ouro preset name or checkpoint directory (default: small)")
    p.add_argument("--convert", type=Path, metavar="LLAMA_CPP_DIR",
                   help="first convert the checkpoint with LLAMA_CPP_DIR/convert_hf_to_gguf.py into --gguf-dir")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="both sides (llama.cpp -t, ouro OMP_NUM_THREADS)")
    p.add_argument("--output-json", type=Path)
    p.add_argument("--compile", action="store_true",
                   help="ouro runs its decode step as a compiled graph (`--compile`; its first start compiles, "
                        "later ones read inductor's cache)")
    a = p.parse_args()
    from ouro.models.resolve import resolve_model
    model_dir = resolve_model(a.model)
    name = Path(a.model).name
    if a.convert:
        convert(a.convert, model_dir, a.gguf_dir, name)
    batches = [int(b) for b in a.batches.split(",")]
    cases = [(label, kind, q, b) for label, kind, q in PAIRS for b in batches]
    for _, kind, _, _ in cases:
        if not (a.gguf_dir / f"{name}-{kind}.gguf").is_file():
            p.error(f"{a.gguf_dir / f'{name}-{kind}.gguf'} is missing (convert first: --convert LLAMA_CPP_DIR)")
    got = {c: {"llama.cpp": [], "ouro": []} for c in cases}
    load = [os.getloadavg()[0]]
    for r in range(a.rounds):              # interleaved: each case's two sides run back to back
        for c in cases:
            label, kind, q, b = c
            got[c]["llama.cpp"].append(llama_tok_s(a.llama_bin_dir, a.gguf_dir / f"{name}-{kind}.gguf", b, a))
            got[c]["ouro"].append(ouro_tok_s(str(model_dir), b, (*q, "--compile") if a.compile else q, a))
            print(f"round {r + 1} {label:12} batch {b:3}: llama.cpp {got[c]['llama.cpp'][-1]:8.1f} tok/s, "
                  f"ouro {got[c]['ouro'][-1]:8.1f} tok/s (load {os.getloadavg()[0]:.2f})", flush=True)
            load.append(os.getloadavg()[0])
    print(f"\ndecode tokens/s, {name}{' (ouro --compile)' if a.compile else ''}, prompt {a.input_len}, "
          f"{a.output_len} generated, {a.threads} threads, "
          f"medians of {a.rounds} rounds, load average {min(load):.2f}-{max(load):.2f}\n")
    print("| precision (ouro / llama.cpp) | batch | llama.cpp | ouro | ouro / llama.cpp |")
    print("|---|---|---|---|---|")
    rows = []
    for c in cases:
        label, kind, q, b = c
        ll, ou = statistics.median(got[c]["llama.cpp"]), statistics.median(got[c]["ouro"])
        rows.append({"precision": label, "gguf": kind, "ouro_flags": list(q), "batch": b, "llama_cpp_tok_s": ll,
                     "ouro_tok_s": ou, "ratio": ou / ll, "rounds": got[c]})
        print(f"| {label} | {b} | {ll:.1f} | {ou:.1f} | {ou / ll:.2f}x |")
    if a.output_json:
        a.output_json.write_text(json.dumps({"model": name, "load_average": load, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
