"""Scoring many token sequences at once: the log-probability of chosen tokens at chosen positions.

What lm-eval's loglikelihood requests need (`stagelm.measure.harness`), on any device: each
input is a token sequence and the (position, token) pairs to read from it. Inputs that are a
prefix of another input ride in its row (causal attention: the prefix's logits are the same
there), and the rest are packed first-fit into rows of one width, each a segment of its own
with positions from 0, so no padding is computed and attention never crosses inputs. Only
the positions read go through the output layer, in chunks, so the (positions, vocab) logits
stay small. The row width is the aligned width, one to four times the longest input, whose rows
cost least (padding against attention over a wider row), and query counts are powers of two: a
whole task compiles a handful of times.
"""

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stagelm.model.decoder import Decoder

ALIGN = 128  # row widths are multiples of the TPU's lane width (splash's block)
# On a v5e the reference kernel's softmax over a row costs about 4.6 times its FLOPs' share of a
# forward pass (1,024 rows of 128 against 832 of 512 and 1,024 of 640: 2.2, 3.3 and 3.7 µs per
# 1,000 row positions), and it beats splash at rows up to 1,024 wide (47.7% of the forward
# bound against 34.2% at 128, 36.8% against 18.6% at 640; splash 2% ahead at 512).
ATTENTION_COST = 4.6
REFERENCE_UP_TO = 1024
WIDTHS = 4  # widths tried: 1 to 4 times the longest input, aligned
MIN_QUERIES = 64  # the fewest query slots of a forward pass
QUERY_CHUNK = 512  # continuation positions through the output layer at once (bounds its (Q, V) logits)


@dataclasses.dataclass
class Scored:
    """One input to score: its tokens and the (position, token) pairs read from it, by request."""

    tokens: tuple[int, ...]
    reads: list[tuple[int, int, int]]  # (request index, position in this input, target token)


