"""Distillation: alpha = 0 is the CE loss, the KL term vanishes on identical logits, a pruned student is the
teacher cut down, the loss falls, the stage."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, forward, micro_params, run, run_in_process, write_params
from flax import nnx
from resume import assert_same_outputs, killed_and_whole

from stagelm.data.loader import MixedRows, PackedRows, batch_iterator
from stagelm.data.rawdata import read_raw
from stagelm.data.tokenizer import chat_prompt_ids, load_tokenizer
from stagelm.infer.generate import Generator
from stagelm.infra.files import read_json
from stagelm.model.decoder import Decoder, DecoderConfig, count_params
from stagelm.model.modeldir import load_model
from stagelm.pipeline.params import load_section
from stagelm.post.distill import SAMPLED, STUDENT, Distiller, OnPolicyBatches, distill_loss, on_policy_step, soft_kl
from stagelm.post.student import mlp_units, student_from_teacher, teacher_layers
from stagelm.train.batches import PackedBatches
from stagelm.train.step import init_state, lm_loss, make_optimizer, make_train_step

TEACHER = DecoderConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
STUDENT_CFG = DecoderConfig(vocab_size=300, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)


def batch_of(micro_data, split="packed/sft", rows=4):
    data = PackedRows(micro_data / split)
    return {k: jnp.asarray(np.stack([data[i][k] for i in range(rows)])) for k in data.columns}


def test_alpha_zero_is_exactly_the_ce_loss(micro_data):
    model = Distiller(Decoder(STUDENT_CFG, nnx.Rngs(0)), Decoder(TEACHER, nnx.Rngs(1)))
    batch = batch_of(micro_data)
    loss, weight, aux = distill_loss(0.0, 2.0)(model, batch, None)
    ce, ce_weight = lm_loss(model.student, batch, None)
    assert float(weight) == float(ce_weight) > 0
    assert float(loss) == float(ce)  # bit for bit
    assert float(aux["kl"]) > 0  # the teacher differs; only its weight is zero


def test_kl_and_its_gradient_vanish_when_the_student_is_the_teacher(micro_data):
    teacher = Decoder(TEACHER, nnx.Rngs(1))
    twin = Decoder(TEACHER, nnx.Rngs(1))  # the same weights, trained as the student
    model = Distiller(twin, teacher)
    batch = batch_of(micro_data)
    graphdef, params, frozen = nnx.split(model, STUDENT, ...)

    def soft_only(p):
        loss, weight, _ = distill_loss(1.0, 3.0)(nnx.merge(graphdef, p, frozen), batch, None)
        return loss / weight

    value, grads = jax.jit(jax.value_and_grad(soft_only))(params)
    assert abs(float(value)) < 1e-6
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) < 1e-6
    # and it is a real KL: positive for different logits, zero only at equality
    a, b = jax.random.normal(jax.random.key(0), (2, 5, 7))
    assert float(soft_kl(a, a, 2.0).max()) < 1e-6 and float(soft_kl(a, b, 2.0).min()) > 0


def test_reverse_kl_by_hand_and_its_own_zero():
    """distill.kl: reverse is KL(student_T ‖ teacher_T): the forward KL with the roles swapped, by
    hand on one position, and zero (with its gradient) when the student is the teacher."""
    teacher, student = jnp.array([[2.0, 0.0, -1.0]]), jnp.array([[0.5, 0.5, 0.0]])
    t, s = jax.nn.softmax(teacher / 2.0), jax.nn.softmax(student / 2.0)
    by_hand = float(jnp.sum(s * (jnp.log(s) - jnp.log(t))))
    np.testing.assert_allclose(float(soft_kl(teacher, student, 2.0, "reverse")[0]), by_hand, rtol=1e-5)
    np.testing.assert_allclose(float(soft_kl(student, teacher, 2.0)[0]), by_hand, rtol=1e-5)
    assert abs(float(soft_kl(teacher, student, 2.0)[0]) - by_hand) > 1e-3  # the two directions differ here
    grad = jax.grad(lambda x: soft_kl(teacher, x, 2.0, "reverse").sum())(teacher)
    assert float(soft_kl(teacher, teacher, 2.0, "reverse")[0]) < 1e-7 and float(jnp.abs(grad).max()) < 1e-6


def test_a_student_pruned_to_the_teachers_own_shape_is_the_teacher(micro_data):
    teacher = Decoder(dataclasses.replace(TEACHER, tie_embeddings=False), nnx.Rngs(1))
    student = student_from_teacher(teacher, teacher.cfg)
    for x, y in zip(jax.tree.leaves(nnx.state(student)), jax.tree.leaves(nnx.state(teacher)), strict=True):
        np.testing.assert_array_equal(x, y)
    batch = batch_of(micro_data)
    args = (batch["tokens"], batch["segment_ids"], batch["positions"])
    np.testing.assert_array_equal(forward(student, *args), forward(teacher, *args))


def test_a_pruned_student_keeps_the_teachers_strongest_units_and_outlying_layers():
    teacher = Decoder(dataclasses.replace(TEACHER, n_layers=4), nnx.Rngs(1))
    assert teacher_layers(4, 2) == [0, 3] and teacher_layers(4, 4) == [0, 1, 2, 3] and teacher_layers(4, 1) == [0]
    cfg = dataclasses.replace(teacher.cfg, n_layers=2, d_ff=24)
    student = student_from_teacher(teacher, cfg)
    assert count_params(student) < count_params(teacher) / 2
    x = jax.random.normal(jax.random.key(2), (2, 5, TEACHER.d_model))
    for mine, index in zip(student.blocks, [0, 3], strict=True):
        theirs = teacher.blocks[index]
        np.testing.assert_array_equal(mine.attn.kv.w[...], theirs.attn.kv.w[...])
        gate_up, down = np.asarray(theirs.mlp.gate_up.w[...]), np.asarray(theirs.mlp.down.w[...])
        units = mlp_units(gate_up, down, 24)
        score = np.linalg.norm(gate_up[:, 0], axis=0) * np.linalg.norm(gate_up[:, 1], axis=0)
        score *= np.linalg.norm(down, axis=1)
        dropped = np.setdiff1d(np.arange(TEACHER.d_ff), units)
        assert len(units) == 24 and score[units].min() >= score[dropped].max()
        # the student's MLP is the teacher's with the dropped units silenced
        theirs.mlp.down.w[...] = jnp.asarray(down).at[dropped].set(0)
        np.testing.assert_allclose(mine.mlp(x), theirs.mlp(x), rtol=1e-5, atol=1e-6)


def run_steps(model, trainable, loss_fn, rows, steps=30):
    """Train `trainable` of `model` for `steps` steps at lr 1e-2: (trained model, optimizer state, metrics per step)."""
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    cfg = dataclasses.replace(load_section(micro_params(), "distill"), lr=1e-2, steps=steps)
    tx = make_optimizer(cfg, params)
    state = init_state(params, tx, jax.random.key(0))
    step = make_train_step(graphdef, tx, loss_fn)
    it = batch_iterator(rows, 8, 0)
    history = []
    for _ in range(steps):
        state, m = step(state, frozen, {k: v[None] for k, v in next(it).items()})
        history.append({k: float(v) for k, v in m.items()})
    return nnx.merge(graphdef, state.params, frozen), state, history


def test_distillation_loss_falls_and_only_the_student_trains(micro_data):
    rows = MixedRows([PackedRows(micro_data / "packed/train"), PackedRows(micro_data / "packed/sft")])
    teacher, _, _ = run_steps(Decoder(TEACHER, nnx.Rngs(1)), nnx.Param, lm_loss, rows, steps=40)
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(teacher, nnx.Param)))
    model = Distiller(Decoder(STUDENT_CFG, nnx.Rngs(0)), teacher)
    trained, state, history = run_steps(model, STUDENT, distill_loss(0.5, 2.0), rows)
    losses, kls = [h["loss"] for h in history], [h["kl"] for h in history]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5])
    assert np.mean(kls[-5:]) < 0.8 * np.mean(kls[:5])
    adam = state.opt_state[1][0]
    assert sum(x.size for x in jax.tree.leaves(adam.mu)) == sum(x.size for x in jax.tree.leaves(state.params))
    assert sum(x.size for x in jax.tree.leaves(state.params)) == sum(
        x.size for x in jax.tree.leaves(nnx.state(trained.student, nnx.Param))
    )
    after = nnx.to_pure_dict(nnx.state(trained.teacher, nnx.Param))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))


def test_mixed_rows_gives_the_corpus_a_full_loss_mask(micro_data):
    corpus, sft = PackedRows(micro_data / "packed/train"), PackedRows(micro_data / "packed/sft")
    mixed = MixedRows([corpus, sft])
    assert len(mixed) == len(corpus) + len(sft)
    first, last = mixed[0], mixed[len(mixed) - 1]
    np.testing.assert_array_equal(first["tokens"], corpus[0]["tokens"])
    assert first["loss_mask"].all()
    np.testing.assert_array_equal(last["loss_mask"], sft[len(sft) - 1]["loss_mask"])


# --- on-policy distillation -------------------------------------------------------------------------------------


def on_policy_source(micro_data, model, share, rows=8, sequence=0.0):
    """OnPolicyBatches over the micro SFT prompts for `model` (a Distiller), the rest from the packed SFT rows;
    `sequence` of the steps on the teacher's greedy answers."""
    tokenizer = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    gen = Generator(model.student, tokenizer, micro_params()["pack"]["seq_len"])
    conversations = read_raw(micro_data / "raw", "sft").to_pylist()
    packed = PackedBatches(PackedRows(micro_data / "packed/sft"), rows, 0)
    teacher = Generator(model.teacher, tokenizer, gen.capacity)
    source = OnPolicyBatches(packed, share, nnx.graphdef(model), gen, conversations, rows, 0, sequence, teacher)
    return source, conversations


