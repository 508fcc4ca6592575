"""The `stagelm` command: what DVC does not do.

stagelm check [--params params.yaml] [--pipeline dvc.yaml]
    validate every params section and every data manifest that exists, in seconds,
    before any compute is spent.
stagelm launch <stage command>
    run a stage's command behind params.yaml's `launch.command` (dvc.yaml's pack and
    training stages start this way). Empty, the command runs as it is; a cluster
    wrapper such as `srun --nodes=2 --ntasks-per-node=4` starts it on every task and
    blocks until they all end, so `dvc repro` on the head node waits for the job. It sets
    SLURM_KILL_BAD_EXIT=1 unless set: a task that fails ends its step at once.
    `launch` is an execution setting: no stage lists it, so it reruns nothing.
stagelm serve <model dir> [--host 127.0.0.1] [--port 8000]
    an OpenAI-compatible server (chat and text completions, streamed or not) with a
    chat page at /, on the KV-cache engine (see stagelm.infer.serve).
stagelm params [--markdown] [--params params.yaml]
    every key of params.yaml with its default and meaning; --markdown prints the
    reference page docs/params.md is (stagelm.pipeline.paramsdoc).
stagelm deps stages/<stage>.py [-- flags]
    print the code deps and params of that stage as dvc.yaml should list them (the
    pipeline test checks dvc.yaml against the same computation); flags such as
    `-- --control` drop the keys the script leaves unread with them.
"""

import argparse
import os
import shlex
import shutil
from pathlib import Path

from stagelm.infra.errors import StagelmError, run_main
from stagelm.infra.files import read_json_object, sha256_file
from stagelm.pipeline.config import SECTIONS, require_inputs
from stagelm.pipeline.params import load_section, read_params, read_yaml, validate_params


def pipeline_vars(pipeline: Path) -> dict[str, str]:
    """The `vars` of dvc.yaml (paths are named there once)."""
    if not pipeline.is_file():
        raise StagelmError(f"{pipeline}: not found; run from the project root or pass --pipeline")
    doc = read_yaml(pipeline) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), dict):
        raise StagelmError(f"{pipeline}: not a DVC pipeline (no `stages` mapping); give --pipeline the project's one")
    merged: dict[str, str] = {}
    for entry in doc.get("vars", []) if isinstance(doc.get("vars"), list) else []:
        if isinstance(entry, dict):
            merged.update({k: v for k, v in entry.items() if isinstance(v, str)})
    return merged


def check_manifest_files(directory: Path, key: str, producer: str) -> dict:
    """The manifest of a data folder, after checking that it exists, that every file it
    lists has its sha256 and that no shard it does not list lies beside them."""
    # Not `dvc checkout --force`: it restores the cache's bytes, and those may be the damaged ones.
    fix = f"rebuild it with `dvc repro -f {producer}`"
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        raise StagelmError(f"{directory}: no manifest.json, so its files are not a finished {producer}; {fix}")
    manifest = read_json_object(manifest_path, fix)
    entries = manifest.get(key)
    entries = list(entries.values()) if isinstance(entries, dict) else entries
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "file" in e and "sha256" in e for e in entries):
        raise StagelmError(f"{manifest_path}: no `{key}` list of files with sha256; {fix}")
    for entry in entries:
        path = directory / entry["file"]
        if not path.is_file():
            raise StagelmError(f"{path}: listed in {manifest_path} but missing; {fix}")
        if sha256_file(path) != entry["sha256"]:
            raise StagelmError(f"{path}: sha256 differs from {manifest_path}; {fix}")
    listed = {e["file"] for e in entries}
    unlisted = sorted(p.name for p in directory.glob("*.arrow") if p.name not in listed)
    if unlisted:
        raise StagelmError(f"{directory}: shards {unlisted[:3]} are not in its manifest.json (a pack stopped?); {fix}")
    return manifest


