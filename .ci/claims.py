"""Check what README.md and docs/default-run.md claim against the metric files of a finished `dvc repro`.

    python .ci/claims.py          # from the project root, after `make repro`

Each claim reads produced files only (manifests, metrics.json) and the params they
were made with; any failure prints the claim and exits 1.
"""

import json
import math
import sys
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from data_lock import locks  # .ci/, this script's folder
from safetensors import safe_open
from tokenizers import Tokenizer

from stagelm.measure.report import best_view, wrong_answers
from stagelm.tasks import check_answer

FAILED: list[str] = []


def claim(ok: bool, text: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {text}")
    if not ok:
        FAILED.append(text)


def target(met: bool, text: str) -> None:
    """A target of the default recipe (docs/default-run.md) not yet shown on seeds 0, 1 and 2: printed, not gated."""
    print(f"info  {text}: {'met' if met else 'NOT met'} (a target, gated once it holds on three seeds)")


def load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def data_claims(params: dict) -> None:
    raw = load("data/raw/manifest.json")
    docs = raw["documents"]
    claim(docs["train"] > 0 and docs["val"] > 0, f"download: {docs['train']} train and {docs['val']} val documents")
    if params["data"]["source"] == "synthetic":
        total = params["data"]["num_documents"]
        claim(docs["train"] + docs["val"] == total, f"download: the synthetic corpus has data.num_documents={total}")
        for family, n in raw["families"]["eval"].items():
            claim(n >= 1000, f"download: {n} held-out eval prompts for {family} (>= 1,000)")
    size = Tokenizer.from_file("data/tokenizer/tokenizer.json").get_vocab_size()
    claim(size <= params["tokenizer"]["vocab_size"], f"tokenizer: {size} tokens <= tokenizer.vocab_size")
    for split in ("train", "val", "sft"):
        m = load(f"data/packed/{split}/manifest.json")
        claim(
            m["tokens"] > 0 and m["seq_len"] == params["pack"]["seq_len"], f"pack: {split} holds {m['tokens']} tokens"
        )
    train = load("data/packed/train/manifest.json")
    claim(
        train["packing_efficiency"] > 0.99, f"pack: train packing efficiency {train['packing_efficiency']:.4f} > 0.99"
    )


def pretrain_claims(params: dict) -> None:
    m = load("runs/pretrain/metrics.json")
    claim(m["step"] == params["training"]["steps"], f"pretrain: ran training.steps={m['step']} steps")
    unigram = load("data/packed/train/manifest.json")["unigram_entropy_nats"]
    claim(
        m["val_loss"] < 0.5 * unigram,
        f"pretrain: val loss {m['val_loss']:.3f} nats is under half the unigram entropy {unigram:.3f} nats",
    )
    worked = load("runs/eval/pretrain/metrics.json")["completion"]["arithmetic"]["accuracy"]
    # On arithmetic alone (issue 36) 400 steps left seed 2 at 0.764; 600 give 0.995, 1.000 and 0.980 on seeds
    # 0, 1 and 2 (issue 56, docs/default-run.md), so it is gated again
    claim(worked >= 0.80, f"pretrain: completion-format arithmetic {worked:.3f} (>= 0.80)")


def pipeline() -> dict:
    return yaml.safe_load(Path("dvc.yaml").read_text())


def model_stages() -> list[str]:
    return [m for entry in pipeline()["vars"] for m in str(entry.get("models", "")).split(",") if m]


def eval_claims(params: dict) -> None:
    models = model_stages()
    report = Path("runs/report.md").read_text()
    asked = {"completion": params["sample"]["prompts"], "chat": params["sample"]["chat_prompts"]}
    formats = {name: item["format"] for name, item in pipeline()["stages"]["sample"]["foreach"].items()}
    for name in models:
        m = load(f"runs/eval/{name}/metrics.json")
        n = m["chat"]["n"]
        claim(n >= 500, f"eval@{name}: accuracy measured on {n} held-out prompts per format (>= 500)")
        samples = [json.loads(line) for line in Path(f"runs/samples/{name}.jsonl").read_text().splitlines()]
        form = formats[name]  # as dvc.yaml runs it
        key = "sample.prompts" if form == "completion" else "sample.chat_prompts"
        claim(
            [(s["prompt"], s["format"]) for s in samples] == [(p, form) for p in asked[form]],
            f"sample@{name}: {len(samples)} samples ({form}, as dvc.yaml asks), one per {key} entry",
        )
        claim(f"| {name} |" in report, f"report: names {name}")
        opening = report.split("## Models")[0]
        claim(f"\n- **{name}** " in opening, f"report: the stage-by-stage section says what {name} added")
        claim(Path(f"runs/report/{name}_loss.png").is_file(), f"report: a loss curve for {name}")


def pooled(scores: dict, families: list[str]) -> tuple[float, float]:
    """(accuracy, standard error) over the prompts of `families` in one format's scores."""
    n = sum(scores[f]["n"] for f in families)
    p = sum(scores[f]["accuracy"] * scores[f]["n"] for f in families) / n
    return p, math.sqrt(p * (1 - p) / n)


def sft_claims() -> None:
    """SFT against pretraining on the families the SFT set teaches (word_limit is asked only in rl and eval).

    Pretraining already works sums out in the completion format (pretrain_claims); what SFT
    adds is the chat format, without costing the language model."""
    pre, sft = load("runs/eval/pretrain/metrics.json"), load("runs/eval/sft/metrics.json")
    taught = sorted(load("data/raw/manifest.json")["families"]["sft"])
    (a, a_se), (b, b_se) = pooled(sft["chat"], taught), pooled(pre["chat"], taught)
    se = math.sqrt(a_se**2 + b_se**2)
    claim(
        a - b >= 3 * se,
        f"sft: chat accuracy on {taught} {a:.3f} beats pretrain's chat accuracy {b:.3f} "
        f"by {(a - b) / se:.1f} standard errors of the difference (>= 3)",
    )
    best, _ = pooled(pre[pre["accuracy_format"]], taught)
    print(f"info  sft: pretrain's best format ({pre['accuracy_format']}) on {taught}: {best:.3f}")
    arithmetic = sft["chat"]["arithmetic"]["accuracy"]
    claim(arithmetic >= 0.90, f"sft: chat arithmetic {arithmetic:.3f} (>= 0.90)")  # 600 steps: 0.976, 0.986, 0.936
    cost = sft["val_loss"] - pre["val_loss"]
    claim(  # held on seeds 0, 1 and 2 (-0.009, -0.004, -0.014 on arithmetic alone)
        cost <= 0.25,
        f"sft: corpus val loss {pre['val_loss']:.3f} → {sft['val_loss']:.3f} nats, {cost:+.3f} (<= +0.25)",
    )


def distill_claims(params: dict) -> None:
    m, prov = load("runs/distill/metrics.json"), load("runs/distill/provenance.json")
    claim(m["step"] == params["distill"]["steps"], f"distill: ran distill.steps={m['step']} steps")
    student, teacher = prov["student_params"], prov["teacher_params"]
    claim(
        2 * student <= teacher, f"distill: the student has {student:,} params, at most half the teacher's {teacher:,}"
    )
    control = load("runs/distill_control/provenance.json")
    claim(
        control["control"]
        and control["student_params"] == student
        and control["params"]["seed"] == prov["params"]["seed"],
        "distill_control: the same student and seed as distill, the teacher's terms off",
    )
    ev, ctl = load("runs/eval/distill/metrics.json"), load("runs/eval/distill_control/metrics.json")
    claim(  # held on seeds 0, 1 and 2 from 600 pretraining steps on, as did the two bars below (docs/default-run.md)
        ev["val_loss"] < ctl["val_loss"],
        f"distill: the student's corpus val loss {ev['val_loss']:.4f} against its control's "
        f"{ctl['val_loss']:.4f} (lower)",
    )
    for kind, bar, gated in (("chat_sampled", 3, True), ("chat", -1, True), ("chat", 3, False)):
        a, b = ev[kind]["arithmetic"], ctl[kind]["arithmetic"]
        se = math.hypot(a["accuracy_se"], b["accuracy_se"])
        diff = (a["accuracy"] - b["accuracy"]) / se if se else 0.0
        (claim if gated else target)(
            diff >= bar,
            f"distill: {kind} arithmetic {a['accuracy']:.3f} against its control's {b['accuracy']:.3f}, "
            f"{diff:+.3f} SE (>= {bar:+d})",  # three decimals: alpha 0.6 reads +2.997 on seed 0
        )


def grpo_claims(params: dict) -> None:
    """GRPO against SFT: the rewarded families do not lose, greedy or at their best temperatures, every other
    family holds and the language model holds, as on seeds 0, 1 and 2; issue 56's gains are printed."""
    m = load("runs/grpo/metrics.json")
    claim(m["step"] == params["grpo"]["steps"], f"grpo: ran grpo.steps={m['step']} optimizer steps")
    rows = Path("runs/grpo/plots/metrics/rollout/reward.tsv").read_text().strip().splitlines()[1:]
    rollouts = params["grpo"]["steps"] // params["grpo"]["updates_per_rollout"]
    claim(len(rows) == rollouts, f"grpo: {len(rows)} rollouts' rewards logged (steps / updates_per_rollout)")
    first, last = m["accuracy_first10"], m["accuracy_last10"]
    claim(  # issue 56's unsure weights train on the prompts still missed, so the rise that sharpening gave
        len(rows) >= 20 and last >= first,  # (+0.05 and more) is gone: +0.030, +0.014, +0.053 on seeds 0, 1, 2
        f"grpo: binary rollout accuracy over {len(rows)} rollouts (>= 20), first ten {first:.3f}, last ten {last:.3f} "
        "(does not fall)",
    )
    entropy = Path("runs/grpo/plots/metrics/rollout/entropy.tsv").read_text().strip().splitlines()[1:]
    claim(
        len(entropy) == rollouts and "![grpo dynamics](report/grpo_dynamics.png)" in Path("runs/report.md").read_text(),
        f"grpo: the policy's entropy logged for every rollout ({len(entropy)}) and plotted in the report "
        f"({m['entropy_first10']:.3f} → {m['entropy_last10']:.3f} nats/token, first and last ten)",
    )
    sft, grpo = load("runs/eval/sft/metrics.json"), load("runs/eval/grpo/metrics.json")
    cost = grpo["val_loss"] - sft["val_loss"]
    claim(cost <= 0.05, f"grpo: corpus val loss {sft['val_loss']:.3f} → {grpo['val_loss']:.3f} nats (<= +0.05)")
    rewarded = params["grpo"]["families"]
    for family in sorted(k for k, v in grpo["chat"].items() if isinstance(v, dict)):
        greedy = change(sft["chat"][family], grpo["chat"][family])
        if family not in rewarded:
            claim(greedy[0] >= -1, f"grpo: holds sft's unrewarded {family}, greedy {greedy[1]} (>= -1)")
            continue
        constant_answer_claim(family)
        (t0, sft_best), (t1, grpo_best) = best_view(sft), best_view(grpo)
        best = change(sft_best[family], grpo_best[family])
        at_best = f"at each one's best temperature (sft T={t0:g}, grpo T={t1:g}) {best[1]}"
        # Held on seeds 0, 1 and 2 since 120 updates: greedy +2 SE (+3.3, +2.4, +2.8; +2.3 over three draws on seeds 1
        # and 2) and no loss at the best temperature; issue 56's +3 SE there holds on seed 0 only (docs/grpo.md)
        # Issue 70: a post-training stage is measured by the share of its parent's greedy errors it removes
        # (75% on seed 0, 64-71% on seed 1, where the committed dvc.lock was made); the standard errors stay
        # in the report and here as information. A target, not a gate: on a fresh clone on an AMD EPYC without
        # AVX-512 (other weights from the same seed) it removed 39 -> 36 (8%) on 2026-12-07.
        removed = errors_removed(sft["chat"][family], grpo["chat"][family])
        target(removed[0] >= 0.5, f"grpo: rewarded {family} greedy errors {removed[1]} (>= 50% removed)")
        print(f"info  grpo: rewarded {family} greedy {greedy[1]} (issue 56's bar was +2)")
        claim(best[0] >= -1, f"grpo: rewarded {family} {at_best} (>= -1)")
        target(best[0] >= 3, f"grpo: rewarded {family} {at_best} (>= +3)")
        sampled = change(sft["chat_sampled"][family], grpo["chat_sampled"][family])
        print(f"info  grpo: rewarded {family} sampled at T=1 {sampled[1]} (sharpening: a temperature gives it free)")
        passes = sft.get("chat_pass_k", {}).get(family), grpo.get("chat_pass_k", {}).get(family)
        if all(passes):
            k, n = grpo["chat_pass_k"]["k"], passes[1]["n"]
            before, after = (p[f"pass_at_{k}"] for p in passes)
            claim(
                n >= 100 and after >= before - 0.02,
                f"grpo: rewarded {family} pass@{k} on {n} prompts (>= 100) {before:.3f} → {after:.3f} (>= -0.02)",
            )


def errors_removed(before: dict, after: dict) -> tuple[float, str]:
    """(the share of `before`'s greedy errors that `after` no longer makes, a phrase) of one family."""
    wrong = [wrong_answers(m) for m in (before, after)]
    share = (wrong[0] - wrong[1]) / wrong[0] if wrong[0] else 0.0
    return share, f"{wrong[0]} → {wrong[1]} ({share:.0%} removed)"


def dpo_claims(params: dict) -> None:
    """DPO against SFT: it ran, drew pairs and kept the language model; issue 70's goals (greedy errors
    removed, pass@k, stage time beside GRPO's) are targets, not yet shown on three seeds."""
    m = load("runs/dpo/metrics.json")
    ran = f"dpo: ran dpo.steps={m['step']} optimizer steps on {m['pairs']:.0f} pairs"
    claim(m["step"] == params["dpo"]["steps"] and m["pairs"] > 0, ran)
    sft, dpo = load("runs/eval/sft/metrics.json"), load("runs/eval/dpo/metrics.json")
    cost = dpo["val_loss"] - sft["val_loss"]
    claim(cost <= 0.05, f"dpo: corpus val loss {sft['val_loss']:.3f} → {dpo['val_loss']:.3f} nats (<= +0.05)")
    for family in params["dpo"]["families"]:
        removed = errors_removed(sft["chat"][family], dpo["chat"][family])
        target(removed[0] >= 0.4, f"dpo: {family} greedy errors {removed[1]} (>= 40% removed)")
        k = dpo["chat_pass_k"]["k"]
        before, after = sft["chat_pass_k"][family][f"pass_at_{k}"], dpo["chat_pass_k"][family][f"pass_at_{k}"]
        target(after >= before - 0.02, f"dpo: {family} pass@{k} {before:.3f} → {after:.3f} (>= -0.02)")
    times = {name: stage_seconds(name) for name in ("dpo", "grpo")}
    took = f"dpo: stage time {times['dpo']:.0f} s, grpo's {times['grpo']:.0f} s (<= half)"
    target(times["dpo"] <= times["grpo"] / 2, took)


def stage_seconds(name: str) -> float:
    prov = load(f"runs/{name}/provenance.json")
    return (datetime.fromisoformat(prov["finished"]) - datetime.fromisoformat(prov["started"])).total_seconds()


def change(before: dict, after: dict) -> tuple[float, str]:
    """(the change in standard errors of the difference, a phrase) of one family's accuracy."""
    se = math.hypot(before["accuracy_se"], after["accuracy_se"])
    diff = (after["accuracy"] - before["accuracy"]) / se if se else 0.0
    return diff, f"{before['accuracy']:.3f} → {after['accuracy']:.3f}, {diff:+.1f} SE"


def constant_answer_claim(family: str) -> None:
    """GRPO's most frequent greedy answer on `family`, given to every held-out prompt, passes at most 5%."""
    specs = {
        row["chat_prompt"]: json.loads(row["spec"])
        for row in pq.read_table("data/raw/eval.parquet").to_pylist()
        if row["family"] == family
    }
    answers = [
        r["completion"]
        for r in map(json.loads, Path("runs/eval/grpo/predictions.jsonl").read_text().splitlines())
        if r["family"] == family and r["format"] == "chat"
    ]
    top = max(set(answers), key=answers.count)
    share = sum(check_answer(family, spec, top)[1] for spec in specs.values()) / len(specs)
    claim(
        share <= 0.05,
        f"grpo: its most frequent {family} answer ({answers.count(top)} of {len(answers)}: {top.strip()!r}) "
        f"passes {share:.1%} of the held-out prompts when given to all (<= 5%)",
    )


def benchmark_claims() -> None:
    m = load("runs/benchmark/metrics.json")
    keys = [
        "train.tokens_per_sec",
        "train.first_call_seconds",
        "train.matmul_fraction",
        "decode.cached_b1.tokens_per_sec",
        "decode.cached_b8.tokens_per_sec",
        "decode.naive_b1.tokens_per_sec",
        "loader.tokens_per_sec",
    ]
    for key in keys:
        value = m
        for part in key.split("."):
            value = value.get(part, {}) if isinstance(value, dict) else None
        claim(isinstance(value, float) and value > 0, f"benchmark: {key} is measured ({value})")
    for b in (1, 8):
        speedup = m["decode"][f"speedup_b{b}"]
        claim(speedup >= 5, f"benchmark: cached decode is {speedup:.1f}x naive recomputation at batch {b} (>= 5x)")
    margin = m["loader"]["margin_over_train"]
    claim(margin >= 10, f"benchmark: the loader delivers {margin:,.0f}x the tokens a train step consumes (>= 10x)")


def model_params(model_dir: str) -> int:
    """The parameter count of a saved model, from its safetensors header."""
    with safe_open(f"{model_dir}/params.safetensors", "numpy") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (no __iter__)


def locked_md5(stages: dict, path: str) -> str | None:
    """The md5 dvc.lock's stages record for the output at `path`, or None when no stage writes it."""
    for entry in stages.values():
        for out in entry.get("outs", []):
            if out["path"] == path:
                return out.get("md5")
    return None


def readme_claims() -> None:
    """README's table of the default run ("What the default run gives") against the metric
    files: each figure as printed, to its three decimals. The table is one run on one CPU
    kind: a row is checked where this run's eval metrics are byte-identical to the ones the
    committed dvc.lock records (the same kind of CPU and the same libraries); elsewhere
    XLA's kernels round differently, training drifts apart, and the row is printed beside
    this machine's figures instead (docs/reproducibility.md)."""
    text = Path("README.md").read_text().split("## What the default run gives")[1].split("\n## ")[0]
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    header = [cell.strip() for cell in rows[0]]
    claim(
        header == ["model", "params", "val loss (nats)", "greedy", "sampled", "pass@8"],
        f"README: the default run's table has the columns this check reads ({header})",
    )
    committed, reproduced = locks()
    for cells in rows[1:]:
        name, params, loss, greedy, sampled, pass8 = (c.strip() for c in cells)
        stage = name.split(" ")[0]
        path = f"runs/eval/{stage}/metrics.json"
        m = load(path)
        count = model_params(f"runs/{stage}/model")
        kind = "completion" if stage == "pretrain" else "chat"
        printed = [
            f"{count / 1e6:.2f} M",
            f"{m['val_loss']:.3f}",
            f"{m[kind]['arithmetic']['accuracy']:.3f}",
            "" if stage == "pretrain" else f"{m['chat_sampled']['arithmetic']['accuracy']:.3f}",
            "" if stage == "pretrain" else f"{m['chat_pass_k']['arithmetic']['pass_at_8']:.3f}",
        ]
        if locked_md5(reproduced, path) == locked_md5(committed, path):
            claim(
                [params, loss, greedy, sampled, pass8] == printed,
                f"README: the default run's row for {stage} is what its files hold ({printed})",
            )
        else:
            print(
                f"info  README: the default run's row for {stage} is not checked here: {path} differs from the "
                f"committed dvc.lock's (another CPU kind or library); README {[params, loss, greedy, sampled, pass8]}, "
                f"this run {printed}"
            )


def main() -> None:
    params = yaml.safe_load(Path("params.yaml").read_text())
    data_claims(params)
    pretrain_claims(params)
    eval_claims(params)
    sft_claims()
    distill_claims(params)
    grpo_claims(params)
    dpo_claims(params)
    benchmark_claims()
    readme_claims()
    if FAILED:
        print(f"{len(FAILED)} claim(s) failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
