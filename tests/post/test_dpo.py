"""DPO: the loss and its gradient by hand, equal answers teach nothing, one pair flips a greedy
answer, the reference's log-probs are the parent's, pairs from files, and the stage."""

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MICRO, ROOT, built_once, micro_params
from flax import nnx
from resume import assert_same_outputs, killed_and_whole
from test_grpo import train_policy

from stagelm.data.chatformat import ChatFormat
from stagelm.data.loader import PackedRows
from stagelm.data.task_sets import pref_row
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import Generator, Sampling
from stagelm.infra.files import read_json
from stagelm.infra.mesh import make_mesh
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.modeldir import load_model
from stagelm.pipeline.params import load_section
from stagelm.post.dpo import Pair, PairSource, both_rows, dpo_loss, file_pairs, pair_rows, pair_width
from stagelm.tasks.arithmetic import arithmetic_task, working
from stagelm.train.loop import train
from stagelm.train.run import TrainRun
from stagelm.train.step import lm_loss

MICRO_DPO = MICRO["dpo"]
CFG = DecoderConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)


def pair_batch(pairs: list[Pair], ref: np.ndarray | None = None) -> dict[str, jax.Array]:
    rows = pair_rows(pairs, pair_width(pairs, 64))
    rows["ref_logp"] = np.zeros((len(pairs), 2), np.float32) if ref is None else ref
    return {k: jnp.asarray(v) for k, v in rows.items()}


def answer_logp(model: Decoder, prompt: list[int], answer: list[int]) -> jax.Array:
    """log π(answer | prompt), from the model's logits, position by position."""
    tokens = jnp.asarray([prompt + answer])
    n = tokens.shape[1]
    logits = model(tokens, jnp.ones_like(tokens), jnp.arange(n)[None])[0]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(answer))


PAIRS = [Pair([1, 2, 3], [4, 5, 6], [4, 7]), Pair([2, 8], [9, 10], [11, 3, 3, 5])]
REF = np.asarray([[-7.5, -6.0], [-4.0, -9.0]], np.float32)


@pytest.mark.parametrize("kind,nll", [("sigmoid", 0.0), ("sigmoid", 0.5), ("ipo", 0.0), ("ipo", 0.3)])
def test_the_loss_and_its_gradient_by_hand(kind, nll):
    """Each pair's loss from the answers' log-probs worked out token by token, and the gradient as
    the chain rule gives it from the gradients of those log-probs."""
    model, beta = Decoder(CFG, nnx.Rngs(0)), 0.3
    graphdef, params = nnx.split(model)

    def by_hand(params):
        m = nnx.merge(graphdef, params)
        total = 0.0
        for pair, (rc, rr) in zip(PAIRS, REF, strict=True):
            pc, pr = answer_logp(m, pair.prompt, pair.chosen), answer_logp(m, pair.prompt, pair.rejected)
            if kind == "ipo":
                margin = (pc - rc) / len(pair.chosen) - (pr - rr) / len(pair.rejected)
                total += (margin - 1 / (2 * beta)) ** 2
            else:
                total += jnp.log1p(jnp.exp(-beta * ((pc - rc) - (pr - rr))))
            total += nll * -pc / len(pair.chosen)
        return total

    def coded(params):
        return dpo_loss(kind, beta, nll)(nnx.merge(graphdef, params), pair_batch(PAIRS, REF), None)[0]

    assert float(coded(params)) == pytest.approx(float(by_hand(params)), rel=1e-5)
    for a, b in zip(jax.tree.leaves(jax.grad(coded)(params)), jax.tree.leaves(jax.grad(by_hand)(params)), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    _, count, aux = dpo_loss(kind, beta, nll)(model, pair_batch(PAIRS, REF), None)
    assert float(count) == 2 and 0 <= float(aux["reward_accuracy"]) <= 2


def test_equal_answers_cost_log_two_and_teach_nothing():
    """With the chosen answer the rejected one, at the reference, the sigmoid loss is log 2 a pair and
    its gradient zero; IPO's is (1/(2β))², its gradient zero too."""
    model = Decoder(CFG, nnx.Rngs(1))
    graphdef, params = nnx.split(model)
    same = [Pair(p.prompt, p.chosen, p.chosen) for p in PAIRS]
    batch = pair_batch(same)
    moved = pair_batch(PAIRS)  # a pair of different answers: its gradient is of the size DPO moves by

    def size(kind: str, b: dict) -> float:
        grads = jax.grad(lambda p: dpo_loss(kind, 0.1)(nnx.merge(graphdef, p), b, None)[0])(params)
        return max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))

    for kind, expected in (("sigmoid", math.log(2)), ("ipo", (1 / (2 * 0.1)) ** 2)):
        assert float(dpo_loss(kind, 0.1)(model, batch, None)[0]) == pytest.approx(2 * expected, rel=1e-6)
        assert size(kind, batch) < 1e-6 * size(kind, moved)  # zero but for float rounding