def test_on_policy_rows_are_the_students_own_answers_scored_by_the_teacher_alone(micro_data, pretrained):
    assert [s for s in range(1, 13) if on_policy_step(s, 0.25)] == [4, 8, 12]
    assert all(on_policy_step(s, 1.0) for s in range(1, 5)) and not any(on_policy_step(s, 0.0) for s in range(1, 5))
    teacher = load_model(pretrained)
    model = Distiller(Decoder(dataclasses.replace(teacher.cfg, n_layers=1), nnx.Rngs(0)), teacher)
    source, conversations = on_policy_source(micro_data, model, 0.5)
    _, params, frozen = nnx.split(model, STUDENT, ...)
    packed, _ = source.next(params, frozen)  # step 1: a packed SFT batch
    assert SAMPLED not in packed and packed["tokens"].shape[1] == micro_params()["pack"]["seq_len"] + 1
    batch, host = source.next(params, frozen)  # step 2: the student's answers
    stop = np.asarray(source.stop)
    chosen = np.random.default_rng([0, 2]).choice(len(source.prompts), 8, replace=False)
    tok = source.gen.tokenizer
    every = [chat_prompt_ids(tok, c["messages"][0]["content"]) for c in conversations]
    # the prompts that leave room for the longest reference answer, and only those
    assert source.prompts == [p for p in every if len(p) + source.max_new <= source.gen.capacity]
    assert 0 < source.skipped < len(every)  # the micro context (64) is too short for the longest uses_word prompts
    for row, mask, seg, i in zip(batch["tokens"], batch["loss_mask"], batch["segment_ids"], chosen, strict=True):
        prompt = source.prompts[i]
        start = len(row) - source.max_new
        assert row[start - len(prompt) : start].tolist() == prompt and not mask[:start].any()
        answer = row[start:][mask[start:] == 1]
        assert len(answer) == mask.sum() > 0 and (seg[start:] == mask[start:]).all()
        # the answer runs through its first stop token, or fills the room it has
        assert stop[answer[-1]] or len(answer) == source.max_new
        assert not stop[answer[:-1]].any()
    assert host["on_policy/answer_tokens"] == batch["loss_mask"].sum() / 8
    # On them the loss is the teacher's distribution alone, whatever alpha gives the hard term.
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    soft, _, aux = distill_loss(1.0, 2.0)(model, jbatch, None)
    for alpha in (0.0, 0.5):
        np.testing.assert_allclose(distill_loss(alpha, 2.0)(model, jbatch, None)[0], soft, rtol=1e-6)
    np.testing.assert_allclose(soft, 4.0 * aux["kl"], rtol=1e-6)
    assert float(aux["kl"]) > 0


