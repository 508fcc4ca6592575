"""Hugging Face interop: a stagelm model as a transformers Llama checkpoint, and back.

`export_hf` writes what `LlamaForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` read: `config.json`, `model.safetensors` (transformers'
parameter names; every projection as an (out, in) matrix), `generation_config.json`,
`tokenizer.json` and `tokenizer_config.json` (the special tokens and a chat template
that renders stagelm's chat format). stagelm's decoder is Llama's: pre-norm RMSNorm,
rotate-half RoPE with inverse frequencies theta^(-2i/d), grouped-query attention,
SwiGLU, an optionally tied head; so the mapping is a reshape and a transpose per
matrix, and logits agree to float tolerance (tested against transformers itself).

`import_hf` reads a local transformers Llama checkpoint (safetensors only; nothing
runs from it) into a stagelm Decoder, refusing what the decoder lacks (biases,
rope scaling, another activation) with one line naming the field.
"""

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from stagelm.data.chatformat import load_chat_format
from stagelm.data.tokenizer import ASSISTANT, BOS, END, EOS, PAD, USER, load_tokenizer
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import atomic_write_bytes, copy_file, read_json_object, write_json
from stagelm.model.decoder import Decoder, DecoderConfig

# Renders stagelm's chat layout: <|user|>text<|end|><|assistant|>text<|end|> ...
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{% elif message['role'] == 'assistant' %}" + ASSISTANT + ""
    "{% else %}{{ raise_exception('stagelm chats have user and assistant turns only') }}{% endif %}"
    "{{ message['content'] }}" + END + "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
    """transformers' Llama state dict (name → (out, in) float arrays) of a stagelm decoder."""
    cfg = model.cfg
    d, h, k, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    out = {"model.embed_tokens.weight": np.asarray(model.embed[...])}
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        kv = np.asarray(block.attn.kv.w[...])
        gate_up = np.asarray(block.mlp.gate_up.w[...])
        out.update(
            {
                p + "input_layernorm.weight": np.asarray(block.attn_norm[...]),
                p + "post_attention_layernorm.weight": np.asarray(block.mlp_norm[...]),
                p + "self_attn.q_proj.weight": np.asarray(block.attn.q.w[...]).reshape(d, h * dh).T,
                p + "self_attn.k_proj.weight": kv[:, 0].reshape(d, k * dh).T,
                p + "self_attn.v_proj.weight": kv[:, 1].reshape(d, k * dh).T,
                p + "self_attn.o_proj.weight": np.asarray(block.attn.o.w[...]).reshape(h * dh, d).T,
                p + "mlp.gate_proj.weight": gate_up[:, 0].T,
                p + "mlp.up_proj.weight": gate_up[:, 1].T,
                p + "mlp.down_proj.weight": np.asarray(block.mlp.down.w[...]).T.reshape(d, f),
            }
        )
    out["model.norm.weight"] = np.asarray(model.final_norm[...])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(model.head[...]).T
    return {name: np.ascontiguousarray(a) for name, a in out.items()}


def hf_config(cfg: DecoderConfig, context: int, chat: Any) -> dict[str, Any]:
    """transformers' config.json of a decoder; the special token ids are its chat format's (`chat`)."""
    dtype = {"float32": "float32", "bfloat16": "bfloat16"}[cfg.param_dtype]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "bos_token_id": chat.bos,
        "eos_token_id": chat.eos,
        "pad_token_id": chat.pad,
    }


EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model.gguf",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def check_export_target(model_dir: Path, out_dir: Path) -> None:
    """Refuse an export target that is a file, the model itself or inside it, or a folder
    holding anything but a previous export's files (which the export replaces)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise StagelmError(f"{out_dir}: a file, not a folder; give export-hf a new or empty folder to write")
    if out_dir.resolve() == model_dir.resolve() or out_dir.resolve().is_relative_to(model_dir.resolve()):
        raise StagelmError(f"{out_dir}: is (or is inside) the model being exported; give export-hf another folder")
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in EXPORT_FILES) if out_dir.is_dir() else []
    if others:
        raise StagelmError(
            f"{out_dir}: holds {others[:3]}, not only a previous export; give export-hf a new or empty folder"
        )


def export_hf(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the transformers Llama checkpoint of stagelm model `model_dir` into `out_dir`.

    The files go to a temporary folder beside `out_dir`, which then replaces it: a failed
    or killed export leaves the previous one (or none) and never half of one."""
    from safetensors.numpy import save

    from stagelm.model.modeldir import load_model, read_model_context

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_export_target(model_dir, out_dir)
    model = load_model(model_dir)
    if model.cfg.lora_rank:
        raise StagelmError(f"{model_dir}: holds unmerged LoRA adapters; export the merged model (runs/sft/model)")
    chat = load_chat_format(load_tokenizer(model_dir / "tokenizer.json"), model_dir)
    context = read_model_context(model_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (out_dir.with_name(f".{out_dir.name}.{what}") for what in ("export-tmp", "export-old"))
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    try:
        # Through the atomic writer, as every other file: the mode a new file gets (0o666 less the
        # umask; safetensors' own writer leaves 0o600), and a failed write names the file.
        atomic_write_bytes(tmp / "model.safetensors", save(hf_tensors(model), metadata={"format": "pt"}))
        write_json(tmp / "config.json", hf_config(model.cfg, context, chat))
        generation = {"bos_token_id": chat.bos, "eos_token_id": list(chat.stops), "pad_token_id": chat.pad}
        write_json(tmp / "generation_config.json", generation)
        copy_file(model_dir / "tokenizer.json", tmp / "tokenizer.json")
        write_json(tmp / "tokenizer_config.json", tokenizer_config(context, chat))
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def tokenizer_config(context: int, chat: Any) -> dict[str, Any]:
    """transformers' tokenizer_config.json: stagelm's specials and template, or the checkpoint's own."""
    common = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    if chat.spec is None:
        return {
            **common,
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "additional_special_tokens": [USER, ASSISTANT, END],
            "add_bos_token": False,
            "chat_template": CHAT_TEMPLATE,
        }
    spec = chat.spec
    tokens = {k: spec[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if spec.get(k)}
    template = {"chat_template": spec["template"]} if spec["template"] else {}
    return {**common, **tokens, "add_bos_token": bool(spec.get("add_bos_token")), **template}


# config.json fields stagelm's decoder has one value of: a checkpoint that says otherwise is refused.
FIXED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "pretraining_tp": 1}
# RoPE as stagelm computes it: theta^(-2i/d) on the whole head, positions as they are. transformers
# 4 spells it `rope_theta` and `rope_scaling: null`; transformers 5 `rope_parameters: {rope_type:
# "default", rope_theta}`. Every other rope type (linear, dynamic, yarn, longrope, llama3) scales
# positions or frequencies stagelm does not, so it is refused.
ROPE_KEYS = {"rope_type", "rope_theta", "type", "partial_rotary_factor"}


# The integer fields import reads, with the largest value accepted: far above any released
# Llama, and low enough that a wrong value fails here instead of in a huge allocation.
HF_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "intermediate_size": 1 << 20,
    "max_position_embeddings": 1 << 20,
    "head_dim": 1 << 12,
}


def hf_int(c: dict[str, Any], field: str, path: Path, default: int | None = None) -> int:
    value = c.get(field, default)
    if value is None:
        raise StagelmError(f"{path}: {field} missing; a Llama config.json needs it")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= HF_LIMITS[field]:
        raise StagelmError(f"{path}: {field} = {value!r}; expected an integer in [1, {HF_LIMITS[field]:,}]")
    return value


def hf_float(c: dict[str, Any], field: str, path: Path, default: float | None = None) -> float:
    value = c.get(field, default)
    if value is None:
        raise StagelmError(f"{path}: {field} missing; a Llama config.json needs it")
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise StagelmError(f"{path}: {field} = {value!r}; expected a positive number")
    return float(value)


def rope_theta(c: dict[str, Any], path: Path) -> float:
    """The RoPE base of a config.json in either layout, refusing any scaling stagelm does not compute.
    A field the checkpoint has is never replaced by a default: only a config with neither
    `rope_theta` nor `rope_parameters` gets Llama's 10,000, as transformers gives it."""
    params = c.get("rope_parameters")
    scaling = c.get("rope_scaling")
    for name, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if block is None:
            continue
        if not isinstance(block, dict):
            raise StagelmError(f"{path}: {name} = {block!r}; expected an object or null")
        kind = block.get("rope_type", block.get("type", "default"))
        if kind != "default":
            raise StagelmError(
                f"{path}: {name} has rope_type {kind!r}; stagelm's RoPE has no scaling (only 'default' imports)"
            )
        extra = sorted(set(block) - ROPE_KEYS)
        if extra:
            raise StagelmError(f"{path}: {name} sets {extra}, which stagelm's RoPE does not implement")
        if block.get("partial_rotary_factor", 1.0) != 1.0:
            raise StagelmError(f"{path}: {name}.partial_rotary_factor {block['partial_rotary_factor']!r} is not 1.0")
    found = {
        "rope_theta": c.get("rope_theta"),
        "rope_parameters.rope_theta": params.get("rope_theta") if isinstance(params, dict) else None,
        "rope_scaling.rope_theta": scaling.get("rope_theta") if isinstance(scaling, dict) else None,
    }
    given = {k: v for k, v in found.items() if v is not None}
    if len(set(given.values())) > 1:
        raise StagelmError(f"{path}: RoPE bases disagree ({given}); keep one")
    key = next(iter(given), "rope_theta")
    return hf_float({key: given.get(key, 10000.0)}, key, path)


