"""SFT and LoRA: frozen base weights, merged ≡ unmerged, adapter-only optimizer state, the stage."""

import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, forward, micro_params, run, write_params
from flax import nnx
from resume import assert_same_outputs, killed_and_whole

from stagelm.data.loader import MixedRows, PackedRows, batch_iterator
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.lora import add_lora, merge_lora
from stagelm.model.modeldir import load_model
from stagelm.pipeline.config import LoraConfig
from stagelm.pipeline.params import load_section
from stagelm.train.step import init_state, make_optimizer, make_train_step

CFG = DecoderConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, targets=("q", "kv", "o", "gate_up", "down"))


def lora_training(micro_data, steps=8, lora=LORA):
    base = Decoder(CFG, nnx.Rngs(0))
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(base, nnx.Param)))
    model = add_lora(base, lora, nnx.Rngs(1))
    graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
    tcfg = load_section(micro_params(), "sft")
    tx = make_optimizer(tcfg, params)
    state = init_state(params, tx, jax.random.key(0))
    step = make_train_step(graphdef, tx)
    it = batch_iterator(PackedRows(micro_data / "packed/sft"), 8, 0)
    losses = []
    for _ in range(steps):
        state, m = step(state, frozen, {k: v[None] for k, v in next(it).items()})
        losses.append(float(m["loss"]))
    return before, nnx.merge(graphdef, state.params, frozen), state, losses


def test_lora_trains_only_adapters_and_leaves_the_base_bit_identical(micro_data):
    before, model, state, losses = lora_training(micro_data, steps=20)
    assert losses[-1] < losses[0]
    after = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.array, after)), strict=True):
        np.testing.assert_array_equal(a, b)
    lora_sizes = sorted(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    adam = state.opt_state[1][0]  # chain(clip, adamw(...)): scale_by_adam's state
    assert sorted(x.size for x in jax.tree.leaves(adam.mu)) == lora_sizes
    assert sorted(x.size for x in jax.tree.leaves(adam.nu)) == lora_sizes
    assert sum(lora_sizes) < 0.5 * sum(x.size for x in jax.tree.leaves(before))


def test_merged_equals_unmerged(micro_data):
    _, model, _, _ = lora_training(micro_data, steps=10)
    merged = merge_lora(model)
    assert merged.cfg.lora_rank == 0
    tokens = PackedRows(micro_data / "packed/sft")[0]
    args = (tokens["tokens"][None, :-1], tokens["segment_ids"][None, :-1], tokens["positions"][None, :-1])
    np.testing.assert_allclose(forward(model, *args), forward(merged, *args), atol=2e-5)
    base = Decoder(CFG, nnx.Rngs(0))
    assert not np.allclose(forward(model, *args), forward(base, *args), atol=1e-3)  # adapters did change it


def test_lora_dropout_only_in_training():
    model = add_lora(Decoder(CFG, nnx.Rngs(0)), LoraConfig(4, 8.0, 0.5, ("q",)), nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda x: x + 0.3, nnx.state(model, nnx.LoRAParam)))
    x = np.arange(12)[None] % 300
    seg, pos = np.ones_like(x), np.arange(12)[None]
    np.testing.assert_array_equal(model(x, seg, pos), model(x, seg, pos))
    assert not np.allclose(model(x, seg, pos, jax.random.key(0)), model(x, seg, pos))


def test_bad_lora_settings():
    base = Decoder(CFG, nnx.Rngs(0))
    with pytest.raises(StagelmError, match=r"^sft\.lora\.rank: 40 exceeds the width 32 of projection 'q'"):
        add_lora(base, LoraConfig(40, 8.0, 0.0, ("q",)), nnx.Rngs(1))
    params = micro_params()
    params["sft"]["lora"]["targets"] = ["q", "wq"]
    with pytest.raises(
        StagelmError, match=r"^sft\.lora\.targets: expected a non-empty list drawn from .*got \['q', 'wq'\]"
    ):
        load_section(params, "sft")
    params["sft"]["lora"] = {**params["sft"]["lora"], "targets": ["q"], "rank": 0}
    with pytest.raises(StagelmError, match=r"^sft\.lora\.rank: expected a positive int, got 0"):
        load_section(params, "sft")


# --- the stage, as a process -----------------------------------------------------------------------------------


def sft_command(micro_data, model, work):
    return [
        sys.executable,
        str(ROOT / "stages/sft.py"),
        "--params",
        str(work / "params.yaml"),
        "--model",
        str(model),
        "--train",
        str(micro_data / "packed/sft"),
        "--corpus",
        str(micro_data / "packed/train"),
        "--val",
        str(micro_data / "packed/val"),
        "--out",
        str(work / "out"),
        "--checkpoints",
        str(work / "ckpt"),
    ]


SFT_LONG = {"steps": 80, "checkpoint_every": 10, "eval_every": 40, "log_every": 10}


@pytest.mark.slow
def test_sft_stage_resumes_after_sigkill_bitwise(micro_data, pretrained, tmp_path):
    command = lambda work: sft_command(micro_data, pretrained, work)  # noqa: E731
    killed, whole, _ = killed_and_whole(tmp_path, micro_params(sft=SFT_LONG), command)
    assert_same_outputs(killed, whole, "model", "adapter")  # DVC sees the same model and adapter
    assert read_json(killed / "out/metrics.json")["train_loss"] == read_json(whole / "out/metrics.json")["train_loss"]