def check(args: argparse.Namespace) -> None:
    params = read_params(args.params)
    sections = validate_params(params)
    from stagelm.tasks import require_family_sets

    require_family_sets(sections["data"], sections["grpo"])
    require_inputs(sections["data"])
    print(f"ok: {args.params}: seed and sections {', '.join(SECTIONS)} are valid")
    fine_tuning_rates(sections)
    print_estimates(sections)
    paths = pipeline_vars(Path(args.pipeline))
    raw = Path(paths.get("raw_dir", "data/raw"))
    if raw.is_dir():
        n = len(check_manifest_files(raw, "files", "download")["files"])
        print(f"ok: {raw}: {n} files match manifest.json")
    tokenizer = Path(paths.get("tokenizer_dir", "data/tokenizer")) / "tokenizer.json"
    packed = Path(paths.get("packed_dir", "data/packed"))
    for split in sorted(p for p in packed.iterdir() if p.is_dir()) if packed.is_dir() else []:
        manifest = check_manifest_files(split, "shards", "pack")
        if tokenizer.is_file() and manifest.get("tokenizer_sha256") != sha256_file(tokenizer):
            raise StagelmError(
                f"{split}: packed with another tokenizer than {tokenizer}; run `dvc repro pack`, "
                f"or `dvc checkout {packed} {tokenizer.parent}` to restore the pair dvc.lock records"
            )
        print(f"ok: {split}: {len(manifest['shards'])} shards match manifest.json")


# Peak learning rates above these are a from-scratch recipe's: on a trained checkpoint one update
# at the default training.lr (3e-3) took SmolLM2-135M's loss from 2.41 to 13.93 (issue 47).
FINE_TUNING_LR = {"training": 3e-4, "sft": 3e-4, "distill": 3e-4, "grpo": 1e-4}


def fine_tuning_rates(sections: dict) -> None:
    """A warning line for each section whose peak rate would wreck a trained checkpoint (`model.init_from`),
    pointing at the fine-tuning preset (docs/huggingface.md)."""
    if sections["model"].init_from is None:
        return
    for name, ceiling in FINE_TUNING_LR.items():
        cfg = sections[name]
        wide = name == "sft" and cfg.method == "lora"  # adapters start at zero: a LoRA rate may be higher
        if cfg.lr > ceiling * (10 if wide else 1):
            print(
                f"warning: {name}.lr: {cfg.lr:g} is a from-scratch rate, and model.init_from starts from a trained "
                "checkpoint; use the fine-tuning preset (docs/huggingface.md#fine-tuning-a-checkpoint)"
            )


def print_estimates(sections: dict) -> None:
    """The memory the stages will ask for, by arithmetic on params.yaml (the vocabulary at its
    cap), against what this machine has: a warning line for each that does not fit."""
    from types import SimpleNamespace

    from stagelm.data.pack import pack_buffer_bytes
    from stagelm.infra.memory import HEADROOM, gib, host_available
    from stagelm.model.footprint import (
        benchmark_bytes,
        generation_bytes,
        param_count,
        train_step_bytes,
        training_state_bytes,
    )

    model, vocab, seq = sections["model"], sections["tokenizer"].vocab_size, sections["pack"].seq_len
    shape = SimpleNamespace(
        **model.shape(), vocab_size=vocab, dtype=model.dtype, head_dim=model.d_model // model.n_heads
    )
    n = param_count(vocab, **model.shape(), tie_embeddings=model.tie_embeddings)
    ev, grpo, bench = sections["eval"], sections["grpo"], sections["benchmark"]
    prompt = 64  # a generous prompt width for the task families' prompts
    rollout = grpo.prompts_per_step * grpo.group_size // grpo.grad_accum
    estimates = {
        "model (parameters, gradients, Adam's moments)": training_state_bytes(n, model.param_dtype),
        "pretrain (a train step's activations)": train_step_bytes(shape, sections["training"].batch_size, seq),
        "pack (a shard's buffers)": pack_buffer_bytes(sections["pack"].rows_per_shard, seq + 1),
        "eval (generation)": generation_bytes(shape, ev.task_batch_size, prompt, ev.max_new_tokens),
        "grpo (sampling a rollout)": generation_bytes(shape, rollout, prompt, grpo.max_new_tokens),
        **{f"benchmark ({key})": need for key, need in benchmark_bytes(bench).items()},
    }
    data = sections["data"]
    if data.source == "synthetic":
        from stagelm.data.download import synthetic_corpus_bytes

        memory, disk = synthetic_corpus_bytes(data)
        estimates["download (the synthetic corpus, generated in memory)"] = memory
        free = shutil.disk_usage(".").free
        fits = disk <= free
        print(
            f"{'ok' if fits else 'warning'}: download (the synthetic corpus on disk): about {gib(disk)} of {gib(free)}"
        )
    have = host_available()
    for what, need in estimates.items():
        fits = have is None or need + HEADROOM <= have
        print(f"{'ok' if fits else 'warning'}: {what}: about {gib(need)}" + (f" of {gib(have)}" if have else ""))


