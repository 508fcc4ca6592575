"""Bad input to the `stagelm` CLI: one line naming the thing and the fix, exit 2, nothing lost.

The command runs in-process (`stagelm.cli.main` with its argv): what is tested is the
check, not a subprocess starting.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ROOT, env_with_venv, micro_params, run, run_in_process, tree_bytes, write_params
from flax import nnx
from tokenizers import Tokenizer

from stagelm import cli
from stagelm.interop.hf_export import EXPORT_FILES
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.modeldir import load_model, save_model


def stagelm(monkeypatch, capsys, *argv: str) -> str:
    """Run `stagelm <argv>`, expect exit 2, return its stderr (one line)."""
    monkeypatch.setattr(sys, "argv", ["stagelm", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


CHECK = "stagelm check"


def test_a_params_path_that_is_no_file_is_named_so(monkeypatch, capsys, tmp_path):
    for path in (tmp_path, Path("/dev/null")):
        err = stagelm(monkeypatch, capsys, "check", "--params", str(path))
        assert err == f"error: {path}: not a regular file; pass --params the path of a params.yaml\n"
    for flag in ("--params", "--pipeline"):  # not taken for the current folder
        err = stagelm(monkeypatch, capsys, "check", flag, "")
        assert (
            err
            == f"error: stagelm check: argument {flag}: an empty path; give a file or folder; see `{CHECK} --help`\n"
        )


@pytest.mark.parametrize("markdown", [[], ["--markdown"]])
def test_params_shows_a_file_only_once_its_values_pass_check(monkeypatch, capsys, tmp_path, markdown):
    """`stagelm params --params` prints the file's values as each key's default: a value no stage
    would take (an unknown key, a word where a width goes) is refused as `stagelm check` refuses it."""
    path = tmp_path / "params.yaml"
    path.write_text((ROOT / "params.yaml").read_text().replace("  d_model: 128", "  d_modle: 128", 1))
    err = stagelm(monkeypatch, capsys, "params", "--params", str(path), *markdown)
    assert err.startswith("error: model.d_modle: unknown key (did you mean 'd_model'?)")
    path.write_text((ROOT / "params.yaml").read_text().replace("  d_model: 128", "  d_model: big", 1))
    err = stagelm(monkeypatch, capsys, "params", "--params", str(path), *markdown)
    assert err == "error: model.d_model: expected a positive int of at most 65,536, got 'big'\n"


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
        (model, "is (or is inside) the model being exported"),
        (other, "holds ['params.safetensors'], not only a previous export"),
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


# --- model directories: hashes written at save time, checked at every load --------------


@pytest.fixture
def model_dir(micro_data, tmp_path):
    """A real (tiny, untrained) stagelm model directory with the micro tokenizer."""
    tokenizer = micro_data / "tokenizer/tokenizer.json"
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    cfg = DecoderConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    save_model(tmp_path / "model", Decoder(cfg, nnx.Rngs(0)), tokenizer, {"context_len": 32})
    return tmp_path / "model"


def permuted_tokenizer(path: Path) -> bytes:
    """The same tokenizer.json with the ids of two vocabulary entries swapped: same size, other ids."""
    doc = json.loads(path.read_text())
    vocab = doc["model"]["vocab"]
    a, b = list(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    text = json.dumps(doc)
    return text.encode()


def damage(model: Path, how: str) -> str:
    """Damage `model` as a user's disk or hands might; return the words its load error must hold."""
    params, config = model / "params.safetensors", model / "config.json"
    if how == "params-bit-flip":
        data = bytearray(params.read_bytes())
        data[-5] ^= 0x10
        params.write_bytes(bytes(data))
        return f"{params.resolve()}: sha256 differs from config.json's params_sha256"
    if how == "params-truncated":
        params.write_bytes(params.read_bytes()[:100])
        return f"{params.resolve()}: sha256 differs from config.json's params_sha256"
    if how == "params-a-folder":  # not "missing": it is there, as something a load cannot read
        params.unlink()
        params.mkdir()
        return f"{params.resolve()}: not a regular file; write the folder again with the command that made it"
    if how == "tokenizer-permuted":
        (model / "tokenizer.json").write_bytes(permuted_tokenizer(model / "tokenizer.json"))
        return f"{(model / 'tokenizer.json').resolve()}: sha256 differs from config.json's tokenizer_sha256"
    raw = json.loads(config.read_text())
    if how == "config-not-json":
        config.write_text("{" + config.read_text())
        return f"{config}: not valid JSON"
    if how == "config-without-vocab_size":
        del raw["vocab_size"]
        config.write_text(json.dumps(raw))
        return f"{config}: vocab_size missing; not a stagelm model config"
    if how == "config-heads-zero":
        raw["n_heads"] = 0
        config.write_text(json.dumps(raw))
        return f"{config}: n_heads: expected a positive int of at most 1,024, got 0"
    if how in ("config-rope-negative", "config-eps-negative"):
        field = "rope_theta" if how == "config-rope-negative" else "norm_eps"
        raw[field] = -1.0
        config.write_text(json.dumps(raw))
        bound = "1e12" if field == "rope_theta" else "0.1"
        return f"{config}: {field}: expected a positive float of at most {bound}, got -1.0"
    if how == "config-without-hashes":
        del raw["params_sha256"]
        config.write_text(json.dumps(raw))
        return "no params_sha256, so params.safetensors cannot be verified; rerun the stage that wrote it"
    raise AssertionError(how)


DAMAGE = [
    "params-bit-flip",
    "params-a-folder",
    "params-truncated",
    "tokenizer-permuted",
    "config-not-json",
    "config-without-vocab_size",
    "config-heads-zero",
    "config-rope-negative",
    "config-eps-negative",
    "config-without-hashes",
]


def test_an_intact_model_generates(monkeypatch, capsys, model_dir):
    monkeypatch.setattr(sys, "argv", ["stagelm", "generate", str(model_dir), "--prompt", "a", "--max-new-tokens", "2"])
    cli.main()  # no SystemExit: the hashes match what was saved
    assert capsys.readouterr().out


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_model_is_refused_on_load(monkeypatch, capsys, model_dir, how):
    words = damage(model_dir, how)
    before = tree_bytes(model_dir)
    err = stagelm(monkeypatch, capsys, "generate", str(model_dir), "--prompt", "a", "--max-new-tokens", "2")
    assert words in err
    err = stagelm(monkeypatch, capsys, "export-hf", str(model_dir), str(model_dir.parent / "hf"))
    assert words in err and not (model_dir.parent / "hf").exists()
    assert tree_bytes(model_dir) == before


