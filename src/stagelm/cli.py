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
stagelm generate <model dir> --prompt ... [--chat]
    stream a completion in the terminal.
stagelm serve <model dir> [--host 127.0.0.1] [--port 8000]
    an OpenAI-compatible server (chat and text completions, streamed or not) with a
    chat page at /, on the KV-cache engine (see stagelm.infer.serve).
stagelm import-hf | import-gguf <checkpoint> <model dir>;  stagelm export-hf | export-gguf <model dir> <out>
    checkpoints from elsewhere in, and a model out to transformers and llama.cpp.
stagelm lm-eval --model_args pretrained=<model dir>[,batch_size=N] --tasks ... [any lm_eval flag]
    EleutherAI's lm-evaluation-harness on stagelm's engine: lm-eval's own command line with
    `--model stagelm` implied (the `eval` extra; stagelm.measure.harness).
stagelm lineage <artifact>;  stagelm inspect <run dir>
    where an artifact came from; what one run directory holds.
stagelm params [--markdown] [--params params.yaml]
    every key of params.yaml with its default and meaning; --markdown prints the
    reference page docs/params.md is (stagelm.pipeline.paramsdoc).
stagelm preset [<name>]
    the `-S section.key=value` flags of a preset for `dvc exp run $(stagelm preset <name>)`
    (sizes, dtype, remat and batch measured for a device; stagelm.pipeline.presets); with no
    name, the presets and what each is for.
stagelm deps stages/<stage>.py [-- flags]
    print the code deps and params of that stage as dvc.yaml should list them (the
    pipeline test checks dvc.yaml against the same computation); flags such as
    `-- --control` drop the keys the script leaves unread with them.

Each command is a parser builder (`add_<command>`) and the function it runs; the work is
the library's. `stagelm launch` starts every pack and training stage, so this module
imports little at the top and each command its own modules.
"""

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from stagelm.infra.errors import OneLineParser, StagelmError, run_main


def path_arg(text: str) -> Path:
    """A path argument; an empty one is refused (Path("") would be the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a file or folder")
    return Path(text)


def check(args: argparse.Namespace) -> None:
    from stagelm.data.manifests import check_manifest_files
    from stagelm.infra.files import sha256_file
    from stagelm.pipeline.config import SECTIONS
    from stagelm.pipeline.dvcfile import pipeline_vars
    from stagelm.pipeline.params import fine_tuning_warnings, read_params, require_inputs, validate_params
    from stagelm.tasks import require_family_sets

    sections = validate_params(read_params(args.params))
    require_family_sets(sections["data"], sections["grpo"], sections["dpo"])
    require_inputs(sections["data"])
    checkpoint = init_checkpoint(sections)
    estimates = memory_estimates(sections, checkpoint)  # refuses a size no machine holds
    print(f"ok: {args.params}: seed and sections {', '.join(SECTIONS)} are valid")
    print("".join(line + "\n" for line in fine_tuning_warnings(sections)), end="")
    print_estimates(sections, estimates)
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


def init_checkpoint(sections: dict) -> Any:
    """The DecoderConfig of the checkpoint `model.init_from` names (its config alone), or None (from scratch);
    the distill student and mesh.tensor are checked against it, the SFT model's shape (the params stage checks
    them against the model section's when there is none)."""
    init_from = sections["model"].init_from
    if init_from is None:
        return None
    from stagelm.interop.checkpoint import checkpoint_config, checkpoint_source
    from stagelm.pipeline.params import require_prunable_student, require_student_vocab, require_tensor_split

    checkpoint = checkpoint_config(checkpoint_source(init_from))[0]
    require_prunable_student(sections["distill"], checkpoint, f"the teacher's ({init_from}) ")
    require_student_vocab(sections["distill"], checkpoint.vocab_size, f"the teacher's ({init_from}) ")
    require_tensor_split(sections["mesh"], checkpoint, f"the checkpoint's ({init_from}) ")
    return checkpoint


def memory_estimates(sections: dict, checkpoint: Any) -> dict[str, int]:
    """The memory each stage will ask for, by what it is spent on, `checkpoint` the DecoderConfig of
    model.init_from's checkpoint (or None). A figure one process or device must hold whatever the mesh
    (the data stages', the benchmark's) is refused, naming its key, when no machine holds it; beyond
    this machine's memory alone it is a warning (`print_estimates`): the stage may run on another."""
    from stagelm.data.footprint import data_stage_estimates
    from stagelm.infra.memory import require_one_machine
    from stagelm.model.footprint import stage_estimates

    estimates = {**data_stage_estimates(sections), **stage_estimates(sections, checkpoint)}
    for what, (need, key) in estimates.items():
        if key is not None:
            require_one_machine(need, key, what)
    return {what: need for what, (need, _) in estimates.items()}


def print_estimates(sections: dict, estimates: dict[str, int]) -> None:
    """An ok or warning line for each stage's memory (and the synthetic corpus's disk) against this machine."""
    from stagelm.data.download import synthetic_corpus_bytes
    from stagelm.infra.memory import HEADROOM, gib, host_available

    if sections["data"].source == "synthetic":
        disk, free = synthetic_corpus_bytes(sections["data"])[1], shutil.disk_usage(".").free
        fits = "ok" if disk <= free else "warning"
        print(f"{fits}: download (the synthetic corpus on disk): about {gib(disk)} of {gib(free)}")
    have = host_available()
    for what, need in estimates.items():
        fits = have is None or need + HEADROOM <= have
        print(f"{'ok' if fits else 'warning'}: {what}: about {gib(need)}" + (f" of {gib(have)}" if have else ""))


def add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="validate params.yaml and the data manifests that exist")
    p.add_argument("--params", default="params.yaml", type=path_arg)
    p.add_argument("--pipeline", default="dvc.yaml", type=path_arg)
    p.set_defaults(func=check)


