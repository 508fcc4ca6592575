"""Continuous batching on the KV cache: requests join and leave a running decode batch.

`Engine` owns a fixed number of slots (rows) that share one KV cache of `capacity`
columns, used as a ring: every decode step writes column `c % capacity` of each row,
and a row attends only to its own request's columns, because the cache's per-column
segment id is that request's (each request gets a new one, so what the slot's previous
occupant left is masked out). Between two decode steps:

- waiting requests join free slots: each prompt is prefilled alone (batch 1, the same
  computation as `Generator.stream`) and its keys and values are copied into its row
  at the columns just before the next one written. On an idle engine that is columns
  [0, width), the layout `stagelm generate` uses, so a lone greedy request gives the
  same tokens;
- finished or cancelled rows leave; the last active row moves into the hole, so the
  active rows are always rows [0, n) and a step computes only a power-of-two prefix of
  the slots (one compile per size), never the idle ones.

Each row carries its own sampling (temperature, top-p), RNG key (from the request's
seed, split once per token as `Generator.stream` does), position, token budget and
stop tokens. The engine runs in one thread; `submit` is thread-safe and refuses a
request (returns False) when its rows would not fit in the free slots plus
`queue_limit` rows waiting.
"""

import collections
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stagelm.infer.generate import Generator, first_max, sample_tokens
from stagelm.model.kvcache import KVCache, LayerCache, init_cache, pinned, slot_axis


@dataclasses.dataclass
class Request:
    """One completion request: `choices` rows decode `prompt` with these settings.

    `emit(choice, token, finish)` is called from the engine thread: with a token id and
    finish None for each token, then once with token None and finish "stop" (a stop
    token), "length" (max_tokens reached), "cancelled" or "error"."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    choices: int
    chat: bool
    emit: Callable[[int, int | None, str | None], None]
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    stopped: set[int] = dataclasses.field(default_factory=set)  # choices ended early (a stop string)

    def cancel(self) -> None:
        """Free the request's slots at the next step (a closed connection)."""
        self.cancelled.set()

    def stop_choice(self, choice: int) -> None:
        """Free one choice's slot at the next step (it met a stop string)."""
        self.stopped.add(choice)

    def ended(self, choice: int) -> bool:
        return self.cancelled.is_set() or choice in self.stopped


@dataclasses.dataclass
class Row:
    request: Request
    choice: int
    position: int  # of the next token written
    generated: int = 0
    token: int = 0  # the last one sampled
    done: bool = False


def sizes_up_to(slots: int) -> list[int]:
    """The batch sizes a step compiles for: powers of two below `slots`, and `slots`."""
    sizes, n = [], 1
    while n < slots:
        sizes.append(n)
        n *= 2
    return [*sizes, slots]