@pytest.mark.slow
def test_sft_stage_outputs_and_frozen_base(micro_data, pretrained, tmp_path):
    write_params(tmp_path / "params.yaml", micro_params())
    out = run(sft_command(micro_data, pretrained, tmp_path), tmp_path)
    assert "sft (lora)" in out.stdout
    adapter = read_json(tmp_path / "out/adapter/adapter_config.json")
    assert adapter["rank"] == micro_params()["sft"]["lora"]["rank"] and adapter["targets"]
    assert len(adapter["base_model_sha256"]) == 64
    merged, base = load_model(tmp_path / "out/model"), load_model(pretrained)
    assert merged.cfg.lora_rank == 0 and merged.cfg.vocab_size == base.cfg.vocab_size
    same = [
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(nnx.state(merged)), jax.tree.leaves(nnx.state(base)), strict=True)
    ]
    assert not all(same) and any(same)  # targeted projections moved; embeddings and norms did not
    assert read_json(tmp_path / "out/provenance.json")["stage"] == "sft"

    write_params(tmp_path / "params.yaml", micro_params(sft={"method": "full"}))
    full = run(sft_command(micro_data, pretrained, tmp_path), tmp_path)
    assert "sft (full)" in full.stdout and "starting fresh" in full.stdout
    assert read_json(tmp_path / "out/adapter/adapter_config.json") == {"method": "full"}


def test_replay_mixes_that_share_of_corpus_rows_into_sft(micro_data):
    sft, corpus = PackedRows(micro_data / "packed/sft"), PackedRows(micro_data / "packed/train")
    mixed = MixedRows([sft, corpus], [None, len(sft)])  # replay 0.5: as many corpus rows as SFT rows
    assert len(mixed) == 2 * len(sft) <= len(sft) + len(corpus)
    rows = [mixed[i] for i in range(len(mixed))]
    np.testing.assert_array_equal(rows[len(sft)]["tokens"], corpus[0]["tokens"])
    # Corpus rows train on every token; SFT rows only on the assistant's.
    assert all(r["loss_mask"].all() for r in rows[len(sft) :])
    assert not any(r["loss_mask"].all() for r in rows[: len(sft)])


@pytest.mark.slow
def test_sft_stage_with_replay_reads_the_corpus_and_refuses_more_than_it_holds(micro_data, pretrained, tmp_path):
    write_params(tmp_path / "params.yaml", micro_params(sft={"replay": 0.5}))
    run(sft_command(micro_data, pretrained, tmp_path), tmp_path)
    assert "corpus" in read_json(tmp_path / "out/provenance.json")["inputs"]
    write_params(tmp_path / "params.yaml", micro_params(sft={"replay": 0.999}))
    result = run(sft_command(micro_data, pretrained, tmp_path), tmp_path, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: sft.replay: 0.999 asks") and line.endswith("; lower it")


@pytest.mark.slow
def test_sft_refuses_a_model_with_another_vocab(micro_data, tmp_path):
    from stagelm.model.modeldir import save_model

    other = Decoder(
        DecoderConfig(vocab_size=123, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32), nnx.Rngs(0)
    )
    save_model(tmp_path / "m", other, micro_data / "tokenizer/tokenizer.json", {"context_len": 64})
    write_params(tmp_path / "params.yaml", micro_params())
    result = run(sft_command(micro_data, tmp_path / "m", tmp_path), tmp_path, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "vocab 123 is smaller than" in line


def test_a_loaded_model_computes_with_the_run_settings_it_is_given(pretrained):
    """model.attention, model.remat and model.scan_layers of params.yaml replace what config.json
    holds or lacks (it keeps no device setting), with the same math."""
    from stagelm.model.modeldir import run_settings

    params = micro_params(model={"remat": "dots", "scan_layers": True, "attention": "reference"})
    loaded = load_model(pretrained, settings=run_settings(load_section(params, "model")))
    plain = load_model(pretrained)
    assert (loaded.cfg.remat, loaded.cfg.scan_layers, loaded.cfg.attention) == ("dots", True, "reference")
    assert (plain.cfg.remat, plain.cfg.scan_layers) == ("none", False)
    seg = np.ones((2, 24), np.int32)
    tokens = np.arange(48, dtype=np.int32).reshape(2, 24) % plain.cfg.vocab_size
    pos = np.tile(np.arange(24, dtype=np.int32), (2, 1))
    np.testing.assert_allclose(nnx.jit(loaded)(tokens, seg, pos), nnx.jit(plain)(tokens, seg, pos), atol=1e-5)


@pytest.mark.parametrize("stage", ["sft", "grpo", "distill"])
def test_every_training_stage_reads_model_attention_from_params_yaml(stage, micro_data, pretrained, tmp_path, capsys):
    """The setting reaches the model each post-training stage trains: `model.attention: splash` on
    this CPU is refused in one line, as pretrain refuses it (before, these stages ran `auto`)."""
    from conftest import run_in_process
    from test_distill import distill_command
    from test_grpo import grpo_command

    command = {"sft": sft_command, "grpo": grpo_command, "distill": distill_command}[stage]
    write_params(tmp_path / "params.yaml", micro_params(model={"attention": "splash"}))
    code, stderr = run_in_process(command(micro_data, pretrained, tmp_path), capsys)
    assert code == 2
    assert stderr.strip() == (
        "error: model.attention: splash is a TPU kernel and this process runs on cpu; "
        "set model.attention: auto (the device's own kernel) or reference"
    )
