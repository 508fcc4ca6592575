"""What a decoder costs in memory, by arithmetic on its shape: parameters, the training state,
a train step's activations, a KV cache and the decode loop.

A size typed into params.yaml or a flag (`model.n_layers: 10000`, `serve --slots 100000`)
fails in one line before anything is allocated (`stagelm.infra.memory.require_memory`),
not as an out-of-memory traceback minutes later. tests/model/test_footprint.py holds these figures
against XLA's own for the compiled programs.

    need = kv_cache_bytes(model.cfg, rows=slots, length=capacity)
    require_memory(need, "--slots", f"{slots} slots × {capacity} positions of KV cache")
"""

from types import SimpleNamespace
from typing import Any

from stagelm.model.attention_kernels import kernel_for


def dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def param_count(
    vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int, tie_embeddings: bool = True
) -> int:
    """Parameters of a stagelm decoder of this shape (stagelm.model.decoder: RMSNorm, GQA, SwiGLU)."""
    head = d_model // n_heads
    attention = d_model * n_heads * head + 2 * d_model * n_kv_heads * head + n_heads * head * d_model
    layer = attention + 3 * d_model * d_ff + 2 * d_model
    return vocab_size * d_model * (1 if tie_embeddings else 2) + n_layers * layer + d_model


def training_state_bytes(n_params: int, param_dtype: str) -> int:
    """Parameters, their gradients and Adam's two moments, each in the parameters' dtype."""
    return 4 * n_params * dtype_bytes(param_dtype)


def kv_cache_bytes(cfg: Any, rows: int, length: int) -> int:
    """A KV cache of `rows` × `length` positions for a decoder config (`stagelm.model.decoder.DecoderConfig`):
    keys and values of every layer, plus the int32 segment and position of each slot."""
    per_position = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes(cfg.dtype) + 8
    return rows * length * per_position


def generation_bytes(cfg: Any, rows: int, width: int, max_new: int) -> int:
    """What the jitted decode loop (`generate.Generator`) allocates for `rows` prompts laid out
    `width` tokens wide and `max_new` new tokens, by arithmetic on the shapes: the KV cache of
    width + max_new slots twice (the loop carries it in and out), the prefill's float32 scores
    and softmax weights of one layer (the prompt attends to itself alone), its MLP activations,
    the last position's logits, and the tokens and statistics out. tests/model/test_footprint.py
    holds it against XLA's own figures for the compiled loop: never below them, at most three
    times them."""
    slots = width + max_new
    scores = 2 * rows * cfg.n_heads * width * width * 4
    prefill = rows * width * (2 * cfg.d_ff + 4 * cfg.d_model) * dtype_bytes(cfg.dtype) + rows * cfg.vocab_size * 4
    return 2 * kv_cache_bytes(cfg, rows, slots) + scores + prefill + rows * max_new * 12