def launch(args: argparse.Namespace) -> None:
    command = args.stage_command
    if not command:
        raise StagelmError("launch: give the stage command, e.g. `stagelm launch python stages/pretrain.py ...`")
    params_file = command[command.index("--params") + 1] if "--params" in command[:-1] else "params.yaml"
    argv = shlex.split(load_section(read_params(params_file), "launch").command) + command
    # srun's default, when one task of a step fails, is to wait for the others: peers stuck in a
    # collective wait forever. Ask it to end the step at once (a --kill-on-bad-exit in the command wins).
    os.environ.setdefault("SLURM_KILL_BAD_EXIT", "1")
    try:
        os.execvp(argv[0], argv)  # the stage (or the wrapper) replaces this process: signals reach it directly
    except OSError as err:
        raise StagelmError(f"launch.command: cannot run {argv[0]!r} ({err.strerror}); fix launch.command") from None


def generate(args: argparse.Namespace) -> None:
    import sys

    import jax

    from stagelm.infer.generate import Sampling, load_generator

    if args.max_new_tokens < 1:
        raise StagelmError(f"--max-new-tokens: expected a positive int, got {args.max_new_tokens}")
    if not 0 <= args.seed < 2**32:
        raise StagelmError(f"--seed: expected an int in [0, 2**32), got {args.seed}")
    try:
        args.prompt.encode()
    except UnicodeEncodeError:  # bytes the terminal's locale could not decode reach Python as surrogates
        raise StagelmError("--prompt: not UTF-8 text; pass the prompt as UTF-8") from None
    sampling = Sampling(args.temperature, args.top_k, args.top_p)  # validates before the model loads
    gen = load_generator(args.model_dir)
    tok = gen.tokenizer
    ids = gen.chat.user_prompt(args.prompt) if args.chat else gen.chat.text(args.prompt)
    out: list[int] = []
    shown = ""
    for token in gen.stream(ids, args.max_new_tokens, sampling, jax.random.key(args.seed), chat=args.chat):
        out.append(token)
        text = tok.decode(out, skip_special_tokens=False)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(tok.decode(out, skip_special_tokens=False)[len(shown) :] + "\n")


def lineage(args: argparse.Namespace) -> None:
    from stagelm.pipeline.lineage import chain, format_chain

    print(format_chain(chain(Path(args.lock), args.artifact)))


def inspect(args: argparse.Namespace) -> None:
    from stagelm.pipeline.lineage import inspect_run

    root = Path(pipeline_vars(Path(args.pipeline)).get("checkpoints_dir", "runs/.checkpoints"))
    print(inspect_run(Path(args.run_dir), root))


def params(args: argparse.Namespace) -> None:
    from stagelm.pipeline import paramsdoc

    print((paramsdoc.markdown if args.markdown else paramsdoc.plain)(args.params), end="")


def deps(args: argparse.Namespace) -> None:
    from stagelm.pipeline.deps import render

    script = Path(args.script)
    if not script.is_file() or script.suffix != ".py":
        raise StagelmError(f"{args.script}: no such stage script; give one of stages/*.py, from the project root")
    print(render(script, Path.cwd(), args.flags), end="")