def trained_on(model, source, loss_fn, steps=30) -> list[dict]:
    """Each step's metrics of `steps` train steps of `model`'s student on `source`'s batches (lr 1e-2, no warmup)."""
    graphdef, params, frozen = nnx.split(model, STUDENT, ...)
    cfg = dataclasses.replace(load_section(micro_params(), "distill"), lr=1e-2, steps=steps, warmup_steps=0)
    tx = make_optimizer(cfg, params)
    state = init_state(params, tx, jax.random.key(0))
    step = make_train_step(graphdef, tx, loss_fn)
    metrics = []
    for _ in range(steps):
        batch, _ = source.next(state.params, frozen)
        state, m = step(state, frozen, {k: v[None] for k, v in batch.items()})
        metrics.append(m)
    return metrics


def test_on_policy_distillation_pulls_the_students_answers_toward_the_teacher(micro_data, pretrained):
    """Every step on the student's own answers: the teacher's KL on them falls."""
    teacher = load_model(pretrained)
    model = Distiller(Decoder(dataclasses.replace(teacher.cfg, n_layers=1), nnx.Rngs(0)), teacher)
    source, _ = on_policy_source(micro_data, model, 1.0)
    kls = [float(m["kl"]) / float(m["tokens"]) for m in trained_on(model, source, distill_loss(0.5, 1.0))]
    assert np.mean(kls[-5:]) < 0.5 * np.mean(kls[:5]), kls