def test_a_symlink_loop_is_named_in_one_line(monkeypatch, capsys, model_dir, tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for argv in (
        ["export-gguf", str(model_dir), str(tmp_path / "a/x.gguf")],
        ["export-hf", str(model_dir), str(tmp_path / "a")],
    ):
        err = stagelm(monkeypatch, capsys, *argv)
        assert err == f"error: {tmp_path / 'a'}: a symlink loop; give a real path\n"


def test_a_transformers_folder_given_as_a_model_is_sent_to_import_hf(monkeypatch, capsys, model_dir, tmp_path):
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-hf", str(model_dir), str(tmp_path / "hf")])
    cli.main()
    for argv in (["export-gguf", str(tmp_path / "hf"), str(tmp_path / "x.gguf")], ["generate", str(tmp_path / "hf")]):
        err = stagelm(monkeypatch, capsys, *argv, *(["--prompt", "a"] if argv[0] == "generate" else []))
        assert err == (
            f"error: {tmp_path / 'hf'}: a transformers checkpoint, not a stagelm model folder; import it first "
            f"(`stagelm import-hf {tmp_path / 'hf'} <folder>`) and give that folder\n"
        )


def test_a_chat_template_that_is_not_text_is_named_not_compiled(monkeypatch, capsys, model_dir):
    spec = {"template": 5, "eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "bos_token": None, "stop_tokens": []}
    (model_dir / "chat.json").write_text(json.dumps(spec))
    err = stagelm(monkeypatch, capsys, "export-hf", str(model_dir), str(model_dir.parent / "hf"))
    chat = model_dir / "chat.json"
    assert err == f"error: {chat}: template is int; expected a Jinja string or null; fix or replace it\n"
    assert not (model_dir.parent / "hf").exists()


def test_a_damaged_stage_model_is_rebuilt_by_its_stage_and_any_other_by_what_wrote_it(monkeypatch, capsys, model_dir):
    """The advice names a DVC stage only where the folder is one's output (runs/<stage>/model)."""
    staged = model_dir.parent / "runs/sft/model"
    shutil.copytree(model_dir, staged)
    for folder, advice in (
        (model_dir, "write the folder again with the command that made it (a stage, import-hf or import-gguf)"),
        (staged, "rebuild it with `dvc repro -f sft`"),
    ):
        damage(folder, "params-bit-flip")
        err = stagelm(monkeypatch, capsys, "export-hf", str(folder), str(model_dir.parent / "hf"))
        assert err.endswith(f"(changed or damaged since it was saved); {advice}\n"), err


def test_export_hf_replaces_only_a_previous_export_and_never_its_source(monkeypatch, capsys, model_dir, tmp_path):
    out = tmp_path / "hf"
    for _ in range(2):  # the second export replaces the first
        monkeypatch.setattr(sys, "argv", ["stagelm", "export-hf", str(model_dir), str(out)])
        cli.main()
    written = sorted(set(EXPORT_FILES) - {"model.gguf"})  # the export stage writes the GGUF beside them
    assert sorted(p.name for p in out.iterdir()) == written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    (tmp_path / "plain").write_text("")  # the mode any new file gets under this umask
    assert {p.name: p.stat().st_mode for p in out.iterdir()} == dict.fromkeys(
        written, (tmp_path / "plain").stat().st_mode
    )  # model.safetensors too, not safetensors' own 0o600
    (out / "notes.md").write_text("mine")
    before = tree_bytes(tmp_path)
    err = stagelm(monkeypatch, capsys, "export-hf", str(model_dir), str(out))
    assert (
        err
        == f"error: {out}: "
        + "holds ['notes.md'], not only a previous export; "
        + "give export-hf a new or empty folder\n"
    )
    err = stagelm(monkeypatch, capsys, "export-hf", str(model_dir), str(model_dir / "hf"))
    assert "is (or is inside) the model being exported" in err
    assert tree_bytes(tmp_path) == before


# --- import-hf: every config field it uses, range-checked before anything is allocated ---

LLAMA = {
    "model_type": "llama",
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "intermediate_size": 32,
    "vocab_size": 512,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}

IMPORTS = [  # (config.json changes, or a file's bytes, → the words of the error)
    ({"max_position_embeddings": 10**12}, "max_position_embeddings = 1000000000000; expected an integer in [1, "),
    ({"max_position_embeddings": -1}, "max_position_embeddings = -1; expected an integer in [1, "),
    ({"num_attention_heads": 0}, "num_attention_heads = 0; expected an integer in [1, "),
    ({"num_attention_heads": 3}, "num_attention_heads 3 does not divide hidden_size 16"),
    ({"hidden_size": "abc"}, "hidden_size = 'abc'; expected an integer in [1, "),
    ({"intermediate_size": None}, "intermediate_size missing; a Llama checkpoint needs it"),
    ({"num_hidden_layers": 200000}, "num_hidden_layers = 200000; expected an integer in [1, 1,024]"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps = 'small'; expected a positive number"),
    ({"rms_norm_eps": 1e300}, "rms_norm_eps = 1e+300; expected a positive number of at most 0.1"),
    ({"rope_theta": 1e300}, "rope_theta = 1e+300; expected a positive number of at most 1e+12"),
    ({"partial_rotary_factor": 0.5}, "config.json: partial_rotary_factor 0.5 is not 1.0"),  # transformers 4's spelling
    ({"config.json": b"[" * 100_000 + b"]" * 100_000}, "config.json: JSON nested too deeply to read"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config (gptq) is set; stagelm"),
    ({"config.json": b"{not json"}, "config.json: not valid JSON"),
    ({"model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"}, "not a readable safetensors file"),
    ({"tokenizer.json": b'{"version": "1.0", "model": 3}'}, "tokenizer.json: not a valid tokenizer.json"),
]


@pytest.mark.parametrize(("change", "words"), IMPORTS, ids=[words.split(";")[0][:40] for _, words in IMPORTS])
def test_import_hf_checks_the_checkpoint_before_allocating(monkeypatch, capsys, micro_data, tmp_path, change, words):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {k: v for k, v in {**LLAMA, **change}.items() if v is not None and "." not in k}
    (hf / "config.json").write_text(json.dumps(config))
    shutil.copyfile(micro_data / "tokenizer/tokenizer.json", hf / "tokenizer.json")
    (hf / "model.safetensors").write_bytes(b"")  # weights are read only after the config passes
    for name, data in change.items():
        if "." in name:
            (hf / name).write_bytes(data)
    err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(tmp_path / "out"))
    assert words in err
    assert not (tmp_path / "out").exists()


# --- stagelm check: data folders a pack or download left unfinished ----------------------


def test_check_refuses_a_pack_that_did_not_finish(monkeypatch, capsys, micro_data, tmp_path):
    shutil.copytree(micro_data, tmp_path / "data")
    write_params(tmp_path / "params.yaml", micro_params())
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "inputs").mkdir()  # data.inputs, which the download stage depends on
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["stagelm", "check"])
    cli.main()
    assert "ok: data/packed/val: " in capsys.readouterr().out
    val = Path("data/packed/val")
    manifest = (val / "manifest.json").read_bytes()
    (val / "manifest.json").unlink()  # killed before its manifest: the shards may be new, old or half
    err = stagelm(monkeypatch, capsys, "check")
    assert err.startswith(f"error: {val}: no manifest.json, so its files are not a finished pack; rebuild it with")
    (val / "manifest.json").write_bytes(manifest)
    shutil.copyfile(val / "shard-00000.arrow", val / "shard-00099.arrow")  # a shard the old manifest does not list
    err = stagelm(monkeypatch, capsys, "check")
    assert "shards ['shard-00099.arrow'] are not in its manifest.json" in err
    (val / "shard-00099.arrow").unlink()
    shard = val / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:-8])  # an old manifest over a new, shorter shard
    err = stagelm(monkeypatch, capsys, "check")
    # the cache may hold the damaged bytes (a link cache), so the advice rebuilds rather than checks out
    assert err == f"error: {shard}: sha256 differs from {val / 'manifest.json'}; rebuild it with `dvc repro -f pack`\n"
    for typo, words in (("trainig", "(did you mean 'training'?)"), ("notes", "unknown top-level key")):
        write_params(tmp_path / "params.yaml", {**micro_params(), typo: {"lr": 1}})
        assert words in stagelm(monkeypatch, capsys, "check")


# --- task files: every row against its schema, naming file, line and field ---------------

