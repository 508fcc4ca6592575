"""How a model's conversations become token ids: stagelm's own chat format, or a checkpoint's template.

A model stagelm trained from scratch speaks stagelm's format (`stagelm.data.tokenizer`):
`<|user|>…<|end|><|assistant|>…<|end|>`. A checkpoint from elsewhere keeps its own: its
Jinja chat template, rendered as transformers renders it (`stagelm.data.template_sandbox`,
with the special tokens' spellings as variables),
and its own end-of-turn and end-of-sequence tokens. What a template needs is `chat.json`,
written beside the tokenizer.json it belongs to (by `import-hf`, the tokenizer stage, and
every model stage after them): the template, the spellings of bos, eos, pad and unk, the
tokens that end a turn, and whether plain text starts with bos. A folder without one speaks
stagelm's format.

Text from a user or a file is always text: only the template inserts special tokens. A
rendering is encoded whole with special tokens recognized, which gives transformers'
`apply_chat_template` ids, unless a message holds a special token's spelling; then that
message is encoded apart, as text.

SFT trains on the assistant's tokens only. A template marks no spans, so they are found
by rendering prefixes of the conversation: an assistant turn is what its message adds to
the rendering that ends with the generation prompt before it, through its end-of-turn token.

A template is code from elsewhere, so it renders in `stagelm.data.template_sandbox`, under
budgets of time, size and arithmetic, each refused in one line naming the file.
"""

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from stagelm.data.template_sandbox import (
    CLOCK,
    MAX_RENDER_CHARS,
    MAX_RENDER_SECONDS,
    ChatRenderError,
    sandbox,
    taking_turns,
)
from stagelm.data.tokenizer import ASSISTANT, BOS, CHAT_FILE, END, EOS, PAD, chat_segments, special_id
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json_object, write_json

ROLES = ("system", "user", "assistant")
_HOLE = "\ue000{}\ue001"  # private-use characters: where a message holding a special token's spelling goes