def test_one_pair_flips_the_greedy_answer_of_its_prompt(micro_data, tmp_path):
    """A model taught two answers to one prompt about equally answers one of them greedily; trained on
    the pair that prefers the other, its greedy answer becomes the other."""
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    task = arithmetic_task(23, "plus", 58)
    cfg = DecoderConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    model = Decoder(cfg, nnx.Rngs(0))
    chat = ChatFormat(tok)
    prompt = chat.user_prompt(task.chat_prompt)
    answers = [
        file_pairs(chat, [pref_row({"prompt": task.chat_prompt, "chosen": a, "rejected": "."})])[0].chosen
        for a in (task.chat_answer, working(23, "plus", 57))
    ]  # "... so 81." and "... so 80."
    rows = both_rows(pair_batch([Pair(prompt, *answers)]))  # both answers, as plain rows
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def teach(model, optimizer, rows):  # both answers, equally
        loss, grads = nnx.value_and_grad(lambda m: lm_loss(m, rows, None)[0])(model)
        optimizer.update(model, grads)

    for _ in range(150):
        teach(model, optimizer, rows)
    gen = Generator(model, tok, 128)
    greedy = lambda m: Generator(m, tok, 128).generate([prompt], 40, Sampling(), chat=True)[0].tokens  # noqa: E731
    first = greedy(model)
    given = [a[: len(first)] == first for a in answers]
    assert any(given), "the taught model answers neither"
    rejected, chosen = (answers[0], answers[1]) if given[0] else (answers[1], answers[0])
    change = {"pairs": "files", "steps": 20, "warmup_steps": 1, "batch_size": 1, "lr": 3e-3, "method": "full"}
    dpo = load_section(micro_params(dpo=change | {"eval_every": 20, "checkpoint_every": 20}), "dpo")
    source = PairSource(dpo, gen, nnx.graphdef(model), 0, pairs=[Pair(prompt, chosen, rejected)])
    mesh = make_mesh(1, 1, 1, jax.devices()[:1])
    result = train(
        model,
        dpo,
        None,
        PackedRows(micro_data / "packed/val"),
        TrainRun(0, mesh, tmp_path / "out", tmp_path / "ckpt", "pair", {}, {}),
        loss_fn=dpo_loss(dpo.loss, dpo.beta, dpo.nll_weight),
        eval_loss_fn=lm_loss,
        batches=source,
    )
    after = greedy(result.model)
    assert chosen[: len(after)] == after and len(after) >= len(chosen) - 1
    assert result.history[-1]["train/reward_accuracy"] == 1.0