CHAT = {"family": "chat", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
USER = {"role": "user", "content": "2+2?"}
PREF = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
TASK = {"family": "arithmetic", "prompt": "2 plus 2 is", "chat_prompt": "What is 2 plus 2?", "spec": {"answer": 4}}

TASK_ROWS = [  # (task set, its lines, the words of the error)
    ("sft", [{**CHAT, "messages": "hi"}], "f.jsonl:1: messages: expected a non-empty list"),
    ("sft", [CHAT, {**CHAT, "messages": [{"role": "user"}]}], "f.jsonl:2: messages[0].content: expected a string"),
    ("sft", [CHAT, {**CHAT, "family": 3}], "f.jsonl:2: family: expected a non-empty string, got 3"),
    ("sft", [CHAT, 5], "f.jsonl:2: not a JSON object; data.sft_files must be jsonl"),
    ("sft", [{**CHAT, "messages": [{"role": "user", "content": "x"}]}], "f.jsonl:1: messages: no assistant turn"),
    ("eval", [{**TASK, "spec": {}}], "f.jsonl:1: spec.answer: missing; the arithmetic checker needs ['answer']"),
    ("eval", [{**TASK, "spec": {"answer": "4"}}], "f.jsonl:1: spec.answer: expected an integer, got '4'"),
    (
        "rl",
        [TASK, {**TASK, "family": "uses_word", "spec": {"name": "Mia", "word": "lamp"}}],
        "f.jsonl:2: spec.max_words: missing",
    ),
    (
        "eval",
        [{**TASK, "family": "word_limit", "spec": {"max_words": 4}}],
        "f.jsonl:1: spec.name: missing; the word_limit checker needs ['max_words', 'name', 'place']",
    ),
    ("rl", [{**TASK, "prompt": 7}], "f.jsonl:1: prompt: expected a non-empty string, got 7"),
    ("pref", [{**PREF, "chosen": 4}], "f.jsonl:1: chosen: expected a non-empty string or one assistant message"),
    ("pref", [PREF, {**PREF, "rejected": "4"}], "f.jsonl:2: rejected: the same answer as chosen"),
    ("pref", [{**PREF, "prompt": [{"role": "bot", "content": "x"}]}], "f.jsonl:1: prompt[0].role: expected 'system'"),
    ("pref", [{**PREF, "messages": []}], "f.jsonl:1: prompt: give `prompt` or `messages`, not both"),
    ("pref", [{"chosen": "4", "rejected": "5"}], "f.jsonl:1: chosen: expected a string or a non-empty list"),
    (
        "pref",
        [
            {
                "chosen": [USER, {"role": "assistant", "content": "4"}],
                "rejected": [{"role": "assistant", "content": "5"}],
            }
        ],
        "f.jsonl:1: rejected: its messages before the answer differ from chosen's",
    ),
    (
        "pref",
        [{**PREF, "prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}],
        "f.jsonl:1: prompt: the prompt must end with the user's message",
    ),
    (
        "pref",
        [{**PREF, "rejected": [{"role": "user", "content": "5"}]}],
        "f.jsonl:1: rejected: expected one assistant message",
    ),
    ("eval", [{**TASK, "family": "poetry"}], "f.jsonl:1: family: unknown 'poetry'"),
]


@pytest.mark.parametrize(("name", "rows", "words"), TASK_ROWS, ids=[w[10:50] for _, _, w in TASK_ROWS])
def test_task_files_are_checked_row_by_row(capsys, tmp_path, monkeypatch, name, rows, words):
    monkeypatch.chdir(tmp_path)
    Path("inputs").mkdir()
    Path("inputs/f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_params(tmp_path / "params.yaml", micro_params(data={f"{name}_files": "inputs/f.jsonl"}))
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "keep.txt").write_text("an earlier download")
    code, err = run_in_process([sys.executable, str(ROOT / "stages/download.py"), "--out", str(raw)], capsys)
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert f"; fix the row or data.{name}_files" in err or "must be jsonl" in err
    assert tree_bytes(raw) == {"keep.txt": b"an earlier download"}


def test_a_batch_that_does_not_split_over_the_mesh_fails_before_compiling(capsys, micro_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", micro_params(training={"batch_size": 6}))  # 8 (simulated) devices
    packed = micro_data / "packed"
    cmd = [sys.executable, str(ROOT / "stages/pretrain.py"), "--train", str(packed / "train"), "--val"]
    cmd += [str(packed / "val"), "--tokenizer", str(micro_data / "tokenizer/tokenizer.json")]
    code, err = run_in_process([*cmd, "--out", "out", "--checkpoints", "ckpt"], capsys)
    assert code == 2 and err == (
        "error: training.batch_size: 6 rows do not split over the mesh's 8 data-parallel devices "
        "(mesh.data × mesh.fsdp = {'data': 8, 'fsdp': 1, 'tensor': 1}); give a multiple of 8, or set the mesh\n"
    )
    assert not Path("out").exists()


# --- export-hf and import-hf never write into what DVC tracks, nor over a user's files ------------


def test_export_and_import_refuse_dvc_outputs_and_other_files(monkeypatch, capsys, model_dir, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    run(["dvc", "init", "--no-scm", "-q"], project)
    (project / "dvc.yaml").write_text("stages:\n  train:\n    cmd: 'true'\n    outs:\n      - runs/train/model\n")
    (project / "runs/train/model").mkdir(parents=True)
    (project / "runs/train/model/config.json").write_text("{}")
    before = tree_bytes(project)
    for target in (project / "runs/train/model", project / "runs/train/model/hf", project / "runs"):
        for command, source in (("export-hf", model_dir), ("import-hf", tmp_path / "hf")):
            err = stagelm(monkeypatch, capsys, command, str(source), str(target))
            assert err == (
                f"error: {target}: holds or is a DVC-tracked output (of train); "
                f"give {command} a folder outside DVC's outputs\n"
            )
    assert tree_bytes(project) == before
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-hf", str(model_dir), str(tmp_path / "hf")])
    cli.main()  # outside DVC's outputs: written
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"a user\'s": "own file"}')
    err = stagelm(monkeypatch, capsys, "import-hf", str(tmp_path / "hf"), str(mine))
    assert (
        err
        == f"error: {mine}: holds ['config.json'], not only a previous import; give import-hf a new or empty folder\n"
    )
    assert (mine / "config.json").read_text() == '{"a user\'s": "own file"}'
    for _ in range(2):  # a previous import is replaced
        monkeypatch.setattr(sys, "argv", ["stagelm", "import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")])
        cli.main()
    assert sorted(p.name for p in (tmp_path / "imported").iterdir()) == [
        "chat.json",  # the checkpoint's chat format (here stagelm's own, which the export wrote)
        "config.json",
        "params.safetensors",
        "tokenizer.json",
    ]


# --- sizes: refused with both figures before anything that large is allocated ---------------------


def stage_cmd(script: str, micro_data: Path, model: Path | None = None) -> list[str]:
    """The in-process command of a stage script on the micro data, its outputs under the cwd."""
    packed, tokenizer = micro_data / "packed", micro_data / "tokenizer"
    args = {
        "pack.py": ["--raw", str(micro_data / "raw"), "--tokenizer", str(tokenizer), "--out", "packed"],
        "pretrain.py": ["--train", str(packed / "train"), "--val", str(packed / "val")]
        + ["--tokenizer", str(tokenizer / "tokenizer.json"), "--out", "out", "--checkpoints", "ckpt"],
        "eval.py": ["--model", str(model), "--name", "m", "--format", "chat", "--val", str(packed / "val")]
        + ["--raw", str(micro_data / "raw"), "--inputs", str(micro_data), "--out", "eval"],
        "benchmark.py": ["--packed", str(packed / "train"), "--out", "bench"],
        "download.py": ["--out", "raw"],
    }[script]
    return [sys.executable, str(ROOT / "stages" / script), *args]


HUGE_MODEL = {"n_layers": 1024, "d_ff": 1 << 20}  # within every size bound, past any one machine
SIZES = [  # (script, params edit, the start of the one-line error)
    ("pack.py", {"pack": {"seq_len": 1_000_000_000}}, "pack.seq_len: a shard of pack.rows_per_shard 32 rows × "),
    ("pretrain.py", {"model": HUGE_MODEL}, "model: 103,082,436,000 parameters with their gradients"),
    ("pretrain.py", {"training": {"batch_size": 10_000}}, "training.batch_size: 10000 × training.grad_accum 1 rows"),
    ("eval.py", {"eval": {"max_new_tokens": 100_000_000}}, "eval.max_new_tokens: generating "),
    ("benchmark.py", {"benchmark": {"matmul_size": 10_000_000}}, "benchmark.matmul_size: the benchmark's matmul"),
    ("benchmark.py", {"benchmark": {"seq_len": 100_000_000}}, "benchmark.seq_len: the benchmark's train step"),
    (
        "benchmark.py",
        {"benchmark": {"batch_size": 100_000}},
        "benchmark.batch_size (or benchmark.seq_len): a train step of 100000 rows",
    ),
    ("benchmark.py", {"benchmark": {"vocab_size": 100_000_000}}, "benchmark.vocab_size: the benchmark's model state"),
    ("benchmark.py", {"benchmark": {"new_tokens": 10_000_000}}, "benchmark.new_tokens: the benchmark's decoding"),
    ("benchmark.py", {"benchmark": {"prompt_len": 100_000}}, "benchmark.prompt_len: the benchmark's decoding"),
    ("download.py", {"data": {"num_documents": 10_000_000_000}}, "data.num_documents: generating 10,000,000,000"),
]


@pytest.mark.parametrize(("script", "edit", "words"), SIZES, ids=[w.split(":")[0] for _, _, w in SIZES])
def test_sizes_beyond_the_machine_are_refused_before_allocating(
    capsys, micro_data, pretrained, tmp_path, monkeypatch, script, edit, words
):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", micro_params(**edit))
    code, err = run_in_process(stage_cmd(script, micro_data, pretrained), capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {words}"), err
    assert "available" in err or "rows" in err
    assert not [p for p in tmp_path.iterdir() if p.name != "params.yaml"]  # nothing written
    if "available" in err:  # a size the memory cannot hold (not one the data cannot fill)
        (tmp_path / "inputs").mkdir()
        monkeypatch.setattr(sys, "argv", ["stagelm", "check", "--pipeline", str(ROOT / "dvc.yaml")])
        key = words.split(":")[0]
        if key in NOWHERE:  # one device must hold it, and no machine does: refused before any stage runs
            with pytest.raises(SystemExit) as exit_info:
                cli.main()
            err = capsys.readouterr().err
            assert exit_info.value.code == 2 and err.count("\n") == 1, err
            assert err.startswith(f"error: {key}: ") and "more than any one machine holds (65,536.0 GiB)" in err
        else:  # `stagelm check` says so too, before any stage runs (a warning: another machine may fit it)
            cli.main()
            assert "warning: " in capsys.readouterr().out
        assert not [p for p in tmp_path.iterdir() if p.name not in ("params.yaml", "inputs")]


# What one process or device must hold whatever the mesh, beyond any machine's memory (64 TiB), at SIZES'
# values: `stagelm check` refuses these; the rest fit no machine like this one but may fit another.
NOWHERE = ("benchmark.matmul_size", "benchmark.seq_len", "benchmark.new_tokens")


def test_eval_counts_what_generating_long_answers_allocates(capsys, micro_data, pretrained, tmp_path, monkeypatch):
    """Round four's case on a 4 GiB machine: 50 answers at a time of up to 100,000 tokens. The KV
    cache alone (2.4 GiB) fits; the decode loop's prefill and the answers' text do not."""
    from stagelm.infra import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 4 << 30)
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", micro_params(eval={"max_new_tokens": 100_000, "task_batch_size": 50}))
    code, err = run_in_process(stage_cmd("eval.py", micro_data, pretrained), capsys)
    assert code == 2 and err.startswith("error: eval.max_new_tokens: generating ") and "4.0 GiB is available" in err
    assert not [p for p in tmp_path.iterdir() if p.name != "params.yaml"]


def test_eval_answers_stop_at_twice_the_trained_context(capsys, micro_data, pretrained, tmp_path, monkeypatch):
    """Round five's case on a machine that holds it: answers of up to 100,000 tokens from a model
    trained on 64 positions would decode for hours in one compiled loop no signal reaches."""
    from stagelm.infra import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 64 << 30)
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", micro_params(eval={"max_new_tokens": 100_000}))
    code, err = run_in_process(stage_cmd("eval.py", micro_data, pretrained), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: eval.max_new_tokens: 100000 plus the longest eval prompt (")
    assert "passes 2× the model's trained context of 64 positions; lower it to at most " in err
    assert not [p for p in tmp_path.iterdir() if p.name != "params.yaml"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seed", "99999999999999999999999"], "--seed: expected an int in [0, 2**32), got 99999999999999999999999"),
        (["--temperature", "inf"], "--temperature: expected a finite value >= 0, got inf"),
        (["--temperature", "1e308"], "--temperature: expected a finite value >= 0, got 1e+308"),  # inf in float32
        (["--temperature", "nan"], "--temperature: expected a finite value >= 0, got nan"),
        (
            ["--top-k", "99999999999999999999"],
            "--top-k: expected >= 0 (0 = off) and below 2**31, got 99999999999999999999",
        ),
        (["--prompt", "caf\udcff"], "--prompt: not UTF-8 text; pass the prompt as UTF-8"),
    ],
)
def test_generate_refuses_what_it_cannot_use(monkeypatch, capsys, model_dir, flags, message):
    prompt = [] if "--prompt" in flags else ["--prompt", "a"]
    err = stagelm(monkeypatch, capsys, "generate", str(model_dir), *prompt, *flags)
    assert err == f"error: {message}\n"


# --- the multi-process environment: every JAX_* and SLURM_* variable checked, whatever it describes -----

ENVIRONMENTS = [  # (variables, the start of the one-line error)
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}, "JAX_NUM_PROCESSES: not set, but JAX_COORDINATOR_ADDRESS is"),
    (
        {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"},
        "JAX_NUM_PROCESSES: expected an integer >= 1, got '0'",
    ),
    ({"JAX_NUM_PROCESSES": "0"}, "JAX_COORDINATOR_ADDRESS: not set, but JAX_NUM_PROCESSES is"),
    (
        {"JAX_COORDINATOR_ADDRESS": "127.0.0.1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
        "JAX_COORDINATOR_ADDRESS: '127.0.0.1' is not host:port",
    ),
    (
        {"JAX_COORDINATOR_ADDRESS": "h:99999", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
        "JAX_COORDINATOR_ADDRESS: 'h:99999' is not host:port",
    ),
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "abc"}, "SLURM_STEP_NUM_TASKS: expected an integer, got 'abc'"),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "-1"}, "SLURM_PROCID: expected an integer >= 0, got '-1'"),
]


