"""EleutherAI's lm-evaluation-harness on stagelm's own engine: the `stagelm` model of lm-eval.

    stagelm lm-eval --model_args pretrained=runs/sft/model,batch_size=64 --tasks arc_easy
    lm_eval.simple_evaluate(model=StagelmLM("runs/sft/model"), tasks=[...])    # the Python API

`StagelmLM` answers lm-eval's three request types for any model folder the lab reads
(trained here, or imported from transformers or GGUF), on whatever device JAX has:

- `loglikelihood` (multiple choice, cloze): every request's input, its context and
  continuation less the last token, is scored by `stagelm.infer.scoring.Scorer`: inputs
  that are a prefix of another ride in its row (a multiple-choice item whose choices differ
  in their last token costs one input), the rest are packed into rows with no padding,
  and only the positions read go through the output layer.
- `loglikelihood_rolling` (perplexity): lm-eval's own rolling windows, scored the same way.
- `generate_until`: `stagelm.infer.generate.Generator`'s KV-cached loop, in batches of
  similar prompt lengths, stopping at the end-of-sequence token (and the end of turn under
  a chat template), at a newline when `\\n` is a stop sequence, and cut at the first stop
  sequence after, as lm-eval's transformers model does.

Tokenization follows lm-eval's transformers model: text is encoded without special tokens,
after bos when the tokenizer starts text with it (`chat.json`'s add_bos_token), and a
request with an empty context is conditioned on bos (else eos). Text is always text: only
a rendering of the model's own chat template (`--apply_chat_template`) has its special
tokens read as tokens. A request longer than the model's context (`max_length`, default
the trained context) is refused, never truncated; a generation is cut at that context.

The class registers itself with lm-eval as `stagelm` when this module is imported, as
lm-eval's own models do.
"""

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tokenizers import Tokenizer

from stagelm.data.chatformat import load_chat_format
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import Generator, Sampling
from stagelm.infer.scoring import Scored, Scorer
from stagelm.infra.errors import StagelmError
from stagelm.model.modeldir import load_model, read_model_context