class ChatFormat:
    """The chat format of a tokenizer: stagelm's (`spec` None) or a template's (`spec`: chat.json)."""

    def __init__(self, tok: Tokenizer, spec: dict[str, Any] | None = None, source: str = "chat.json"):
        self.tok, self.spec, self.source = tok, spec, source
        if spec is None:
            self.template = None
            self.eos, self.pad, self.bos = special_id(tok, EOS), special_id(tok, PAD), special_id(tok, BOS)
            self.add_bos = False
            self.stops = (self.eos, special_id(tok, END))
            return
        self.template = spec["template"]  # None: a checkpoint without one (a base model), text only
        if self.template is not None and not isinstance(self.template, str):
            kind = type(self.template).__name__
            raise StagelmError(f"{source}: template is {kind}; expected a Jinja string or null; fix or replace it")
        self.eos, self.pad = self.token(spec["eos_token"], "eos_token"), self.token(spec["pad_token"], "pad_token")
        self.bos = self.token(spec["bos_token"], "bos_token") if spec.get("bos_token") else None
        self.add_bos = bool(spec.get("add_bos_token")) and self.bos is not None
        self.stops = tuple(dict.fromkeys([self.eos, *(self.token(t, "stop_tokens") for t in spec["stop_tokens"])]))
        self.specials = sorted(
            {t.content for t in tok.get_added_tokens_decoder().values() if t.special}, key=len, reverse=True
        )
        # A copy that reads special tokens' spellings in text as the tokens: for the template's own text only.
        self.marked = Tokenizer.from_str(tok.to_str())
        self.marked.encode_special_tokens = False
        self.compiled = None
        if self.template is not None:
            try:
                self.compiled = sandbox().from_string(self.template)
            except Exception as err:  # jinja2's TemplateSyntaxError and kin
                raise StagelmError(f"{source}: the chat template does not parse ({err}); fix or replace it") from None

    def token(self, spelling: str, key: str) -> int:
        found = self.tok.token_to_id(spelling) if isinstance(spelling, str) else None
        if found is None:
            raise StagelmError(f"{self.source}: {key} {spelling!r} is not a token of its tokenizer.json")
        return found

    # --- rendering -----------------------------------------------------------------------

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The template's text for `messages` (each {role, content}), bounded in time and size."""
        if self.compiled is None:  # a server tells its clients the reason, not the model's path
            raise ChatRenderError(
                f"{self.source}: the checkpoint has no chat template, so it takes text only (no chat); add its "
                "template as `template` there, or use the completion format",
                "this model has no chat template, so it takes text only; use the completion format (/v1/completions)",
            )
        variables = {k: self.spec.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        pieces, size = [], 0
        try:
            with taking_turns():  # a server's renderings take turns; the budget runs from the first
                CLOCK.deadline = time.monotonic() + MAX_RENDER_SECONDS
                for piece in self.compiled.generate(
                    messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
                ):
                    size += len(piece)
                    if size > MAX_RENDER_CHARS:
                        raise ChatRenderError(f"the chat template's rendering exceeds {MAX_RENDER_CHARS:,} characters")
                    pieces.append(piece)
        except Exception as err:  # past a budget, raise_exception, or an error inside the template (RecursionError ...)
            reason = str(err) if isinstance(err, ChatRenderError) else f"the chat template refused the messages: {err}"
            reason = reason[:300]
            raise ChatRenderError(f"{self.source}: {reason}", reason) from None
        finally:
            CLOCK.deadline = float("inf")
        return "".join(pieces)

    def encode(self, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
        """The ids of a rendering: whole, special tokens recognized, when no message spells one (so
        exactly transformers' ids); otherwise such messages go in as text between the template's pieces."""
        spelled = [i for i, m in enumerate(messages) if any(s in m["content"] for s in self.specials)]
        if not spelled:
            return self.marked.encode(self.render(messages, add_generation_prompt), add_special_tokens=False).ids
        holes = [dict(m, content=_HOLE.format(i)) if i in spelled else m for i, m in enumerate(messages)]
        text = self.render(holes, add_generation_prompt)
        ids: list[int] = []
        for i in spelled:
            before, _, text = text.partition(_HOLE.format(i))
            ids += self.marked.encode(before, add_special_tokens=False).ids
            ids += self.tok.encode(messages[i]["content"], add_special_tokens=False).ids
        return ids + self.marked.encode(text, add_special_tokens=False).ids

    # --- what the stages and the server ask for ------------------------------------------

    def check_roles(self, messages: Sequence[dict], where: str = "messages") -> None:
        allowed = ROLES if self.spec is not None else ROLES[1:]
        for i, m in enumerate(messages):
            if m.get("role") not in allowed:
                kind = "its chat template takes" if self.spec is not None else "stagelm's chat format has"
                raise StagelmError(f"{where}[{i}].role: {m.get('role')!r} is not supported; {kind} {list(allowed)}")

    def conversation(self, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of a whole conversation; the mask is 1 on the assistant's tokens
        through each turn's end-of-turn token."""
        self.check_roles(messages)
        if self.spec is None:
            return chat_segments(self.tok, messages)
        ids = self.encode(messages, add_generation_prompt=False)
        mask = [0] * len(ids)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self.encode(messages[:k], add_generation_prompt=True) if k else []
            upto = self.encode(messages[: k + 1], add_generation_prompt=False)
            if ids[: len(upto)] != upto or upto[: len(start)] != start:
                raise StagelmError(
                    f"{self.source}: the chat template's rendering of a conversation's first {k + 1} messages is "
                    "not a prefix of the whole, so its assistant tokens cannot be found; use a template that renders "
                    "turn by turn"
                )
            turn = list(range(len(start), len(upto)))
            ends = [j for j in turn if ids[j] in self.stops]
            for j in turn[: turn.index(ends[0]) + 1] if ends else turn:
                mask[j] = 1
        return ids, mask

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """Ids of `messages` (the last one the user's) ready for the assistant's answer."""
        self.check_roles(messages)
        if self.spec is None:
            ids, _ = chat_segments(self.tok, messages)
            return ids + [special_id(self.tok, ASSISTANT)]
        return self.encode(messages, add_generation_prompt=True)

    def user_prompt(self, text: str) -> list[int]:
        """A one-turn chat prompt: `text` as the user's message."""
        return self.prompt([{"role": "user", "content": text}])

    def text(self, text: str) -> list[int]:
        """Ids of plain text (a completion prompt), after bos when the tokenizer starts text with it."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos, *ids] if self.add_bos else ids

    def stop_ids(self, chat: bool) -> tuple[int, ...]:
        """Tokens that end a generation: end-of-sequence, and in a chat the end-of-turn tokens too."""
        return self.stops if chat else (self.eos,)


def read_chat_spec(folder: str | Path) -> dict[str, Any] | None:
    """`folder`'s chat.json (a template's format), or None (stagelm's own)."""
    path = Path(folder) / CHAT_FILE
    if not path.is_file():
        return None
    spec = read_json_object(path, "rewrite it with `stagelm import-hf` or rerun the stage that wrote it")
    for key in ("template", "eos_token", "pad_token", "stop_tokens"):
        if key not in spec:
            raise StagelmError(f"{path}: {key} missing; rewrite it with `stagelm import-hf` or rerun its stage")
    return spec


def load_chat_format(tok: Tokenizer, folder: str | Path) -> ChatFormat:
    """The chat format of the tokenizer in `folder` (a tokenizer or model directory)."""
    return ChatFormat(tok, read_chat_spec(folder), str(Path(folder) / CHAT_FILE))


def write_chat_spec(folder: str | Path, spec: dict[str, Any] | None) -> None:
    """Write `spec` as `folder`'s chat.json (nothing for stagelm's own format)."""
    if spec is not None:
        write_json(Path(folder) / CHAT_FILE, spec)
