"""A checkpoint's chat template is code from elsewhere: it renders as transformers renders it,
under budgets of time, size and arithmetic, each refused in one line naming its file."""

import threading
import time

import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stagelm.data import synthetic
from stagelm.data.chatformat import MAX_RENDER_SECONDS, ChatFormat, ChatRenderError
from stagelm.data.tokenizer import EOS, PAD, train_tokenizer

TURN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
HANG = "{% set r = range(99999) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(synthetic.generate(0, 200, 1, 1, 1)["corpus"], 300)


def chat_format(tok, template: str) -> ChatFormat:
    spec = {"template": template, "eos_token": EOS, "pad_token": PAD, "stop_tokens": [EOS]}
    return ChatFormat(tok, spec, source="ckpt/chat.json")


HOSTILE = [  # (template, words of the refusal): each would hang, or allocate gigabytes, unbudgeted
    (HANG + "x", f"took more than {MAX_RENDER_SECONDS:g} s"),
    ("{{ 10**(10**8) }}", "raises an integer past 65536 bits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "multiplies"),
    ("{{ ('a'*10**9)|length }}", "repetition exceeds"),
    ("{{ messages|tojson(indent=10**9) }}", "to the tojson filter"),
    ("{{ messages|tojson(indent=100) }}", "tojson indent is past 64"),
    ("{{ 'a'|center(10**9) }}", "to the center filter"),
    ("{{ [1]|batch(10**9, 0)|list|length }}", "to the batch filter"),
    ("{{ 'a'.ljust(10**9) }}", "to ljust()"),
    ("{{ '{:>999999999}'.format(1) }}", "str.format asks for a field"),
    ("{{ '%999999999d' % 1 }}", "% formatting asks for a field"),
    ("{{ '%*d' % (999999999, 1) }}", "% formatting asks for a field"),
    ("{{ '%999999999d'|format(1) }}", "format filter asks for a field"),
    ("{% set s = 'a'*4000000 %}{{ s.replace('a', 'bbbbbbbbbbb')|length }}", "replace() exceeds"),
    (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "text exceeds",
    ),
    (
        "{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "concatenation",
    ),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "maximum recursion depth"),
    ("{% for i in range(10) %}{{ 'x' * 1000000 }}{% endfor %}", "rendering exceeds"),
]


@pytest.mark.parametrize(("template", "words"), HOSTILE, ids=[w for _, w in HOSTILE])
def test_a_hostile_template_is_refused_in_one_line_within_its_time_budget(tok, template, words):
    t0 = time.monotonic()
    chat = chat_format(tok, template)  # compiles: nothing is folded at compile time
    with pytest.raises(ChatRenderError, match=r"^ckpt/chat\.json: ") as refused:
        chat.render([{"role": "user", "content": "Hi."}], add_generation_prompt=True)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    assert refused.value.reason in str(refused.value) and "ckpt/" not in refused.value.reason
    assert time.monotonic() - t0 < MAX_RENDER_SECONDS + 1.5


def test_a_template_within_its_budgets_renders_as_the_plain_sandbox_renders_it(tok):
    """The budgets change no rendering: arithmetic, formatting, loops and filters give the text
    jinja2's own sandbox gives (transformers' flags: trim_blocks, lstrip_blocks, loop controls)."""
    template = (
        "{% set sep = '-' * 3 %}{{ 2 ** 10 }} {{ '%02d' % 5 }} {{ '{:>4}'.format('ab') }} {{ 'x%sy'|format(7) }}\n"
        "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{{ sep ~ m.role|upper ~ sep }}{{ m.content|center(12) }}{{ [1, 2] + [3] }}{{ m.content.replace('a', 'A') }}\n"
        "{% endfor %}{{ (messages|map(attribute='content')|join(','))|length * 3 }}"
    )
    messages = [{"role": r, "content": f"{r} says a"} for r in ("system", "user", "assistant", "user", "assistant")]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    expected = plain.from_string(template).render(messages=messages, add_generation_prompt=True)
    assert chat_format(tok, template).render(messages, add_generation_prompt=True) == expected


def test_the_deadline_is_per_thread(tok):
    """A server renders in threads: a template that runs out its budget in one thread leaves
    another thread's rendering alone, and each is judged by its own clock."""
    slow = chat_format(tok, "{% if messages[0].content == 'slow' %}" + HANG + "{% endif %}" + TURN)
    results: dict[str, object] = {}

    def render(content: str) -> None:
        try:
            results[content] = slow.render([{"role": "user", "content": content}], add_generation_prompt=True)
        except ChatRenderError as err:
            results[content] = err

    hog = threading.Thread(target=render, args=("slow",))
    hog.start()
    time.sleep(0.2)
    for _ in range(50):  # renderings that start and end while the slow one runs
        render("quick")
        assert results["quick"] == "<|user|>quick<|end|>"
    hog.join()
    assert isinstance(results["slow"], ChatRenderError) and "took more than" in str(results["slow"])


def test_renderings_that_take_turns_wait_a_slice_of_each_and_end_when_closed(tok):
    """A server's renderings take turns (template_sandbox.Turns): ten that loop cost an ordinary one
    a slice each, not their budget, and `close` ends every one still running or waiting at once."""
    from stagelm.data.template_sandbox import CLOCK, STOPPING, Turns

    turns = Turns()
    looping = chat_format(tok, "{% if messages[0].content == 'loop' %}" + HANG + "{% endif %}" + TURN)
    ordinary = chat_format(tok, TURN)
    errors: list[str] = []

    def render(chat: ChatFormat, content: str, took: dict | None = None) -> None:
        CLOCK.turns = turns
        t0 = time.monotonic()
        try:
            chat.render([{"role": "user", "content": content}], add_generation_prompt=True)
        except ChatRenderError as err:
            errors.append(err.reason)
        if took is not None:
            took["seconds"] = time.monotonic() - t0

    hogs = [threading.Thread(target=render, args=(looping, "loop")) for _ in range(10)]
    for hog in hogs:
        hog.start()
    time.sleep(0.3)
    took: dict = {}
    quick = threading.Thread(target=render, args=(ordinary, "hi", took))
    quick.start()
    quick.join()
    assert not errors and took["seconds"] < MAX_RENDER_SECONDS / 4, took  # ten slices, not a budget
    t0 = time.monotonic()
    turns.close()
    for hog in hogs:
        hog.join()
    assert time.monotonic() - t0 < 0.5 and errors == [STOPPING] * 10
    render(ordinary, "hi")  # a rendering that starts after close is refused at once too
    assert errors[-1] == STOPPING
    CLOCK.turns = None


def test_a_model_without_a_template_tells_a_client_why_without_its_path(tok):
    from stagelm.infer.openai_api import BadRequest, chat_prompt

    spec = {"template": None, "eos_token": EOS, "pad_token": PAD, "stop_tokens": [EOS]}
    chat = ChatFormat(tok, spec, source="/home/someone/models/m/chat.json")
    with pytest.raises(BadRequest) as refused:
        chat_prompt({"messages": [{"role": "user", "content": "hi"}]}, chat)
    assert refused.value.message == (
        "this model has no chat template, so it takes text only; use the completion format (/v1/completions)"
    )
    with pytest.raises(ChatRenderError, match="^/home/someone/models/m/chat.json: the checkpoint has no chat template"):
        chat.user_prompt("hi")  # the command line names the file
