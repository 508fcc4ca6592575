"""final_answer: a user's graded task from task files alone (GSM8K's rows as they are, or prompt/answer)."""

import json

import pytest
from test_download import collect, data_cfg

from stagelm.data.rawdata import read_raw
from stagelm.infra.errors import StagelmError
from stagelm.tasks import check_answer, require_family_sets, select
from stagelm.tasks.final_answer import task_from_row

GSM8K = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
    "in April and May.\n#### 72",
}


def grade(reference: str, completion: str) -> tuple[bool, bool]:
    return check_answer("final_answer", {"answer": reference}, completion)


@pytest.mark.parametrize(
    ("reference", "completion", "expected"),
    [
        ("72", "She sold 24 in May, so 72 in all.\n#### 72", (True, True)),
        ("72", "#### 72.0", (True, True)),
        ("1000", "The total is\n#### $1,000", (True, True)),
        ("$1,000.00", "#### 1000", (True, True)),
        ("72", "24 in May and 48 in April make 72", (True, True)),  # no ####: the last number
        ("72", "72 in all, or 71 counting twice", (True, False)),
        ("72", "#### 72 clips, then 5 more", (True, True)),  # after ####: the first number
        ("72", "#### 27", (True, False)),
        ("72", "I do not know.", (False, False)),
        ("-3", "#### -3", (True, True)),
        ("0.5", "#### .5", (True, False)),  # a number starts with a digit: this reads as 5
        ("Paris", "  Paris \n", (True, True)),
        ("Paris", "paris", (True, False)),  # text: exactly, after trimming
        ("Paris", "The answer is Paris.", (True, False)),
        ("Paris", "Let me think.\n#### Paris", (True, True)),
        ("Paris", "   ", (False, False)),
    ],
)
def test_the_checker_compares_numbers_numerically_and_text_exactly(reference, completion, expected):
    assert grade(reference, completion) == expected


def test_a_gsm8k_row_is_asked_as_its_question_and_graded_by_what_follows_its_marks():
    task = task_from_row(GSM8K)
    assert task.chat_prompt == GSM8K["question"] and task.chat_answer == GSM8K["answer"]
    assert task.prompt == f"Question: {GSM8K['question']}\nAnswer:" and task.spec == {"answer": "72"}
    assert grade("72", task.chat_answer) == (True, True) and grade("72", task.answer) == (True, True)
    plain = task_from_row({"prompt": "What is the capital of France?", "answer": "Paris"})
    assert plain.chat_answer == "Paris" and plain.spec == {"answer": "Paris"}
    assert task_from_row({"prompt": "2+2?", "answer": 4}).spec == {"answer": "4"}  # a number as JSON has it


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_gsm8k_rows_work_in_every_task_set_as_their_files_hold_them(tmp_path):
    rows = [GSM8K, {"family": "final_answer", "prompt": "Capital of France?", "answer": "Paris"}]
    files = {name: write(tmp_path / f"{name}.jsonl", rows) for name in ("sft", "rl", "eval")}
    collect(data_cfg(sft_files=files["sft"], rl_files=files["rl"], eval_files=files["eval"]), tmp_path / "raw")
    sft = read_raw(tmp_path / "raw", "sft").to_pylist()
    assert sft[0]["family"] == "final_answer"
    assert [m["content"] for m in sft[0]["messages"]] == [GSM8K["question"], GSM8K["answer"]]  # the worked solution
    for name in ("rl", "eval"):
        tasks = read_raw(tmp_path / "raw", name).to_pylist()
        assert [json.loads(t["spec"]) for t in tasks] == [{"answer": "72"}, {"answer": "Paris"}]
        assert [t["chat_prompt"] for t in tasks] == [GSM8K["question"], "Capital of France?"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "How many?", "answer": "Twelve of them."}, r"answer: no '#### <final answer>' at its end"),
        ({"question": "How many?", "answer": "Twelve.\n#### "}, r"answer: nothing after '####'"),
        ({"question": "How many?"}, r"answer: missing"),
        ({"prompt": "How many?", "answer": ""}, r"answer: expected a non-empty string"),
        ({"question": "", "answer": "#### 1"}, r"question: expected a non-empty string"),
        ({"question": "a?", "prompt": "b?", "answer": "#### 1"}, r"question: give `question` .* not both"),
        ({"prompt": "How many?", "answer": True}, r"answer: expected a non-empty string, got True"),
    ],
)
def test_a_bad_final_answer_row_fails_the_download_naming_file_line_and_field(tmp_path, row, message):
    path = write(tmp_path / "eval.jsonl", [GSM8K, row])
    with pytest.raises(StagelmError, match=rf"eval\.jsonl:2: {message}"):
        collect(data_cfg(eval_files=path), tmp_path / "raw")
    assert not list((tmp_path / "raw").glob("*"))


def test_final_answer_is_rewarded_from_files_but_never_generated():
    with pytest.raises(StagelmError, match=r"^data\.families: \['final_answer'\] come from task files only"):
        select(["arithmetic", "final_answer"], "data.families")
    data = data_cfg(rl_files="inputs/gsm8k.jsonl")
    require_family_sets(data, type("G", (), {"families": ["final_answer"]})())  # rewarded from the rl files: fine