def add_launch(sub: argparse._SubParsersAction) -> None:
    def launch(args: argparse.Namespace) -> None:
        from stagelm.pipeline.launch import launch

        launch(args.stage_command)

    p = sub.add_parser("launch", help="run a pack or training stage command behind params.yaml's launch.command")
    p.add_argument("stage_command", nargs=argparse.REMAINDER)
    p.set_defaults(func=launch)


def generate(args: argparse.Namespace) -> None:
    import jax

    from stagelm.infer.generate import Sampling, load_generator, stream_text

    if args.max_new_tokens < 1:
        raise StagelmError(f"--max-new-tokens: expected a positive int, got {args.max_new_tokens}")
    if not 0 <= args.seed < 2**32:
        raise StagelmError(f"--seed: expected an int in [0, 2**32), got {args.seed}")
    try:
        args.prompt.encode()
    except UnicodeEncodeError:  # bytes the terminal's locale could not decode reach Python as surrogates
        raise StagelmError("--prompt: not UTF-8 text; pass the prompt as UTF-8") from None
    try:  # validates before the model loads
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except StagelmError as err:  # named as the flag: `top_p: ...` → `--top-p: ...`
        key, rest = str(err).split(":", 1)
        raise StagelmError(f"--{key.replace('_', '-')}:{rest}") from None
    gen = load_generator(args.model_dir)
    ids = gen.chat.user_prompt(args.prompt) if args.chat else gen.chat.text(args.prompt)
    tokens = gen.stream(ids, args.max_new_tokens, sampling, jax.random.key(args.seed), chat=args.chat)
    for piece in stream_text(gen, tokens):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a model directory")
    p.add_argument("model_dir", type=path_arg)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=generate)


def add_lineage(sub: argparse._SubParsersAction) -> None:
    def lineage(args: argparse.Namespace) -> None:
        from stagelm.pipeline.lineage import chain, format_chain

        print(format_chain(chain(Path(args.lock), args.artifact)))

    p = sub.add_parser("lineage", help="trace an artifact back to the raw data")
    p.add_argument("artifact")
    p.add_argument("--lock", default="dvc.lock")
    p.set_defaults(func=lineage)


def add_inspect(sub: argparse._SubParsersAction) -> None:
    def inspect(args: argparse.Namespace) -> None:
        from stagelm.pipeline.dvcfile import pipeline_vars
        from stagelm.pipeline.lineage import inspect_run

        root = Path(pipeline_vars(Path(args.pipeline)).get("checkpoints_dir", "runs/.checkpoints"))
        print(inspect_run(Path(args.run_dir), root))

    p = sub.add_parser("inspect", help="summarise one stage run directory")
    p.add_argument("run_dir")
    p.add_argument("--pipeline", default="dvc.yaml", type=path_arg)
    p.set_defaults(func=inspect)


