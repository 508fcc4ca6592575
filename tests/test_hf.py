"""Hugging Face interop, checked by transformers itself: export parity, chat template, import, bad configs."""

import json
import shutil
import sys

import numpy as np
import pytest
from conftest import ROOT, forward, micro_params, run, write_params
from flax import nnx

from stagelm.errors import StagelmError
from stagelm.generate import Generator
from stagelm.hf import export_hf, import_hf
from stagelm.model import Decoder, DecoderConfig
from stagelm.modeldir import load_model, save_model
from stagelm.tokenizer import chat_prompt_ids, load_tokenizer

torch = pytest.importorskip("torch", reason="torch is a test-only interop dependency (pip install -e '.[interop]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test-only interop dependency")


def stagelm_model(micro_data, tmp_path, tie: bool):
    tok = micro_data / "tokenizer/tokenizer.json"
    vocab = load_tokenizer(tok).get_vocab_size()
    cfg = DecoderConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, tie_embeddings=tie)
    model = Decoder(cfg, nnx.Rngs(3))
    save_model(tmp_path / "model", model, tok, {"context_len": 64})
    return tmp_path / "model", model


def ids_of(micro_data, text="Once upon a time, Mia found 41 shells."):
    return load_tokenizer(micro_data / "tokenizer/tokenizer.json").encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("tie", [True, False])
def test_export_loads_in_transformers_with_the_same_logits_and_greedy_tokens(micro_data, tmp_path, tie):
    model_dir, model = stagelm_model(micro_data, tmp_path, tie)
    out = export_hf(model_dir, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == tie and hf.config.num_key_value_heads == 2
    ids = ids_of(micro_data)
    t = np.array([ids], np.int32)
    ours = np.asarray(forward(model, t, np.ones_like(t), np.arange(len(ids))[None]))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)

    gen = Generator(load_model(model_dir), load_tokenizer(model_dir / "tokenizer.json"), 64)
    mine = gen.generate([ids], 12, until_stop=False)[0].tokens
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert mine == hf_out[0, len(ids) :].tolist()


def test_exported_tokenizer_and_chat_template_match_stagelm(micro_data, tmp_path):
    model_dir, _ = stagelm_model(micro_data, tmp_path, True)
    out = export_hf(model_dir, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(model_dir / "tokenizer.json")
    question = "What is 41 plus 17?"
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    assert text == f"<|user|>{question}<|end|><|assistant|>"
    assert tok.encode(text, add_special_tokens=False) == chat_prompt_ids(ours, question)
    assert tok.decode(tok.encode("Tom has 12 apples.", add_special_tokens=False)) == "Tom has 12 apples."
    config = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == [tok.convert_tokens_to_ids("<|eos|>"), tok.convert_tokens_to_ids("<|end|>")]


def tiny_llama(vocab: int, seed: int, **overrides):
    """A randomly initialised micro-sized transformers Llama (untied, GQA)."""
    settings = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab, **{**settings, **overrides})).eval()


def save_hf_llama(micro_data, path, **overrides):
    """A randomly initialised transformers Llama with the micro tokenizer, saved as safetensors."""
    vocab = load_tokenizer(micro_data / "tokenizer/tokenizer.json").get_vocab_size()
    model = tiny_llama(vocab, 0, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    shutil.copyfile(micro_data / "tokenizer/tokenizer.json", path / "tokenizer.json")
    return model


def test_import_of_a_transformers_llama_has_its_logits_then_fine_tunes(micro_data, tmp_path):
    hf = save_hf_llama(micro_data, tmp_path / "hf")
    model, context = import_hf(tmp_path / "hf")
    assert context == 64
    ids = ids_of(micro_data)
    t = np.array([ids], np.int32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(t, np.ones_like(t), np.arange(len(ids))[None])), theirs, atol=1e-4)

    run(["stagelm", "import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")], tmp_path)
    write_params(tmp_path / "params.yaml", micro_params(sft={"steps": 4, "eval_every": 4, "checkpoint_every": 4}))
    out = run(
        [sys.executable, str(ROOT / "stages/sft.py"), "--params", "params.yaml", "--model", "imported"]
        + ["--train", str(micro_data / "packed/sft"), "--corpus", str(micro_data / "packed/train")]
        + ["--val", str(micro_data / "packed/val"), "--out", "sft", "--checkpoints", "ck"],
        tmp_path,
    )
    assert "sft: done at step 4" in out.stdout
    assert load_model(tmp_path / "sft/model").cfg.d_model == 32