@pytest.mark.parametrize(("variables", "words"), ENVIRONMENTS, ids=[w.split(":")[0] for _, w in ENVIRONMENTS])
@pytest.mark.parametrize("script", ["pack.py", "pretrain.py"])
def test_every_stage_that_runs_as_processes_checks_their_variables(
    capsys, micro_data, tmp_path, monkeypatch, script, variables, words
):
    """pack joins through `distributed.join()`, training through `initialize()`: the same checks,
    before any early return for one process (a cluster would otherwise run N whole copies)."""
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", micro_params())
    code, err = run_in_process(stage_cmd(script, micro_data), capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {words}"), err
    assert not [p for p in tmp_path.iterdir() if p.name != "params.yaml"]


# --- data.* paths: the right key, the project's own folders, text that is text -----------------------


@pytest.mark.parametrize("inputs", [".", "..", "/"])
def test_data_inputs_must_be_a_folder_inside_the_project(monkeypatch, capsys, tmp_path, inputs):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", micro_params(data={"inputs": inputs}))
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    err = stagelm(monkeypatch, capsys, "check")
    assert err.startswith(f"error: data.inputs: {inputs!r} is ") and ("the project itself" in err or "outside" in err)
    code, err = run_in_process([sys.executable, str(ROOT / "stages/params.py"), "--out", "stamp.json"], capsys)
    assert code == 2 and err.startswith("error: data.inputs: ") and not Path("stamp.json").exists()


def test_a_missing_task_file_names_its_own_key(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("inputs").mkdir()
    write_params(tmp_path / "params.yaml", micro_params(data={"eval_files": "inputs/nowhere.jsonl"}))
    code, err = run_in_process(stage_cmd("download.py", Path()), capsys)
    assert code == 2 and err.startswith("error: data.eval_files: 'inputs/nowhere.jsonl' matches no "), err


@pytest.mark.parametrize("where", ["corpus", "sft_files"])
def test_a_lone_surrogate_is_refused_naming_the_file_and_line(capsys, tmp_path, monkeypatch, where):
    """JSON's `\\ud800` decodes to a code point no UTF-8 file or tokenizer can hold."""
    monkeypatch.chdir(tmp_path)
    Path("inputs").mkdir()
    good = json.dumps({"text": "a fine document"}) if where == "corpus" else json.dumps(CHAT)
    bad = '{"text": "bad \\ud800 text"}' if where == "corpus" else json.dumps(CHAT).replace("hello", "he\\ud800llo")
    Path("inputs/f.jsonl").write_text(good + "\n" + bad + "\n")
    key = {"source": "files:inputs/f.jsonl"} if where == "corpus" else {"sft_files": "inputs/f.jsonl"}
    write_params(tmp_path / "params.yaml", micro_params(data=key))
    code, err = run_in_process(stage_cmd("download.py", Path()), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: inputs/f.jsonl:2: holds a lone surrogate escape (\\ud800"), err
    assert not Path("raw").exists()


def test_export_gguf_never_writes_over_a_file_unless_told(monkeypatch, capsys, model_dir, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("mine\n")
    err = stagelm(monkeypatch, capsys, "export-gguf", str(model_dir), str(readme))
    assert err == f"error: {readme}: exists; give another path, or --force to replace it\n"
    assert readme.read_text() == "mine\n"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-gguf", str(model_dir), str(readme), "--force"])
    cli.main()
    assert readme.read_bytes()[:4] == b"GGUF"


# --- import-hf and import-gguf: the tensors against the config, one checker for both ---------

WEIGHTS = [  # (config.json changes, tensor changes (name → array, None = removed), words of the error)
    (
        {"tie_word_embeddings": False},
        {},
        "tensor lm_head.weight is missing, though tie_word_embeddings is false; set it true if the output layer",
    ),
    (
        {"intermediate_size": 48},
        {},
        "tensor model.layers.0.mlp.gate_proj.weight has shape (32, 16), but "
        "intermediate_size, hidden_size give (48, 16)",
    ),
    (
        {"num_key_value_heads": 2},
        {},
        "tensor model.layers.0.self_attn.k_proj.weight has shape (8, 16), but "
        "num_key_value_heads, num_attention_heads, hidden_size give (16, 16)",
    ),
    (
        {"num_hidden_layers": 1000},
        {},
        "num_hidden_layers is 1000 but tensor model.layers.1.input_layernorm.weight is missing",
    ),
    (
        {},
        {"model.layers.1.input_layernorm.weight": np.ones(16, np.float32)},
        "num_hidden_layers is 1 but the weights hold model.layers.1.input_layernorm.weight",
    ),
    (
        {},
        {"model.layers.0.self_attn.q_proj.bias": np.zeros(16, np.float32)},
        "tensor model.layers.0.self_attn.q_proj.bias has no place (stagelm's decoder has no such weight)",
    ),
    (
        {},
        {"model.norm.weight": np.ones(16, np.int8)},
        "tensor model.norm.weight is int8; stagelm imports floating-point weights",
    ),
    ({}, {"model.norm.weight": np.full(16, np.nan, np.float32)}, "tensor model.norm.weight holds NaN"),
    ({}, {"model.norm.weight": None}, "tensor model.norm.weight is missing"),
]


@pytest.mark.parametrize(("config", "tensors", "words"), WEIGHTS, ids=[w[:48] for _, _, w in WEIGHTS])
def test_import_hf_holds_the_weights_to_the_config(monkeypatch, capsys, model_dir, tmp_path, config, tensors, words):
    from safetensors.numpy import load_file, save_file

    hf = tmp_path / "hf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-hf", str(model_dir), str(hf)])
    cli.main()
    (hf / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), **config}))
    weights = load_file(str(hf / "model.safetensors"))
    for name, values in tensors.items():
        if values is None:
            del weights[name]
        else:
            weights[name] = values
    save_file(weights, str(hf / "model.safetensors"))
    err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(tmp_path / "out"))
    assert words in err
    assert not (tmp_path / "out").exists()


def test_a_stray_second_weights_file_is_refused_not_merged(monkeypatch, capsys, model_dir, tmp_path):
    from safetensors.numpy import save_file

    hf = tmp_path / "hf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-hf", str(model_dir), str(hf)])
    cli.main()
    save_file({"model.norm.weight": np.zeros(16, np.float32)}, str(hf / "old-norm.safetensors"))
    err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(tmp_path / "out"))
    assert "tensor model.norm.weight is also in" in err
    assert not (tmp_path / "out").exists()