def import_config(hf_dir: Path) -> tuple[DecoderConfig, int]:
    """(stagelm DecoderConfig, context length) of a transformers Llama config.json in transformers 4's
    or 5's layout, or one line why not: every field used is type- and range-checked (HF_LIMITS)
    before anything is allocated, and a field stagelm cannot represent is refused, never dropped."""
    path = hf_dir / "config.json"
    c = read_json_object(path, "hf:<dir> must be a local transformers checkpoint directory")
    if c.get("model_type") != "llama":
        raise StagelmError(f"{path}: model_type {c.get('model_type')!r}; stagelm imports 'llama' checkpoints only")
    for field, value in FIXED.items():
        if c.get(field, value) != value:
            raise StagelmError(f"{path}: {field} = {c[field]!r} is not supported (stagelm's decoder has {value!r})")
    d, h = hf_int(c, "hidden_size", path), hf_int(c, "num_attention_heads", path)
    k = hf_int(c, "num_key_value_heads", path, default=h)
    if d % h:
        raise StagelmError(f"{path}: num_attention_heads {h} does not divide hidden_size {d}")
    if h % k:
        raise StagelmError(f"{path}: num_key_value_heads {k} does not divide num_attention_heads {h}")
    if (d // h) % 2:
        raise StagelmError(f"{path}: hidden_size / num_attention_heads = {d // h} must be even for RoPE")
    if c.get("head_dim") is not None and hf_int(c, "head_dim", path) != d // h:
        raise StagelmError(f"{path}: head_dim {c['head_dim']!r} differs from hidden_size / num_attention_heads")
    cfg = DecoderConfig(
        vocab_size=hf_int(c, "vocab_size", path),
        d_model=d,
        n_layers=hf_int(c, "num_hidden_layers", path),
        n_heads=h,
        n_kv_heads=k,
        d_ff=hf_int(c, "intermediate_size", path),
        rope_theta=rope_theta(c, path),
        norm_eps=hf_float(c, "rms_norm_eps", path, 1e-6),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_std=hf_float(c, "initializer_range", path, 0.02),
    )
    return cfg, hf_int(c, "max_position_embeddings", path, default=2048)


def read_safetensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a transformers checkpoint's safetensors files (never a pickled .bin)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise StagelmError(f"{hf_dir}: no *.safetensors weights (stagelm never loads pickled .bin files)")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as err:
            raise StagelmError(f"{file}: not a readable safetensors file ({str(err)[:80]})") from None
    return tensors


def decoder_from_hf(
    cfg: DecoderConfig, tensors: dict[str, np.ndarray], where: Path, vocab_size: int | None = None, **settings: Any
) -> Decoder:
    """A stagelm Decoder holding transformers' Llama state dict `tensors` (name → (out, in) arrays).

    `vocab_size` beyond the checkpoint's grows the embedding (and an untied head) for tokens
    added to its tokenizer; their rows start at the mean of the existing ones. `settings` are
    DecoderConfig fields that do not change the weights (dtype, param_dtype, remat)."""
    trained_vocab = cfg.vocab_size
    cfg = dataclasses.replace(cfg, vocab_size=max(vocab_size or 0, trained_vocab), **settings)
    d, h, k, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise StagelmError(f"{where}: weight {name} missing")
        return tensors[name].astype(np.float32)

    def grown(rows: np.ndarray) -> np.ndarray:  # (trained vocab, d) → (cfg.vocab_size, d)
        if len(rows) != trained_vocab:
            return rows  # a wrong shape is named below
        extra = np.repeat(rows.mean(0, keepdims=True), cfg.vocab_size - trained_vocab, axis=0)
        return np.concatenate([rows, extra])

    model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    values = {("embed",): grown(get("model.embed_tokens.weight")), ("final_norm",): get("model.norm.weight")}
    if not cfg.tie_embeddings:
        values[("head",)] = grown(get("lm_head.weight")).T
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        q = get(p + "self_attn.q_proj.weight").T.reshape(d, h, dh)
        kk = get(p + "self_attn.k_proj.weight").T.reshape(d, k, dh)
        v = get(p + "self_attn.v_proj.weight").T.reshape(d, k, dh)
        values.update(
            {
                ("blocks", i, "attn_norm"): get(p + "input_layernorm.weight"),
                ("blocks", i, "mlp_norm"): get(p + "post_attention_layernorm.weight"),
                ("blocks", i, "attn", "q", "w"): q,
                ("blocks", i, "attn", "kv", "w"): np.stack([kk, v], axis=1),
                ("blocks", i, "attn", "o", "w"): get(p + "self_attn.o_proj.weight").T.reshape(h, dh, d),
                ("blocks", i, "mlp", "gate_up", "w"): np.stack(
                    [get(p + "mlp.gate_proj.weight").T, get(p + "mlp.up_proj.weight").T], axis=1
                ),
                ("blocks", i, "mlp", "down", "w"): get(p + "mlp.down_proj.weight").T.reshape(f, d),
            }
        )
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, variable in flat.items():
        name = ".".join(map(str, path))
        if path not in values:
            raise StagelmError(f"{where}: no weight maps to stagelm parameter {name}")
        if values[path].shape != variable.shape:
            raise StagelmError(f"{where}: weight for {name} has shape {values[path].shape}, expected {variable.shape}")
        flat[path] = variable.replace(jax.numpy.asarray(values[path], variable.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def import_hf(hf_dir: str | Path, vocab_size: int | None = None, **settings: Any) -> tuple[Decoder, int]:
    """(stagelm Decoder, context length) of a local transformers Llama checkpoint (model.safetensors);
    `vocab_size` and `settings` as `decoder_from_hf` takes them."""
    hf_dir = Path(hf_dir)
    cfg, context = import_config(hf_dir)
    return decoder_from_hf(cfg, read_safetensors(hf_dir), hf_dir, vocab_size, **settings), context


def hf_token(value: Any) -> str | None:
    """A special token's spelling as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def hf_chat_spec(hf_dir: Path, tok: Any) -> dict[str, Any]:
    """chat.json of a transformers checkpoint (stagelm.data.chatformat), from its tokenizer_config.json (or
    chat_template.jinja) and generation_config.json and config.json ids; its template is None when
    it has none (a base model: text only). Every token named must be in `tok`, its own tokenizer."""
    config_path = hf_dir / "tokenizer_config.json"
    config = read_json_object(config_path, "the checkpoint's tokenizer_config.json") if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if (hf_dir / "chat_template.jinja").is_file():  # transformers 4.43+ saves it apart
        template = (hf_dir / "chat_template.jinja").read_text()
    if not isinstance(template, str) or not template.strip():
        template = None
    generation = hf_dir / "generation_config.json"
    gen = read_json_object(generation, "fix or remove it") if generation.is_file() else {}
    model = read_json_object(hf_dir / "config.json", "a transformers checkpoint's config.json")

    def spelled(key: str) -> str | None:
        token = hf_token(config.get(f"{key}_token"))
        if token is None:
            ids = gen.get(f"{key}_token_id", model.get(f"{key}_token_id"))
            ids = ids if isinstance(ids, list) else [ids]
            token = tok.id_to_token(ids[0]) if ids and isinstance(ids[0], int) else None
        return token

    eos = spelled("eos")
    if eos is None:
        raise StagelmError(f"{config_path}: no eos_token (nor an eos_token_id in generation_config.json); add one")
    ends = gen.get("eos_token_id", model.get("eos_token_id"))
    stops = [tok.id_to_token(i) for i in (ends if isinstance(ends, list) else [ends]) if isinstance(i, int)]
    spec = {
        "template": template,
        "bos_token": spelled("bos"),
        "eos_token": eos,
        "pad_token": spelled("pad") or eos,
        "unk_token": spelled("unk"),
        "stop_tokens": [t for t in stops if t],
        "add_bos_token": bool(config.get("add_bos_token", False)),
    }
    return with_end_of_turn(spec, tok, config_path)


def with_end_of_turn(spec: dict[str, Any], tok: Any, where: Path) -> dict[str, Any]:
    """`spec` with its template's end-of-turn token among the stop tokens: the first special token
    the template writes after an assistant message's text."""
    from stagelm.data.chatformat import ChatFormat

    if spec["template"] is None:
        return {**spec, "stop_tokens": list(dict.fromkeys([spec["eos_token"], *spec["stop_tokens"]]))}

    chat = ChatFormat(tok, {**spec, "stop_tokens": [t for t in spec["stop_tokens"] if tok.token_to_id(t) is not None]})
    turn = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    text = chat.render(turn, add_generation_prompt=False)
    after = text[text.rfind("Hello.") + len("Hello.") :]
    ends = [s for s in chat.specials if s in after]
    first = min(ends, key=after.index) if ends else None
    stops = list(dict.fromkeys(spec["stop_tokens"] + ([first] if first else [])))
    if not stops:
        raise StagelmError(f"{where}: nothing ends an assistant turn (no eos, no special token after it); add one")
    return {**spec, "stop_tokens": stops}