def test_sequence_kd_rows_are_the_teachers_greedy_answers_as_labels(micro_data, pretrained):
    """Sequence-level KD: the teacher's greedy answers, decoded once in batches, equal its answers
    generated one prompt at a time; on them the hard term is the student's CE on those tokens.
    Shared with on-policy steps, the generated steps take turns."""
    teacher = load_model(pretrained)
    model = Distiller(Decoder(dataclasses.replace(teacher.cfg, n_layers=1), nnx.Rngs(0)), teacher)
    source, _ = on_policy_source(micro_data, model, 0.25, sequence=0.25)
    _, params, frozen = nnx.split(model, STUDENT, ...)
    kinds = []
    for _ in range(8):
        batch, host = source.next(params, frozen)
        kinds.append(SAMPLED in batch and "student" or "sequence/answer_tokens" in host and "teacher" or "data")
    assert kinds == ["data", "student", "data", "teacher", "data", "student", "data", "teacher"]
    alone = Generator(teacher, source.gen.tokenizer, source.gen.capacity)
    for i in np.random.default_rng(0).choice(len(source.prompts), 5, replace=False):
        (mine,) = alone.generate([source.prompts[i]], source.max_new, chat=True, stop_at_newline=True)
        length = source.answers[1][i]
        assert source.answers[0][i][:length].tolist() == mine.tokens[:length]
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}  # step 8: the teacher's answers
    hard, _, _ = distill_loss(0.0, 2.0)(model, jbatch, None)
    ce, _ = lm_loss(model.student, jbatch, None)
    np.testing.assert_allclose(hard, ce, rtol=1e-6)


def test_sequence_kd_teaches_the_student_the_teachers_answers(micro_data, pretrained):
    """Every step on the teacher's answers, the hard term alone: the student's loss on them falls."""
    teacher = load_model(pretrained)
    model = Distiller(Decoder(dataclasses.replace(teacher.cfg, n_layers=1), nnx.Rngs(0)), teacher)
    source, _ = on_policy_source(micro_data, model, 0.0, sequence=1.0)
    losses = [float(m["loss"]) for m in trained_on(model, source, distill_loss(0.0, 1.0))]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses


# --- the stage, as a process -----------------------------------------------------------------------------------


def distill_command(micro_data, teacher, work):
    return [
        sys.executable,
        str(ROOT / "stages/distill.py"),
        "--params",
        str(work / "params.yaml"),
        "--teacher",
        str(teacher),
        "--corpus",
        str(micro_data / "packed/train"),
        "--sft",
        str(micro_data / "packed/sft"),
        "--val",
        str(micro_data / "packed/val"),
        "--raw",
        str(micro_data / "raw"),
        "--out",
        str(work / "out"),
        "--checkpoints",
        str(work / "ckpt"),
    ]