def rewritten_gguf(src: Path, dst: Path, fields: dict, tensors: dict) -> Path:
    """`src` written again with metadata `fields` changed (key → (value, GGUFValueType), None = dropped)
    and `tensors` changed (name → float32 array, None = dropped): how a damaged or foreign GGUF looks."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), "llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in fields:
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, change in fields.items():
        if change is not None:
            writer.add_key_value(key, *change)
    for t in reader.tensors:
        if t.name not in tensors:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    for name, values in tensors.items():
        if values is not None:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


GGUF_CASES = [  # (metadata changes, tensor changes, words of the error)
    ({"llama.attention.head_count": (0, "UINT32")}, {}, "llama.attention.head_count = 0; expected an integer in"),
    ({"llama.embedding_length": ("16", "STRING")}, {}, "llama.embedding_length = '16'; expected an integer"),
    ({"llama.attention.layer_norm_rms_epsilon": (-1.0, "FLOAT32")}, {}, "layer_norm_rms_epsilon = -1.0; expected a"),
    ({"llama.rope.freq_base": (float("nan"), "FLOAT32")}, {}, "llama.rope.freq_base = nan; expected a positive"),
    ({"llama.context_length": (0, "UINT32")}, {}, "llama.context_length = 0; expected an integer in"),
    (
        {"llama.block_count": (1000, "UINT32")},
        {},
        "llama.block_count is 1000 but tensor blk.1.attn_norm.weight is missing",
    ),
    ({}, {"blk.0.attn_q.bias": np.zeros(16, np.float32)}, "blk.0.attn_q.bias"),
    ({"tokenizer.ggml.tokens": None}, {}, "tokenizer.ggml.tokens is missing or not a list of strings"),
    ({"tokenizer.ggml.token_type": ([1, 1], "ARRAY", "INT32")}, {}, "tokenizer.ggml.token_type has 2 entries for"),
    ({"tokenizer.ggml.merges": (["ab"], "ARRAY", "STRING")}, {}, "tokenizer.ggml.merges holds 'ab', not two tokens"),
    ({"tokenizer.ggml.eos_token_id": (10**6, "UINT32")}, {}, "tokenizer.ggml.eos_token_id 1000000 is not a token id"),
    ({"llama.vocab_size": (8, "UINT32")}, {}, "tokenizer.ggml.tokens holds 300 tokens but llama.vocab_size is 8"),
    ({}, {"blk.0.attn_q.weight": np.zeros((15, 16), np.float32)}, "has shape (15, 16), but llama.attention.head_count"),
    (
        {"tokenizer.ggml.token_type": (["normal"] * 300, "ARRAY", "STRING")},
        {},
        "tokenizer.ggml.token_type holds 'normal', not one of llama.cpp's token types 0 to 6",
    ),
    ({"tokenizer.ggml.token_type": ([99] * 300, "ARRAY", "INT32")}, {}, "tokenizer.ggml.token_type holds '99', not"),
    ({"tokenizer.ggml.token_type": ([True] * 300, "ARRAY", "BOOL")}, {}, "tokenizer.ggml.token_type holds 'True', not"),
    ({"tokenizer.chat_template": (5, "UINT32")}, {}, "tokenizer.chat_template is '5'; expected a Jinja string"),
    ({"tokenizer.ggml.add_bos_token": ("yes", "STRING")}, {}, "add_bos_token = 'yes'; expected true or false"),
    ({"tokenizer.ggml.pre": (["smollm"], "ARRAY", "STRING")}, {}, "tokenizer.ggml.pre ['smollm'] is not a pre-"),
    ({"tokenizer.ggml.merges": (5, "UINT32")}, {}, "tokenizer.ggml.merges is '5', not a list"),
    ({"tokenizer.ggml.merges": None}, {}, "tokenizer.ggml.merges missing; a byte-level BPE needs them"),
    ({"llama.expert_count": (8, "UINT32")}, {}, "llama.expert_count is 8; stagelm imports dense Llama models only"),
    ({"tokenizer.ggml.tokens": ([b"\xff\xfe"], "ARRAY", "STRING")}, {}, "tokens holds bytes that are not UTF-8 text"),
    ({"tokenizer.ggml.eos_token_id": (True, "BOOL")}, {}, "tokenizer.ggml.eos_token_id True is not a token id"),
    ({"tokenizer.ggml.eos_token_id": ("2", "STRING")}, {}, "tokenizer.ggml.eos_token_id '2' is not a token id"),
    ({"llama.attention.head_count": (3, "UINT32")}, {}, "llama.attention.head_count 3 and head_count_kv"),
    (
        {"llama.attention.layer_norm_rms_epsilon": (1e30, "FLOAT32")},
        {},
        "llama.attention.layer_norm_rms_epsilon = 1.0000000150474662e+30; expected a positive number of at most 0.1",
    ),
]


@pytest.mark.parametrize(("fields", "tensors", "words"), GGUF_CASES, ids=[w[:40] for _, _, w in GGUF_CASES])
def test_import_gguf_checks_what_import_hf_checks(monkeypatch, capsys, model_dir, tmp_path, fields, tensors, words):
    import gguf

    good = tmp_path / "good.gguf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-gguf", str(model_dir), str(good)])
    cli.main()
    fields = {k: None if v is None else (v[0], *(gguf.GGUFValueType[t] for t in v[1:])) for k, v in fields.items()}
    bad = rewritten_gguf(good, tmp_path / "bad.gguf", fields, tensors)
    err = stagelm(monkeypatch, capsys, "import-gguf", str(bad), str(tmp_path / "out"))
    assert words in err
    assert not (tmp_path / "out").exists()


CHAT_FILES = [  # (file, contents, words of the error)
    ("generation_config.json", {"eos_token_id": [-5]}, "generation_config.json: eos_token_id -5 is not a token id"),
    ("generation_config.json", {"eos_token_id": 10**30}, "eos_token_id 1000000000000000000000000000000 is not a"),
    ("tokenizer_config.json", {"chat_template": ["x", 3]}, "chat_template is a list of something other than"),
    ("tokenizer_config.json", {"chat_template": 3}, "tokenizer_config.json: chat_template is int; expected a Jinja"),
    (
        "tokenizer_config.json",
        {"chat_template": "{% for %}"},
        "tokenizer_config.json: the chat template does not parse",
    ),
    (
        "tokenizer_config.json",
        {"chat_template": "{{ 10**(10**8) }}"},
        "tokenizer_config.json: the chat template raises",
    ),
    (
        "tokenizer_config.json",
        {"chat_template": [{"name": "tool_use", "template": "{{ messages }}"}]},
        "chat_template lists named templates ['tool_use'] but none named 'default'",
    ),
    ("tokenizer_config.json", {"add_bos_token": "yes"}, "add_bos_token = 'yes'; expected true or false"),
    ("tokenizer_config.json", {"eos_token": 42}, "tokenizer_config.json: eos_token = 42; expected the token's text"),
    ("tokenizer_config.json", {"pad_token": ["<|pad|>"]}, "pad_token = ['<|pad|>']; expected the token's text"),
    (  # no template: the tokens are checked all the same (a load would refuse them)
        "tokenizer_config.json",
        {"chat_template": None, "eos_token": "<nope>"},
        "eos_token '<nope>' is not a token of its tokenizer.json",
    ),
]


@pytest.mark.parametrize(("name", "contents", "words"), CHAT_FILES, ids=[w[:40] for _, _, w in CHAT_FILES])
def test_import_hf_checks_its_chat_files(monkeypatch, capsys, model_dir, tmp_path, name, contents, words):
    hf = tmp_path / "hf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-hf", str(model_dir), str(hf)])
    cli.main()
    path = hf / name
    path.write_text(json.dumps({**(json.loads(path.read_text()) if path.is_file() else {}), **contents}))
    err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(tmp_path / "out"))
    assert words in err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_linked_into_inputs_from_outside_is_outside(monkeypatch, capsys, tmp_path):
    """DVC hashes a symbolic link, not what it points to: a checkpoint reached through one would
    change without any stage rerunning, so init_from refuses it as it refuses a path outside."""
    (tmp_path / "elsewhere/ckpt").mkdir(parents=True)
    (tmp_path / "project/inputs").mkdir(parents=True)
    (tmp_path / "project/inputs/ckpt").symlink_to(tmp_path / "elsewhere/ckpt")
    monkeypatch.chdir(tmp_path / "project")
    write_params(Path("params.yaml"), micro_params(model={"init_from": "hf:inputs/ckpt"}))
    code, err = run_in_process([sys.executable, str(ROOT / "stages/params.py"), "--out", "stamp.json"], capsys)
    assert code == 2 and err.startswith("error: model.init_from: 'inputs/ckpt' lies outside data.inputs 'inputs'")
    assert not Path("stamp.json").exists()


LLAMA_8B = {  # config.json of an 8B Llama (Llama 3's sizes): no weights beside it
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def test_a_checkpoint_is_sized_by_its_config_before_a_weight_is_read(capsys, micro_data, tmp_path, monkeypatch):
    """`stagelm check` and pretrain size an init_from checkpoint by its own config (8.03 B parameters:
    120 GiB with gradients and Adam's moments), not the unused model section, and pretrain refuses
    it in one line before it looks for a weight."""
    from stagelm.infra import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 24 << 30)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inputs/llama").mkdir(parents=True)
    (tmp_path / "inputs/llama/config.json").write_text(json.dumps(LLAMA_8B))
    # distill.init: scratch, as the micro student cannot be pruned from an 8B teacher (test below)
    params = micro_params(model={"init_from": "hf:inputs/llama"}, distill={"init": "scratch"})
    write_params(tmp_path / "params.yaml", params)
    monkeypatch.setattr(sys, "argv", ["stagelm", "check", "--pipeline", str(ROOT / "dvc.yaml")])
    cli.main()
    out = capsys.readouterr().out
    assert "warning: model (parameters, gradients, Adam's moments): about 119.7 GiB of " in out, out
    code, err = run_in_process(stage_cmd("pretrain.py", micro_data), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: model.init_from: inputs/llama: 8,030,261,248 parameters with their gradients"), err
    assert "start from a smaller checkpoint" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs", "params.yaml"]


# --- import and export never replace what they did not write ---------------------------------------


def test_import_hf_never_replaces_a_model_trained_here(monkeypatch, capsys, model_dir, tmp_path):
    """A model directory a stage wrote holds the same file names as an import: only one whose
    config.json says `imported_from` is a previous import, which an import may replace."""
    hf = tmp_path / "hf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-hf", str(model_dir), str(hf)])
    cli.main()
    before = tree_bytes(tmp_path)
    err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(model_dir))
    assert err == (
        f"error: {model_dir}: holds a stagelm model that was trained, not imported (its config.json has no "
        "imported_from); give import-hf a new or empty folder\n"
    )
    assert tree_bytes(tmp_path) == before
    inside = hf / "sub"  # a folder inside the checkpoint it reads (which DVC may hash) is never a target
    err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(inside))
    assert err == f"error: {inside}: inside the checkpoint {hf} it reads; write the import somewhere else\n"
    assert not inside.exists()
    trained = tmp_path / "trained"  # an imported_from that names no source is no import either
    shutil.copytree(model_dir, trained)
    for value in (None, "", False):
        config = json.loads((trained / "config.json").read_text())
        (trained / "config.json").write_text(json.dumps({**config, "imported_from": value}))
        before = tree_bytes(trained)
        err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(trained))
        assert "holds a stagelm model that was trained" in err
        assert tree_bytes(trained) == before


def test_export_hf_never_replaces_a_checkpoint_it_did_not_write(monkeypatch, capsys, model_dir, tmp_path):
    """A folder of transformers' own file names (what save_pretrained writes) is no previous export:
    only one whose config.json holds exactly the keys export-hf writes is replaced."""
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({"model_type": "llama", "transformers_version": "4.57.0"}))
    (saved / "model.safetensors").write_bytes(b"a user's weights")
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes(b"a user's weights")
    before = tree_bytes(tmp_path)
    for target in (saved, weights_only):
        err = stagelm(monkeypatch, capsys, "export-hf", str(model_dir), str(target))
        assert err == (
            f"error: {target}: holds a checkpoint export-hf did not write (its config.json is not an export's); "
            "give export-hf a new or empty folder\n"
        )
    assert tree_bytes(tmp_path) == before


def test_export_gguf_never_writes_into_the_model_it_exports(monkeypatch, capsys, model_dir, tmp_path):
    before = tree_bytes(tmp_path)
    for target, force in (("params.safetensors", True), ("tokenizer.json", True), ("x.gguf", False)):
        out = model_dir / target
        err = stagelm(monkeypatch, capsys, "export-gguf", str(model_dir), str(out), *(["--force"] if force else []))
        assert err == f"error: {out}: is inside the model being exported; give export-gguf a path outside {model_dir}\n"
    pipe = tmp_path / "pipe.gguf"  # as /dev/null would be: --force must not put a file in its place
    os.mkfifo(pipe)
    err = stagelm(monkeypatch, capsys, "export-gguf", str(model_dir), str(pipe), "--force")
    assert (
        err == f"error: {pipe}: a device, pipe or socket, not a file; give export-gguf the path of a .gguf to write\n"
    )
    assert stat.S_ISFIFO(pipe.lstat().st_mode)
    pipe.unlink()
    (tmp_path / "link").symlink_to(model_dir)  # the same folder by another name
    err = stagelm(monkeypatch, capsys, "export-gguf", str(model_dir), str(tmp_path / "link/x.gguf"))
    assert "is inside the model being exported" in err
    (tmp_path / "link").unlink()
    assert tree_bytes(tmp_path) == before


def test_temporary_names_beside_a_target_are_never_a_users(monkeypatch, capsys, model_dir, tmp_path):
    """Export and import write beside their target and rename: under names no one else's file
    has, so a user's `.hf.export-old` or `.m.gguf.tmp` survives them."""
    mine = [".hf.export-tmp/a", ".hf.export-old/a", ".imported.import-tmp/a", ".imported.old/a", ".m.gguf.tmp"]
    for name in mine:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("a user's file")
    for argv in (
        ["export-hf", str(model_dir), str(tmp_path / "hf")],
        ["export-hf", str(model_dir), str(tmp_path / "hf")],
        ["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")],
        ["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")],
        ["export-gguf", str(model_dir), str(tmp_path / "m.gguf")],
    ):
        monkeypatch.setattr(sys, "argv", ["stagelm", *argv])
        cli.main()
    assert all((tmp_path / name).read_text() == "a user's file" for name in mine)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(
        {name.split("/")[0] for name in mine}
    )  # and nothing of the commands' own is left
    assert oct((tmp_path / "hf").stat().st_mode & 0o777) == oct((tmp_path / "model").stat().st_mode & 0o777)
    (tmp_path / "elsewhere").mkdir()  # a target that is a link is written where it leads, the link kept
    for command, source, target in (("export-hf", model_dir, "hf"), ("import-hf", tmp_path / "hf", "imported")):
        (tmp_path / "elsewhere" / target).symlink_to(tmp_path / target)
        monkeypatch.setattr(sys, "argv", ["stagelm", command, str(source), str(tmp_path / "elsewhere" / target)])
        cli.main()
        assert (tmp_path / "elsewhere" / target).is_symlink() and (tmp_path / target / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["hf", "imported"]


# --- import-hf reads regular files only, each up to a size --------------------------------------


def exported_hf(monkeypatch, model_dir: Path, hf: Path) -> Path:
    """A transformers folder (export-hf of the tiny model) with every file import-hf reads."""
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-hf", str(model_dir), str(hf)])
    cli.main()
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "chat_template.jinja").write_text(config.pop("chat_template"))
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    return hf


