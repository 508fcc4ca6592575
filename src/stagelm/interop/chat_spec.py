"""chat.json of a checkpoint from elsewhere: its template, special tokens and the tokens that end a turn.

`stagelm.data.chatformat` renders conversations with it; an import builds it from a
transformers folder's tokenizer_config.json and generation_config.json, or from a GGUF
file's metadata, always through `chat_spec`, so both carry the same seven keys. The
template's own end-of-turn token (the first special token it writes after an assistant's
text, e.g. ChatML's `<|im_end|>`) joins the stop tokens.
"""

from pathlib import Path
from typing import Any

from stagelm.data.chatformat import ChatFormat
from stagelm.data.tokenizer import ASSISTANT, END, USER
from stagelm.infra.errors import StagelmError

# Renders stagelm's chat layout: <|user|>text<|end|><|assistant|>text<|end|> ...
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{% elif message['role'] == 'assistant' %}" + ASSISTANT + ""
    "{% else %}{{ raise_exception('stagelm chats have user and assistant turns only') }}{% endif %}"
    "{{ message['content'] }}" + END + "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def chat_spec(
    tok: Any,
    where: Path,
    *,
    template: Any,
    eos: str,
    bos: str | None = None,
    pad: str | None = None,
    unk: str | None = None,
    stops: list[str | None] | tuple = (),
    add_bos: bool = False,
) -> dict[str, Any]:
    """chat.json of a checkpoint (its seven keys, the one place they are built): `template` (None when
    it has none or a blank one: a base model, text only), the special tokens as `tok` spells them
    (pad defaults to eos), the stop tokens given plus the template's end of turn, and whether
    the template's text starts with bos."""
    spec = {
        "template": template if isinstance(template, str) and template.strip() else None,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad or eos,
        "unk_token": unk,
        "stop_tokens": list(dict.fromkeys(t for t in stops if t)),
        "add_bos_token": bool(add_bos),
    }
    return with_end_of_turn(spec, tok, where)


def with_end_of_turn(spec: dict[str, Any], tok: Any, where: Path) -> dict[str, Any]:
    """`spec` with its template's end-of-turn token among the stop tokens: the first special token
    the template writes after an assistant message's text. `where` is the file the template came from."""
    if spec["template"] is None:
        spec = {**spec, "stop_tokens": list(dict.fromkeys([spec["eos_token"], *spec["stop_tokens"]]))}
        ChatFormat(tok, spec, source=str(where))  # every token it names is one of `tok`'s, as a load checks
        return spec

    stops = [t for t in spec["stop_tokens"] if tok.token_to_id(t) is not None]
    chat = ChatFormat(tok, {**spec, "stop_tokens": stops}, source=str(where))
    turn = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    text = chat.render(turn, add_generation_prompt=False)
    after = text[text.rfind("Hello.") + len("Hello.") :]
    ends = [s for s in chat.specials if s in after]
    first = min(ends, key=after.index) if ends else None
    stops = list(dict.fromkeys(spec["stop_tokens"] + ([first] if first else [])))
    if not stops:
        raise StagelmError(f"{where}: nothing ends an assistant turn (no eos, no special token after it); add one")
    return {**spec, "stop_tokens": stops}
