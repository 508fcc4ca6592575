"""The download stage's task sets (sft, rl, eval): the synthetic families' or the user's jsonl files.

A task file's rows are checked against the set's schema (sft: `family`, `messages`; rl and
eval: `family`, `prompt`, `chat_prompt` and a `spec` the family's checker can read), and a
bad row is one line naming the file, line and field. A row with a reference final answer
and no `family` (GSM8K's `question` and `answer` ending `#### <answer>`, or `prompt` and
`answer`) is a `final_answer` task in every set (`stagelm.tasks.final_answer`): in sft its
worked solution is the assistant's turn.
"""

import json
from typing import Any

from stagelm.data.corpus_files import match_files, open_stream, require_text
from stagelm.infra.errors import StagelmError
from stagelm.pipeline.config import DataConfig
from stagelm.tasks import FAMILIES, Task, spec_problem
from stagelm.tasks.final_answer import is_final_answer_row, task_from_row


def task_sets(cfg: DataConfig, generated: dict[str, list]) -> tuple[dict[str, list], dict[str, str]]:
    """{"sft", "rl", "eval"} rows, and where each came from (files when set, else synthetic)."""
    sets = {
        "sft": generated["sft"],
        "rl": [task_row(t) for t in generated["rl"]],
        "eval": [task_row(t) for t in generated["eval"]],
    }
    origin = {name: f"synthetic(seed={cfg.seed})" for name in sets}
    for name, path in (("sft", cfg.sft_files), ("rl", cfg.rl_files), ("eval", cfg.eval_files)):
        if path:
            sets[name] = read_task_file(path, name)
            origin[name] = f"files:{path}"
    if cfg.pref_files:  # no synthetic counterpart: the dpo stage's own pairs come from its sampling
        sets["pref"] = read_task_file(cfg.pref_files, "pref")
        origin["pref"] = f"files:{cfg.pref_files}"
    return sets, origin


def task_row(task: Task) -> dict[str, Any]:
    return {
        "family": task.family,
        "prompt": task.prompt,
        "chat_prompt": task.chat_prompt,
        "answer": task.answer,
        "chat_answer": task.chat_answer,
        "spec": json.dumps(task.spec),
    }


def read_task_file(path: str, name: str) -> list[dict[str, Any]]:
    """The rows of the jsonl task files `path` names, each checked against the schema of
    task set `name` (sft: `family`, `messages`; rl and eval: `family`, `prompt`,
    `chat_prompt` and a `spec` the family's checker can read; pref: `pref_row`), or one line
    naming the file, line and field. Rows keep only the schema's fields, so Arrow sees one type
    per column."""
    rows = []
    key = f"data.{name}_files"
    for file in match_files(path, key):
        for i, line in enumerate(open_stream(file), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict):
                raise StagelmError(f"{file}:{i}: not a JSON object; {key} must be jsonl, one task per line")
            require_text(json.dumps(row, ensure_ascii=False), f"{file}:{i}")
            try:
                rows.append(READERS.get(name, task_file_row)(row))
            except ValueError as err:
                raise StagelmError(f"{file}:{i}: {err}; fix the row or {key}") from None
    if not rows:
        raise StagelmError(f"{key}: {path!r} holds no rows")
    return rows


def text_field(row: dict[str, Any], field: str, required: bool = True) -> str:
    if field not in row and not required:
        return ""
    if field not in row:
        raise ValueError(f"{field}: missing")
    value = row[field]
    if not isinstance(value, str) or (required and not value.strip()):
        raise ValueError(f"{field}: expected a non-empty string, got {value!r}"[:200])
    return value


def sft_row(row: dict[str, Any]) -> dict[str, Any]:
    """{family, messages: [{role, content}]}: user and assistant turns, at least one of them trained;
    a final_answer row (a question and its worked solution) as one such exchange."""
    if is_final_answer_row(row):
        task = task_from_row(row)
        messages = [{"role": "user", "content": task.chat_prompt}, {"role": "assistant", "content": task.chat_answer}]
        return {"family": task.family, "messages": messages}
    family = text_field(row, "family")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: expected a non-empty list of {{role, content}} objects, got {messages!r}"[:200])
    turns = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{j}]: expected a {{role, content}} object, got {message!r}"[:200])
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise ValueError(f"messages[{j}].role: expected 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{j}].content: expected a string, got {content!r}"[:200])
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" for t in turns):
        raise ValueError("messages: no assistant turn, so nothing to learn from")
    return {"family": family, "messages": turns}


