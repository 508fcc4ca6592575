"""params.yaml read as DVC reads it (YAML 1.2), and values no check may let through.

`dvc exp run -S training.lr=5e-5` writes `lr: 5e-05`; YAML 1.1 (PyYAML) reads that as a
string, YAML 1.2 (DVC's ruamel.yaml) as a float. Every reader of params.yaml here
agrees with DVC. The checks run in-process: `stagelm check` and the params stage.
"""

import sys

import pytest
from conftest import ROOT, micro_params, run_in_process, write_params

from stagelm import cli
from stagelm.pipeline.params import load_section, read_params, validate_params


def params_text(tmp_path, edit: str) -> str:
    """The micro params.yaml with one line replaced as a user (or `dvc exp run -S`) writes it."""
    path = write_params(tmp_path / "params.yaml", micro_params())
    text = path.read_text()
    old, new = edit.split(" => ")
    assert old in text, old
    indent = old[: len(old) - len(old.lstrip())]
    path.write_text(text.replace(old, indent + new, 1))
    return str(path)


@pytest.mark.parametrize("written", ["5e-05", "3e-4", "1E-3", "5.0e-5", "0.00005"])
def test_numbers_as_dvc_writes_them_are_floats(tmp_path, written):
    path = params_text(tmp_path, f"  lr: 0.003 => lr: {written}")
    assert load_section(read_params(path), "training").lr == float(written)


