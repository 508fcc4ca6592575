"""stagelm's lm-eval model on a micro model: packed and prefix-shared scoring ≡ each request alone,
rolling windows ≡ lm-eval's, generation ≡ the generator's, few compiles, and bad input in one line."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, env_with_venv, micro_decoder

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the eval extra (pip install -e '.[eval]'; make test does)")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval_tasks import write_tasks  # noqa: E402  (tests/measure/)

from stagelm.infer.scoring import pack_rows, share_prefixes  # noqa: E402
from stagelm.infra.errors import StagelmError  # noqa: E402
from stagelm.measure.harness import StagelmLM, lm_eval_argv, metrics_of, resolve_tasks  # noqa: E402
from stagelm.model.modeldir import save_model  # noqa: E402

CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(micro_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("harness") / "model"
    save_model(
        out, micro_decoder(micro_data)[0], micro_data / "tokenizer/tokenizer.json", extra={"context_len": CONTEXT}
    )
    return out


@pytest.fixture(scope="module")
def lm(model_dir) -> StagelmLM:
    return StagelmLM(str(model_dir), batch_size=4)


def request(kind: str, args: tuple, i: int = 0) -> Instance:
    return Instance(kind, {}, args, i, metadata=("t", i, 1))


def alone(lm: StagelmLM, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """A request scored on its own, by a full forward pass of the model's own call."""
    whole = context + continuation
    tokens = jnp.asarray([whole[:-1]])
    logits = lm.model(tokens, jnp.ones_like(tokens), jnp.arange(len(whole) - 1)[None])[0]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    at = [len(context) - 1 + j for j in range(len(continuation))]
    return float(sum(logp[a, t] for a, t in zip(at, continuation, strict=True))), all(
        int(jnp.argmax(logits[a])) == t for a, t in zip(at, continuation, strict=True)
    )


PAIRS = [
    ("Once upon a time,", " Mia found a kite"),
    ("Work out 23 plus 58:", " 3"),
    ("Work out 23 plus 58:", " 4"),  # the same input as the one above: one row computes both
    ("Work out 23 plus 58:", " 3 plus 8 is 11"),  # the inputs above are a prefix of this one
    ("Tom saw a big red", " kite near the river and ran"),
    ("", "Once upon a time"),  # empty context: conditioned on the prefix token
] * 3


