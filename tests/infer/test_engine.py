"""The continuous-batching engine: requests that join a running batch decode as each alone, in both cache layouts."""

import pytest
from conftest import micro_decoder

from stagelm.infer.engine import Engine, Request
from stagelm.infer.generate import Generator
from stagelm.model import kvcache


@pytest.fixture(scope="module")
def gen(micro_data):
    return Generator(*micro_decoder(micro_data), capacity=48)


@pytest.mark.parametrize("layout", ["heads", "slots"])
def test_requests_joining_a_running_batch_decode_as_each_alone(gen, layout, monkeypatch):
    """Greedy requests admitted at different steps (so prompts land mid-ring and steps run a
    prefix of the slots) give the tokens `Generator.generate` gives each prompt alone. The
    engine's steps are driven here, one `iterate` at a time; its own thread waits for a `submit`."""
    monkeypatch.setattr(kvcache, "default_layout", lambda backend=None: layout)
    engine = Engine(gen, slots=4, queue_limit=0)
    texts = ["Once upon a time, Mia", "23 plus 5 is", "Tom saw a big red kite near the river and"]
    prompts = [gen.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    budgets = [12, 10, 8]
    got: list[list[int]] = [[] for _ in prompts]

    def request(i: int) -> Request:
        def emit(choice: int, token: int | None, finish: str | None) -> None:
            if token is not None:
                got[i].append(token)

        return Request(prompts[i], budgets[i], 0.0, 1.0, 0, 1, False, emit)

    engine.iterate([request(0)])
    for _ in range(3):
        engine.iterate([])
    engine.iterate([request(1), request(2)])
    while engine.rows:
        engine.iterate([])
    for prompt, budget, tokens in zip(prompts, budgets, got, strict=True):
        assert tokens == gen.generate([prompt], budget)[0].tokens
