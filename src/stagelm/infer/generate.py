"""Text generation with a fixed-capacity KV cache: prefill, then one token per step.

Prompts of different lengths share a batch by left padding: pad slots have segment 0,
real tokens segment 1, and each row carries its own positions (0 at its first real
token), so a row's completion does not depend on what else is in the batch.

Two ways to run the same step function:

- `Generator.generate`: the whole decode loop in one jitted `lax.while_loop` that
  stops when every row has hit a stop token (fast: eval, GRPO rollouts, samples);
- `Generator.stream`: one jitted decode step per token, yielded as it is produced
  (`stagelm generate`).

Shapes are bucketed (prompt width to a multiple of 16) and sampling settings are
traced values, so a generator compiles once per batch size and bucket.
"""

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from stagelm.data.chatformat import ChatFormat, load_chat_format
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infra.errors import StagelmError
from stagelm.model.decoder import Decoder, Projection
from stagelm.model.kvcache import init_cache
from stagelm.model.modeldir import load_model, read_model_context

BUCKET = 16


FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # Finite in float32, as the sampler computes: 1e308 would be inf there, every token equally likely.
        if not 0 <= self.temperature <= FLOAT32_MAX:
            raise StagelmError(f"temperature: expected a finite value >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise StagelmError(f"top_p: expected a value in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:  # an int32 on the device
            raise StagelmError(f"top_k: expected >= 0 (0 = off) and below 2**31, got {self.top_k}")

    def arrays(self) -> dict[str, jax.Array]:
        return {
            "temperature": jnp.float32(self.temperature),
            "top_k": jnp.int32(self.top_k),
            "top_p": jnp.float32(self.top_p),
        }


def first_max(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, -1)` (the first of equal maxima) as two plain reductions, a max and a min of
    indices: XLA:CPU runs argmax's paired value-and-index reduction several times slower (a
    (256, 1024) row of logits: 0.9 against 0.6 ms; drawing a token 13 against 5 ms). A row with a
    NaN, which argmax would point at, gives the last index rather than one past the vocabulary."""
    top = jnp.max(x, axis=-1, keepdims=True)
    vocab = x.shape[-1]
    index = jnp.min(jnp.where(x == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(index, vocab - 1).astype(jnp.int32)


def draw(key: jax.Array, logits: jax.Array) -> jax.Array:
    """`jax.random.categorical(key, logits, axis=-1)`, the same tokens from the same key (the
    Gumbel-max trick it computes: argmax of logits plus Gumbel noise), through `first_max`."""
    return first_max(logits + jax.random.gumbel(key, logits.shape, logits.dtype))


def sample_tokens(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """(B,) next tokens from (B, V) logits: greedy at temperature 0, else top-k, then top-p (nucleus)."""
    logits = logits.astype(jnp.float32)

    def filtered(logits: jax.Array) -> jax.Array:
        scaled = logits / temperature
        ranked = -jnp.sort(-scaled, axis=-1)  # descending
        vocab = logits.shape[-1]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take(ranked, k - 1, axis=-1)[:, None]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        ranked = jnp.where(jnp.arange(vocab) < k, ranked, -jnp.inf)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
        keep = before < top_p  # the smallest prefix whose mass reaches top_p (at least one token)
        floor = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < floor, -jnp.inf, scaled)
        return draw(key, scaled)

    def plain(logits: jax.Array) -> jax.Array:
        return draw(key, logits / temperature)

    def sample(logits: jax.Array) -> jax.Array:
        return jax.lax.cond((top_k == 0) & (top_p >= 1), plain, filtered, logits)

    def greedy(logits: jax.Array) -> jax.Array:
        return first_max(logits)

    # Branches, not selects: greedy decoding, and sampling with no top-k or top-p cut (GRPO's
    # rollouts, eval's sampled answers), skip the sort over the vocabulary, which on a CPU
    # costs more than the model's own decode step at a batch of 256.
    return jax.lax.cond(temperature > 0, sample, greedy, logits)


def as_matrices(graphdef: Any, params: Any) -> tuple[Any, Callable[[Any], Any]]:
    """`params` with each projection's weight as the 2-D matrix its matmul multiplies by (the
    fan-in axes flattened, then the rest), and the function that gives them their stored shapes back.

    A decode loop carries the matrices and reshapes them back inside: XLA folds that reshape into
    the matmul's own (`decoder.matmul`), so each step reads a weight as it lies. Carried in their
    stored shapes, XLA:TPU tiled the (D, 2, F) gate_up weight by its axis of 2 and relaid it out
    to (D, 2F) inside the loop, every layer and step (benchmarks/README.md, "Decoding on a TPU")."""
    graph = nnx.iter_graph(nnx.merge(graphdef, params))
    projections = {path: node for path, node in graph if isinstance(node, Projection)}
    stored = {path: p.w.shape for path, p in projections.items()}
    matrices = {path: (math.prod(p.w.shape[: p.in_dims]), -1) for path, p in projections.items()}

    def reshaped(params: Any, shapes: dict[tuple, tuple[int, ...]]) -> Any:
        def leaf(path: tuple, x: jax.Array) -> jax.Array:
            names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))  # (..., "gate_up", "w")
            return x.reshape(shapes[names[:-1]]) if names[-1] == "w" and names[:-1] in shapes else x

        return jax.tree_util.tree_map_with_path(leaf, params)

    return reshaped(params, matrices), lambda flat: reshaped(flat, stored)


@dataclasses.dataclass
class Completion:
    tokens: list[int]  # generated ids, the stop token excluded
    text: str
    finish: str  # "stop" or "length"


class Generator:
    """Generation for one model and tokenizer; `capacity` is the KV cache size in tokens and `chat`
    the tokenizer's chat format (default: stagelm's own), whose tokens end a generation."""

    def __init__(self, model: Decoder, tokenizer: Tokenizer, capacity: int, chat: ChatFormat | None = None):
        if tokenizer.get_vocab_size() > model.cfg.vocab_size:
            raise StagelmError(
                f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab is "
                f"{model.cfg.vocab_size}; use the tokenizer.json saved with the model"
            )
        self.model, self.tokenizer, self.capacity = model, tokenizer, capacity
        self.chat = chat or ChatFormat(tokenizer)
        self.graphdef, self.params = nnx.split(model)
        self._prefill = jax.jit(self._prefill_fn)
        self._step = jax.jit(self._step_fn, donate_argnums=1)
        self._loop = jax.jit(self._loop_fn, static_argnames=("max_new", "logprobs"))
        self._sample = jax.jit(sample_tokens)
        self._full = jax.jit(lambda params, tokens, seg, pos: nnx.merge(self.graphdef, params)(tokens, seg, pos))
        # Tokens whose text holds a newline (a special token's decodes to its spelling: never one).
        self.newline_ids = [
            i for i in range(tokenizer.get_vocab_size()) if "\n" in tokenizer.decode([i], skip_special_tokens=True)
        ]

    # --- pure functions (jitted above) ---------------------------------------------------

    def _prefill_fn(
        self, params: Any, tokens: jax.Array, seg: jax.Array, pos: jax.Array, slots: int | None = None
    ) -> tuple:
        """The prompts' last logits and a cache of `slots` slots (default: the capacity) holding them."""
        model = nnx.merge(self.graphdef, params)
        cache = init_cache(model.cfg, tokens.shape[0], slots or self.capacity)
        logits, cache = model.prefill(tokens, seg, pos, cache)
        return logits[:, -1], cache

    def _step_fn(self, params: Any, cache: Any, token: jax.Array, pos: jax.Array, index: jax.Array) -> tuple:
        model = nnx.merge(self.graphdef, params)
        ones = jnp.ones_like(token)[:, None]
        # The cache fills its slots in order: after this step's, the slots from index + 1 on are empty.
        logits, cache = model.cached(token[:, None], ones, pos[:, None], cache, index, filled=index + 1)
        return logits[:, 0], cache

    def _loop_fn(
        self,
        params: Any,
        tokens: jax.Array,
        seg: jax.Array,
        pos: jax.Array,
        stop: jax.Array,
        key: jax.Array,
        sampling: dict,
        max_new: int,
        logprobs: bool = False,
    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array] | None]:
        # The cache holds what this call can reach, the prompt width plus max_new: every decode
        # step attends over those slots only, not the whole capacity (the masked slots beyond
        # would add nothing to a row's softmax but their cost).
        batch, width = tokens.shape
        logits, cache = self._prefill_fn(params, tokens, seg, pos, width + max_new)
        matrices, stored = as_matrices(self.graphdef, params)  # what the loop carries
        next_pos = pos[:, -1] + 1
        out = jnp.zeros((batch, max_new), jnp.int32)
        zeros = jnp.zeros((batch, max_new), jnp.float32)
        stats = {"logp": zeros, "entropy": zeros} if logprobs else None
        done = jnp.zeros(batch, bool)

        def cond(carry: tuple) -> jax.Array:
            i, _, _, _, _, done, _ = carry
            return (i < max_new) & ~jnp.all(done)

        def body(carry: tuple) -> tuple:
            i, logits, cache, out, stats, done, key = carry
            key, sub = jax.random.split(key)
            token = sample_tokens(logits, sub, **sampling)
            token = jnp.where(done, 0, token)
            out = out.at[:, i].set(token)
            if logprobs:  # of the distribution drawn from, before any top-k or top-p cut
                scale = jnp.where(sampling["temperature"] > 0, sampling["temperature"], 1.0)
                drawn = jax.nn.log_softmax(logits.astype(jnp.float32) / scale, axis=-1)
                picked = jnp.take_along_axis(drawn, token[:, None], 1)[:, 0]
                entropy = -jnp.sum(jnp.exp(drawn) * drawn, axis=-1)
                stats = {
                    "logp": stats["logp"].at[:, i].set(jnp.where(done, 0.0, picked)),
                    "entropy": stats["entropy"].at[:, i].set(jnp.where(done, 0.0, entropy)),
                }
            done = done | stop[token]
            logits, cache = self._step_fn(stored(matrices), cache, token, next_pos + i, width + i)
            return i + 1, logits, cache, out, stats, done, key

        carry = (jnp.int32(0), logits, cache, out, stats, done, key)
        n, _, _, out, stats, _, _ = jax.lax.while_loop(cond, body, carry)
        return out, n, stats

    # --- host side -------------------------------------------------------------------------

    def stop_mask(self, chat: bool, stop_at_newline: bool, enabled: bool = True) -> jax.Array:
        stop = np.zeros(self.model.cfg.vocab_size, bool)
        if not enabled:  # fixed-length generation (benchmarks)
            return jnp.asarray(stop)
        stop[list(self.chat.stop_ids(chat))] = True
        if stop_at_newline:
            stop[self.newline_ids] = True
        return jnp.asarray(stop)

    def layout(self, prompts: Sequence[Sequence[int]], max_new: int, batch: int | None = None) -> tuple:
        """Left-padded (tokens, segments, positions) of `prompts`, width bucketed, rows padded to `batch`."""
        longest = max(len(p) for p in prompts)
        if any(len(p) == 0 for p in prompts):
            raise StagelmError("prompt: empty; give at least one token of text")
        if longest + max_new > self.capacity:
            raise StagelmError(
                f"prompt: {longest} tokens + max_new_tokens {max_new} exceed the cache "
                f"capacity of {self.capacity} tokens; shorten the prompt or lower max_new_tokens"
            )
        width = max(longest, min(-(-longest // BUCKET) * BUCKET, self.capacity - max_new))
        rows = batch or len(prompts)
        tokens = np.zeros((rows, width), np.int32)
        seg = np.zeros((rows, width), np.int32)
        pos = np.zeros((rows, width), np.int32)
        for r, p in enumerate(list(prompts) + [prompts[0]] * (rows - len(prompts))):
            tokens[r, width - len(p) :] = p
            seg[r, width - len(p) :] = 1
            pos[r, width - len(p) :] = np.arange(len(p))
        return jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new: int,
        sampling: Sampling = Sampling(),
        key: jax.Array | None = None,
        chat: bool = False,
        stop_at_newline: bool = False,
        batch: int | None = None,
        until_stop: bool = True,
    ) -> list[Completion]:
        """Completions of token-id prompts (one jitted loop; rows padded to `batch` for a fixed shape).

        `until_stop=False` always generates `max_new` tokens (benchmarks).
        """
        tokens, seg, pos = self.layout(prompts, max_new, batch)
        key = jax.random.key(0) if key is None else key
        stop = self.stop_mask(chat, stop_at_newline, until_stop)
        out, _ = self.decode(self.params, tokens, seg, pos, stop, key, sampling, max_new)
        return [self.completion(row, stop) for row in np.asarray(out)[: len(prompts)]]

    def decode(
        self,
        params: Any,
        tokens: jax.Array,
        seg: jax.Array,
        pos: jax.Array,
        stop: jax.Array,
        key: jax.Array,
        sampling: Sampling,
        max_new: int,
        logprobs: bool = False,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """(rows, max_new) new token ids of a `layout`, from the jitted loop, on the device, and
        with `logprobs` (rows, max_new) arrays of each step's distribution, the one the token
        was drawn from (the model's softmax at the sampling temperature, before any top-k or
        top-p cut): `logp`, the drawn token's log-probability, what an RL update must
        reproduce from the same tokens, and `entropy` (else None).

        `params` stand in for the model's own (GRPO samples with the policy's current
        weights); a row is zero (and its statistics 0) after its first `stop` token."""
        out, _, stats = self._loop(
            params, tokens, seg, pos, stop, key, sampling.arrays(), max_new=max_new, logprobs=logprobs
        )
        return out, stats

    def completion(self, row: np.ndarray, stop: jax.Array) -> Completion:
        stop = np.asarray(stop)
        ends = np.flatnonzero(stop[row])
        ids = row[: ends[0]] if len(ends) else row
        finish = "stop" if len(ends) else "length"
        return Completion(ids.tolist(), self.tokenizer.decode(ids.tolist(), skip_special_tokens=False), finish)

    def stream(
        self,
        prompt: Sequence[int],
        max_new: int,
        sampling: Sampling = Sampling(),
        key: jax.Array | None = None,
        chat: bool = False,
    ) -> Iterator[int]:
        """Yield generated token ids one by one (the stop token is not yielded)."""
        tokens, seg, pos = self.layout([prompt], max_new)
        key = jax.random.key(0) if key is None else key
        stop = np.asarray(self.stop_mask(chat, False))
        logits, cache = self._prefill(self.params, tokens, seg, pos)
        width, next_pos = tokens.shape[1], pos[:, -1] + 1
        arrays = sampling.arrays()
        for i in range(max_new):
            key, sub = jax.random.split(key)
            token = self._sample(logits, sub, **arrays)
            value = int(token[0])
            if stop[value]:
                return
            yield value
            if i + 1 < max_new:
                logits, cache = self._step(self.params, cache, token, next_pos + i, jnp.int32(width + i))

    def forced_logits(self, prompt: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
        """(len(continuation) + 1, V) next-token logits with the cache, feeding `continuation` in."""
        tokens, seg, pos = self.layout([prompt], len(continuation) + 1)
        logits, cache = self._prefill(self.params, tokens, seg, pos)
        out = [np.asarray(logits[0])]
        width, next_pos = tokens.shape[1], pos[:, -1] + 1
        for i, token in enumerate(continuation):
            token = jnp.asarray([token], jnp.int32)
            logits, cache = self._step(self.params, cache, token, next_pos + i, jnp.int32(width + i))
            out.append(np.asarray(logits[0]))
        return np.stack(out)

    def naive_generate(
        self, prompts: Sequence[Sequence[int]], max_new: int, continuation: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Greedy decoding without a cache: every step recomputes the whole prefix (the reference).

        Returns (tokens (B, max_new), logits of row 0 at each step (max_new, V)). With
        `continuation`, those tokens are fed instead of the greedy ones (teacher forcing).
        """
        tokens, seg, pos = self.layout(prompts, max_new)
        width = tokens.shape[1]
        pad = jnp.zeros((tokens.shape[0], max_new), jnp.int32)
        tokens, seg = jnp.concatenate([tokens, pad], 1), jnp.concatenate([seg, pad + 1], 1)
        pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(max_new)[None]], 1)
        out, logits_0 = [], []
        for i in range(max_new):
            logits = self._full(self.params, tokens, seg, pos)[:, width + i - 1]
            logits_0.append(np.asarray(logits[0]))
            token = jnp.argmax(logits, -1).astype(jnp.int32)
            if continuation is not None and i < len(continuation):
                token = jnp.full_like(token, continuation[i])
            tokens = tokens.at[:, width + i].set(token)
            out.append(np.asarray(token))
        return np.stack(out, 1), np.stack(logits_0)


def load_generator(model_dir: str | Path, capacity: int | None = None) -> Generator:
    """A Generator for a stagelm model directory (its params, config.json and tokenizer.json)."""
    model = load_model(model_dir)
    tokenizer = load_tokenizer(Path(model_dir) / "tokenizer.json")
    chat = load_chat_format(tokenizer, model_dir)
    return Generator(model, tokenizer, capacity or read_model_context(model_dir), chat)


def stream_text(gen: Generator, tokens: Iterator[int]) -> Iterator[str]:
    """The text of a token stream as it grows, in pieces that never split a UTF-8 character
    (`stagelm generate` prints them as they come); the last piece flushes whatever is left."""
    out: list[int] = []
    shown = ""
    for token in tokens:
        out.append(token)
        text = gen.tokenizer.decode(out, skip_special_tokens=False)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            yield text[len(shown) :]
            shown = text
    yield gen.tokenizer.decode(out, skip_special_tokens=False)[len(shown) :]