@pytest.mark.slow
def test_distill_stage_resumes_after_sigkill_bitwise(micro_data, pretrained, tmp_path):
    # a third of the steps sample the student's answers: their prompts, keys and the packed rows' cursor resume too
    long = {"steps": 30, "checkpoint_every": 10, "eval_every": 15, "log_every": 10, "on_policy": 0.34}
    command = lambda work: distill_command(micro_data, pretrained, work)  # noqa: E731
    killed, whole, _ = killed_and_whole(tmp_path, micro_params(distill=long), command)
    assert_same_outputs(killed, whole, "model")
    assert load_model(killed / "out/model").cfg.d_model == micro_params()["distill"]["student"]["d_model"]
    done, reference = read_json(killed / "out/metrics.json"), read_json(whole / "out/metrics.json")
    assert (done["train_loss"], done["val_loss"]) == (reference["train_loss"], reference["val_loss"])
    assert read_json(whole / "out/provenance.json")["stage"] == "distill"
    tsv = (whole / "out/plots/metrics/on_policy/answer_tokens.tsv").read_text().splitlines()
    column = tsv[0].split("\t").index("step")
    sampled = [int(line.split("\t")[column]) for line in tsv[1:]]
    assert sampled == [s for s in range(1, 31) if on_policy_step(s, 0.34)] and len(sampled) == 10


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"alpha": 1.5}, "distill.alpha: expected a float in [0, 1], got 1.5"),
        ({"temperature": 0}, "distill.temperature: expected a float in (0, 100] (the soft term is scaled by T²"),
        (
            {"student": {"d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 32, "vocab_size": 999}},
            "distill.student.vocab_size: 999 differs from the teacher's",
        ),
        ({"init": "pruned"}, "distill.init: expected one of 'scratch', 'teacher', got 'pruned'"),
        ({"on_policy": 1.5}, "distill.on_policy: expected a float in [0, 1], got 1.5"),
        ({"on_policy": 0.6, "sequence": 0.6}, "distill.sequence: 0.6 plus distill.on_policy 0.6 is more than every"),
        (
            {
                "init": "teacher",
                "student": {
                    "d_model": 16,
                    "n_layers": 1,
                    "n_heads": 2,
                    "n_kv_heads": 1,
                    "d_ff": 32,
                    "vocab_size": None,
                },
            },
            "distill.student.d_model: 16 differs from the teacher's d_model, 32",
        ),
        (
            {
                "init": "teacher",
                "student": {
                    "d_model": 32,
                    "n_layers": 3,
                    "n_heads": 4,
                    "n_kv_heads": 2,
                    "d_ff": 32,
                    "vocab_size": None,
                },
            },
            "distill.student.n_layers: 3 is more than the teacher's n_layers, 2",
        ),
    ],
)
def test_distill_bad_params_fail_in_one_line(micro_data, pretrained, tmp_path, change, message, capsys):
    write_params(tmp_path / "params.yaml", micro_params(distill=change))
    code, stderr = run_in_process(distill_command(micro_data, pretrained, tmp_path), capsys)
    assert code == 2
    (line,) = stderr.strip().splitlines()
    assert message in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_control_run_is_the_student_trained_with_alpha_zero(micro_data, pretrained, tmp_path):
    """`--control` trains what `distill.alpha: 0` trains (the teacher's terms off, nothing else
    changed) whatever alpha and temperature say; a distilled student differs from it."""
    change = {"alpha": 0.9, "temperature": 3.0, "kl": "reverse", "on_policy": 0.5, "sequence": 0.3}
    runs = {"control": (change, ["--control"]), "alpha0": ({"alpha": 0.0}, []), "distilled": (change, [])}
    for name, (change, flags) in runs.items():
        work = tmp_path / name
        work.mkdir()
        write_params(work / "params.yaml", micro_params(distill=change))
        run(distill_command(micro_data, pretrained, work) + flags, work)
    states = {name: jax.tree.leaves(nnx.state(load_model(tmp_path / name / "out/model"))) for name in runs}
    for a, b in zip(states["control"], states["alpha0"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert any(not np.allclose(a, b, atol=1e-3) for a, b in zip(states["control"], states["distilled"], strict=True))
    provenance = read_json(tmp_path / "control/out/provenance.json")
    assert provenance["stage"] == "distill_control" and provenance["control"] is True
    assert provenance["params"]["distill"]["alpha"] == 0.0  # what it ran with, not what params.yaml says
    assert provenance["params"]["distill"]["on_policy"] == 0.0 and provenance["params"]["distill"]["kl"] == "forward"
