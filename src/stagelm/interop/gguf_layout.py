"""GGUF, llama.cpp's model file, as stagelm maps it: tensor names, the q/k row order, token types.

A GGUF of the `llama` architecture holds the weights (quantized or not) under llama.cpp's
names, the hyperparameters as `llama.*` metadata, and the tokenizer as lists (tokens, their
types, BPE merges) beside its pre-tokenizer's name and the chat template.

llama.cpp's converter stores each q and k projection with its rows permuted for llama.cpp's
RoPE, which rotates adjacent pairs where transformers (and stagelm) rotate halves: within
each head the rows are cut in two halves and interleaved. Import undoes it (`unpermute`) and
export does it (`permute`), k with its own (kv) head count.

The byte-level BPE pre-tokenizers stagelm rebuilds are named as llama.cpp names them
(`PRE_TOKENIZERS`): stagelm's own (single digits, then GPT-2's split) is llama.cpp's
`smollm`, so a stagelm model's GGUF tokenizes in llama.cpp as it does here.
"""

import numpy as np

# llama.cpp's GGUF names for transformers' Llama weights, per layer and whole.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
WHOLE_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# tokenizer.ggml.pre → the regexes llama.cpp splits text with, as a `tokenizers` pre-tokenizer spec:
# "digits" splits every digit off first (\p{N}), then GPT-2's byte-level split, as stagelm's own does.
PRE_TOKENIZERS = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), "digits"),
    **dict.fromkeys(("gpt2", "default", "mpt", "olmo", "jais"), "gpt2"),
}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
TOKEN_TYPES = range(0, 7)  # llama.cpp's: undefined, normal, unknown, control, user-defined, unused, byte


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' (out, in) q or k rows → llama.cpp's: each head's two halves interleaved."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, out // heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's (out, in) q or k rows → transformers': the inverse of `permute`."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, out // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
