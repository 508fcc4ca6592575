"""Bad input against the checkpoint surfaces (import-hf, import-gguf, the exports, generate and
stagelm check), tried as a user would through the CLI: one JSON line per case, then a summary.

    python benchmarks/bad_input_audit.py runs/sft/model [--only NAME ...]

A case starts from good files made from the model directory (`stagelm export-hf` and
`export-gguf`), breaks one thing, runs one `stagelm` command in a fresh process (60 s at most)
and reads what came back. It is handled well when the command exits non-zero (or zero where
the input is fine and the case says so), prints no traceback, says what is wrong in one line
(argparse's usage line beside its error line is allowed), leaves no output behind where none
was, and every file that existed as it was. Whether the line names the file or key at fault
is for the reader: each case's line is printed.
"""

import argparse
import hashlib
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

STAGELM = [sys.executable, "-m", "stagelm.cli"]
ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], cwd: Path, timeout: float = 60.0) -> dict:
    start = time.perf_counter()
    try:
        done = subprocess.run([*STAGELM, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": None, "err": "timeout", "seconds": timeout}
    return {"rc": done.returncode, "err": done.stderr.strip(), "seconds": round(time.perf_counter() - start, 1)}


def digest(path: Path) -> str | None:
    """One hash of a file or a folder's files (None where nothing is)."""
    if not path.exists():
        return None
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_file():
            h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode() + p.read_bytes())
    return h.hexdigest()


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    out = change(data)
    path.write_text(json.dumps(data if out is None else out))


def set_key(path: Path, key: str, value: object) -> None:
    edit_json(path, lambda d: d.__setitem__(key, value))


def rewrite_tensor(folder: Path, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    from safetensors.numpy import load_file, save_file

    [file] = folder.glob("*.safetensors")
    tensors = load_file(file)
    tensors[name] = change(tensors[name])
    save_file(tensors, file)


def patch_gguf_value(path: Path, key: str, kind: str, value: object) -> None:
    """Overwrite a GGUF metadata value in place: the bytes after `key` and its 4-byte type."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key) + 4
    if kind == "str":
        length = struct.unpack_from("<Q", data, at)[0]
        new = str(value).encode()
        assert len(new) == length, "same length only"
        data[at + 8 : at + 8 + length] = new
    else:
        struct.pack_into("<" + kind, data, at, value)
    path.write_bytes(bytes(data))


def cases(hf: Path, gguf: Path, model: Path) -> list[tuple[str, Callable[[Path], list[str]], str]]:
    """(name, set-up returning the command's args in a fresh folder, what is expected: refuse | accept)."""

    def hf_case(change: Callable[[Path], None]) -> Callable[[Path], list[str]]:
        def setup(work: Path) -> list[str]:
            shutil.copytree(hf, work / "hf")
            change(work / "hf")
            return ["import-hf", "hf", "imported"]

        return setup

    def gguf_case(change: Callable[[Path], None]) -> Callable[[Path], list[str]]:
        def setup(work: Path) -> list[str]:
            shutil.copy(gguf, work / "m.gguf")
            change(work / "m.gguf")
            return ["import-gguf", "m.gguf", "imported"]

        return setup

    def model_case(change: Callable[[Path], None], args: list[str]) -> Callable[[Path], list[str]]:
        def setup(work: Path) -> list[str]:
            shutil.copytree(model, work / "model")
            change(work / "model")
            return args

        return setup

    def generate_case(*flags: str) -> Callable[[Path], list[str]]:
        return model_case(lambda m: None, ["generate", "model", "--prompt", "hi", *flags])

    def params_case(text: str) -> Callable[[Path], list[str]]:
        def setup(work: Path) -> list[str]:
            (work / "inputs").mkdir()  # data.inputs, as the repository ships it
            base = (ROOT / "params.yaml").read_text()
            (work / "params.yaml").write_text(base + "\n" + text if text.startswith("#") else text)
            return ["check", "--params", "params.yaml", "--pipeline", str(ROOT / "dvc.yaml")]

        return setup

    def merged_params(section: str, key: str, value: str) -> Callable[[Path], list[str]]:
        def setup(work: Path) -> list[str]:
            import yaml

            (work / "inputs").mkdir()
            params = yaml.safe_load((ROOT / "params.yaml").read_text())
            params[section][key] = yaml.safe_load(value)
            (work / "params.yaml").write_text(yaml.safe_dump(params))
            return ["check", "--params", "params.yaml", "--pipeline", str(ROOT / "dvc.yaml")]

        return setup

    def truncate(path: Path, keep: float = 0.5) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])

    def safetensors_of(folder: Path) -> Path:
        return next(folder.glob("*.safetensors"))

    def header_length(folder: Path, value: int) -> None:
        file = safetensors_of(folder)
        data = bytearray(file.read_bytes())
        struct.pack_into("<Q", data, 0, value)
        file.write_bytes(bytes(data))

    def header_garbage(folder: Path) -> None:
        file = safetensors_of(folder)
        data = bytearray(file.read_bytes())
        data[8:16] = b"{not js\x00"
        file.write_bytes(bytes(data))

    def inf_weight(a: np.ndarray) -> np.ndarray:
        a = a.copy()
        a.flat[3] = np.inf
        return a

    def existing(path: str, what: str = "file") -> Callable[[Path], None]:
        def make(work: Path) -> None:
            if what == "file":
                (work / path).write_text("keep me\n")
            else:
                (work / path).mkdir()
                (work / path / "notes.txt").write_text("keep me\n")

        return make

    def with_existing(setup: Callable[[Path], list[str]], make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
        def both(work: Path) -> list[str]:
            args = setup(work)
            make(work)
            return args

        return both

    cfg = "config.json"
    return [
        # import-hf: config.json
        ("hf: config.json not JSON", hf_case(lambda f: truncate(f / cfg, 0.5)), "refuse"),
        ("hf: config.json a list", hf_case(lambda f: (f / cfg).write_text("[1, 2]")), "refuse"),
        ("hf: config.json missing", hf_case(lambda f: (f / cfg).unlink()), "refuse"),
        ("hf: hidden_size a string", hf_case(lambda f: set_key(f / cfg, "hidden_size", "64")), "refuse"),
        ("hf: num_attention_heads 0", hf_case(lambda f: set_key(f / cfg, "num_attention_heads", 0)), "refuse"),
        (
            "hf: num_attention_heads 3 (no divisor)",
            hf_case(lambda f: set_key(f / cfg, "num_attention_heads", 3)),
            "refuse",
        ),
        ("hf: rms_norm_eps 0", hf_case(lambda f: set_key(f / cfg, "rms_norm_eps", 0)), "refuse"),
        ("hf: max_position_embeddings 0", hf_case(lambda f: set_key(f / cfg, "max_position_embeddings", 0)), "refuse"),
        ("hf: vocab_size below the rows", hf_case(lambda f: set_key(f / cfg, "vocab_size", 10)), "refuse"),
        ("hf: tie_word_embeddings 'yes'", hf_case(lambda f: set_key(f / cfg, "tie_word_embeddings", "yes")), "refuse"),
        ("hf: model_type gpt2", hf_case(lambda f: set_key(f / cfg, "model_type", "gpt2")), "refuse"),
        ("hf: hidden_act gelu", hf_case(lambda f: set_key(f / cfg, "hidden_act", "gelu")), "refuse"),
        ("hf: attention_bias true", hf_case(lambda f: set_key(f / cfg, "attention_bias", True)), "refuse"),
        ("hf: mlp_bias true", hf_case(lambda f: set_key(f / cfg, "mlp_bias", True)), "refuse"),
        ("hf: head_dim against the weights", hf_case(lambda f: set_key(f / cfg, "head_dim", 8)), "refuse"),
        (
            "hf: rope_scaling yarn",
            hf_case(lambda f: set_key(f / cfg, "rope_scaling", {"rope_type": "yarn", "factor": 4.0})),
            "refuse",
        ),
        ("hf: rope_theta a list", hf_case(lambda f: set_key(f / cfg, "rope_theta", [1, 2])), "refuse"),
        ("hf: num_hidden_layers 1.5", hf_case(lambda f: set_key(f / cfg, "num_hidden_layers", 1.5)), "refuse"),
        # import-hf: weights
        ("hf: safetensors truncated", hf_case(lambda f: truncate(safetensors_of(f))), "refuse"),
        ("hf: safetensors header length 2^60", hf_case(lambda f: header_length(f, 2**60)), "refuse"),
        ("hf: safetensors header not JSON", hf_case(header_garbage), "refuse"),
        ("hf: safetensors empty file", hf_case(lambda f: safetensors_of(f).write_bytes(b"")), "refuse"),
        ("hf: no safetensors", hf_case(lambda f: safetensors_of(f).unlink()), "refuse"),
        # a float tensor in another precision is read as float32, as transformers reads it
        (
            "hf: a float64 weight",
            hf_case(lambda f: rewrite_tensor(f, "model.norm.weight", lambda a: a.astype(np.float64))),
            "accept",
        ),
        (
            "hf: an inf weight",
            hf_case(lambda f: rewrite_tensor(f, "model.layers.0.mlp.down_proj.weight", inf_weight)),
            "refuse",
        ),
        (
            "hf: a weight transposed",
            hf_case(
                lambda f: rewrite_tensor(f, "model.layers.0.mlp.down_proj.weight", lambda a: np.ascontiguousarray(a.T))
            ),
            "refuse",
        ),
        # import-hf: tokenizer, chat, generation config, paths
        ("hf: tokenizer.json missing", hf_case(lambda f: (f / "tokenizer.json").unlink()), "refuse"),
        ("hf: tokenizer.json not JSON", hf_case(lambda f: truncate(f / "tokenizer.json", 0.3)), "refuse"),
        (
            "hf: tokenizer.json of another kind",
            hf_case(lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')),
            "refuse",
        ),
        (
            "hf: generation_config.json not JSON",
            hf_case(lambda f: (f / "generation_config.json").write_text("{")),
            "refuse",
        ),
        (
            "hf: chat_template a number",
            hf_case(lambda f: set_key(f / "tokenizer_config.json", "chat_template", 7)),
            "refuse",
        ),
        (
            "hf: chat_template never closes a block",
            hf_case(
                lambda f: set_key(
                    f / "tokenizer_config.json", "chat_template", "{% for m in messages %}{{ m.content }}"
                )
            ),
            "refuse",
        ),
        ("hf: source missing", lambda w: ["import-hf", "nowhere", "imported"], "refuse"),
        (
            "hf: source a text file",
            lambda w: ((w / "x.txt").write_text("hi"), ["import-hf", "x.txt", "imported"])[1],
            "refuse",
        ),
        ("hf: target an existing file", with_existing(hf_case(lambda f: None), existing("imported")), "refuse"),
        (
            "hf: target an existing folder",
            with_existing(hf_case(lambda f: None), existing("imported", "dir")),
            "refuse",
        ),
        (
            "hf: target under a file",
            with_existing(
                lambda w: (shutil.copytree(hf, w / "hf"), ["import-hf", "hf", "afile/imported"])[1], existing("afile")
            ),
            "refuse",
        ),
        ("hf: a good folder", hf_case(lambda f: None), "accept"),
        ("hf: an extra unknown config key", hf_case(lambda f: set_key(f / cfg, "my_note", "hello")), "accept"),
        # import-gguf
        ("gguf: truncated", gguf_case(lambda p: truncate(p)), "refuse"),
        ("gguf: empty file", gguf_case(lambda p: p.write_bytes(b"")), "refuse"),
        ("gguf: random bytes", gguf_case(lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096))), "refuse"),
        (
            "gguf: version 99",
            gguf_case(lambda p: p.write_bytes(p.read_bytes()[:4] + struct.pack("<I", 99) + p.read_bytes()[8:])),
            "refuse",
        ),
        (
            "gguf: architecture llamb",
            gguf_case(lambda p: patch_gguf_value(p, "general.architecture", "str", "llamb")),
            "refuse",
        ),
        ("gguf: block_count 0", gguf_case(lambda p: patch_gguf_value(p, "llama.block_count", "I", 0)), "refuse"),
        ("gguf: block_count 2^31", gguf_case(lambda p: patch_gguf_value(p, "llama.block_count", "I", 2**31)), "refuse"),
        (
            "gguf: head_count 3",
            gguf_case(lambda p: patch_gguf_value(p, "llama.attention.head_count", "I", 3)),
            "refuse",
        ),
        (
            "gguf: embedding_length 65",
            gguf_case(lambda p: patch_gguf_value(p, "llama.embedding_length", "I", 65)),
            "refuse",
        ),
        (
            "gguf: feed_forward_length 7",
            gguf_case(lambda p: patch_gguf_value(p, "llama.feed_forward_length", "I", 7)),
            "refuse",
        ),
        ("gguf: a folder", lambda w: ((w / "d.gguf").mkdir(), ["import-gguf", "d.gguf", "imported"])[1], "refuse"),
        ("gguf: target an existing file", with_existing(gguf_case(lambda p: None), existing("imported")), "refuse"),
        ("gguf: a good file", gguf_case(lambda p: None), "accept"),
        # exports
        (
            "export-gguf: over an existing file",
            with_existing(
                lambda w: (shutil.copytree(model, w / "model"), ["export-gguf", "model", "out.gguf"])[1],
                existing("out.gguf"),
            ),
            "refuse",
        ),
        (
            "export-gguf: --dtype q2_k",
            model_case(lambda m: None, ["export-gguf", "--dtype", "q2_k", "model", "out.gguf"]),
            "refuse",
        ),
        # the file's folders are made, as DVC makes an output's
        (
            "export-gguf: into a missing folder",
            model_case(lambda m: None, ["export-gguf", "model", "no/such/out.gguf"]),
            "accept",
        ),
        (
            "export-gguf: weights truncated",
            model_case(lambda m: truncate(safetensors_of(m)), ["export-gguf", "model", "out.gguf"]),
            "refuse",
        ),
        (
            "export-gguf: config.json missing",
            model_case(lambda m: (m / "config.json").unlink(), ["export-gguf", "model", "out.gguf"]),
            "refuse",
        ),
        (
            "export-gguf: config.json not JSON",
            model_case(lambda m: truncate(m / "config.json"), ["export-gguf", "model", "out.gguf"]),
            "refuse",
        ),
        (
            "export-gguf: tokenizer missing",
            model_case(lambda m: (m / "tokenizer.json").unlink(), ["export-gguf", "model", "out.gguf"]),
            "refuse",
        ),
        (
            "export-gguf: a NaN weight",
            model_case(
                lambda m: rewrite_tensor(m, next(iter(_names(m))), lambda a: np.full_like(a, np.nan)),
                ["export-gguf", "model", "out.gguf"],
            ),
            "refuse",
        ),
        (
            "export-hf: over an existing folder",
            with_existing(
                lambda w: (shutil.copytree(model, w / "model"), ["export-hf", "model", "out"])[1],
                existing("out", "dir"),
            ),
            "refuse",
        ),
        (
            "export-hf: over an existing file",
            with_existing(
                lambda w: (shutil.copytree(model, w / "model"), ["export-hf", "model", "out"])[1], existing("out")
            ),
            "refuse",
        ),
        ("export-hf: the model folder itself", model_case(lambda m: None, ["export-hf", "model", "model"]), "refuse"),
        (
            "export-hf: weights truncated",
            model_case(lambda m: truncate(safetensors_of(m)), ["export-hf", "model", "out"]),
            "refuse",
        ),
        # generate
        *(
            (f"generate: {' '.join(flags)}", generate_case(*flags), "refuse")
            for flags in (
                ("--max-new-tokens", "-1"),
                ("--temperature", "nan"),
                ("--top-p", "2"),
                ("--top-k", "-3"),
                ("--max-new-tokens", "1000000000"),
            )
        ),
        ("generate: model folder missing", lambda w: ["generate", "nomodel", "--prompt", "hi"], "refuse"),
        ("generate: a good prompt", generate_case("--max-new-tokens", "4"), "accept"),
        # stagelm check on params.yaml
        ("params: not a mapping", params_case("- 1\n- 2\n"), "refuse"),
        ("params: not YAML", params_case("training: {lr: [\n"), "refuse"),
        ("params: a python tag", params_case("training: !!python/object/apply:os.system ['true']\n"), "refuse"),
        ("params: training.lr .nan", merged_params("training", "lr", ".nan"), "refuse"),
        ("params: training.lr -1", merged_params("training", "lr", "-1"), "refuse"),
        # YAML 1.1 reads `lr: 3e-4` as a string; the params stage takes it as the number it says
        ("params: training.lr '3e-4' (a string)", merged_params("training", "lr", "'3e-4'"), "accept"),
        ("params: training.lr 'fast'", merged_params("training", "lr", "fast"), "refuse"),
        ("params: training.steps 0", merged_params("training", "steps", "0"), "refuse"),
        ("params: an unknown key training.lrr", merged_params("training", "lrr", "0.1"), "refuse"),
        ("params: pack.seq_len 1", merged_params("pack", "seq_len", "1"), "refuse"),
        ("params: grpo.group_size 1", merged_params("grpo", "group_size", "1"), "refuse"),
        ("params: eval.temperatures [-1]", merged_params("eval", "temperatures", "[-1]"), "refuse"),
        ("params: eval.temperatures ['hot']", merged_params("eval", "temperatures", "['hot']"), "refuse"),
        ("params: model.init_from ftp:x", merged_params("model", "init_from", "ftp:x"), "refuse"),
        ("params: model.init_from hf:../outside", merged_params("model", "init_from", "hf:../outside"), "refuse"),
        ("params: model.dtype float8", merged_params("model", "dtype", "float8"), "refuse"),
        ("params: model.remat everything", merged_params("model", "remat", "everything"), "refuse"),
        ("params: export.gguf_dtype q3_k", merged_params("export", "gguf_dtype", "q3_k"), "refuse"),
        ("params: the defaults", params_case("# the defaults\n"), "accept"),
    ]


def _names(model: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(next(model.glob("*.safetensors"))), "np") as f:
        return [k for k in f.keys() if "norm" not in k]  # noqa: SIM118 - safe_open is not iterable


def judge(
    expect: str, result: dict, before: dict[str, str | None], after: dict[str, str | None], target: str
) -> list[str]:
    """What went wrong, if anything (empty: handled well)."""
    err, rc = result["err"], result["rc"]
    faults = []
    if rc is None:
        return ["hang (60 s)"]
    if "Traceback" in err:
        faults.append("traceback")
    if expect == "refuse":
        if rc == 0:
            faults.append("exit 0")
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
        lines = [line for line in lines if "warn" not in line.lower()]
        if len(lines) != 1:
            faults.append(f"{len(lines)} lines")
        if target and after.get(target) != before.get(target) and before.get(target) is None:
            faults.append(f"left {target}")
    elif rc != 0:
        faults.append(f"refused a good input: {err.splitlines()[-1] if err else rc}")
    changed = [name for name, h in before.items() if h is not None and after.get(name) != h]
    if changed:
        faults.append(f"changed {changed}")
    return faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a stagelm model directory (runs/sft/model)")
    parser.add_argument("--only", nargs="*", help="case names that start with these")
    args = parser.parse_args()
    model = args.model.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        hf, gguf = base / "hf", base / "m.gguf"
        for made, cmd in ((hf, ["export-hf", str(model), str(hf)]), (gguf, ["export-gguf", str(model), str(gguf)])):
            result = run(cmd, base)
            if result["rc"] != 0:
                sys.exit(f"could not make {made.name}: {result['err']}")
        good = 0
        total = 0
        for name, setup, expect in cases(hf, gguf, model):
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            work = base / f"case{total}"
            work.mkdir()
            cmd = setup(work)
            outputs = [a for a in cmd[1:] if not a.startswith("-")][-1:] if cmd[0] != "check" else []
            target = (
                outputs[0] if outputs and cmd[0] in ("import-hf", "import-gguf", "export-gguf", "export-hf") else ""
            )
            names = {p.name for p in work.iterdir()} | ({target.split("/")[0]} if target else set())
            before = {n: digest(work / n) for n in names}
            result = run(cmd, work)
            after = {n: digest(work / n) for n in names}
            faults = judge(expect, result, before, after, target.split("/")[0] if target else "")
            total += 1
            good += not faults
            last = result["err"].splitlines()[-1] if result["err"] else ""
            line = {"case": name, "expect": expect, "rc": result["rc"], "ok": not faults, "faults": faults}
            print(json.dumps(line | {"said": last[:300], "seconds": result.get("seconds")}), flush=True)
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({"cases": total, "handled_well": good, "share": round(good / max(total, 1), 4)}))


if __name__ == "__main__":
    main()