def add_params(sub: argparse._SubParsersAction) -> None:
    def params(args: argparse.Namespace) -> None:
        from stagelm.pipeline import paramsdoc

        print((paramsdoc.markdown if args.markdown else paramsdoc.plain)(args.params), end="")

    p = sub.add_parser("params", help="list every params.yaml key with its default and meaning")
    p.add_argument("--markdown", action="store_true", help="print the reference page (docs/params.md)")
    p.add_argument("--params", default="params.yaml", type=path_arg, help="the file whose values are shown as defaults")
    p.set_defaults(func=params)


def add_preset(sub: argparse._SubParsersAction) -> None:
    def preset(args: argparse.Namespace) -> None:
        from stagelm.pipeline.presets import PRESETS, describe, flags

        if args.name is None:
            for name in PRESETS:
                print(f"{name}: {describe(name)}")
            return
        print(" ".join(flags(args.name)))

    p = sub.add_parser("preset", help="print a preset's -S flags for dvc exp run, or list the presets")
    p.add_argument("name", nargs="?")
    p.set_defaults(func=preset)


def add_deps(sub: argparse._SubParsersAction) -> None:
    def deps(args: argparse.Namespace) -> None:
        from stagelm.pipeline.deps import render

        script = Path(args.script)
        if not script.is_file() or script.suffix != ".py":
            raise StagelmError(f"{args.script}: no such stage script; give one of stages/*.py, from the project root")
        print(render(script, Path.cwd(), args.flags), end="")

    p = sub.add_parser("deps", help="print a stage script's code deps and params as dvc.yaml lists them")
    p.add_argument("script")
    p.add_argument("flags", nargs="*", help="the stage's flags that change what it reads, e.g. --control")
    p.set_defaults(func=deps)


def add_export_hf(sub: argparse._SubParsersAction) -> None:
    def export_hf(args: argparse.Namespace) -> None:
        from stagelm.interop.hf_export import export_hf
        from stagelm.pipeline.dvcfile import refuse_dvc_output

        refuse_dvc_output(args.out_dir, "export-hf")  # the export@ stages write there through the library
        out = export_hf(args.model_dir, args.out_dir)  # refuses its source, a file, or a folder of other files
        print(f"export-hf: {args.model_dir} → {out} (LlamaForCausalLM; model.safetensors, tokenizer, chat template)")

    p = sub.add_parser("export-hf", help="write a model directory as a transformers Llama checkpoint")
    p.add_argument("model_dir", type=path_arg)
    p.add_argument("out_dir", type=path_arg)
    p.set_defaults(func=export_hf)


def add_export_gguf(sub: argparse._SubParsersAction) -> None:
    def export_gguf(args: argparse.Namespace) -> None:
        from stagelm.interop.gguf_export import check_gguf_target, export_gguf
        from stagelm.pipeline.dvcfile import refuse_dvc_output

        check_gguf_target(args.model_dir, args.out_file)  # a folder, or inside the model: refused, --force or not
        if args.out_file.exists() and not args.force:
            raise StagelmError(f"{args.out_file}: exists; give another path, or --force to replace it")
        refuse_dvc_output(args.out_file, "export-gguf")
        out = export_gguf(args.model_dir, args.out_file, args.dtype)
        print(f"export-gguf: {args.model_dir} → {out} (llama, {args.dtype} matrices; tokenizer and chat template)")

    p = sub.add_parser("export-gguf", help="write a model directory as a llama GGUF file for llama.cpp")
    p.add_argument("model_dir", type=path_arg)
    p.add_argument("out_file", type=path_arg)
    p.add_argument("--dtype", default="float32", help="float32, float16, bfloat16, q8_0 or q4_0 (the matrices)")
    p.add_argument("--force", action="store_true", help="replace out_file if it exists")
    p.set_defaults(func=export_gguf)


