"""A stagelm model as a transformers Llama checkpoint folder.

`export_hf` writes what `LlamaForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` read: `config.json`, `model.safetensors` (transformers'
parameter names; every projection as an (out, in) matrix), `generation_config.json`,
`tokenizer.json` and `tokenizer_config.json` (the special tokens and a chat template
that renders stagelm's chat format, or the checkpoint's own). Logits agree with
transformers' to float tolerance (tests/interop).
"""

import os
import shutil
import types
from pathlib import Path
from typing import Any

from stagelm.data.chatformat import load_chat_format
from stagelm.data.tokenizer import ASSISTANT, BOS, END, EOS, PAD, USER, load_tokenizer
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import (
    atomic_write_bytes,
    copy_file,
    folder_beside,
    read_json_object,
    replace_folder,
    write_json,
)
from stagelm.interop.chat_spec import CHAT_TEMPLATE
from stagelm.interop.llama_state import llama_tensors
from stagelm.model.decoder import DecoderConfig
from stagelm.model.modeldir import load_model, read_model_context, read_sampling_defaults


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
    holding anything but a previous export (which the export replaces)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise StagelmError(f"{out_dir}: a file, not a folder; give export-hf a new or empty folder to write")
    if out_dir.resolve() == model_dir.resolve() or out_dir.resolve().is_relative_to(model_dir.resolve()):
        raise StagelmError(f"{out_dir}: is (or is inside) the model being exported; give export-hf another folder")
    names = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    others = [name for name in names if name not in EXPORT_FILES]
    if others:
        raise StagelmError(
            f"{out_dir}: holds {others[:3]}, not only a previous export; give export-hf a new or empty folder"
        )
    if names and not is_previous_export(out_dir / "config.json"):  # e.g. a checkpoint transformers saved
        raise StagelmError(
            f"{out_dir}: holds a checkpoint export-hf did not write (its config.json is not an export's); "
            "give export-hf a new or empty folder"
        )


def is_previous_export(config: Path) -> bool:
    """Whether `config` is a config.json export-hf wrote: the keys `hf_config` writes, no others (transformers
    writes `transformers_version` into every config.json it saves)."""
    if not os.path.lexists(config):
        return False
    ours = hf_config(DecoderConfig(vocab_size=2, d_model=2, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=2), 1, SPECIALS)
    return set(read_json_object(config, "move the folder away")) == set(ours)


SPECIALS = types.SimpleNamespace(bos=None, eos=0, pad=0)  # a chat format's token ids, as hf_config reads them


def export_hf(model_dir: str | Path, out_dir: str | Path, sampling: dict[str, float] | None = None) -> Path:
    """Write the transformers Llama checkpoint of stagelm model `model_dir` into `out_dir`.
    generation_config.json carries the model's sampling defaults (its own generation_config.json's,
    then `sampling`'s, e.g. the eval's best temperature), with do_sample on when there are any.

    The files go to a temporary folder beside `out_dir`, which then replaces it: a failed
    or killed export leaves the previous one (or none) and never half of one."""
    from safetensors.numpy import save

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir = out_dir.resolve() if out_dir.is_symlink() else out_dir  # written where a link leads, built beside it
    check_export_target(model_dir, out_dir)
    model = load_model(model_dir)
    if model.cfg.lora_rank:
        raise StagelmError(f"{model_dir}: holds unmerged LoRA adapters; export the merged model (runs/sft/model)")
    chat = load_chat_format(load_tokenizer(model_dir / "tokenizer.json"), model_dir)
    context = read_model_context(model_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder_beside(out_dir, "export")
    try:
        # Through the atomic writer, as every other file: the mode a new file gets (0o666 less the
        # umask; safetensors' own writer leaves 0o600), and a failed write names the file.
        atomic_write_bytes(tmp / "model.safetensors", save(llama_tensors(model), metadata={"format": "pt"}))
        write_json(tmp / "config.json", hf_config(model.cfg, context, chat))
        generation = {"bos_token_id": chat.bos, "eos_token_id": list(chat.stops), "pad_token_id": chat.pad}
        defaults = {**read_sampling_defaults(model_dir), **(sampling or {})}
        if defaults:
            generation.update(do_sample=True, **defaults)
        write_json(tmp / "generation_config.json", generation)
        copy_file(model_dir / "tokenizer.json", tmp / "tokenizer.json")
        write_json(tmp / "tokenizer_config.json", tokenizer_config(context, chat))
        replace_folder(tmp, out_dir)
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
