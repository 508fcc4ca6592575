"""Supervised fine-tuning's rows and its result, full or LoRA.

The loss counts only assistant tokens (the packed rows' loss_mask); with `sft.replay` above
0 that share of the rows are rows of the pretraining corpus (every token counted), so the
language model is kept while the chat format is learned. With `sft.method: lora` only the
adapters train; the saved model is merged (an ordinary model) and the adapter weights are
kept apart beside it.
"""

from pathlib import Path

import jax

from stagelm.data.loader import MixedRows, PackedRows
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import sha256_tree, write_json
from stagelm.model.decoder import Decoder
from stagelm.model.lora import merge_lora, save_adapter
from stagelm.model.modeldir import read_model_config
from stagelm.pipeline.config import SftConfig


def sft_rows(cfg: SftConfig, train: Path, corpus: Path, model_dir: Path) -> PackedRows | MixedRows:
    """The SFT rows of `train`, with `sft.replay`'s share of corpus rows mixed in, checked against
    the tokenizer and vocabulary of the model they tune (`model_dir`)."""
    rows = PackedRows(train)
    base_cfg = read_model_config(model_dir)
    if base_cfg.vocab_size < rows.manifest["vocab_size"]:  # an imported checkpoint may have spare rows
        raise StagelmError(
            f"{model_dir}: vocab {base_cfg.vocab_size} is smaller than {train}'s "
            f"{rows.manifest['vocab_size']}; retrain the model on this tokenizer (`dvc repro`)"
        )
    tokenizer = model_dir / "tokenizer.json"
    rows.require_tokenizer(tokenizer)
    if cfg.replay == 0:
        return rows
    replayed = PackedRows(corpus)
    replayed.require_tokenizer(tokenizer)
    wanted = round(len(rows) * cfg.replay / (1 - cfg.replay))
    if wanted > len(replayed):
        raise StagelmError(
            f"sft.replay: {cfg.replay} asks {wanted} corpus rows beside {len(rows)} SFT rows, but "
            f"{corpus} holds {len(replayed)}; lower it"
        )
    return MixedRows([rows, replayed], [None, wanted])


def finish_sft(model: Decoder, cfg: SftConfig, adapter_dir: Path, base_params: Path) -> Decoder:
    """The model to save: with LoRA the adapters are written alone to `adapter_dir` (with the hash
    of the base's params) and merged into the weights; full fine-tuning says so there."""
    if cfg.method == "lora":
        save_adapter(adapter_dir, model, cfg.lora, sha256_tree(base_params))
        return merge_lora(model)
    if jax.process_index() == 0:
        write_json(adapter_dir / "adapter_config.json", {"method": "full"})
    return model