def dvc_output_at(target: Path) -> str | None:
    """The DVC stage (or .dvc file) whose output `target` is, lies inside or holds; None if
    none, or when `target` is in no DVC project. A command writing there behind DVC's back
    would change what dvc.lock records."""
    resolved = target.resolve()
    root = next((p for p in (resolved, *resolved.parents) if (p / ".dvc").is_dir()), None)
    if root is None:
        return None
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            outs = [(Path(str(o.fs_path)), getattr(o.stage, "name", None) or o.stage.relpath) for o in repo.index.outs]
    except DvcException as err:
        raise StagelmError(f"{root / 'dvc.yaml'}: DVC cannot read it ({err}), so {target} cannot be checked") from None
    for out, stage in outs:
        if resolved == out or resolved.is_relative_to(out) or out.is_relative_to(resolved):
            return stage
    return None


def refuse_dvc_output(target: Path, command: str) -> None:
    stage = dvc_output_at(target)
    if stage is not None:
        raise StagelmError(
            f"{target}: holds or is a DVC-tracked output (of {stage}); give {command} a folder outside DVC's outputs"
        )


def export_hf(args: argparse.Namespace) -> None:
    from stagelm.interop.hf_export import export_hf

    refuse_dvc_output(args.out_dir, "export-hf")  # the export@ stages write there through the library
    out = export_hf(args.model_dir, args.out_dir)  # refuses its source, a file, or a folder of other files
    print(f"export-hf: {args.model_dir} → {out} (LlamaForCausalLM; model.safetensors, tokenizer, chat template)")


def export_gguf(args: argparse.Namespace) -> None:
    from stagelm.interop.gguf_export import export_gguf

    if args.out_file.is_dir():
        raise StagelmError(f"{args.out_file}: a folder; give export-gguf the path of the .gguf file to write")
    refuse_dvc_output(args.out_file, "export-gguf")
    out = export_gguf(args.model_dir, args.out_file, args.dtype)
    print(f"export-gguf: {args.model_dir} → {out} (llama, {args.dtype} matrices; tokenizer and chat template)")


def check_import_target(out_dir: Path) -> None:
    """Refuse a target that is a file, a DVC output, or a folder holding anything but a
    previous import (a stagelm model directory's files), which the import replaces."""
    from stagelm.data.tokenizer import CHAT_FILE
    from stagelm.model.modeldir import PARAMS_FILE

    if out_dir.exists() and not out_dir.is_dir():
        raise StagelmError(f"{out_dir}: a file, not a folder; give import-hf a new or empty folder to write")
    refuse_dvc_output(out_dir, "import-hf")
    if not out_dir.is_dir():
        return
    mine = ("config.json", PARAMS_FILE, "tokenizer.json", CHAT_FILE)
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in mine)
    config = out_dir / "config.json"
    if not others and config.is_file() and "params_sha256" not in read_json_object(config, "move it away"):
        others = ["config.json"]  # a config.json of someone else's, not a stagelm model's
    if others:
        raise StagelmError(
            f"{out_dir}: holds {others[:3]}, not only a previous import; give import-hf a new or empty folder"
        )


def import_checkpoint(args: argparse.Namespace) -> None:
    from stagelm.interop.checkpoint import read_checkpoint
    from stagelm.model.decoder import count_params
    from stagelm.model.modeldir import save_model

    check_import_target(args.out_dir)
    found = read_checkpoint(args.source)
    model, context = found.model, found.context
    extra = {"params_count": count_params(model), "context_len": context, "imported_from": str(args.source)}
    save_model(args.out_dir, model, found.tokenizer_file or found.tokenizer, extra, chat=found.chat)
    template = "its chat template" if found.chat["template"] else "no chat template (text only)"
    print(f"import: {args.source} → {args.out_dir} ({count_params(model):,} params, context {context}; {template})")