def stage_fails(capsys, path: str) -> str:
    """The params stage on `path`: exit 2 with one line; its stderr."""
    cmd = [sys.executable, str(ROOT / "stages/params.py"), "--params", path, "--out", path + ".stamp"]
    code, err = run_in_process(cmd, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


BAD = [  # (params.yaml edit, the words of the one-line error)
    ("  lr: 0.003 => lr: 0.003\n  lr: 0.001", 'found duplicate key "lr"'),
    ("  norm_eps: 1.0e-06 => norm_eps: .inf", "model.norm_eps: expected a finite float, got inf"),
    ("  rope_theta: 10000.0 => rope_theta: .inf", "model.rope_theta: expected a finite float, got inf"),
    ("  temperature: 0.8 => temperature: .inf", "sample.temperature: expected a finite float, got inf"),
    ('  - What is 41 plus 17? => - ""', "sample.chat_prompts: expected a non-empty list of non-empty strings"),
    ("  lr: 0.003 => lr: .nan", "training.lr: expected a finite float, got nan"),
    ("seed: 0 => seed: 18446744073709551616", "seed: expected an int in [0, 2**32), got 18446744073709551616"),
    ("  seed: 0 => seed: -1", "data.seed: expected an int in [0, 2**32), got -1"),
    ("  lr: 0.003 => lr: 1" + "0" * 400, "training.lr: expected a positive float, got 1000000"),
    ("  weight_decay: 0.1 => weight_decay: 1e300", "training.weight_decay: expected a non-negative float of at most"),
]


@pytest.mark.parametrize(("edit", "words"), BAD, ids=[w.split(":")[0] for _, w in BAD])
def test_values_no_check_may_let_through(monkeypatch, capsys, tmp_path, edit, words):
    path = params_text(tmp_path, edit)
    assert words in stage_fails(capsys, path)
    monkeypatch.setattr(sys, "argv", ["stagelm", "check", "--params", path, "--pipeline", str(ROOT / "dvc.yaml")])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_a_file_that_is_not_yaml_text_is_one_line(capsys, tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"seed: 0\n\xff\xfe\x00garbage")
    assert stage_fails(capsys, str(binary)) == f"error: {binary}: not UTF-8 text (byte 8); save it as UTF-8 YAML\n"
    deep = tmp_path / "deep.yaml"
    deep.write_text("seed: " + "[" * 100_000 + "]" * 100_000 + "\n")
    err = stage_fails(capsys, str(deep))
    assert err.startswith(f"error: {deep}: ") and ("nested too deeply" in err or "not valid YAML" in err)


def test_a_check_pipeline_that_is_not_a_pipeline_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inputs").mkdir()
    write_params(tmp_path / "params.yaml", micro_params())
    (tmp_path / "notes.yaml").write_text("- just\n- a list\n")
    monkeypatch.setattr(sys, "argv", ["stagelm", "check", "--pipeline", "notes.yaml"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: notes.yaml: not a DVC pipeline (no `stages` mapping)")


def test_corpus_paths_must_lie_in_the_folder_dvc_hashes(tmp_path):
    params = micro_params(data={"source": "files:elsewhere/*.jsonl"})
    with pytest.raises(Exception, match=r"^data\.source: 'elsewhere/\*\.jsonl' lies outside data\.inputs 'inputs'"):
        validate_params(params)
    for inside in ("files:inputs/*.jsonl", "files:inputs/corpus", "files:./inputs/a/**/*.txt"):
        validate_params(micro_params(data={"source": inside}))
    with pytest.raises(Exception, match=r"^data\.eval_files: '/tmp/x\.jsonl' lies outside data\.inputs"):
        validate_params(micro_params(data={"eval_files": "/tmp/x.jsonl"}))
    with pytest.raises(Exception, match=r"^data\.source: 'my-dataset' lies outside"):  # a local hf: dataset
        validate_params(micro_params(data={"source": "hf:my-dataset"}))
    validate_params(micro_params(data={"source": "hf:someone/corpus", "hf_revision": "main"}))  # the hub: no files
    validate_params(micro_params(data={"source": "files:/data/c/*.txt", "inputs": "/data/c"}))


def test_sizes_no_machine_runs_are_refused_before_any_stage():
    with pytest.raises(Exception, match=r"^training\.steps: expected a positive int of at most 1,000,000,000"):
        validate_params(micro_params(training={"steps": 10**30}))
    bounds = r"an int from 262 \(the 256 bytes and 6 special tokens\) to 2,097,152"
    with pytest.raises(Exception, match=rf"^tokenizer\.vocab_size: expected {bounds}, got 1000000000$"):
        validate_params(micro_params(tokenizer={"vocab_size": 10**9}))
    validate_params(micro_params(tokenizer={"vocab_size": 262144}))  # Gemma's vocabulary: fine


def test_lm_eval_tasks_must_lie_in_the_folder_dvc_hashes_and_lm_eval_be_installed(monkeypatch):
    validate_params(micro_params(eval={"lm_eval_tasks": ["inputs/lm_eval/arith_cloze.yaml", "hellaswag"]}))
    with pytest.raises(Exception, match=r"^eval\.lm_eval_tasks: '/tmp/t\.yaml' lies outside data\.inputs 'inputs'"):
        validate_params(micro_params(eval={"lm_eval_tasks": ["/tmp/t.yaml"]}))
    with pytest.raises(Exception, match=r"^eval\.lm_eval_tasks: expected a list of distinct task names"):
        validate_params(micro_params(eval={"lm_eval_tasks": ["hellaswag", "hellaswag"]}))
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if the eval extra were not installed
    validate_params(micro_params(eval={"lm_eval_tasks": []}))  # nothing asked of it: fine without it
    with pytest.raises(Exception, match=r"^eval\.lm_eval_tasks: lm-eval is not installed; pip install -e '\.\[eval\]'"):
        validate_params(micro_params(eval={"lm_eval_tasks": ["hellaswag"]}))


@pytest.mark.parametrize(
    ("data", "grpo", "words"),
    [
        (["arithmetic", "poetry"], ["arithmetic"], "data.families: unknown ['poetry']; choose among"),
        ([], ["arithmetic"], "data.families: empty list; name the synthetic task families to generate"),
        (["arithmetic"], ["uses_word"], "grpo.families: ['uses_word'] not in data.families ['arithmetic']"),
    ],
)
def test_task_families_are_checked_before_any_stage(monkeypatch, capsys, tmp_path, data, grpo, words):
    """An unknown family, or a reward for a family the rl set will not hold, fails the params stage
    and `stagelm check` in one line, before the download."""
    path = str(write_params(tmp_path / "params.yaml", micro_params(data={"families": data}, grpo={"families": grpo})))
    assert words in stage_fails(capsys, path)
    monkeypatch.setattr(sys, "argv", ["stagelm", "check", "--params", path, "--pipeline", str(ROOT / "dvc.yaml")])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2 and words in capsys.readouterr().err