def save_foreign_llama(micro_data, path):
    """A transformers Llama whose own tokenizer lacks stagelm's specials (<s>, </s>, <unk> instead)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from stagelm.rawdata import read_raw

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(read_raw(micro_data / "raw", "corpus_train").column("text").to_pylist(), trainer=trainer)
    model = tiny_llama(tok.get_vocab_size(), 1, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    return model, tok


def test_pipeline_starts_from_a_local_hf_checkpoint(micro_data, tmp_path):
    hf, hf_tok = save_foreign_llama(micro_data, tmp_path / "hf")
    vocab = hf_tok.get_vocab_size()
    text = "Once upon a time, Mia found 41 shells."
    ids = hf_tok.encode(text).ids

    # The six chat specials grow the embedding and the head; the checkpoint's own tokens keep their logits.
    grown, _ = import_hf(tmp_path / "hf", vocab + 6)
    t = np.array([ids], np.int32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(grown(t, np.ones_like(t), np.arange(len(ids))[None]))
    assert ours.shape[-1] == vocab + 6
    np.testing.assert_allclose(ours[..., :vocab], theirs, atol=1e-4)

    params = micro_params(
        model={"init_from": f"hf:{tmp_path / 'hf'}"},
        training={"steps": 4, "warmup_steps": 1, "eval_every": 4, "checkpoint_every": 4},
        sft={"steps": 4, "warmup_steps": 1, "eval_every": 4, "checkpoint_every": 4},
        eval={"max_examples": 8, "max_new_tokens": 8},
    )
    work = tmp_path / "work"
    work.mkdir()
    write_params(work / "params.yaml", params)
    raw = str(micro_data / "raw")

    def stage(name, *args):
        return run([sys.executable, str(ROOT / f"stages/{name}.py"), "--params", "params.yaml", *args], work).stdout

    out = stage("tokenizer", "--raw", raw, "--out", "tok")
    assert "appended: <|pad|>, <|bos|>, <|eos|>, <|user|>, <|assistant|>, <|end|>" in out
    adopted = load_tokenizer(work / "tok/tokenizer.json")
    assert adopted.get_vocab_size() == vocab + 6 and adopted.encode(text, add_special_tokens=False).ids == ids
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == ids

    stage("pack", "--raw", raw, "--tokenizer", "tok", "--out", "packed")
    out = stage(
        "pretrain",
        *("--train", "packed/train", "--val", "packed/val", "--tokenizer", "tok/tokenizer.json"),
        *("--out", "pretrain", "--checkpoints", "ck/pretrain"),
    )
    assert f"from {tmp_path / 'hf'} (its architecture" in out and "done at step 4" in out
    assert load_model(work / "pretrain/model").cfg.vocab_size == vocab + 6
    out = stage(
        "sft",
        *("--model", "pretrain/model", "--train", "packed/sft", "--corpus", "packed/train"),
        *("--val", "packed/val", "--out", "sft", "--checkpoints", "ck/sft"),
    )
    assert "sft (lora)" in out and "done at step 4" in out
    stage(
        "eval",
        *("--model", "sft/model", "--name", "sft", "--format", "chat", "--val", "packed/val", "--raw", raw),
        *("--out", "eval"),
    )
    metrics = json.loads((work / "eval/metrics.json").read_text())
    assert np.isfinite(metrics["val_loss"])


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"attention_bias": True}, "attention_bias = True is not supported"),
        ({"mlp_bias": True}, "mlp_bias = True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling = "),
    ],
)
def test_unsupported_configurations_fail_naming_the_field(micro_data, tmp_path, overrides, field):
    save_hf_llama(micro_data, tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    config.update(overrides)
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    with pytest.raises(StagelmError, match=field.replace("(", r"\(")):
        import_hf(tmp_path / "hf")