UNREADABLE = [  # (file, what it is)
    ("config.json", "/dev/zero"),
    ("config.json", "fifo"),
    ("tokenizer.json", "fifo"),
    ("tokenizer_config.json", "/dev/zero"),
    ("generation_config.json", "fifo"),
    ("chat_template.jinja", "/dev/zero"),
    ("model.safetensors", "fifo"),
    ("model.safetensors.index.json", "/dev/zero"),
]


def test_import_hf_reads_no_device_and_no_pipe(monkeypatch, capsys, model_dir, tmp_path):
    """A link to /dev/zero would be read until the kernel kills the process, a FIFO would block it
    forever, and one where an optional file goes was taken for no file: each is refused in one
    line, exit 2, by `stagelm import-hf` processes that end."""
    good = exported_hf(monkeypatch, model_dir, tmp_path / "good")
    procs = {}
    try:
        for i, (name, kind) in enumerate(UNREADABLE):
            hf = tmp_path / f"hf{i}"
            shutil.copytree(good, hf)
            (hf / name).unlink(missing_ok=True)
            if kind == "fifo":
                os.mkfifo(hf / name)
            else:
                (hf / name).symlink_to(kind)
            # Under a 4 GiB address space: a regression fails with a line about memory, not the machine's.
            cmd = ["prlimit", f"--as={4 << 30}", "stagelm", "import-hf", str(hf), str(tmp_path / f"out{i}")]
            procs[hf / name] = subprocess.Popen(
                cmd, env=env_with_venv(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        for path, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 2 and err.count("\n") == 1, err
            assert err.startswith(f"error: {path}: a device, pipe or socket, not a regular file; "), err
    finally:
        for proc in procs.values():
            proc.kill()
    assert not list(tmp_path.glob("out*")) and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(("name", "size"), [("config.json", 64 << 20), ("tokenizer.json", 256 << 20)])
def test_import_hf_reads_a_metadata_file_up_to_its_size(monkeypatch, capsys, model_dir, tmp_path, name, size):
    hf = exported_hf(monkeypatch, model_dir, tmp_path / "hf")
    with open(hf / name, "r+b") as f:  # sparse: no disk spent
        f.truncate(size + 1)
    err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(tmp_path / "out"))
    assert err.startswith(f"error: {hf / name}: {size + 1:,} bytes, more than the {size:,} such a file may hold; ")
    assert not (tmp_path / "out").exists()


# --- import-hf: weights it cannot read, and sharded checkpoints --------------------------------------


def retyped(file: Path, name: str, dtype: str) -> None:
    """Rewrite safetensors `file` with tensor `name`'s bytes declared as `dtype` (one byte an element)."""
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    start, end = header[name]["data_offsets"]
    header[name].update(dtype=dtype, shape=[end - start])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])


def test_import_hf_names_a_dtype_it_cannot_read(monkeypatch, capsys, model_dir, tmp_path):
    hf = exported_hf(monkeypatch, model_dir, tmp_path / "hf")
    retyped(hf / "model.safetensors", "model.norm.weight", "F8_E4M3")
    err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(tmp_path / "out"))
    assert err == (
        f"error: {hf / 'model.safetensors'}: tensor model.norm.weight is F8_E4M3, a dtype stagelm does not import; "
        "give the checkpoint in float32, float16 or bfloat16\n"
    )
    assert not (tmp_path / "out").exists()


def test_import_hf_reads_the_shards_its_index_names(monkeypatch, capsys, model_dir, tmp_path):
    """model.safetensors.index.json says which file holds each tensor: a shard it names that is
    missing, or a tensor not where it says, is refused; an index that agrees imports."""
    from safetensors.numpy import load_file

    hf = exported_hf(monkeypatch, model_dir, tmp_path / "hf")
    names = sorted(load_file(str(hf / "model.safetensors")))
    index = hf / "model.safetensors.index.json"
    cases = [
        ({n: "model-00001-of-00002.safetensors" for n in names}, "names model-00001-of-00002.safetensors, which is"),
        ({**dict.fromkeys(names, "model.safetensors"), "extra.weight": "model.safetensors"}, "lacks ['extra.weight']"),
        ({n: "model.safetensors" for n in names[1:]}, f"holds, besides what it names, ['{names[0]}']"),
        ({names[0]: "../model.safetensors"}, "not a .safetensors beside it"),
    ]
    for weight_map, words in cases:
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(tmp_path / "out"))
        assert err.startswith(f"error: {index}: ") and words in err, err
        assert not (tmp_path / "out").exists()
    index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}))
    monkeypatch.setattr(sys, "argv", ["stagelm", "import-hf", str(hf), str(tmp_path / "out")])
    cli.main()
    assert (tmp_path / "out/params.safetensors").is_file()


# --- import-gguf: tensor data where llama.cpp's loader expects it --------------------------------------


def test_import_gguf_refuses_a_tensor_offset_out_of_place(monkeypatch, capsys, model_dir, tmp_path):
    """A tensor's offset moved by 4 bytes would read its weights shifted (and overlapping the next):
    llama.cpp refuses such a file, and so does the import."""
    import gguf

    path = tmp_path / "m.gguf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-gguf", str(model_dir), str(path)])
    cli.main()
    reader = gguf.GGUFReader(str(path), "r+")
    first = reader.tensors[0]
    first.field.parts[-1][0] += 4  # the offset in its tensor info, written through the memory map
    reader.data.flush()
    del reader
    err = stagelm(monkeypatch, capsys, "import-gguf", str(path), str(tmp_path / "out"))
    assert err == (
        f"error: {path}: tensor {first.name} starts at data offset 4, but the tensors before it end at 0; "
        "the file is damaged\n"
    )
    assert not (tmp_path / "out").exists()


def test_import_gguf_refuses_what_its_header_declares_beyond_the_file(monkeypatch, capsys, model_dir, tmp_path):
    """An array whose declared length no file could hold (gguf's reader walks it item by item: a
    length of 2**50 would run for days), and bytes after the last tensor (an 8 GiB file behind a
    small model's header): each refused in one line, before anything is written."""
    import gguf

    good = tmp_path / "good.gguf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-gguf", str(model_dir), str(good)])
    cli.main()
    long = tmp_path / "long.gguf"
    shutil.copyfile(good, long)
    reader = gguf.GGUFReader(str(long), "r+")
    reader.fields["tokenizer.ggml.token_type"].parts[4][0] = 2**50  # the array's length, through the memory map
    reader.data.flush()
    del reader
    err = stagelm(monkeypatch, capsys, "import-gguf", str(long), str(tmp_path / "out"))
    assert err.startswith(f"error: {long}: metadata tokenizer.ggml.token_type declares 4,503,599,627,370,496 bytes")
    assert err.endswith(" are left; the file is damaged\n") and err.count("\n") == 1
    whole = good.read_bytes()
    cut = tmp_path / "cut.gguf"  # cut anywhere: in the header, the metadata, the tensor infos or the data
    for size, words in [
        (4, "4 bytes, its GGUF header cut short"),
        (20, "the metadata count declares 8 bytes where 4 are left"),
        (200, "declares"),
        (len(whole) // 2, "bytes of data from byte"),
        (len(whole) - 1, f"run past the end of the file at {len(whole) - 1:,}"),
    ]:
        cut.write_bytes(whole[:size])
        err = stagelm(monkeypatch, capsys, "import-gguf", str(cut), str(tmp_path / "out"))
        assert err.startswith(f"error: {cut}: ") and words in err and err.endswith("; it is truncated\n"), err
    padded = tmp_path / "padded.gguf"
    padded.write_bytes(whole + bytes(2**20))
    err = stagelm(monkeypatch, capsys, "import-gguf", str(padded), str(tmp_path / "out"))
    assert err == f"error: {padded}: 1,048,576 bytes follow the last tensor's data; the file is damaged\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["import-hf", "import-gguf", "export-hf", "export-gguf"])
def test_an_empty_path_is_refused_not_taken_for_the_current_folder(monkeypatch, capsys, tmp_path, command):
    monkeypatch.chdir(tmp_path)
    err = stagelm(monkeypatch, capsys, command, "", str(tmp_path / "out"))
    assert err == (
        f"error: stagelm {command}: argument {'model_dir' if command.startswith('export') else 'source'}: "
        f"an empty path; give a file or folder; see `stagelm {command} --help`\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("where", "words"),
    [
        ("type", "metadata llama.context_length has value type 99, none of GGUF's; the file is damaged"),
        ("key", "metadata key 0 is not UTF-8 text; the file is damaged"),
        ("tensor", "tensor 0's name is not UTF-8 text; the file is damaged"),
    ],
)
def test_import_gguf_names_a_header_it_cannot_walk(monkeypatch, capsys, model_dir, tmp_path, where, words):
    """A value type no GGUF has (past it every later length would be read out of step) and a key or
    tensor name that is not UTF-8: named in one line, not in Python's or numpy's words."""
    import gguf

    path = tmp_path / "m.gguf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-gguf", str(model_dir), str(path)])
    cli.main()
    reader = gguf.GGUFReader(str(path), "r+")
    if where == "type":
        reader.fields["llama.context_length"].parts[2][0] = 99  # the value's type, through the memory map
    elif where == "key":
        first = next(f for name, f in reader.fields.items() if not name.startswith("GGUF."))  # not the header's
        first.parts[1][0] = 0xFF  # the first key's first byte
    else:
        reader.tensors[0].field.parts[1][0] = 0xFF  # the first tensor's name's first byte
    reader.data.flush()
    del reader
    err = stagelm(monkeypatch, capsys, "import-gguf", str(path), str(tmp_path / "out"))
    assert err == f"error: {path}: {words}\n"
    assert not (tmp_path / "out").exists()


