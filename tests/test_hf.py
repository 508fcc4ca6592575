"""Hugging Face interop, checked by transformers itself: export parity, chat template, import, bad configs."""

import json
import shutil
import sys

import numpy as np
import pytest
from conftest import ROOT, micro_params, run, write_params
from flax import nnx

from stagelm.errors import StagelmError
from stagelm.generate import Generator
from stagelm.hf import export_hf, import_hf
from stagelm.model import Decoder, DecoderConfig
from stagelm.modelio import load_model, save_model
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
    ours = np.asarray(model(t, np.ones_like(t), np.arange(len(ids))[None]))
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


def save_hf_llama(micro_data, path, **overrides):
    """A randomly initialised transformers Llama with the micro tokenizer, saved as safetensors."""
    vocab = load_tokenizer(micro_data / "tokenizer/tokenizer.json").get_vocab_size()
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
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
        + ["--train", str(micro_data / "packed/sft"), "--val", str(micro_data / "packed/val")]
        + ["--out", "sft", "--checkpoints", "ck"],
        tmp_path,
    )
    assert "sft: done at step 4" in out.stdout
    assert load_model(tmp_path / "sft/model").cfg.d_model == 32


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
