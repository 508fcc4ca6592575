"""Offline lm-eval tasks the tests write: task YAMLs whose data are jsonl files beside them.

- `arith_mc`: multiple choice, `a+b=` with two answers, the right one and one off by one
  (acc and acc_norm): the answers share all but their last token, as many tasks' choices do;
- `count_gen`: counting on, `a, a+1, a+2,` answered by generation up to a newline or a
  comma (exact_match: a task a 135M model mostly gets right);
- `prose_ppl`: short paragraphs scored whole (loglikelihood_rolling: word and byte
  perplexity, bits per byte).
"""

import json
import random
from pathlib import Path

MC = """task: arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN = """task: count_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", ","]
  max_gen_toks: {new}
  do_sample: false
metric_list:
  - metric: exact_match
    regexes_to_ignore: [" "]
"""

PPL = """task: prose_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""

PARAGRAPHS = [
    "The river ran past the old mill, where the miller's children played every evening until the lamps were lit.",
    "A small robot learned to count by watching the rain fall on the window, one drop at a time, all afternoon.",
    "In the spring the orchard filled with bees, and the farmer sold honey at the market on the square.",
    "She opened the letter slowly. It was from her brother, who had sailed north three winters ago.",
    "Bread needs flour, water, salt and time; the oven does the rest while the baker sleeps.",
    "Once upon a time, a fox and a crow argued about who could see farther from the top of the hill.",
]


def write_tasks(folder: Path, n_mc: int = 200, n_gen: int = 50, new_tokens: int = 4, seed: int = 0) -> dict[str, Path]:
    """The three task YAMLs and their data in `folder` (created); {task name: YAML path}."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    questions = []
    for _ in range(max(n_mc, n_gen)):
        a, b = rng.randint(1, 60), rng.randint(1, 39)
        questions.append((f"{a}+{b}=", a + b))
    mc = []
    for q, answer in questions[:n_mc]:
        wrong = answer + (1 if answer % 10 < 9 else -1)
        choices = [str(answer), str(wrong)]  # lm-eval puts its target_delimiter, a space, before each
        rng.shuffle(choices)
        mc.append({"question": q, "choices": choices, "label": choices.index(str(answer))})
    starts = [rng.randint(1, 300) for _ in range(n_gen)]
    gen = [{"question": f"{a}, {a + 1}, {a + 2},", "answer": str(a + 3)} for a in starts]
    ppl = [{"text": t} for t in PARAGRAPHS]
    out = {}
    for name, rows, template, extra in (
        ("arith_mc", mc, MC, {}),
        ("count_gen", gen, GEN, {"new": new_tokens}),
        ("prose_ppl", ppl, PPL, {}),
    ):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        path = folder / f"{name}.yaml"
        path.write_text(template.format(data=data.resolve(), **extra))
        out[name] = path
    return out
