"""final_answer: a user's own graded task, no code: rows that carry a reference final answer.

Read from task files only (`data.sft_files`, `data.rl_files`, `data.eval_files`), never
generated. A row needs no `family` field (or says `family: final_answer`) and takes one of
two shapes:

- GSM8K's own rows, exactly as its files hold them: `question`, and `answer`, the worked
  solution ending in `#### <final answer>`;
- plain rows: `prompt`, and `answer`, the final answer itself (a string or a number).

A question is asked as the user's turn in chat, and as `Question: <question>\nAnswer:` in
the completion format (the prompt lm-eval's gsm8k task writes). The worked solution (a
plain row: the answer) is the reference assistant turn, which SFT trains on.

The checker reads the model's final answer: what follows the last `####` of its
completion when it writes one, else the completion itself. A reference that is a number
is compared numerically with the first number after `####`, or without one with the
completion's last number (commas, a trailing `.0` and a leading `$` tolerated: `$1,000.00`
is 1000); any other reference must equal the final answer after trimming whitespace.
"""

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from stagelm.tasks.family import Family, Task

NAME = "final_answer"
MARK = "####"  # GSM8K's: the worked solution ends `#### <final answer>`

_NUMBER = re.compile(r"-?\$?-?\d[\d,]*(?:\.\d+)?")
_WHOLE_NUMBER = re.compile(r"\s*-?\$?-?\d[\d,]*(?:\.\d+)?\s*")


def as_number(text: str) -> Decimal | None:
    """The value of a number as people write it (`$1,000.50`, `-3`, `72.0`), or None."""
    cleaned = text.strip().replace("$", "").replace(",", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def reference_answer(text: str) -> Decimal | str:
    """A reference as the checker compares it: a number when it reads as one, else trimmed text."""
    if _WHOLE_NUMBER.fullmatch(text):
        number = as_number(text)
        if number is not None:
            return number
    return text.strip()


def model_answer(completion: str, numeric: bool) -> str | None:
    """The final answer a completion gives (None: none found): after its last `####`, or the
    whole completion; for a numeric reference, the first number after `####`, else the last one."""
    marked = MARK in completion
    text = completion.rsplit(MARK, 1)[1] if marked else completion
    if not numeric:
        return text.strip() or None
    numbers = [m.group(0).rstrip(",") for m in _NUMBER.finditer(text)]
    if not numbers:
        return None
    return numbers[0] if marked else numbers[-1]


def check(spec: dict[str, Any], completion: str) -> tuple[bool, bool]:
    reference = reference_answer(spec["answer"])
    numeric = isinstance(reference, Decimal)
    found = model_answer(completion, numeric)
    if found is None:
        return False, False
    return True, (as_number(found) == reference) if numeric else (found == reference)


def split_solution(answer: str) -> tuple[str, str]:
    """(worked solution, final answer) of a GSM8K `answer`; ValueError naming the field when
    there is no `#### <final answer>`."""
    if MARK not in answer:
        raise ValueError(f"answer: no '{MARK} <final answer>' at its end, as GSM8K's solutions have; add one")
    final = answer.rsplit(MARK, 1)[1].strip()
    if not final:
        raise ValueError(f"answer: nothing after '{MARK}'; the final answer follows it")
    return answer, final


def task_from_row(row: dict[str, Any]) -> Task:
    """A task of a GSM8K row (`question`, `answer` with `####`) or a plain row (`prompt`, `answer`);
    ValueError naming the field of a row that is neither."""
    if "question" in row and "prompt" in row:
        raise ValueError("question: give `question` (a GSM8K row) or `prompt` (a plain row), not both")
    field = "question" if "question" in row else "prompt"
    question = row.get(field)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{field}: expected a non-empty string, got {question!r}"[:200])
    answer = row.get("answer")
    if field == "prompt" and isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        what = "missing" if "answer" not in row else f"expected a non-empty string, got {answer!r}"[:200]
        raise ValueError(f"answer: {what}")
    solution, final = split_solution(answer) if field == "question" else (answer.strip(), answer.strip())
    return Task(
        family=NAME,
        prompt=f"Question: {question}\nAnswer:",
        chat_prompt=question,
        answer=f" {solution}",
        chat_answer=solution,
        spec={"answer": final},
    )


def is_final_answer_row(row: dict[str, Any]) -> bool:
    """Whether a task file's row is one of this family's shapes (no `spec`, no `messages`)."""
    return row.get("family", NAME) == NAME and "spec" not in row and "messages" not in row


def no_problems() -> list:
    return []


def never_asked(rng: Any, problem: Any) -> Task:
    raise AssertionError("final_answer tasks come from task files, never from the synthetic source")


FAMILY = Family(
    NAME,
    no_problems,
    never_asked,
    check,
    spec_schema={"answer": str},
    generated=False,
    one_line=False,
)