def add_imports(sub: argparse._SubParsersAction) -> None:
    def import_checkpoint(args: argparse.Namespace) -> None:
        from stagelm.interop.import_target import import_into
        from stagelm.model.decoder import count_params

        found = import_into(args.source, args.out_dir)
        template = "its chat template" if found.chat["template"] else "no chat template (text only)"
        size = f"{count_params(found.model):,} params, context {found.context}"
        print(f"import: {args.source} → {args.out_dir} ({size}; {template})")

    for name, what in (("import-hf", "a transformers Llama folder (or a GGUF file)"), ("import-gguf", "a GGUF file")):
        p = sub.add_parser(name, help=f"read {what} into a model directory, with its tokenizer and chat template")
        p.add_argument("source", type=path_arg)
        p.add_argument("out_dir", type=path_arg)
        p.set_defaults(func=import_checkpoint)


def serve(args: argparse.Namespace) -> None:
    from stagelm.infer.serve import MAX_QUEUE, MAX_SLOTS, serve

    if not 1 <= args.slots <= MAX_SLOTS:
        raise StagelmError(f"--slots: expected 1 to {MAX_SLOTS} requests decoded together, got {args.slots}")
    if not 0 <= args.queue <= MAX_QUEUE:
        raise StagelmError(f"--queue: expected 0 to {MAX_QUEUE} requests waiting for a slot, got {args.queue}")
    if not 0 < args.header_timeout < 3600:
        raise StagelmError(f"--header-timeout: expected seconds in (0, 3600), got {args.header_timeout}")
    if args.name is not None and not args.name.strip():
        raise StagelmError("--name: expected a non-empty name")
    if any(not host.strip() for host in args.allow_host):  # "" would answer requests that name no host
        raise StagelmError("--allow-host: expected a host name, got ''")
    hosts = tuple(args.allow_host)
    serve(args.model_dir, args.host, args.port, args.slots, args.queue, args.name, hosts, args.header_timeout)


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API")
    p.add_argument("model_dir", type=path_arg)
    p.add_argument("--host", default="127.0.0.1", help="loopback unless told otherwise")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=16, help="requests decoded together")
    p.add_argument("--queue", type=int, default=64, help="requests waiting for a slot; beyond that 429")
    p.add_argument("--name", help="the model's name in the API (default: the directory as given)")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        help="a Host name to answer besides loopback's (repeatable); bound elsewhere, only these when given",
    )
    p.add_argument("--header-timeout", type=float, default=10.0, help="seconds to send a request's head")
    p.set_defaults(func=serve)


def lm_eval(args: argparse.Namespace) -> None:
    from stagelm.pipeline.params import lm_eval_installed

    if not lm_eval_installed():
        raise StagelmError("lm-eval: not installed; pip install -e '.[eval]' (EleutherAI's lm-evaluation-harness)")
    from stagelm.measure.harness import run_cli

    run_cli(args.lm_eval_args)


LM_EVAL = "lm-eval"  # its arguments are lm-eval's, passed on whole (argparse would read its flags as ours)


def add_lm_eval(sub: argparse._SubParsersAction) -> None:
    help_text = "lm-evaluation-harness on a model directory: lm_eval's flags, --model stagelm implied"
    p = sub.add_parser(LM_EVAL, help=help_text, add_help=False)  # --help is lm-eval's own
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lm_eval)


# In the order `stagelm --help` lists them.
COMMANDS = (
    add_check,
    add_launch,
    add_generate,
    add_lineage,
    add_inspect,
    add_params,
    add_preset,
    add_deps,
    add_export_hf,
    add_serve,
    add_imports,
    add_export_gguf,
    add_lm_eval,
)


def main() -> None:
    parser = OneLineParser(prog="stagelm", description="stagelm: what DVC does not do")  # its subcommands' too
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    if sys.argv[1:2] == [LM_EVAL]:
        args = argparse.Namespace(func=lm_eval, lm_eval_args=sys.argv[2:])
    else:
        args, extra = parser.parse_known_args()
        if extra:  # said by the subcommand, so the line names it (parse_args says `stagelm: ...`)
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    run_main(lambda: args.func(args), interrupted=None)  # a command, not a stage: no rerun to speak of


if __name__ == "__main__":
    main()