class Engine:
    def __init__(self, gen: Generator, slots: int, queue_limit: int):
        self.gen, self.slots, self.queue_limit = gen, slots, queue_limit
        self.capacity = gen.capacity
        self.sizes = sizes_up_to(slots)
        self.stop = {chat: np.asarray(gen.stop_mask(chat, False)) for chat in (False, True)}
        self.graphdef, self.params = nnx.split(gen.model)
        self._join = jax.jit(self._join_fn, donate_argnums=(1, 2, 3))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1, 2, 3), static_argnames=("size", "greedy"))
        self._move = jax.jit(self._move_fn, donate_argnums=0)
        self.lock = threading.Condition()
        self.waiting: collections.deque[Request] = collections.deque()
        self.rows: list[Row] = []  # active rows, in slot order
        self.next_segment = 1
        self.counters: dict[str, Any] = {
            "requests": 0,
            "rejected": 0,
            "cancelled": 0,  # rows freed because their connection closed
            "tokens": 0,
            "steps_by_batch": collections.Counter(),  # decode steps, by the number of rows decoded together
        }
        self.reset()
        self.thread = threading.Thread(target=self.run, name="stagelm-engine", daemon=True)
        self.thread.start()

    def reset(self) -> None:
        cfg = self.gen.model.cfg
        self.cache = jax.jit(lambda: init_cache(cfg, self.slots, self.capacity))()
        self.logits = jnp.zeros((self.slots, cfg.vocab_size), jnp.float32)
        self.keys = jax.random.split(jax.random.key(0), self.slots)
        self.segments = np.zeros(self.slots, np.int32)
        self.column = 0

    # --- jitted pieces -------------------------------------------------------------------

    def _join_fn(self, params: Any, cache: KVCache, logits, keys, tokens, seg, pos, row, column, seed, choice):
        """Prefill one prompt alone, copy its keys/values into `row` at the columns before
        `column`, and set the row's logits and RNG key (choice 0 of a seed: `stream`'s key)."""
        model = nnx.merge(self.graphdef, params)
        alone = init_cache(model.cfg, 1, self.capacity)
        first, alone = model.prefill(tokens, seg, pos, alone)
        width = tokens.shape[1]
        cols = (column - width + jnp.arange(width)) % self.capacity

        def copied(big: jax.Array, one: jax.Array) -> jax.Array:
            if big.ndim == 4:  # (B, K, S, Dh)[row, :, cols] is (width, K, Dh): the advanced indices' axis comes first
                return pinned(big).at[row, :, cols].set(one[0, :, :width].swapaxes(0, 1))
            return pinned(big).at[row, cols].set(one[0, :width])  # (B, S, K·Dh)[row, cols] is (width, K·Dh)

        layers = tuple(
            LayerCache(copied(big.k, one.k), copied(big.v, one.v))
            for big, one in zip(cache.layers, alone.layers, strict=True)
        )
        segs = cache.segment_ids.at[row, cols].set(seg[0])
        poss = cache.positions.at[row, cols].set(pos[0])
        key = jax.random.key(seed)
        key = jax.lax.cond(choice > 0, lambda k: jax.random.fold_in(k, choice), lambda k: k, key)
        logits = logits.at[row].set(first[0, -1].astype(logits.dtype))
        return logits, keys.at[row].set(key), KVCache(layers, segs, poss)

    def _decode_fn(
        self, params: Any, cache: KVCache, logits, keys, temperature, top_p, seg, pos, column, size: int, greedy: bool
    ):
        """One token for each of rows [0, size): sample it from the row's logits (its own key,
        split as `Generator.stream` splits it, and settings), write it at `column`, and compute
        the row's next logits. Rows [size, slots) are left as they are."""
        model = nnx.merge(self.graphdef, params)
        split = jax.vmap(jax.random.split)(keys[:size])

        def one(row_logits, key, t, p):
            return sample_tokens(row_logits[None], key, t, jnp.int32(0), p)[0]

        if greedy:  # every row at temperature 0: skip the sampler's sort over the vocabulary
            tokens = first_max(logits[:size])
        else:
            tokens = jax.vmap(one)(logits[:size], split[:, 1], temperature[:size], top_p[:size])

        if size == self.slots:  # every row: the cache is updated in place
            new, cache = model.cached(tokens[:, None], seg[:, None], pos[:, None], cache, column)
        else:  # a prefix of the rows; only the column written goes back (no copy of the whole cache)
            part = jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, size, axis=0), cache)
            new, part = model.cached(tokens[:, None], seg[:size, None], pos[:size, None], part, column)

            def put(whole: jax.Array, rows: jax.Array) -> jax.Array:
                written = jax.lax.dynamic_slice_in_dim(rows, column, 1, axis=slot_axis(whole))
                return jax.lax.dynamic_update_slice_in_dim(pinned(whole), written, column, axis=slot_axis(whole))

            cache = jax.tree.map(put, cache, part)
        logits = jax.lax.dynamic_update_slice_in_dim(logits, new[:, 0].astype(logits.dtype), 0, 0)
        keys = jax.lax.dynamic_update_slice_in_dim(keys, split[:, 0], 0, 0)
        return tokens, logits, keys, cache

    def _move_fn(self, cache: KVCache, src, dst) -> KVCache:
        return jax.tree.map(lambda a: a.at[dst].set(a[src]), cache)

    # --- the request side ----------------------------------------------------------------

    def submit(self, request: Request, force: bool = False) -> bool:
        """Queue `request`; False (refused at once) when the waiting queue is full, unless `force`
        (the server's own warm-up)."""
        if request.choices > self.slots:
            raise ValueError(f"n={request.choices} exceeds the engine's {self.slots} slots")
        self.gen.layout([request.prompt], request.max_tokens)  # raises on a prompt the cache cannot hold
        with self.lock:
            busy = self.active() + sum(r.choices for r in self.waiting)  # rows decoding or waiting for one
            if busy + request.choices > self.slots + self.queue_limit and not force:
                self.counters["rejected"] += 1
                return False
            self.waiting.append(request)
            self.counters["requests"] += 1
            self.lock.notify()
        return True

    def active(self) -> int:
        """Rows still decoding: one that has ended is free (its slot is reused at the next step) as
        soon as its request hears so, though the engine drops it only after the step."""
        return sum(not row.done for row in list(self.rows))

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            steps = dict(sorted(self.counters["steps_by_batch"].items()))
            return {
                "slots": self.slots,
                "queue_limit": self.queue_limit,
                "active": self.active(),
                "waiting": len(self.waiting),
                "requests": self.counters["requests"],
                "rejected": self.counters["rejected"],
                "cancelled": self.counters["cancelled"],
                "tokens": self.counters["tokens"],
                "steps_by_batch": {str(k): v for k, v in steps.items()},
                "max_batch": max(steps, default=0),
            }

    # --- the engine thread ---------------------------------------------------------------

    def run(self) -> None:
        while True:
            with self.lock:
                while not self.waiting and not self.rows:
                    self.lock.wait()
                joining = []
                free = self.slots - len(self.rows)
                while self.waiting and self.waiting[0].choices <= free:
                    request = self.waiting.popleft()
                    free -= request.choices
                    joining.append(request)
            try:
                self.iterate(joining)
            except Exception:  # a bug, not bad input (that is refused in submit): fail the rows, keep serving
                traceback.print_exc(file=sys.stderr)
                for row in self.rows:
                    if not row.done:
                        row.request.emit(row.choice, None, "error")
                self.rows = []
                self.reset()

    def iterate(self, joining: list[Request]) -> None:
        """One engine step: admit `joining`, then decode one token of every active row together."""
        if not self.rows:
            self.column = 0
        for request in joining:
            if request.cancelled.is_set():
                for choice in range(request.choices):
                    request.emit(choice, None, "cancelled")
                continue
            for choice in range(request.choices):
                self.join(request, choice)
        self.drop_finished()
        n = len(self.rows)
        if not n:
            return
        temperature = np.zeros(self.slots, np.float32)
        top_p = np.ones(self.slots, np.float32)
        positions = np.zeros(self.slots, np.int32)
        for i, row in enumerate(self.rows):
            temperature[i], top_p[i], positions[i] = row.request.temperature, row.request.top_p, row.position
            row.position += 1
        column = np.int32(self.column % self.capacity)
        self.column += 1
        tokens, self.logits, self.keys, self.cache = self._decode(
            self.params,
            self.cache,
            self.logits,
            self.keys,
            temperature,
            top_p,
            self.segments,
            positions,
            column,
            size=self.size(n),
            greedy=not temperature.any(),
        )
        for row, token in zip(self.rows, np.asarray(tokens)[:n].tolist(), strict=True):
            row.token = token
            self.advance(row)  # a row that ends here computed one step more; it leaves below
        with self.lock:
            self.counters["steps_by_batch"][n] += 1
            self.counters["tokens"] += n
        self.drop_finished()

    def size(self, n: int) -> int:
        """The compiled batch size that holds `n` active rows."""
        return next(s for s in self.sizes if s >= n)

    def join(self, request: Request, choice: int) -> None:
        row_index = len(self.rows)
        tokens, seg, pos = self.gen.layout([request.prompt], request.max_tokens)
        width = tokens.shape[1]
        if not self.rows:
            self.column = max(self.column, width)  # an idle engine: the prompt at [0, width), as `stream` lays it
        segment = self.next_segment
        self.next_segment = self.next_segment % 2_000_000_000 + 1
        seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
        self.logits, self.keys, self.cache = self._join(
            self.params,
            self.cache,
            self.logits,
            self.keys,
            tokens,
            seg * segment,
            pos,
            row_index,
            self.column,
            seed,
            choice,
        )
        self.segments[row_index] = segment
        self.rows.append(Row(request, choice, position=len(request.prompt)))

    def advance(self, row: Row) -> None:
        """Hand the row's sampled token to its request, or finish the row."""
        token = row.token
        if row.done:
            return
        request = row.request
        if request.ended(row.choice):
            self.end_early(row)
            return
        if self.stop[request.chat][token]:
            self.finish(row, "stop")
            return
        row.generated += 1
        request.emit(row.choice, token, None)
        if row.generated >= request.max_tokens:
            self.finish(row, "length")

    def finish(self, row: Row, reason: str) -> None:
        """End a row: it stops counting as active before its client can hear that it ended."""
        with self.lock:
            row.done = True
            if reason == "cancelled" and row.request.cancelled.is_set():
                self.counters["cancelled"] += 1
        row.request.emit(row.choice, None, reason)

    def end_early(self, row: Row) -> None:
        """Finish a row its request ended: a closed connection (counted) or a stop string."""
        self.finish(row, "cancelled")

    def drop_finished(self) -> None:
        """Remove done or cancelled rows, moving the last active row into each hole."""
        i = 0
        while i < len(self.rows):
            row = self.rows[i]
            if row.request.ended(row.choice) and not row.done:
                self.end_early(row)
            if not row.done:
                i += 1
                continue
            last = len(self.rows) - 1
            if i != last:
                self.cache = self._move(self.cache, jnp.int32(last), jnp.int32(i))
                self.logits = self.logits.at[i].set(self.logits[last])
                self.keys = self.keys.at[i].set(self.keys[last])
                self.segments[i] = self.segments[last]
                self.rows[i] = self.rows[last]
            self.segments[last] = 0
            self.rows.pop()
