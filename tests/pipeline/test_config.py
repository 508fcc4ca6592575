"""params.yaml parses into typed sections; bad values fail with the dotted key."""

import sys

import pytest
from conftest import ROOT, micro_params, run, shipped_params, write_params

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.config import SECTIONS
from stagelm.pipeline.params import load_section, load_seed, parse_dataclass


def test_every_shipped_section_parses():
    params = shipped_params()
    assert load_seed(params) == 0
    for name in SECTIONS:
        cfg = load_section(params, name)
        assert type(cfg) is SECTIONS[name]


def test_micro_params_parse():
    params = micro_params()
    for name in SECTIONS:
        load_section(params, name)


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("pack", "seq_len", "long", "pack.seq_len: expected an int >= 2, got 'long'"),
        ("pack", "seq_len", 1, "pack.seq_len: expected an int >= 2, got 1"),
        ("training", "lr", "fast", "training.lr: expected a positive float, got 'fast'"),
        ("training", "lr", -1.0, "training.lr: expected a positive float, got -1.0"),
        ("model", "d_model", 10**9, "model.d_model: expected a positive int of at most 65,536, got 1000000000"),
        (
            "training",
            "batch_size",
            2**21,
            "training.batch_size: expected a positive int of at most 1,048,576, got 2097152",
        ),
        ("training", "steps", True, "training.steps: expected a positive int of at most 1,000,000,000, got True"),
        (
            "training",
            "schedule",
            "linear",
            "training.schedule: expected one of 'constant', 'cosine', 'wsd', got 'linear'",
        ),
        ("data", "val_fraction", 1.5, "data.val_fraction: expected a float in (0, 1), got 1.5"),
        ("model", "tie_embeddings", "yes", "model.tie_embeddings: expected a bool, got 'yes'"),
        ("mesh", "data", 0, "mesh.data: expected -1 (infer) or a positive int, got 0"),
        (
            "grpo",
            "beta1",
            1.0,
            "grpo.beta1: expected a float in [0, 1) (at 1 the average never moves and Adam divides by 0), got 1.0",
        ),
        (
            "distill",
            "beta2",
            1.0,
            "distill.beta2: expected a float in [0, 1) (at 1 the average never moves and Adam divides by 0), got 1.0",
        ),
        (
            "grpo",
            "kl_coef",
            1e308,
            "grpo.kl_coef: expected a float in [0, 1000] (beyond, the KL term overflows the loss), got 1e+308",
        ),
        (
            "distill",
            "temperature",
            1e308,
            "distill.temperature: expected a float in (0, 100] (the soft term is "
            "scaled by T², which overflows beyond), got 1e+308",
        ),
        ("model", "attention", "flash", "model.attention: expected one of 'auto', 'reference', 'splash', got 'flash'"),
        ("model", "remat", "full", "model.remat: expected one of 'none', 'dots', 'block', got 'full'"),
        (
            "data",
            "source",
            "s3://bucket/corpus",
            "data.source: expected 'synthetic', 'files:<path, folder or glob>' or "
            "'hf:<dataset id or local dir>', got 's3://bucket/corpus'",
        ),
        (
            "data",
            "source",
            "files:",
            "data.source: expected 'synthetic', 'files:<path, folder or glob>' or "
            "'hf:<dataset id or local dir>', got 'files:'",
        ),
        ("data", "text_field", "", "data.text_field: expected a non-empty string, got ''"),
    ],
)
def test_wrong_values_name_the_key(section, key, value, message):
    params = shipped_params()
    params[section][key] = value
    with pytest.raises(StagelmError) as err:
        load_section(params, section)
    assert str(err.value) == message


def test_unknown_and_missing_keys():
    params = shipped_params()
    params["training"]["learning_rate"] = 0.1
    with pytest.raises(StagelmError, match=r"^training\.learning_rate: unknown key"):
        load_section(params, "training")
    params = shipped_params()
    del params["pack"]["seq_len"]
    with pytest.raises(StagelmError, match=r"^pack\.seq_len: missing"):
        load_section(params, "pack")
    with pytest.raises(StagelmError, match=r"^model: section missing"):
        load_section({}, "model")


def test_a_grpo_objective_that_weighs_no_sample_is_refused():
    params = shipped_params()
    params["grpo"] |= {"objective": "grpo", "positive_weight": 0.0, "negative_weight": 0}
    with pytest.raises(StagelmError) as err:
        load_section(params, "grpo")
    assert str(err.value) == "grpo.positive_weight: 0 with grpo.negative_weight 0 trains on no sample; set one above 0"


def test_cross_field_rules():
    params = shipped_params()
    params["model"]["n_kv_heads"] = 3
    with pytest.raises(StagelmError, match=r"^model\.n_kv_heads"):
        load_section(params, "model")


@pytest.mark.parametrize("section", ["training", "sft", "distill", "grpo"])
def test_one_optimizer_rule_names_each_sections_own_keys(section):
    # One validator serves the four training sections; its error names the key the user wrote.
    params = shipped_params()
    steps = params[section]["steps"]
    params[section]["warmup_steps"] = steps + 400
    with pytest.raises(StagelmError) as err:
        load_section(params, section)
    assert str(err.value) == f"{section}.warmup_steps: {steps + 400} must be below {section}.steps {steps}"


@pytest.mark.parametrize(
    ("section", "prefix"), [("model", "model"), ("distill", "distill.student"), ("benchmark", "benchmark")]
)
def test_one_shape_rule_names_each_sections_own_keys(section, prefix):
    params = shipped_params()
    shape = params[section]["student"] if section == "distill" else params[section]
    shape["n_heads"] = 5
    with pytest.raises(StagelmError) as err:
        load_section(params, section)
    assert str(err.value) == f"{prefix}.n_heads: 5 does not divide {prefix}.d_model {shape['d_model']}"


def test_int_is_accepted_as_float_and_converted():
    cfg = parse_dataclass(SECTIONS["training"], {**shipped_params()["training"], "lr": 1}, "training")
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


def test_stagelm_check_cli(tmp_path, micro_data):
    params = write_params(tmp_path / "params.yaml", micro_params())
    pipeline = ROOT / "dvc.yaml"
    ok = run(
        [sys.executable, "-m", "stagelm.cli", "check", "--params", str(params), "--pipeline", str(pipeline)],
        micro_data.parent,
    )
    assert "sections" in ok.stdout and "shards match" in ok.stdout and "files match" in ok.stdout
    assert "ok: eval (generation): about " in ok.stdout  # the estimates it can make, against this machine
    assert "ok: pack (a shard's buffers): about " in ok.stdout  # and the data stages' (stagelm.data.footprint)
    assert "ok: download (the synthetic corpus, generated in memory): about " in ok.stdout
    write_params(params, micro_params(model={"n_layers": 1024, "d_ff": 1 << 20}))
    huge = run(
        [sys.executable, "-m", "stagelm.cli", "check", "--params", str(params), "--pipeline", str(pipeline)],
        micro_data.parent,
    )
    assert "warning: model (parameters, gradients, Adam's moments): about " in huge.stdout  # warned, not refused
    bad = micro_params(pack={"seq_len": "abc"})
    write_params(params, bad)
    fail = run(
        [sys.executable, "-m", "stagelm.cli", "check", "--params", str(params), "--pipeline", str(pipeline)],
        tmp_path,
        check=False,
    )
    assert fail.returncode == 2
    assert fail.stderr.strip() == "error: pack.seq_len: expected an int >= 2, got 'abc'"