def test_import_gguf_reads_a_file_aligned_to_64_bytes(monkeypatch, capsys, model_dir, tmp_path):
    """general.alignment 64 (llama.cpp's writers may choose it): the tensors' padding follows it."""
    from stagelm.interop.gguf_import import open_gguf

    good = tmp_path / "good.gguf"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-gguf", str(model_dir), str(good)])
    cli.main()
    wide = rewritten_gguf(good, tmp_path / "wide.gguf", {"general.alignment": (64, gguf_type("UINT32"))}, {})
    assert int(open_gguf(wide).alignment) == 64
    monkeypatch.setattr(sys, "argv", ["stagelm", "import-gguf", str(wide), str(tmp_path / "out")])
    cli.main()
    original, imported = load_model(model_dir), load_model(tmp_path / "out")
    for a, b in zip(jax.tree.leaves(nnx.state(original)), jax.tree.leaves(nnx.state(imported)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def gguf_type(name: str):
    import gguf

    return gguf.GGUFValueType[name]


@pytest.mark.parametrize(("key", "bound"), [("norm_eps", "0.1"), ("rope_theta", "1e12"), ("init_std", "1")])
def test_check_bounds_a_decoders_real_numbers(monkeypatch, capsys, tmp_path, key, bound):
    """An RMSNorm epsilon of 1e300 would train on, every activation flattened to zero: refused in
    params.yaml as import-hf refuses it in a checkpoint's config.json."""
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", micro_params(model={key: 1e300}))
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    err = stagelm(monkeypatch, capsys, "check")
    assert err == f"error: model.{key}: expected a positive float of at most {bound}, got 1e+300\n"


# --- import-hf: special_tokens_map.json, read when transformers reads it -----------------------------


def test_import_hf_reads_special_tokens_map_as_transformers_does(monkeypatch, capsys, model_dir, tmp_path):
    """transformers reads special_tokens_map.json when tokenizer_config.json has no added_tokens_decoder
    (a checkpoint saved before 4.34), its tokens over tokenizer_config.json's: the import reads it then,
    and a bad one is refused naming it; beside an added_tokens_decoder, which transformers reads instead,
    it is left unread, as transformers leaves it."""
    hf = exported_hf(monkeypatch, model_dir, tmp_path / "hf")
    path = hf / "special_tokens_map.json"
    cases = [
        (b"{not json", "not valid JSON"),
        (b'["<|eos|>"]', "expected a JSON object, got list"),
        (b'{"eos_token": 42}', "eos_token = 42; expected the token's text (or an AddedToken object)"),
        (b'{"pad_token": {"content": 7}}', "pad_token = {'content': 7}; expected the token's text"),
        (b'{"eos_token": "<nope>"}', "eos_token '<nope>' is not a token of its tokenizer.json"),
    ]
    for data, words in cases:
        path.write_bytes(data)
        err = stagelm(monkeypatch, capsys, "import-hf", str(hf), str(tmp_path / "out"))
        assert err.startswith(f"error: {path}: {words}"), err
        assert not (tmp_path / "out").exists()
    path.write_text(json.dumps({"pad_token": {"content": "<|end|>", "lstrip": False}}))  # over tokenizer_config's
    monkeypatch.setattr(sys, "argv", ["stagelm", "import-hf", str(hf), str(tmp_path / "out")])
    cli.main()
    assert json.loads((tmp_path / "out/chat.json").read_text())["pad_token"] == "<|end|>"
    config = hf / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "added_tokens_decoder": {}}))
    path.write_bytes(b"{not json")
    monkeypatch.setattr(sys, "argv", ["stagelm", "import-hf", str(hf), str(tmp_path / "again")])
    cli.main()
    assert json.loads((tmp_path / "again/chat.json").read_text())["pad_token"] == "<|pad|>"


# --- a GGUF file is known by its content, not its name -----------------------------------------------


def test_a_gguf_file_is_known_by_its_magic_bytes(monkeypatch, capsys, model_dir, tmp_path):
    """A GGUF file named model.bin imports (import-hf, import-gguf and model.init_from: gguf:); a file
    that is not GGUF is refused by its content, in one line, whatever its name."""
    gguf_file = tmp_path / "inputs/model.bin"
    monkeypatch.setattr(sys, "argv", ["stagelm", "export-gguf", str(model_dir), str(tmp_path / "m.gguf")])
    cli.main()
    gguf_file.parent.mkdir()
    shutil.copyfile(tmp_path / "m.gguf", gguf_file)
    for command in ("import-gguf", "import-hf"):
        monkeypatch.setattr(sys, "argv", ["stagelm", command, str(gguf_file), str(tmp_path / command)])
        cli.main()
        assert (tmp_path / command / "params.safetensors").is_file()
    fake = tmp_path / "inputs/fake.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    err = stagelm(monkeypatch, capsys, "import-gguf", str(fake), str(tmp_path / "out"))
    assert err.startswith(f"error: {fake}: not a GGUF file (it does not start with the bytes GGUF) nor a "), err
    assert not (tmp_path / "out").exists()
    monkeypatch.chdir(tmp_path)
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    write_params(tmp_path / "params.yaml", micro_params(model={"init_from": "gguf:inputs/fake.gguf"}))
    err = stagelm(monkeypatch, capsys, "check")
    assert err.startswith("error: model.init_from: inputs/fake.gguf is not a GGUF file (it does not start with "), err
    params = micro_params(model={"init_from": "gguf:inputs/model.bin"}, distill={"init": "scratch"})
    write_params(tmp_path / "params.yaml", params)
    monkeypatch.setattr(sys, "argv", ["stagelm", "check"])
    cli.main()
    assert "ok: params.yaml: seed and sections" in capsys.readouterr().out


# --- stagelm check: lm-eval task names, the distill student, the size of params.yaml ---------------------


class FewTasks:
    """lm-eval's TaskManager with two tasks, built without indexing its thousands (seconds each time)."""

    built = 0

    def __init__(self, *args, **kwargs):
        type(self).built += 1
        self.all_tasks = ["arc_easy", "hellaswag"]


def checked(monkeypatch, capsys, tmp_path, **sections) -> str:
    """`stagelm check` of the micro params with `sections` changed, in a project of its own: its stderr
    (one line, exit 2), or "" when it passes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inputs").mkdir(exist_ok=True)
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    write_params(tmp_path / "params.yaml", micro_params(**sections))
    monkeypatch.setattr(sys, "argv", ["stagelm", "check"])
    capsys.readouterr()  # what came before
    try:
        cli.main()
    except SystemExit as exit_info:
        assert exit_info.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        return err
    return ""


def test_check_knows_lm_eval_task_names(monkeypatch, capsys, tmp_path):
    """A misspelled task name is refused by `stagelm check` (and the params stage), not by the eval
    stage after training; lm-eval's tasks are indexed only when the list names one."""
    pytest.importorskip("lm_eval", reason="lm-eval is the eval extra (pip install -e '.[eval]')")
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", FewTasks)
    err = checked(monkeypatch, capsys, tmp_path, eval={"lm_eval_tasks": ["inputs/mine.yaml", "arc_esy"]})
    assert err == (
        "error: eval.lm_eval_tasks: 'arc_esy' is not an lm-eval task (did you mean 'arc_easy'?); "
        "`stagelm lm-eval ls tasks` lists them, or give a task YAML's path\n"
    )
    assert checked(monkeypatch, capsys, tmp_path, eval={"lm_eval_tasks": ["arc_easy", "hellaswag"]}) == ""
    built = FewTasks.built
    assert checked(monkeypatch, capsys, tmp_path, eval={"lm_eval_tasks": ["inputs/mine.yaml"]}) == ""
    assert FewTasks.built == built  # task YAMLs alone: nothing indexed


