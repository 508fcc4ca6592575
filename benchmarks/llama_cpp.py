"""llama.cpp as the decode peer: the same model, as GGUF files, in llama-cpp-python against stagelm.

    python -m venv ~/.cache/llamacpp && CMAKE_BUILD_PARALLEL_LEVEL=2 ~/.cache/llamacpp/bin/pip install \\
        llama-cpp-python==0.3.36 numpy                                   # builds llama.cpp: ~20 min on 2 cores
    stagelm import-gguf SmolLM2-135M-Instruct.Q4_1.gguf smollm2   # a model directory
    python benchmarks/llama_cpp.py smollm2 --llama-python ~/.cache/llamacpp/bin/python [--dtypes float32 q8_0]
    python benchmarks/llama_cpp.py runs/sft/model --llama-python ...    # a stagelm-trained model too

Exports the model with `stagelm export-gguf` in each of `--dtypes` (float32 by default),
then times greedy decoding of `--new-tokens` tokens after a `--prompt-len`-token prompt at
batch 1 and 8: stagelm's KV-cache generator (one jitted loop, the model directory's float32
weights), and llama.cpp through its C API (`llama_decode` on one batch of every sequence's
next token, each sequence its own KV cache cells), 2 threads, in the same run, the median
of `--reps` after a warm-up. It also checks that
the two agree: llama.cpp's tokenizer (the GGUF's `tokenizer.ggml.pre`) splits sample texts
into stagelm's ids, and the first greedy tokens at batch 1 are the same. One JSON line
per figure; the table in docs/speed.md is made from them.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# The llama.cpp side, run by the interpreter that has llama-cpp-python (this one need not):
# greedy decoding of a batch of token-id prompts through the C API, timed.
PEER = r"""
import json, statistics, sys, time
import ctypes
import numpy as np
import llama_cpp as L

path, texts, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
new, reps = int(sys.argv[4]), int(sys.argv[5])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 8 * 512, 512, 512, 8
params.n_threads = params.n_threads_batch = 2
ctx = L.llama_init_from_model(model, params)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)

def tokenize(text):
    data = text.encode()
    buf = (L.llama_token * (len(data) + 8))()
    n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
    return list(buf[:n])

def greedy(rows):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    batch = L.llama_batch_init(512, 0, len(rows))
    def run(entries):  # (seq, token, pos, wants logits)
        batch.n_tokens = len(entries)
        for i, (s, t, p, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, want
            batch.seq_id[i][0] = s
        assert L.llama_decode(ctx, batch) == 0
        wanted = [i for i, e in enumerate(entries) if e[3]]
        return [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)) for i in wanted]
    logits = run([(s, t, p, p == len(r) - 1) for s, r in enumerate(rows) for p, t in enumerate(r)])
    out = [[] for _ in rows]
    for step in range(new):
        nxt = [int(np.argmax(l)) for l in logits]
        for s, t in enumerate(nxt):
            out[s].append(t)
        if step + 1 < new:
            logits = run([(s, t, len(rows[s]) + step, True) for s, t in enumerate(nxt)])
    L.llama_batch_free(batch)
    return out

result = {"tokens": [tokenize(t) for t in texts]}
for b in (1, 8):
    rows = prompts[:b]
    first = greedy(rows)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        greedy(rows)
        times.append(time.perf_counter() - t0)
    result[f"b{b}"] = {"greedy": first, "seconds": statistics.median(times)}
print(json.dumps(result))
"""

TEXTS = [
    "Work out 41 plus 17: 1 plus 7 is 8, 4 plus 1 is 5, so 58.",
    "Once upon a time, Mia found 12 shells.",
    "x = 3.14159",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a stagelm model directory")
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32"],
        help="export.gguf_dtype values: one GGUF file and llama.cpp run each",
    )
    args = parser.parse_args()

    from stagelm.infer.generate import load_generator
    from stagelm.interop.gguf_export import export_gguf
    from stagelm.measure.benchmark import cpu_model
    from stagelm.measure.microbench import matmul_gflops
    from stagelm.model.decoder import count_params

    gen = load_generator(args.model)
    vocab = gen.tokenizer.get_vocab_size()
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, vocab - 100, (8, args.prompt_len)).tolist()
    machine = {"cpu": cpu_model(), "matmul_gflops": matmul_gflops()}
    peers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            gguf = export_gguf(args.model, Path(tmp) / f"model-{dtype}.gguf", dtype)
            cmd = [args.llama_python, "-c", PEER, str(gguf), json.dumps(TEXTS), json.dumps(prompts)]
            peer = subprocess.run([*cmd, str(args.new_tokens), str(args.reps)], capture_output=True, text=True)
            if peer.returncode != 0:
                sys.exit(f"llama.cpp side failed on the {dtype} file:\n{peer.stderr[-2000:]}")
            peers[dtype] = json.loads(peer.stdout.strip().splitlines()[-1]) | {"gguf_bytes": gguf.stat().st_size}

    ours = [gen.tokenizer.encode(t).ids for t in TEXTS]
    for dtype, theirs in peers.items():
        print(json.dumps({"check": "tokenizer", "gguf_dtype": dtype, "same_ids": ours == theirs["tokens"], **machine}))
    for b in (1, 8):
        rows = prompts[:b]
        first = [c.tokens for c in gen.generate(rows, args.new_tokens, until_stop=False)]
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            gen.generate(rows, args.new_tokens, until_stop=False)
            times.append(time.perf_counter() - t0)
        stagelm_tps = b * args.new_tokens / statistics.median(times)
        for dtype, theirs in peers.items():
            pairs = zip(first, theirs[f"b{b}"]["greedy"], strict=True)
            agree = [int(np.argmin(np.array(a + [-1]) == np.array(t + [-2]))) for a, t in pairs]
            llama_tps = b * args.new_tokens / theirs[f"b{b}"]["seconds"]
            line = {
                "batch": b,
                "gguf_dtype": dtype,
                "gguf_bytes": theirs["gguf_bytes"],
                "stagelm_tokens_per_sec": round(stagelm_tps, 1),
                "llama_cpp_tokens_per_sec": round(llama_tps, 1),
                "ratio": round(stagelm_tps / llama_tps, 2),
                "greedy_tokens_agreeing_before_first_difference": agree,
                "model": str(args.model),
                "params": count_params(gen.model),
                **machine,
            }
            print(json.dumps(line))


if __name__ == "__main__":
    main()