def task_file_row(row: dict[str, Any]) -> dict[str, Any]:
    """An rl or eval task: a registered family, both prompts, and a spec its checker can read (or a
    final_answer row, which carries its reference in place of them)."""
    if is_final_answer_row(row):
        return task_row(task_from_row(row))
    family = text_field(row, "family")
    if family not in FAMILIES:
        raise ValueError(f"family: unknown {family!r}; expected one of {list(FAMILIES)}")
    problem = spec_problem(family, row.get("spec")) if "spec" in row else "spec: missing"
    if problem:
        raise ValueError(problem)
    return {
        "family": family,
        "prompt": text_field(row, "prompt"),
        "chat_prompt": text_field(row, "chat_prompt"),
        "answer": text_field(row, "answer", required=False),
        "chat_answer": text_field(row, "chat_answer", required=False),
        "spec": json.dumps(row["spec"]),
    }


def pref_row(row: dict[str, Any]) -> dict[str, Any]:
    """A preference pair in TRL's formats: {messages, chosen, rejected}, the prompt's messages as
    JSON and each answer as the assistant's text.

    The prompt is `prompt` (a text, one user turn, or a list of messages) or `messages`; each
    answer a text or a list holding one assistant message. Without either prompt field the
    answers are whole conversations (TRL's implicit prompt) whose messages before the last,
    the assistant's, are the prompt and must be the same in both."""
    given = [f for f in ("prompt", "messages") if f in row]
    if len(given) > 1:
        raise ValueError("prompt: give `prompt` or `messages`, not both")
    answers = {}
    if given:
        field = given[0]
        value = row[field]
        prompt = [{"role": "user", "content": value}] if isinstance(value, str) and value.strip() else None
        prompt = prompt or message_list(value, field)
        for side in ("chosen", "rejected"):
            answers[side] = answer_text(row.get(side), side)
    else:
        whole = {side: message_list(row.get(side), side) for side in ("chosen", "rejected")}
        if whole["chosen"][:-1] != whole["rejected"][:-1]:
            raise ValueError("rejected: its messages before the answer differ from chosen's (give `prompt`)")
        prompt = whole["chosen"][:-1]
        for side in ("chosen", "rejected"):
            answers[side] = answer_text(whole[side][-1:], side)
    if not prompt or prompt[-1]["role"] != "user":
        raise ValueError(f"{given[0] if given else 'chosen'}: the prompt must end with the user's message")
    if answers["chosen"] == answers["rejected"]:
        raise ValueError("rejected: the same answer as chosen, so nothing to prefer")
    return {"messages": json.dumps(prompt, ensure_ascii=False), **answers}


def message_list(value: Any, field: str) -> list[dict[str, str]]:
    """A non-empty list of messages, each a `role` (system, user or assistant) and a `content` text, or ValueError."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field}: expected a string or a non-empty list of {{role, content}}, got {value!r}"[:200])
    messages = []
    for j, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"{field}[{j}].role: expected 'system', 'user' or 'assistant', got {role!r}"[:200])
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{field}[{j}].content: expected a string, got {content!r}"[:200])
        messages.append({"role": role, "content": content})
    return messages


def answer_text(value: Any, field: str) -> str:
    """An answer: a non-empty string, or a list of one assistant message holding it."""
    if isinstance(value, list):
        messages = message_list(value, field)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise ValueError(f"{field}: expected one assistant message, got {len(messages)} message(s)")
        value = messages[0]["content"]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{field}: expected a non-empty string or one assistant message, got {value!r}"[:200])
    return value


READERS = {"sft": sft_row, "pref": pref_row}  # the rl and eval sets' rows: task_file_row


def count_families(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["family"]] = counts.get(row["family"], 0) + 1
    return counts