STUDENT = {"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "d_ff": 32, "vocab_size": None}
STUDENTS = [  # (distill.student changes, the one-line error; the micro model: d_model 32, 2 layers, d_ff 64)
    ({"n_layers": 3}, "distill.student.n_layers: 3 is more than model.n_layers, 2; distill.init: teacher can only"),
    ({"d_ff": 128}, "distill.student.d_ff: 128 is more than model.d_ff, 64; distill.init: teacher can only remove"),
    ({"d_model": 64}, "distill.student.d_model: 64 differs from model.d_model, 32; distill.init: teacher keeps the"),
    ({"n_kv_heads": 4}, "distill.student.n_kv_heads: 4 differs from model.n_kv_heads, 2; distill.init: teacher"),
]


@pytest.mark.parametrize(("change", "words"), STUDENTS, ids=[w.split(":")[0] for _, w in STUDENTS])
def test_check_refuses_a_student_the_teacher_cannot_be_pruned_to(monkeypatch, capsys, tmp_path, change, words):
    """With distill.init: teacher the student is the SFT model pruned: one wider or deeper (or of
    another width or head count) is refused at check time, not after pretraining and SFT; from
    scratch (init: scratch) a larger student is legitimate."""
    student = {**STUDENT, **change}
    err = checked(monkeypatch, capsys, tmp_path, distill={"init": "teacher", "student": student})
    assert err.startswith(f"error: {words}"), err
    assert checked(monkeypatch, capsys, tmp_path, distill={"init": "scratch", "student": student}) == ""


def test_check_holds_the_student_to_an_init_from_checkpoint(monkeypatch, capsys, tmp_path):
    """With model.init_from the teacher has the checkpoint's shape (the model section's sizes are unused)."""
    (tmp_path / "inputs/llama").mkdir(parents=True)
    (tmp_path / "inputs/llama/config.json").write_text(json.dumps(LLAMA))  # d16, 2 heads, 1 kv head, 1 layer
    student = {**STUDENT, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "n_layers": 2}
    sections = {"model": {"init_from": "hf:inputs/llama"}, "distill": {"init": "teacher", "student": student}}
    err = checked(monkeypatch, capsys, tmp_path, **sections)
    assert err.startswith("error: distill.student.n_layers: 2 is more than the teacher's (hf:inputs/llama) n_layers, 1")
    sections["distill"]["student"] = {**student, "n_layers": 1}
    assert checked(monkeypatch, capsys, tmp_path, **sections) == ""


def test_a_params_file_is_read_up_to_its_size(monkeypatch, capsys, tmp_path):
    """A 200 MB params.yaml would be read whole and parsed: refused by its size before it is opened,
    by `stagelm check` and every stage (they read it through the same function)."""
    assert checked(monkeypatch, capsys, tmp_path) == ""
    with open(tmp_path / "params.yaml", "r+b") as f:  # sparse: no disk spent
        f.truncate(200 << 20)
    err = stagelm(monkeypatch, capsys, "check")
    assert err == (
        f"error: params.yaml: {200 << 20:,} bytes, more than the {1 << 20:,} such a file may hold; it holds "
        "settings, not data; give the project's own\n"
    )
    code, err = run_in_process([sys.executable, str(ROOT / "stages/params.py"), "--out", "stamp.json"], capsys)
    assert code == 2 and err.startswith("error: params.yaml: 209,715,200 bytes, more than the 1,048,576"), err
    assert not Path("stamp.json").exists()


# --- stagelm check: what params alone show can never run -------------------------------------------------


@pytest.mark.parametrize("size", [10, 261])
def test_check_refuses_a_vocabulary_smaller_than_the_bytes_and_specials(monkeypatch, capsys, tmp_path, size):
    """The tokenizer stage adds the 256 bytes and 6 special tokens: a vocabulary below 262 fails at
    `stagelm check` (and the params stage), not when BPE starts training."""
    err = checked(monkeypatch, capsys, tmp_path, tokenizer={"vocab_size": size})
    assert err == (
        "error: tokenizer.vocab_size: expected an int from 262 (the 256 bytes and 6 special tokens) to 2,097,152, "
        f"got {size}\n"
    )
    assert not (tmp_path / "data").exists()
    assert checked(monkeypatch, capsys, tmp_path, tokenizer={"vocab_size": 262}) == ""


def test_check_refuses_a_student_vocabulary_other_than_the_teachers(monkeypatch, capsys, tmp_path):
    """The student shares the teacher's tokenizer: a distill.student.vocab_size other than null or the
    teacher's (tokenizer.vocab_size, or model.init_from's checkpoint's) fails at check, not after SFT."""
    for init in ("scratch", "teacher"):
        distill = {"init": init, "student": {**STUDENT, "vocab_size": 999}}
        err = checked(monkeypatch, capsys, tmp_path, distill=distill)
        assert err == (
            "error: distill.student.vocab_size: 999 differs from tokenizer.vocab_size, 300; the student shares "
            "the teacher's tokenizer, so set it to null\n"
        )
    assert checked(monkeypatch, capsys, tmp_path, distill={"student": {**STUDENT, "vocab_size": 300}}) == ""
    (tmp_path / "inputs/llama").mkdir(parents=True)
    (tmp_path / "inputs/llama/config.json").write_text(json.dumps(LLAMA))
    student = {**STUDENT, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 300}
    sections = {"model": {"init_from": "hf:inputs/llama"}, "distill": {"init": "teacher", "student": student}}
    err = checked(monkeypatch, capsys, tmp_path, **sections)
    vocab = LLAMA["vocab_size"]
    assert err.startswith(
        f"error: distill.student.vocab_size: 300 differs from the teacher's (hf:inputs/llama) vocab_size, {vocab}; "
    ), err
    sections["distill"]["student"]["vocab_size"] = vocab
    assert checked(monkeypatch, capsys, tmp_path, **sections) == ""


def test_check_refuses_a_tensor_axis_that_splits_no_heads(monkeypatch, capsys, tmp_path):
    """mesh.tensor splits the attention heads, key/value heads and MLP width: one that does not divide them
    (the weights would stay whole on every device, silently) fails at check, for the model and the student."""
    tail = "; the tensor axis splits the attention heads, key/value heads and MLP width"
    err = checked(monkeypatch, capsys, tmp_path, mesh={"tensor": 3})  # the micro model: 4 heads, 2 kv heads
    assert err.startswith(f"error: mesh.tensor: 3 does not divide model.n_heads, 4{tail} (model.n_heads,"), err
    err = checked(monkeypatch, capsys, tmp_path, mesh={"tensor": 4})
    assert err.startswith(f"error: mesh.tensor: 4 does not divide model.n_kv_heads, 2{tail}"), err
    student = {**STUDENT, "d_ff": 33}
    err = checked(monkeypatch, capsys, tmp_path, mesh={"tensor": 2}, distill={"student": student})
    assert err.startswith(f"error: mesh.tensor: 2 does not divide distill.student.d_ff, 33{tail}"), err
    (tmp_path / "inputs/llama").mkdir(parents=True)
    (tmp_path / "inputs/llama/config.json").write_text(json.dumps(LLAMA))  # 2 heads, 1 kv head
    sections = {"model": {"init_from": "hf:inputs/llama"}, "distill": {"init": "scratch", "student": STUDENT}}
    err = checked(monkeypatch, capsys, tmp_path, mesh={"tensor": 2}, **sections)
    assert err.startswith(
        f"error: mesh.tensor: 2 does not divide the checkpoint's (hf:inputs/llama) n_kv_heads, 1{tail}"
    )
    for tensor in (1, -1):
        assert checked(monkeypatch, capsys, tmp_path, mesh={"tensor": tensor}, **sections) == ""
    assert checked(monkeypatch, capsys, tmp_path, mesh={"tensor": 2}) == ""


@pytest.mark.parametrize(
    ("section", "key", "nowhere", "large"),
    [
        ("pack", "seq_len", 10**12, 10**8),  # pack's shard buffers: one process's, however many are launched
        ("pack", "rows_per_shard", 10**12, 10**8),
        ("benchmark", "matmul_size", 10**7, 10**6),  # the benchmark: one device
        ("data", "num_documents", 10**14, 10**11),  # the synthetic corpus, generated whole by one process
    ],
)
def test_check_refuses_a_size_no_machine_holds(monkeypatch, capsys, tmp_path, section, key, nowhere, large):
    """A size one process or device must hold that exceeds any machine's memory (64 TiB) is refused at
    check, naming its key; one beyond this machine's alone stays a warning: the stage may run elsewhere."""
    err = checked(monkeypatch, capsys, tmp_path, **{section: {key: nowhere}})
    assert err.startswith(f"error: {section}.{key}: ") and err.endswith(
        ", more than any one machine holds (65,536.0 GiB); lower it\n"
    ), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dvc.yaml", "inputs", "params.yaml"]  # nothing written
    monkeypatch.setattr("stagelm.infra.memory.host_available", lambda: 8 << 30)  # an 8 GiB machine
    assert checked(monkeypatch, capsys, tmp_path, **{section: {key: large}}) == ""
    assert "warning: " in capsys.readouterr().out


def test_check_names_a_size_beyond_a_float(monkeypatch, capsys, tmp_path):
    """params.yaml's ints have no bound: a figure too large for a float is still one line, not an OverflowError."""
    err = checked(monkeypatch, capsys, tmp_path, pack={"seq_len": 10**400})
    assert err.startswith("error: pack.seq_len: pack (a shard's buffers) needs about 1.4e+394 GiB, more than"), err


ARGUMENTS = [  # (argv, the one line argparse's finding becomes)
    ([], "stagelm: the following arguments are required: command; see `stagelm --help`"),
    (["chek"], "stagelm: argument command: invalid choice: 'chek' (choose from 'check', "),
    (["check", "--bogus"], "stagelm check: unrecognized arguments: --bogus; see `stagelm check --help`"),
    (["generate"], "stagelm generate: the following arguments are required: model_dir, --prompt; see `stagelm"),
    (["serve", "m", "--port", "x"], "stagelm serve: argument --port: invalid int value: 'x'; see `stagelm serve"),
    (["export-gguf", "m"], "stagelm export-gguf: the following arguments are required: out_file; see"),
    (["preset", "a", "b"], "stagelm preset: unrecognized arguments: b; see `stagelm preset --help`"),
    (["import-hf", "a", "b", "--force"], "stagelm import-hf: unrecognized arguments: --force; see `stagelm import-hf"),
]


@pytest.mark.parametrize(("argv", "words"), ARGUMENTS, ids=[" ".join(a) or "none" for a, _ in ARGUMENTS])
def test_argument_errors_are_one_line_naming_the_command(monkeypatch, capsys, tmp_path, argv, words):
    """argparse's findings in any subcommand read as every other error: one line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert stagelm(monkeypatch, capsys, *argv).startswith(f"error: {words}")
    assert not list(tmp_path.iterdir())


def test_help_is_still_argparse_own(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["stagelm", "serve", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: stagelm serve [-h]") and "--slots SLOTS" in out


def test_a_stage_scripts_argument_error_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_in_process([sys.executable, str(ROOT / "stages/pretrain.py"), "--train", "x"], capsys)
    assert code == 2 and err == (
        "error: pretrain.py: the following arguments are required: --val, --tokenizer, --out, --checkpoints; "
        "see `pretrain.py --help`\n"
    )
    assert not list(tmp_path.iterdir())