@register_model("stagelm")
class StagelmLM(TemplateLM):
    """A stagelm model folder as an lm-eval model (`pretrained`: the folder; `batch_size`: rows of
    a forward pass and prompts generated together; `max_length`: the longest request in tokens,
    default the model's trained context; `max_gen_toks`: a generation's default length)."""

    def __init__(
        self,
        pretrained: str,
        batch_size: int | str = 16,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 0,
        device: str | None = None,  # lm-eval passes its --device; JAX places the work on its default device
        max_batch_size: int | None = None,  # lm-eval's, for batch_size=auto
        **unknown: Any,
    ):
        super().__init__()
        if unknown:
            raise StagelmError(
                f"--model_args: {sorted(unknown)} unknown to the stagelm model; it takes pretrained, batch_size, "
                "max_length, max_gen_toks and seed"
            )
        folder = Path(str(pretrained))
        if not (folder / "config.json").is_file():
            raise StagelmError(f"pretrained={pretrained}: not a stagelm model folder (no config.json); give one")
        self.batch_size = self._batch_size(batch_size, max_batch_size)
        self.model = load_model(folder)
        self.tok = load_tokenizer(folder / "tokenizer.json")
        self.chat = load_chat_format(self.tok, folder)
        trained = read_model_context(folder)
        self._max_length = int(max_length) if max_length is not None else trained
        self.max_gen_toks, self.seed, self.folder = int(max_gen_toks), int(seed), folder
        if self._max_length < 2 or self.max_gen_toks < 1:
            raise StagelmError("--model_args: max_length must be >= 2 and max_gen_toks >= 1")
        self.chat_rendered = False  # set once lm-eval renders a prompt with the chat template
        # The tokenizer that reads special tokens' spellings as the tokens (a template's own copy, or
        # one of stagelm's format, whose markers are added tokens), for those renderings only.
        self.marked = self.chat.marked if self.chat.spec is not None else Tokenizer.from_str(self.tok.to_str())
        self.marked.encode_special_tokens = False
        self._instances: dict[int, Instance] = {}  # the loglikelihood requests being scored, to name one
        self.scorer = Scorer(self.model, self.batch_size, self._max_length)
        self.gen = Generator(self.model, self.tok, self._max_length, self.chat)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> "StagelmLM":
        """lm-eval's construction from --model_args and its own flags (--batch_size, --device ...):
        a key given in --model_args wins over the same flag."""
        if "pretrained" not in arg_dict:
            raise StagelmError("--model_args: pretrained=<model dir> is required; give the stagelm model folder")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "StagelmLM":
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @staticmethod
    def _batch_size(value: int | str, most: int | None) -> int:
        text = str(value)
        if text.startswith("auto"):  # no probing of memory: lm-eval's bound, else a size that fits a CPU
            return int(most) if most else 16
        if not text.isdigit() or int(text) < 1:
            raise StagelmError(f"--model_args batch_size: expected a positive integer or auto, got {value!r}")
        return int(text)

    # --- what lm-eval reads ------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.chat.eos

    @property
    def prefix_token_id(self) -> int:
        return self.chat.bos if self.chat.bos is not None else self.chat.eos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.folder).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not chat_template:
            return None
        return self.chat.template if self.chat.spec is not None else "stagelm"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's own chat rendering of `chat_history`: its template's text, or stagelm's format."""
        self.chat_rendered = True
        if self.chat.spec is not None:
            return self.chat.render(chat_history, add_generation_prompt)
        messages = [dict(m) for m in chat_history]
        if messages and messages[0]["role"] == "system":  # stagelm's format has no system turn
            raise StagelmError(
                "--system_instruction: stagelm's own chat format has no system turn; leave it out for this model"
            )
        ids = self.chat.prompt(messages) if add_generation_prompt else self.chat.conversation(messages)[0]
        return self.tok.decode(ids, skip_special_tokens=False)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        encoder = self.marked if self.chat_rendered else self.tok  # a rendering's special tokens are tokens
        ids = encoder.encode(string, add_special_tokens=False).ids
        bos = self.chat.bos
        wants_bos = add_special_tokens if add_special_tokens is not None else self.chat.add_bos
        if add_special_tokens is None and bos is not None and string.startswith(self.tok.decode([bos], False)):
            wants_bos = False  # the text already starts with it (lm-eval's has_bos_prefix)
        return [bos, *ids] if wants_bos and bos is not None and self.chat.add_bos else ids

    # --- loglikelihood ---------------------------------------------------------------------

    def _too_long(self, request: Any, length: int) -> StagelmError:
        where = f"task {request.task_name} doc {request.doc_id}" if isinstance(request, Instance) else "a request"
        return StagelmError(
            f"lm-eval {where}: {length} tokens, beyond the model's context of {self._max_length}; lower the task's "
            "few-shot count or pass --model_args max_length=N to run the model past its trained context"
        )

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        items = []
        for i, (_, context, continuation) in enumerate(requests):
            whole = list(context) + list(continuation)
            if len(whole) - 1 > self._max_length:
                raise self._too_long(self._instances.get(i), len(whole) - 1)
            start = len(whole) - 1 - len(continuation)
            items.append(Scored(tuple(whole[:-1]), [(i, start + j, t) for j, t in enumerate(continuation)]))
        if not items:
            return []
        logp, greedy = self.scorer.score(items, len(items))
        out = [(float(a), bool(b)) for a, b in zip(logp, greedy, strict=True)]
        for (key, _, _), answer in zip(requests, out, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._instances = dict(enumerate(requests))  # to name a request that is too long
        try:
            return super().loglikelihood(requests, disable_tqdm)
        finally:
            self._instances = {}

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, request in enumerate(requests):
            (string,) = request.args
            tokens = self.tok_encode(string)
            rolling = lm_utils.get_rolling_token_windows(
                token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self._max_length, context_len=1
            )
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owner.append(n)
        scores = np.zeros(len(requests))
        if windows:
            for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
                scores[n] += logp
        out = [float(s) for s in scores]
        for request, score in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, score)
        return out

    # --- generation ----------------------------------------------------------------------

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            eos = self.tok.decode([self.eot_token_id], skip_special_tokens=False)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            contexts = {i: self.tok_encode(requests[i].args[0]) for i in members}
            for i, ids in contexts.items():
                if len(ids) >= self._max_length:
                    raise self._too_long(requests[i], len(ids))
            order = sorted(members, key=lambda i: -len(contexts[i]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                texts = self._generate([contexts[i] for i in chunk], kwargs, until, start)
                for i, text in zip(chunk, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return [text or "" for text in out]

    def _generate(self, prompts: list[list[int]], kwargs: dict, until: list[str], start: int) -> list[str]:
        longest = max(len(p) for p in prompts)
        max_new = min(int(kwargs["max_gen_toks"]), self._max_length - longest)
        sampling = Sampling()
        if kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0)) > 0:
            sampling = Sampling(
                temperature=float(kwargs.get("temperature", 1.0)),
                top_k=int(kwargs.get("top_k") or 0),
                top_p=float(kwargs.get("top_p") or 1.0),
            )
        key = jax.random.fold_in(jax.random.key(self.seed), start)
        completions = self.gen.generate(
            prompts,
            max_new,
            sampling,
            key,
            chat=self.chat_rendered,
            stop_at_newline="\n" in until,
            batch=self.batch_size,
        )
        texts = [self.tok.decode(c.tokens, skip_special_tokens=True) for c in completions]
        return [postprocess_generated_text(t, until, None) for t in texts]


def lm_eval_argv(args: list[str]) -> list[str]:
    """lm-eval's command line for `stagelm lm-eval ARGS`: `run --model stagelm ARGS` (or a
    subcommand other than run, as given)."""
    if args and args[0] in ("ls", "validate"):
        return ["lm-eval", *args]
    rest = args[1:] if args and args[0] == "run" else args
    if rest and rest[0] in ("-h", "--help"):
        return ["lm-eval", "run", "--help"]
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        raise StagelmError("--model: implied (stagelm); give the model folder as --model_args pretrained=<dir>")
    for flag, value in zip(rest, rest[1:], strict=False):
        if flag == "--limit" and not positive_number(value):
            raise StagelmError(f"--limit: expected a positive count (or a fraction in (0, 1]), got {value!r}")
    return ["lm-eval", "run", "--model", "stagelm", *rest]


def positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def run_cli(args: list[str]) -> None:
    """`stagelm lm-eval ARGS`: lm-eval's own command line with `--model stagelm` implied."""
    import yaml
    from lm_eval.__main__ import cli_evaluate

    argv = lm_eval_argv(args)
    saved = sys.argv
    sys.argv = argv
    try:
        cli_evaluate()
    except (ValueError, KeyError, FileNotFoundError, AssertionError, yaml.YAMLError) as err:
        raise StagelmError(f"lm-eval: {one_line(err)}") from None
    finally:
        sys.argv = saved


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:400]


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """lm-eval's figures by task, as stagelm's metrics.json keeps them: `<metric>` and
    `<metric>_stderr` (the filter `none`'s), or under `<filter>` for a task's other filters;
    `samples`, the documents scored."""
    out: dict[str, dict[str, Any]] = {}
    for task, figures in results["results"].items():
        entry: dict[str, Any] = {}
        for key, value in figures.items():
            if "," not in key or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            metric, filt = key.split(",", 1)
            place = entry if filt == "none" else entry.setdefault(filt, {})
            place[metric] = float(value)
        if task in results.get("n-samples", {}):
            entry["samples"] = int(results["n-samples"][task]["effective"])
        out[task] = entry
    return out