OPEN_ROWS = 64  # rows still tried for each item when packing (keeps packing linear in the items)


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit-decreasing packing of items of `lengths` into rows of `width`, trying the last
    `OPEN_ROWS` rows opened: each row a list of item indices (every length must be <= width)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        first = max(0, len(rows) - OPEN_ROWS)
        for r in range(first, len(rows)):
            if lengths[i] <= room[r]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def share_prefixes(inputs: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each distinct input mapped to the input whose row computes it: the longest input it is a
    prefix of (causal attention: a prefix's logits are the same inside the longer row)."""
    ordered = sorted(set(inputs))
    host: dict[tuple[int, ...], tuple[int, ...]] = {}
    for i in range(len(ordered) - 1, -1, -1):  # an input's extensions sort right after it
        seq, nxt = ordered[i], ordered[i + 1] if i + 1 < len(ordered) else None
        host[seq] = host[nxt] if nxt is not None and nxt[: len(seq)] == seq else seq
    return host


def row_width(lengths: list[int], longest_allowed: int, attention_share: float) -> int:
    """The row width that computes `lengths` cheapest: of the aligned widths from the longest input to
    `WIDTHS` times it (at most `longest_allowed`, aligned), the one whose rows cost least, a row of
    width W costing W·(1 + W·`attention_share`) (its matmuls, and attention over the whole row)."""
    base = -(-max(lengths) // ALIGN) * ALIGN
    top = max(base, -(-longest_allowed // ALIGN) * ALIGN)
    widths = [w for w in range(base, min(top, WIDTHS * base) + 1, ALIGN)]
    cost = {w: len(pack_rows(lengths, w)) * w * (1 + w * attention_share) for w in widths}
    return min(widths, key=lambda w: (cost[w], w))


def bucket(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


class Scorer:
    """Scores `Scored` inputs with `model`, `batch_size` rows of a forward pass, no input past `max_length`."""

    def __init__(self, model: Decoder, batch_size: int, max_length: int):
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.graphdef, self.params = nnx.split(model)
        self._score = jax.jit(self._score_fn, static_argnums=0)
        cfg = model.cfg
        # Rows up to REFERENCE_UP_TO wide attend with the reference kernel whatever the model's setting.
        plain = nnx.eval_shape(lambda: Decoder(dataclasses.replace(cfg, attention="reference"), nnx.Rngs(0)))
        self.reference = nnx.split(plain)[0]
        # Attention's FLOPs per token per position of the row over the matmuls' per token, times what
        # its softmax costs beyond its FLOPs (on a v5e: benchmarks/lm-eval-tpu-*.json).
        matmul = 2 * cfg.d_model * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim + 3 * cfg.d_model * cfg.d_ff
        self.attention_share = ATTENTION_COST * 2 * cfg.n_heads * cfg.head_dim / matmul

    def forward(self, arrays: tuple) -> tuple[jax.Array, jax.Array]:
        """One batch's (log-probabilities, greedy) on the device, dispatched, not waited for."""
        graphdef = self.reference if arrays[0].shape[1] <= REFERENCE_UP_TO else self.graphdef
        return self._score(graphdef, self.params, *map(jnp.asarray, arrays))

    def _score_fn(
        self, graphdef: Any, params: Any, tokens: jax.Array, seg: jax.Array, pos: jax.Array, *queries: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(log-probability, is-argmax) of each query's target token, read at its (row, column) of the batch."""
        rows, at, target = queries
        model = nnx.merge(graphdef, params)
        h = model.hidden(tokens, seg, pos)  # (R, W, D)
        picked = h[rows, at]  # (Q, D): only the positions read go through the output layer

        def chunk(args: tuple) -> tuple[jax.Array, jax.Array]:
            hq, tq = args
            logits = model.logits(hq[None])[0].astype(jnp.float32)  # (C, V)
            logp = jnp.take_along_axis(logits, tq[:, None], 1)[:, 0] - jax.nn.logsumexp(logits, -1)
            return logp, jnp.argmax(logits, -1) == tq

        size = min(QUERY_CHUNK, picked.shape[0])
        shaped = (picked.reshape(-1, size, picked.shape[-1]), target.reshape(-1, size))
        logp, greedy = jax.lax.map(chunk, shaped)
        return logp.reshape(-1), greedy.reshape(-1)

    def score(self, items: list[Scored], n_requests: int) -> tuple[np.ndarray, np.ndarray]:
        """(sum of log-probabilities, all greedy) per request index, over every read of `items`.

        Every batch is dispatched before any result is read back, so the host lays out the
        next batch while the device scores the last one."""
        pending = [(self.forward(arrays), requests) for arrays, requests in self.batches(items)]
        logp = np.zeros(n_requests, np.float64)
        greedy = np.ones(n_requests, bool)
        for (out_logp, out_greedy), requests in pending:
            np.add.at(logp, requests, np.asarray(out_logp)[: len(requests)])
            np.logical_and.at(greedy, requests, np.asarray(out_greedy)[: len(requests)])
        return logp, greedy

    def batches(self, items: list[Scored]) -> Iterator[tuple[tuple, np.ndarray]]:
        """The forward passes `items` take: each batch's arrays (`layout`) and the request of each query."""
        host = share_prefixes([it.tokens for it in items])
        hosted: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
        for it in items:
            hosted.setdefault(host[it.tokens], []).extend(it.reads)
        seqs = list(hosted)
        width = row_width([len(s) for s in seqs], self.max_length, self.attention_share)
        rows = pack_rows([len(s) for s in seqs], width)
        for start in range(0, len(rows), self.batch_size):
            yield self.layout([[seqs[i] for i in row] for row in rows[start : start + self.batch_size]], hosted, width)

    def layout(self, rows: list[list[tuple]], hosted: dict, width: int) -> tuple[tuple, np.ndarray]:
        """((tokens, segments, positions, query rows, columns, targets) of one batch, the request of each query)."""
        shape = (self.batch_size, width)
        tokens, seg, pos = np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        queries: list[tuple[int, int, int, int]] = []  # (row, column, target, request)
        for r, row in enumerate(rows):
            col = 0
            for s, seq in enumerate(row, 1):
                tokens[r, col : col + len(seq)], seg[r, col : col + len(seq)] = seq, s
                pos[r, col : col + len(seq)] = np.arange(len(seq))
                queries += [(r, col + at, target, req) for req, at, target in hosted[seq]]
                col += len(seq)
        table = np.zeros((bucket(len(queries), MIN_QUERIES), 4), np.int32)  # a power of two of query slots
        table[: len(queries)] = queries
        return (tokens, seg, pos, table[:, 0], table[:, 1], table[:, 2]), table[: len(queries), 3]