def serve(args: argparse.Namespace) -> None:
    from stagelm.infer.serve import serve

    if args.slots < 1 or args.queue < 0:
        raise StagelmError("--slots: expected at least 1 (and --queue at least 0)")
    if not 0 < args.header_timeout < 3600:
        raise StagelmError(f"--header-timeout: expected seconds in (0, 3600), got {args.header_timeout}")
    if args.name is not None and not args.name.strip():
        raise StagelmError("--name: expected a non-empty name")
    serve(
        args.model_dir,
        args.host,
        args.port,
        args.slots,
        args.queue,
        args.name,
        tuple(args.allow_host),
        args.header_timeout,
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="stagelm", description="stagelm: what DVC does not do")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="validate params.yaml and the data manifests that exist")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--pipeline", default="dvc.yaml")
    p.set_defaults(func=check)
    la = sub.add_parser("launch", help="run a pack or training stage command behind params.yaml's launch.command")
    la.add_argument("stage_command", nargs=argparse.REMAINDER)
    la.set_defaults(func=launch)
    g = sub.add_parser("generate", help="stream a completion from a model directory")
    g.add_argument("model_dir", type=Path)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=generate)
    lin = sub.add_parser("lineage", help="trace an artifact back to the raw data")
    lin.add_argument("artifact")
    lin.add_argument("--lock", default="dvc.lock")
    lin.set_defaults(func=lineage)
    ins = sub.add_parser("inspect", help="summarise one stage run directory")
    ins.add_argument("run_dir")
    ins.add_argument("--pipeline", default="dvc.yaml")
    ins.set_defaults(func=inspect)
    pr = sub.add_parser("params", help="list every params.yaml key with its default and meaning")
    pr.add_argument("--markdown", action="store_true", help="print the reference page (docs/params.md)")
    pr.add_argument("--params", default="params.yaml", help="the file whose values are shown as defaults")
    pr.set_defaults(func=params)
    dp = sub.add_parser("deps", help="print a stage script's code deps and params as dvc.yaml lists them")
    dp.add_argument("script")
    dp.add_argument("flags", nargs="*", help="the stage's flags that change what it reads, e.g. --control")
    dp.set_defaults(func=deps)
    ex = sub.add_parser("export-hf", help="write a model directory as a transformers Llama checkpoint")
    ex.add_argument("model_dir", type=Path)
    ex.add_argument("out_dir", type=Path)
    ex.set_defaults(func=export_hf)
    sv = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API")
    sv.add_argument("model_dir", type=Path)
    sv.add_argument("--host", default="127.0.0.1", help="loopback unless told otherwise")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--slots", type=int, default=16, help="requests decoded together")
    sv.add_argument("--queue", type=int, default=64, help="requests waiting for a slot; beyond that 429")
    sv.add_argument("--name", help="the model's name in the API (default: the directory as given)")
    sv.add_argument(
        "--allow-host",
        action="append",
        default=[],
        help="a Host name to answer besides loopback's (repeatable); bound elsewhere, only these when given",
    )
    sv.add_argument("--header-timeout", type=float, default=10.0, help="seconds to send a request's head")
    sv.set_defaults(func=serve)
    for name, what in (("import-hf", "a transformers Llama folder (or a GGUF file)"), ("import-gguf", "a GGUF file")):
        im = sub.add_parser(name, help=f"read {what} into a model directory, with its tokenizer and chat template")
        im.add_argument("source", type=Path)
        im.add_argument("out_dir", type=Path)
        im.set_defaults(func=import_checkpoint)
    eg = sub.add_parser("export-gguf", help="write a model directory as a llama GGUF file for llama.cpp")
    eg.add_argument("model_dir", type=Path)
    eg.add_argument("out_file", type=Path)
    eg.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (the matrices)")
    eg.set_defaults(func=export_gguf)
    args = parser.parse_args()
    run_main(lambda: args.func(args), interrupted=None)  # a command, not a stage: no rerun to speak of


if __name__ == "__main__":
    main()