def train_step_bytes(cfg: Any, rows: int, seq_len: int) -> int:
    """A train step's memory beside the state by arithmetic (what `train.loop.require_step_memory`
    reads from XLA once the step is compiled): what each layer keeps for the backward pass
    (`cfg.remat`: everything, the projections' outputs, or only its input) and one layer's
    recomputation and its gradients where remat applies, with the float32 attention weights the reference kernel
    keeps (splash keeps a row statistic); the logits and their gradient; the gradients."""
    tokens, width = rows * seq_len, dtype_bytes(cfg.dtype)
    d, f = cfg.d_model, cfg.d_ff
    reference = kernel_for(getattr(cfg, "attention", "auto"), seq_len) == "reference"
    scores = 2 * rows * cfg.n_heads * seq_len * (seq_len if reference else 1) * 4
    if reference or getattr(cfg, "scan_layers", False):
        # XLA:CPU keeps float32 copies of a bfloat16 step's activations, and a scan's stacked
        # residuals on a TPU take as much (8 to 14% below the compiled step on a v5e)
        kept = 12 * d + 6 * f
    else:  # what the backward pass reads: the two norms' inputs and outputs, q, k, v, attention's
        # output, the gate and up projections and their SwiGLU product (5 to 11% above on a v5e)
        kept = 6 * d + 2 * cfg.n_kv_heads * (d // cfg.n_heads) + 3 * f
    block = tokens * kept * width + scores
    remat = getattr(cfg, "remat", "none")
    if remat == "none":
        layers = cfg.n_layers * block
    else:
        kept = d if remat == "block" else 3 * d + 2 * cfg.n_kv_heads * (d // cfg.n_heads) + 2 * f
        layers = cfg.n_layers * tokens * kept * width + 2 * block  # one layer recomputed, and its gradients
    logits = 3 * tokens * cfg.vocab_size * 4
    n = param_count(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff)
    return layers + logits + n * 4


def train_step_floor_bytes(cfg: Any, rows: int, seq_len: int) -> int:
    """What any train step of this shape allocates at least, whatever its remat and kernel: each
    layer's input, kept for the backward pass, and the logits. A check by this floor before
    compiling never refuses a step that runs; the compiled step's own figures decide the rest."""
    tokens, width = rows * seq_len, dtype_bytes(cfg.dtype)
    return tokens * (cfg.n_layers * cfg.d_model + cfg.vocab_size) * width


def benchmark_step_key(cfg: Any) -> str:
    """The key a refusal of the benchmark's train step names: the larger of its two sizes."""
    return "benchmark.batch_size" if cfg.batch_size > cfg.seq_len else "benchmark.seq_len"


def benchmark_bytes(cfg: Any) -> dict[str, int]:
    """What each of the benchmark stage's measures allocates (`config.BenchmarkConfig`), under the
    key that drives it, so a refusal names the key to lower: the matmul; the train step's state
    (by its larger part: the vocabulary's rows or the layers) and its floor (the compiled step is
    checked as the training stages check theirs); cached and naive decoding at batch 8."""
    shape = SimpleNamespace(
        vocab_size=cfg.vocab_size, **cfg.shape(), dtype=cfg.dtype, head_dim=cfg.d_model // cfg.n_heads
    )
    n = param_count(cfg.vocab_size, **cfg.shape())
    slots = cfg.prompt_len + cfg.new_tokens
    embedding = cfg.vocab_size * cfg.d_model
    return {
        "benchmark.matmul_size": 3 * cfg.matmul_size**2 * dtype_bytes(cfg.dtype),
        "benchmark.vocab_size" if 2 * embedding > n else "benchmark.n_layers": training_state_bytes(n, "float32"),
        benchmark_step_key(cfg): train_step_floor_bytes(shape, cfg.batch_size, cfg.seq_len),
        "benchmark.prompt_len" if cfg.prompt_len > cfg.new_tokens else "benchmark.new_tokens": max(
            generation_bytes(shape, 8, cfg.prompt_len, cfg.new_tokens),
            2 * 8 * cfg.n_heads * slots * slots * 4 + 8 * slots * cfg.vocab_size * 4,  # naive: whole prefixes
        ),
    }


def stage_estimates(sections: dict[str, Any], checkpoint: Any = None) -> dict[str, tuple[int, str | None]]:
    """The memory each model stage will ask for, by arithmetic on params.yaml's sections (the
    vocabulary at its cap, a generous prompt width): what `stagelm check` holds against this machine,
    beside the data stages' (`stagelm.data.footprint.data_stage_estimates`), as (bytes, key): the key
    that sizes a figure one device must hold whatever the mesh (the benchmark's: it runs on one device),
    None for one a mesh may split over many. With `model.init_from`,
    `checkpoint` is its DecoderConfig: its sizes and vocabulary, not the model section's, with the
    section's run settings (dtype, remat, attention)."""
    model, vocab, seq = sections["model"], sections["tokenizer"].vocab_size, sections["pack"].seq_len
    sizes, tied = model.shape(), model.tie_embeddings
    if checkpoint is not None:
        sizes = {k: getattr(checkpoint, k) for k in sizes}
        vocab, tied = checkpoint.vocab_size, checkpoint.tie_embeddings
    shape = SimpleNamespace(**sizes, vocab_size=vocab, dtype=model.dtype, head_dim=sizes["d_model"] // sizes["n_heads"])
    shape.remat, shape.attention = model.remat, model.attention  # what pretrain's step keeps
    n = param_count(vocab, **sizes, tie_embeddings=tied)
    ev, grpo, dpo, bench = sections["eval"], sections["grpo"], sections["dpo"], sections["benchmark"]
    timed = SimpleNamespace(**bench.shape(), vocab_size=bench.vocab_size, dtype=bench.dtype)
    prompt = 64  # a generous prompt width for the task families' prompts
    rollout = grpo.prompts_per_step * grpo.group_size // grpo.grad_accum
    return {
        "model (parameters, gradients, Adam's moments)": (training_state_bytes(n, model.param_dtype), None),
        "pretrain (a train step's activations)": (train_step_bytes(shape, sections["training"].batch_size, seq), None),
        "eval (generation)": (generation_bytes(shape, ev.task_batch_size, prompt, ev.max_new_tokens), None),
        "grpo (sampling a rollout)": (generation_bytes(shape, rollout, prompt, grpo.max_new_tokens), None),
        "dpo (sampling answers)": (generation_bytes(shape, dpo.sample_rows, prompt, dpo.max_new_tokens), None),
        **{f"benchmark ({key})": (need, key) for key, need in benchmark_bytes(bench).items()},
        "benchmark (a train step's activations)": (
            train_step_bytes(timed, bench.batch_size, bench.seq_len),
            benchmark_step_key(bench),
        ),
    }