def test_reference_log_probs_are_the_parents(micro_data):
    """The pairs' reference log-probs, scored in padded chunks, are the parent's answer log-probs worked
    out one pair at a time, and they stay the parent's after the policy has moved."""
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    cfg = DecoderConfig(vocab_size=tok.get_vocab_size(), d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    model = Decoder(cfg, nnx.Rngs(2))
    pairs = [Pair([1, 2, 3], [4, 5, 6], [4, 7]), Pair([2, 8], [9, 10], [11, 3, 3, 5]), Pair([5], [6], [7, 8])]
    dpo = load_section(micro_params(dpo={"pairs": "files", "sample_rows": 2}), "dpo")
    source = PairSource(dpo, Generator(model, tok, 64), nnx.graphdef(model), 0, pairs=pairs)
    expected = [[answer_logp(model, p.prompt, p.chosen), answer_logp(model, p.prompt, p.rejected)] for p in pairs]
    moved = jax.tree.map(lambda x: x + 0.1, nnx.state(model))
    nnx.update(model, moved)  # the policy moves; the reference must not
    assert float(answer_logp(model, pairs[0].prompt, pairs[0].chosen)) != pytest.approx(float(expected[0][0]))
    source.round = 0
    assert source.begin_round(policy=None) == {"pairs/count": 3.0}  # a user's pairs: nothing sampled
    np.testing.assert_allclose(source.rows["ref_logp"], np.asarray(expected, np.float32), rtol=1e-5)


def test_pref_rows_in_trls_formats():
    """TRL's explicit prompt (string or messages), `messages`, and the implicit prompt of whole
    conversations all become the prompt's messages and the two answers' texts."""
    user = {"role": "user", "content": "2+2?"}
    a, b = {"role": "assistant", "content": "4"}, {"role": "assistant", "content": "5"}
    expected = {"messages": json.dumps([user]), "chosen": "4", "rejected": "5"}
    assert pref_row({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) == expected
    assert pref_row({"prompt": [user], "chosen": [a], "rejected": [b]}) == expected
    assert pref_row({"messages": [user], "chosen": "4", "rejected": [b]}) == expected
    assert pref_row({"chosen": [user, a], "rejected": [user, b]}) == expected


def test_file_pairs_are_the_answers_turns_in_the_chat_format(micro_data):
    """A pair's answers are exactly the assistant turn the chat format adds after the prompt."""
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    chat = ChatFormat(tok)
    row = pref_row({"prompt": "What is 2 plus 2?", "chosen": "It is 4.", "rejected": "It is 5."})
    (pair,) = file_pairs(chat, [row])
    assert pair.prompt == chat.user_prompt("What is 2 plus 2?")
    for answer, text in ((pair.chosen, "It is 4."), (pair.rejected, "It is 5.")):
        turns = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": text}]
        ids, mask = chat.conversation(turns)
        assert pair.prompt + answer == ids[: len(pair.prompt) + len(answer)] and all(mask[len(pair.prompt) :])
        assert answer[-1] in chat.stop_ids(chat=True)


@pytest.fixture(scope="module")
def policy(micro_data, tmp_path_factory):
    """A micro model trained by the pretrain stage then the SFT stage (full fine-tuning), once a run."""
    return built_once(tmp_path_factory, "policy", lambda work: train_policy(micro_data, work))


def dpo_command(micro_data, model, work):
    paths = {"--model": model, "--raw": micro_data / "raw", "--val": micro_data / "packed/val"}
    paths |= {"--out": work / "out", "--checkpoints": work / "ckpt", "--params": work / "params.yaml"}
    return [sys.executable, str(ROOT / "stages/dpo.py"), *(x for k, v in paths.items() for x in (k, str(v)))]


@pytest.mark.slow
def test_dpo_stage_resumes_after_sigkill_bitwise(micro_data, policy, tmp_path):
    """Killed after its first checkpoint, in its second round of pairs drawn from the policy's own
    answers, and rerun, the stage ends in the bytes of an uninterrupted run; the merged LoRA model
    moved off the SFT weights, and the metrics say what it drew."""
    change = {"rounds": 2, "steps": 8, "eval_every": 8, "checkpoint_every": 6, "warmup_steps": 1, "batch_size": 4}
    killed, whole, _ = killed_and_whole(
        tmp_path, micro_params(dpo=change), lambda w: dpo_command(micro_data, policy, w)
    )
    assert_same_outputs(killed, whole, "model")
    metrics = read_json(whole / "out/metrics.json")
    assert metrics["pairs"] > 0 and metrics["samples"] == 2 * MICRO_DPO["prompts"] * MICRO_DPO["samples"]
    a, before = load_model(whole / "out/model"), load_model(policy)
    assert a.cfg.lora_rank == 0 and read_json(whole / "out/provenance.json")["stage"] == "dpo"
    leaves = zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(before)), strict=True)
    assert any(not np.array_equal(x, y) for x, y in leaves)