# datasets' builders of local files: a task whose dataset_path is one reads its dataset_kwargs' files.
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def task_files(config: dict[str, Any]) -> list[str]:
    """The local paths an lm-eval task config reads its data from (none for a hub dataset)."""
    kwargs = config.get("dataset_kwargs") or {}
    paths: list[str] = []
    files = kwargs.get("data_files")
    for value in files.values() if isinstance(files, dict) else [files]:
        paths += [value] if isinstance(value, str) else [v for v in value or [] if isinstance(v, str)]
    if isinstance(kwargs.get("data_dir"), str):
        paths.append(kwargs["data_dir"])
    dataset = config.get("dataset_path")
    if isinstance(dataset, str) and dataset not in FILE_BUILDERS and Path(dataset).exists():
        paths.append(dataset)  # a local dataset folder or file
    return paths


def resolve_tasks(tasks: Iterable[str], inputs: Path, key: str = "eval.lm_eval_tasks") -> list[str]:
    """The task specs lm-eval takes for `tasks`: registered names as they are, task YAML files
    (`.yaml`/`.yml`) checked to lie, with every data file they read, under `inputs` (which DVC
    hashes), or one line naming the key and the file."""
    from lm_eval.tasks._yaml_loader import load_yaml

    root = inputs.resolve()
    specs = []
    for task in tasks:
        if not task.endswith((".yaml", ".yml")):
            specs.append(task)
            continue
        path = Path(task)
        if not path.is_file():
            raise StagelmError(f"{key}: {task} is not a file; give a task YAML under {inputs} or a task name")
        if not path.resolve().is_relative_to(root):
            raise StagelmError(f"{key}: {task} lies outside data.inputs ({inputs}); move it there so DVC hashes it")
        try:
            config = load_yaml(path, resolve_func=False)
        except Exception as err:  # yaml's errors, an include cycle
            raise StagelmError(f"{task}: not an lm-eval task YAML ({one_line(err)}); fix it") from None
        outside = [f for f in task_files(config) if not Path(f).resolve().is_relative_to(root)]
        if outside:
            raise StagelmError(
                f"{task}: its data {outside[0]} lie outside data.inputs ({inputs}); move them there so DVC hashes them"
            )
        specs.append(str(path))
    return specs


def evaluate_tasks(
    model_dir: Path, tasks: list[str], limit: int | None, inputs: Path, batch_size: int
) -> dict[str, dict[str, Any]]:
    """lm-eval's figures (`metrics_of`) of the model in `model_dir` on `tasks` (names or task
    YAMLs under `inputs`), `limit` documents each (None: all), with the shots each task sets
    and lm-eval's default seeds."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    specs = resolve_tasks(tasks, inputs)
    names = [s for s in specs if not s.endswith((".yaml", ".yml"))]
    manager = TaskManager(include_defaults=bool(names))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise StagelmError(
            f"eval.lm_eval_tasks: {unknown} are not lm-eval tasks; `stagelm lm-eval ls tasks` lists them, or give a "
            "task YAML's path"
        )
    model = StagelmLM(str(model_dir), batch_size=batch_size)
    try:
        results = simple_evaluate(model=model, tasks=specs, limit=limit, task_manager=manager, log_samples=False)
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise StagelmError(f"eval.lm_eval_tasks: lm-eval refused the tasks: {one_line(err)}") from None
    return metrics_of(results)
