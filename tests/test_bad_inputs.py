"""Bad input to the `stagelm` CLI: one line naming the thing and the fix, exit 2, nothing lost.

The command runs in-process (`stagelm.cli.main` with its argv): what is tested is the
check, not a subprocess starting.
"""

import sys

import pytest
from conftest import tree_bytes

from stagelm import cli


def stagelm(monkeypatch, capsys, *argv: str) -> str:
    """Run `stagelm <argv>`, expect exit 2, return its stderr (one line)."""
    monkeypatch.setattr(sys, "argv", ["stagelm", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("count", ["0", "-5"])
def test_generate_needs_a_positive_token_count(monkeypatch, capsys, tmp_path, count):
    err = stagelm(monkeypatch, capsys, "generate", str(tmp_path), "--prompt", "x", "--max-new-tokens", count)
    assert err == f"error: --max-new-tokens: expected a positive int, got {count}\n"


def test_export_hf_never_writes_over_a_model_or_a_file(monkeypatch, capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 10}')
    (model / "params.safetensors").write_bytes(b"weights")
    other = tmp_path / "other"
    other.mkdir()
    (other / "params.safetensors").write_bytes(b"other weights")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    before = tree_bytes(tmp_path)
    cases = [
        (model, "is the model being exported"),
        (other, "holds a stagelm model, which the export would overwrite"),
        (a_file, "a file, not a folder"),
    ]
    for target, words in cases:
        err = stagelm(monkeypatch, capsys, "export-hf", str(model), str(target))
        assert err.startswith(f"error: {target}: ") and words in err
    assert tree_bytes(tmp_path) == before


def test_lineage_and_inspect_refuse_files_that_are_not_theirs(monkeypatch, capsys, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# A project\n\nNot a lock file: [unclosed\n")
    err = stagelm(monkeypatch, capsys, "lineage", "data/raw", "--lock", str(readme))
    assert err == f"error: {readme}: not a dvc.lock (no `stages` mapping); give --lock the project's dvc.lock\n"
    for text, missing in (("{not json", "'stage'"), ("", "'stage'"), ('{"stage": "pretrain"}', "'started'")):
        (tmp_path / "provenance.json").write_text(text)
        err = stagelm(monkeypatch, capsys, "inspect", str(tmp_path))
        assert err.startswith(f"error: {tmp_path / 'provenance.json'}: not a stage's provenance (no {missing})")
