"""lm-eval on SmolLM2-135M-Instruct: stagelm's engine against lm-eval's own transformers model.

The wheel's GGUF file is imported (`stagelm import-gguf`) and exported (`stagelm export-hf`,
float32); lm-eval then scores the same offline tasks with `StagelmLM` on the import and with
`--model hf` on the export. Every loglikelihood agrees within 1e-3 nats, every rolling
loglikelihood within 1e-3 nats per document, and the accuracy of a 200-item multiple-choice
task and the exact match of a 50-item generation task (and of 20 of its items in the chat template) are
equal. Both engines run once, in a module fixture.
"""

import sys

import pytest
from conftest import ROOT, run

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="torch is a test-only interop dependency (pip install -e '.[interop]')")
pytest.importorskip("transformers", reason="transformers is a test-only interop dependency")
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the eval extra (pip install -e '.[eval]')")

sys.path.insert(0, str(ROOT / "tests/measure"))
from lm_eval_tasks import write_tasks  # noqa: E402
from test_real_model import gguf_file  # noqa: E402, F401  (the wheel's GGUF file, or a skip naming the install)

# Both engines' max_length: 24 tokens split each paragraph into rolling windows; in the chat
# template (its system prompt alone is 20 tokens) 96.
CONTEXT = {False: 24, True: 96}


@pytest.fixture(scope="module")
def runs(gguf_file, tmp_path_factory):  # noqa: F811
    """{engine: {task: [per-document responses]}, engine + "_metrics": lm-eval's results}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from stagelm.measure.harness import StagelmLM

    work = tmp_path_factory.mktemp("lm_eval_real")
    run(["stagelm", "import-gguf", str(gguf_file), str(work / "smollm2")], work)
    run(["stagelm", "export-hf", str(work / "smollm2"), str(work / "hf")], work)
    tasks = [str(p) for p in write_tasks(work / "tasks").values()]
    out = {}
    for engine in ("stagelm", "hf"):
        for chat in (False, True):
            if engine == "stagelm":
                model, args = StagelmLM(str(work / "smollm2"), batch_size=32, max_length=CONTEXT[chat]), None
            else:
                model, args = "hf", f"pretrained={work / 'hf'},dtype=float32,batch_size=32,max_length={CONTEXT[chat]}"
            results = simple_evaluate(
                model=model,
                model_args=args,
                tasks=tasks if not chat else [t for t in tasks if t.endswith("count_gen.yaml")],
                limit=20 if chat else None,  # the template adds 20 tokens a prompt: 20 answers suffice
                task_manager=TaskManager(include_defaults=False),
                apply_chat_template=chat,
                log_samples=True,
                device="cpu",
            )
            name = f"{engine}_chat" if chat else engine
            out[name] = {task: sorted(s, key=lambda s: s["doc_id"]) for task, s in results["samples"].items()}
            out[name + "_metrics"] = results["results"]
    return out


def scores(samples: list[dict]) -> list[float]:
    return [r[0][0] if isinstance(r[0], tuple | list) else r[0] for s in samples for r in s["resps"]]


def test_every_loglikelihood_is_transformers_within_a_thousandth_of_a_nat(runs):
    ours, theirs = scores(runs["stagelm"]["arith_mc"]), scores(runs["hf"]["arith_mc"])
    assert len(ours) == len(theirs) == 400
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3
    greedy = [r[0][1] for s in runs["stagelm"]["arith_mc"] for r in s["resps"]]
    assert greedy == [r[0][1] for s in runs["hf"]["arith_mc"] for r in s["resps"]]


def test_every_rolling_loglikelihood_is_transformers_within_a_thousandth_of_a_nat(runs):
    ours, theirs = scores(runs["stagelm"]["prose_ppl"]), scores(runs["hf"]["prose_ppl"])
    assert len(ours) == len(theirs) == 6
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


@pytest.mark.parametrize("metric", ["acc,none", "acc_norm,none"])
def test_the_multiple_choice_accuracy_is_transformers(runs, metric):
    assert runs["stagelm_metrics"]["arith_mc"][metric] == runs["hf_metrics"]["arith_mc"][metric]
    assert runs["stagelm_metrics"]["arith_mc"][metric] > 0.55  # it knows some sums: two choices, a real signal


@pytest.mark.parametrize("chat", [False, True])
def test_generation_answers_and_exact_match_are_transformers(runs, chat):
    ours, theirs = runs["stagelm_chat" if chat else "stagelm"], runs["hf_chat" if chat else "hf"]
    assert [s["resps"] for s in ours["count_gen"]] == [s["resps"] for s in theirs["count_gen"]]
    ours = runs["stagelm_chat_metrics" if chat else "stagelm_metrics"]["count_gen"]["exact_match,none"]
    assert ours == runs["hf_chat_metrics" if chat else "hf_metrics"]["count_gen"]["exact_match,none"]
    assert ours > 0.5 or chat  # it counts on; in its chat template it may answer in words