def test_packed_prefix_shared_scores_are_each_request_alone(lm):
    out = lm.loglikelihood([request("loglikelihood", p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)
    for (context, continuation), (logp, greedy) in zip(PAIRS, out, strict=True):
        if context:
            ctx, cont = lm._encode_pair(context, continuation)
        else:
            ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation)
        ref_logp, ref_greedy = alone(lm, ctx, cont)
        assert logp == pytest.approx(ref_logp, abs=2e-4) and greedy == ref_greedy


def test_prefixes_ride_in_the_row_of_their_longest_extension_and_rows_pack_tightly():
    inputs = [(1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 5), (2,), (1, 2)]
    host = share_prefixes(inputs)
    assert host[(1, 2)] == host[(1, 2, 3)] == (1, 2, 3, 4) and host[(1, 5)] == (1, 5) and host[(2,)] == (2,)
    rows = pack_rows([5, 3, 2, 4, 1, 1], width=6)
    assert sorted(i for r in rows for i in r) == list(range(6)) and len(rows) == 3
    assert all(sum([5, 3, 2, 4, 1, 1][i] for i in r) <= 6 for r in rows)


def test_a_task_of_many_requests_compiles_the_scorer_a_handful_of_times(model_dir):
    lm = StagelmLM(str(model_dir), batch_size=8)
    rng = np.random.default_rng(0)
    pairs = [(f"Work out {a} plus {b}:", f" {a + b}.") for a, b in rng.integers(0, 99, (300, 2))]
    lm.loglikelihood([request("loglikelihood", p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    assert lm.scorer._score._cache_size() <= 2  # one row width; the query count of the last batch may differ


def test_rolling_loglikelihood_is_lm_evals_windows_scored_alone(lm, model_dir):
    text = "Once upon a time, Mia found a red kite near the river. " * 9
    short = StagelmLM(str(model_dir), batch_size=4, max_length=16)
    [ours] = short.loglikelihood_rolling([request("loglikelihood_rolling", (text,))], disable_tqdm=True)
    tokens = short.tok_encode(text)
    windows = lm_utils.get_rolling_token_windows(tokens, short.prefix_token_id, 16, 1)
    expected = sum(alone(short, c, t)[0] for c, t in map(lm_utils.make_disjoint_window, windows))
    assert len(tokens) > 3 * 16 and ours == pytest.approx(expected, abs=1e-3)
    [whole] = lm.loglikelihood_rolling([request("loglikelihood_rolling", (text[:60],))], disable_tqdm=True)
    assert whole == pytest.approx(alone(lm, [lm.prefix_token_id], lm.tok_encode(text[:60]))[0], abs=2e-4)


def test_generation_is_the_generators_greedy_answer_cut_at_the_first_stop_sequence(lm):
    prompts = ["Once upon a time,", "Work out 23 plus 58:", "Tom saw a big red kite near the river and"]
    kwargs = {"until": ["."], "max_gen_toks": 12, "do_sample": False}
    together = lm.generate_until([request("generate_until", (p, kwargs), i) for i, p in enumerate(prompts)])
    for prompt, text in zip(prompts, together, strict=True):
        [completion] = lm.gen.generate([lm.tok_encode(prompt)], 12)
        assert text == lm.tok.decode(completion.tokens, skip_special_tokens=True).split(".")[0]
        [again] = lm.generate_until([request("generate_until", (prompt, kwargs))])
        assert again == text  # a batch gives each prompt what it gets alone


def test_the_chat_template_renders_the_models_own_format(lm):
    text = lm.apply_chat_template([{"role": "user", "content": "What is 41 plus 17?"}])
    assert lm.tok_encode(text) == lm.chat.user_prompt("What is 41 plus 17?")  # its markers read as tokens
    fresh = StagelmLM(str(lm.folder), batch_size=1)
    assert "<|user|>" in text and len(fresh.tok_encode(text)) > len(lm.tok_encode(text))  # plain text: text


def test_a_request_past_the_context_is_refused_naming_task_and_document(lm):
    long = "Once upon a time, " * 40
    with pytest.raises(StagelmError, match=r"^lm-eval task t doc 7: \d+ tokens, beyond the model's context of 64"):
        lm.loglikelihood([request("loglikelihood", (long, " end"), 7)], disable_tqdm=True)
    with pytest.raises(StagelmError, match=r"beyond the model's context of 64"):
        lm.generate_until([request("generate_until", (long, {"until": ["."]}))])


def test_simple_evaluate_gives_each_task_its_metrics_with_standard_errors(model_dir, tmp_path):
    tasks = write_tasks(tmp_path / "inputs" / "tasks", n_mc=20, n_gen=5)
    specs = resolve_tasks([str(p) for p in tasks.values()], tmp_path / "inputs")
    results = simple_evaluate(
        model=StagelmLM(str(model_dir), batch_size=8), tasks=specs, task_manager=TaskManager(include_defaults=False)
    )
    figures = metrics_of(results)
    assert set(figures) == {"arith_mc", "count_gen", "prose_ppl"}
    assert set(figures["arith_mc"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "samples"}
    assert figures["arith_mc"]["samples"] == 20 and 0 <= figures["arith_mc"]["acc"] <= 1
    assert figures["prose_ppl"]["bits_per_byte"] > 0 and "bits_per_byte_stderr" not in figures["prose_ppl"]  # N/A
    json.dumps(figures)  # metrics.json holds them as they are


def test_task_yamls_outside_data_inputs_or_reading_data_outside_are_refused(tmp_path):
    inside = write_tasks(tmp_path / "inputs" / "tasks", n_mc=2, n_gen=2)
    outside = write_tasks(tmp_path / "elsewhere", n_mc=2, n_gen=2)
    with pytest.raises(StagelmError, match=r"^eval\.lm_eval_tasks: .*arith_mc\.yaml lies outside data\.inputs"):
        resolve_tasks([str(outside["arith_mc"])], tmp_path / "inputs")
    moved = tmp_path / "inputs" / "tasks" / "moved.yaml"
    moved.write_text(outside["arith_mc"].read_text())  # the YAML inside, its data outside
    with pytest.raises(
        StagelmError, match=r"moved\.yaml: its data .*elsewhere/arith_mc\.jsonl lie outside data\.inputs"
    ):
        resolve_tasks([str(moved)], tmp_path / "inputs")
    with pytest.raises(StagelmError, match=r"^eval\.lm_eval_tasks: .*nowhere\.yaml is not a file"):
        resolve_tasks([str(tmp_path / "inputs" / "nowhere.yaml")], tmp_path / "inputs")
    assert resolve_tasks([str(inside["arith_mc"]), "hellaswag"], tmp_path / "inputs")[1] == "hellaswag"


def stagelm(*args: str, cwd: Path, prelude: str = "pass") -> subprocess.CompletedProcess:
    code = f"import sys; {prelude}; from stagelm.cli import main; sys.argv = ['stagelm', *sys.argv[1:]]; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env_with_venv(), capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_stagelm_lm_eval_is_lm_evals_command_line_with_the_model_implied(model_dir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks", n_mc=8, n_gen=2)
    args = ["lm-eval", "--model_args", f"pretrained={model_dir},batch_size=4", "--tasks", str(tasks["arith_mc"])]
    done = stagelm(*args, "--output_path", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "|arith_mc|" in done.stdout and "acc_norm" in done.stdout
    [written] = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(written.read_text())["results"]["arith_mc"]["acc,none"] >= 0
    unknown = stagelm("lm-eval", "--model_args", f"pretrained={model_dir}", "--tasks", "no_such_task", cwd=tmp_path)
    assert unknown.returncode != 0 and unknown.stderr.strip().splitlines()[-1].startswith("error: lm-eval: ")
    assert "no_such_task" in unknown.stderr.strip().splitlines()[-1]
    missing = stagelm(*args, cwd=tmp_path, prelude="sys.modules['lm_eval'] = None")
    assert missing.returncode != 0
    assert (
        missing.stderr.strip()
        == "error: lm-eval: not installed; pip install -e '.[eval]' (EleutherAI's lm-evaluation-harness)"
    )


def test_lm_eval_reads_the_model_arguments_and_refuses_unknown_ones(model_dir):
    lm = StagelmLM.create_from_arg_string(f"pretrained={model_dir},batch_size=3,max_length=32", {"batch_size": 64})
    assert lm.batch_size == 3 and lm.max_length == 32  # --model_args win over lm-eval's own flags
    with pytest.raises(StagelmError, match=r"^--model_args: \['dtype'\] unknown to the stagelm model"):
        StagelmLM.create_from_arg_string(f"pretrained={model_dir},dtype=bfloat16")
    with pytest.raises(StagelmError, match=r"^pretrained=.*: not a stagelm model folder"):
        StagelmLM(str(ROOT / "docs"))
    with pytest.raises(StagelmError, match=r"^--model_args: pretrained=<model dir> is required"):
        StagelmLM.create_from_arg_string("batch_size=4")
    with pytest.raises(StagelmError, match=r"^--limit: expected a positive count .*, got '-1'"):
        lm_eval_argv(["--model_args", f"pretrained={model_dir}", "--tasks", "t", "--limit", "-1"])
    assert lm_eval_argv(["--tasks", "t", "--limit", "0.5"])[:4] == ["lm-eval", "run", "--model", "stagelm"]
