"""The report: one Markdown page (plus PNG curves) a person reads after `dvc repro`.

It gathers, per model stage: the eval metrics, the training summary, the model's
size, its samples and its lineage (commit, params hash, input hashes) from
provenance.json, and draws one loss-curve picture per training stage from the
dvclive plot files. Plain Markdown with relative image links, so it reads the same
on GitHub and in any Markdown viewer.
"""

import csv
import hashlib
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from stagelm.infra.files import read_json
from stagelm.pipeline.config import temperature_key


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_curve(tsv: Path) -> tuple[list[int], list[float]]:
    if not tsv.is_file():
        return [], []
    with tsv.open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [int(r["step"]) for r in rows], [float(r[tsv.stem]) for r in rows]


def loss_curve(
    plots_dir: Path,
    title: str,
    out_png: Path,
    curves: tuple = (("train/loss.tsv", "-"), ("val/loss.tsv", "o-")),
    ylabel: str = "loss (nats/token)",
) -> None:
    """Curves of dvclive plot files (train and val loss by default) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, style in curves:
        steps, values = read_curve(plots_dir / name)
        if steps:
            ax.plot(steps, values, style, label=name.removesuffix(".tsv"), markersize=4)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, metadata={"Software": None})  # no version stamp: the same curve gives the same bytes
    plt.close(fig)


# An RL stage's dynamics, one panel each: (title, [(plot file, style)], y label).
DYNAMICS = (
    ("entropy of the sampling policy", [("rollout/entropy.tsv", "-")], "nats/token"),
    (
        "groups of a rollout",
        [
            ("rollout/all_right_groups.tsv", "-"),
            ("rollout/mixed_groups.tsv", "--"),
            ("rollout/all_wrong_groups.tsv", ":"),
        ],
        "share",
    ),
    ("KL to the reference (k3)", [("train/kl.tsv", "-")], "nats/token"),
    ("gradient norm", [("train/grad_norm.tsv", "-")], "global norm"),
)


def dynamics_figure(plots_dir: Path, title: str, out_png: Path) -> None:
    """The RL dynamics beside each other (`DYNAMICS`): entropy first, since it falls as the
    policy sharpens and the reward tracks it; then the groups' shape, the KL and the gradient."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 5.5), dpi=100)
    for ax, (name, curves, ylabel) in zip(axes.flat, DYNAMICS, strict=True):
        drawn = 0
        for tsv, style in curves:
            steps, values = read_curve(plots_dir / tsv)
            if steps:
                ax.plot(steps, values, style, label=tsv.removesuffix(".tsv").split("/")[1])
                drawn += 1
        if not drawn:  # e.g. the KL with grpo.kl_coef 0, which scores no reference
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel="step", ylabel=ylabel, title=name)
        ax.grid(alpha=0.3)
        if len(curves) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, metadata={"Software": None})
    plt.close(fig)


def flat_numbers(tree: dict, prefix: str = "", skip: tuple = ()) -> list[tuple[str, float]]:
    """(dotted key, value) of every number in a nested dict, in order, leaving out the `skip` keys."""
    out = []
    for key, value in tree.items():
        if key in skip:
            continue
        if isinstance(value, dict):
            out += flat_numbers(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append((f"{prefix}{key}", value))
    return out


def params_hash(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


def model_summary(runs: Path, name: str) -> dict[str, Any]:
    """What the report shows of model stage `name`."""
    ev = read_json(runs / "eval" / name / "metrics.json")
    train = read_json(runs / name / "metrics.json")
    prov = read_json(runs / name / "provenance.json")
    config = read_json(runs / name / "model" / "config.json")
    wall = (datetime.fromisoformat(prov["finished"]) - datetime.fromisoformat(prov["started"])).total_seconds()
    return {
        "name": name,
        "eval": ev,
        "train": train,
        "provenance": prov,
        "params_count": config.get("params_count"),
        "wall_seconds": wall,
    }


def model_table(models: list[dict]) -> list[str]:
    lines = [
        "| model | val loss | perplexity | bits/byte | accuracy (format) | completion | chat | params | "
        "training tokens | wall time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in models:
        e = m["eval"]
        acc = f"{e['accuracy']:.3f} ± {e['accuracy_se']:.3f} ({e['accuracy_format']})"
        lines.append(
            f"| {m['name']} | {e['val_loss']:.4f} | {e['perplexity']:.3f} | {e['bits_per_byte']:.4f} | {acc} | "
            f"{e['completion']['accuracy']:.3f} | {e['chat']['accuracy']:.3f} | {m['params_count']:,} | "
            f"{m['train']['tokens_seen']:,} | {m['wall_seconds']:.0f} s |"
        )
    return lines


def family_table(models: list[dict]) -> list[str]:
    families = sorted({k for m in models for k, v in m["eval"]["chat"].items() if isinstance(v, dict)})
    lines = ["| model | format | " + " | ".join(families) + " |", "|---|---|" + "---|" * len(families)]
    for m in models:
        for fmt in ("completion", "chat"):
            cells = [f"{m['eval'][fmt][f]['accuracy']:.3f} ± {m['eval'][fmt][f]['accuracy_se']:.3f}" for f in families]
            lines.append(f"| {m['name']} | {fmt} | " + " | ".join(cells) + " |")
    return lines


def lm_eval_table(models: list[dict]) -> list[str]:
    """lm-eval's figures of every model (`eval.lm_eval_tasks`), one column per task and metric, ± its
    standard error; none when no eval ran a task."""
    columns = sorted(
        {
            (task, path)
            for m in models
            for task, figures in m["eval"].get("lm_eval", {}).items()
            for path, _ in flat_numbers(figures)
            if path != "samples" and not path.endswith("_stderr")
        }
    )
    if not columns:
        return []
    lines = ["| model | " + " | ".join(f"{t} {p}" for t, p in columns) + " |", "|---|" + "---|" * len(columns)]
    for m in models:
        figures = {task: dict(flat_numbers(v)) for task, v in m["eval"].get("lm_eval", {}).items()}
        cells = []
        for task, path in columns:
            value, se = figures.get(task, {}).get(path), figures.get(task, {}).get(path + "_stderr")
            cells.append("" if value is None else f"{value:.4g}" + (f" ± {se:.2g}" if se is not None else ""))
        lines.append(f"| {m['name']} | " + " | ".join(cells) + " |")
    return lines


def parent_of(m: dict, names: list[str]) -> tuple[str, str] | None:
    """(input name, model) a stage started from, read from its provenance: ("model", "pretrain")
    for SFT, ("teacher", "sft") for distillation; None for a model trained from scratch."""
    for key in ("teacher", "model"):
        path = m["provenance"].get("inputs", {}).get(key, {}).get("path", "")
        for name in names:
            if f"/{name}/model/" in f"/{path}":
                return key, name
    return None


def control_of(m: dict, models: list[dict]) -> dict | None:
    """The control run of distilled model `m`: the teacher's terms off, the same teacher."""
    teacher = m["provenance"].get("inputs", {}).get("teacher", {}).get("path")
    for other in models:
        prov = other["provenance"]
        if prov.get("control") and prov.get("inputs", {}).get("teacher", {}).get("path") == teacher:
            return other
    return None


def cell(metrics: dict, family: str) -> str:
    f = metrics.get(family)
    return f"{f['accuracy']:.3f} ± {f['accuracy_se']:.3f}" if f else "—"


def pass_view(e: dict) -> tuple[str, dict] | None:
    """The eval's pass@k in the shape of an accuracy (per family: accuracy, accuracy_se), or None."""
    passes = e.get("chat_pass_k")
    if not passes:
        return None
    k = passes["k"]
    view = {
        f: {"accuracy": v[f"pass_at_{k}"], "accuracy_se": v[f"pass_at_{k}_se"]}
        for f, v in passes.items()
        if isinstance(v, dict)
    }
    return f"chat, pass@{k} at T={passes['temperature']:g} (first {passes['n'] // max(len(view), 1)} per family)", view


BAR_SE = 3.0  # a distilled student beats its control by at least this many standard errors, greedy


def stage_table(models: list[dict]) -> list[str]:
    """One row per model and format it is read in: the base model's completion and chat, a tuned
    model's chat, and its chat sampled at the eval's temperature when the eval measured it."""
    families = sorted({k for m in models for k, v in m["eval"]["chat"].items() if isinstance(v, dict)})
    lines = [
        "| stage | started from | val loss | asked | " + " | ".join(families) + " |",
        "|---|---|---|---|" + "---|" * len(families),
    ]
    names = [m["name"] for m in models]
    for m in models:
        e, parent = m["eval"], parent_of(m, names)
        rows = [("completion", e["completion"]), ("chat", e["chat"])] if parent is None else [("chat", e["chat"])]
        if "chat_sampled" in e:
            rows.append((f"chat, sampled at T={e['chat_sampled']['temperature']:g}", e["chat_sampled"]))
        best = best_view(e)
        if best:
            of = "/".join(f"{float(t):g}" for t in e["chat_temperatures"])
            rows.append((f"chat, sampled at its best T={best[0]:g} (of {of})", best[1]))
        passes = pass_view(e)
        if passes:
            rows.append(passes)
        role = " (teacher's terms off)" if m["provenance"].get("control") else " (teacher)"
        origin = "random weights" if parent is None else parent[1] + (role if parent[0] == "teacher" else "")
        for i, (asked, metrics) in enumerate(rows):
            first = i == 0
            lead = f"| {m['name']} | {origin} | {e['val_loss']:.3f} |" if first else "| | | |"
            lines.append(f"{lead} {asked} | " + " | ".join(cell(metrics, f) for f in families) + " |")
    return lines


def best_view(e: dict) -> tuple[float, dict] | None:
    """(best temperature, its metrics) of an eval's `chat_temperatures`, or None when it has none."""
    temps = e.get("chat_temperatures")
    if not temps:
        return None
    t = float(e["chat_best_temperature"])
    return t, temps[temperature_key(t)]


def at_best_temperatures(before: dict, after: dict, names: tuple[str, str], families: list[str]) -> str:
    """Each family's change with both models sampled at their best temperatures, and whether a
    sampled gain at the eval's temperature is no more than the first model's best temperature
    gives for free."""
    best_before, best_after = best_view(before), best_view(after)
    if not (best_before and best_after):
        return ""
    (t0, v0), (t1, v1) = best_before, best_after
    text = f"; at each one's best temperature ({names[0]} T={t0:g}, {names[1]} T={t1:g}): " + ", ".join(
        change(v0, v1, f) for f in families
    )
    if "chat_sampled" in before and "chat_sampled" in after:
        t, gain = after["chat_sampled"]["temperature"], after["chat_sampled"]["accuracy"]
        if gain > before["chat_sampled"]["accuracy"] and gain <= v0["accuracy"]:
            text += (
                f"; its sampled gain at T={t:g} ({gain:.3f}, from {before['chat_sampled']['accuracy']:.3f}) is no "
                f"more than sampling {names[0]} at T={t0:g} gives for free ({v0['accuracy']:.3f}, no training)"
            )
    return text


def change(before: dict, after: dict, family: str) -> str:
    """`family`'s accuracy before → after, with the difference in standard errors of the difference."""
    a, b = before[family], after[family]
    se = math.hypot(a["accuracy_se"], b["accuracy_se"])
    diff = b["accuracy"] - a["accuracy"]
    size = f" ({diff / se:+.1f} SE)" if se > 0 else ""
    return f"{family} {a['accuracy']:.3f} → {b['accuracy']:.3f}{size}"


def stage_sentences(models: list[dict]) -> list[str]:
    """One sentence per stage: what it added to the model it started from, in the numbers above."""
    by_name = {m["name"]: m for m in models}
    out = []
    for m in models:
        parent = parent_of(m, list(by_name))
        if parent is None:
            out.append(base_sentence(m))
        elif parent[0] == "teacher":
            out.append(student_sentence(m, by_name[parent[1]], models))
        else:
            out.append(tuned_sentence(m, by_name[parent[1]]))
    return out


def families_of(e: dict) -> list[str]:
    return sorted(k for k, v in e["chat"].items() if isinstance(v, dict))


def base_sentence(m: dict) -> str:
    """A model trained from random weights: its tokens, val loss and completion accuracies."""
    e = m["eval"]
    accs = ", ".join(f"{f} {e['completion'][f]['accuracy']:.3f}" for f in families_of(e))
    return (
        f"- **{m['name']}** trained {m['params_count']:,} parameters from random weights on "
        f"{m['train']['tokens_seen']:,} tokens to a val loss of {e['val_loss']:.3f} nats/token; "
        f"asked in the completion format it answers {accs}."
    )


def student_sentence(m: dict, teacher: dict, models: list[dict]) -> str:
    """A distilled student (or its control) against its teacher, and against its control."""
    e, source, families = m["eval"], teacher["eval"], families_of(m["eval"])
    pruned = m["provenance"].get("params", {}).get("distill", {}).get("init") == "teacher"
    how = "cut from its teacher" if pruned else "from random weights,"
    if m["provenance"].get("control"):
        return (
            f"- **{m['name']}** trained the same {m['params_count']:,}-parameter student ({how.rstrip(',')}, "
            f"the same data, steps and seed) with the teacher's terms off, on its own next-token loss: "
            f"the control distillation is measured against; val loss {e['val_loss']:.3f}."
        )
    share = m["params_count"] / teacher["params_count"]
    accs = ", ".join(
        f"{f} {e['chat'][f]['accuracy']:.3f} (teacher {source['chat'][f]['accuracy']:.3f})" for f in families
    )
    sentence = (
        f"- **{m['name']}** trained a {m['params_count']:,}-parameter student ({share:.0%} of its teacher "
        f"{teacher['name']}; {how} then distilled) to a val loss of {e['val_loss']:.3f} "
        f"(teacher {source['val_loss']:.3f}); chat: {accs}"
    )
    control = control_of(m, models)
    if control:
        c = control["eval"]
        sentence += f". Against its control {control['name']} (val loss {c['val_loss']:.3f}): greedy " + ", ".join(
            change(c["chat"], e["chat"], f) for f in families
        )
        if "chat_sampled" in e and "chat_sampled" in c:
            sentence += "; sampled " + ", ".join(change(c["chat_sampled"], e["chat_sampled"], f) for f in families)
        sentence += at_best_temperatures(c, e, (control["name"], m["name"]), families)
        sentence += beats_control(c, e, families)
    return sentence + "."


def beats_control(control: dict, student: dict, families: list[str]) -> str:
    """Whether the distilled student beats its control by issue 56's bar (greedy ≥ +3 SE on every
    family and a lower corpus val loss), said in so many words when it does not."""
    short = []
    for f in families:
        a, b = control["chat"][f], student["chat"][f]
        se = math.hypot(a["accuracy_se"], b["accuracy_se"])
        diff = (b["accuracy"] - a["accuracy"]) / se if se else 0.0
        if diff < BAR_SE:  # a miss that one decimal would round up to the bar shows three
            short.append(f"{f} greedy {diff:+.1f} SE" if round(diff, 1) < BAR_SE else f"{f} greedy {diff:+.3f} SE")
    if student["val_loss"] >= control["val_loss"]:
        short.append(f"val loss {student['val_loss'] - control['val_loss']:+.4f} nats")
    if not short:
        return f"; it beats its control (greedy ≥ +{BAR_SE:g} SE, a lower val loss)"
    return (
        f"; it does not beat its control by the bar of +{BAR_SE:g} SE greedy and a lower val loss ({', '.join(short)})"
    )


def wrong_answers(scores: dict) -> int:
    """The wrong answers behind an accuracy (`accuracy` of `n` prompts: a family's, or the pooled chat's)."""
    return round((1 - scores["accuracy"]) * scores["n"])


def errors_removed(parent: dict, e: dict) -> str:
    """The parent's greedy chat errors → the tuned model's, and the share of them removed (or added)."""
    before, after = wrong_answers(parent["chat"]), wrong_answers(e["chat"])
    if not before:
        return f"{before} → {after}"
    share = (before - after) / before
    return f"{before} → {after} ({share:.0%} removed)" if share >= 0 else f"{before} → {after} ({-share:.0%} more)"


def post_training_table(models: list[dict]) -> list[str]:
    """The models tuned from a tuned model (DPO and GRPO from SFT) side by side with it: greedy,
    best-temperature and pass@k accuracy, val loss, the share of the parent's greedy errors removed,
    the answers the stage sampled, and its time. Empty when no stage tuned a tuned model."""
    by_name = {m["name"]: m for m in models}
    rows: list[tuple[dict, dict | None]] = []
    for m in models:
        parent = parent_of(m, list(by_name))
        if parent and parent[0] == "model" and parent_of(by_name[parent[1]], list(by_name)):
            start = by_name[parent[1]]
            if all(r[0] is not start for r in rows):
                rows.append((start, None))
            rows.append((m, start))
    if not rows:
        return []
    lines = [
        "| model | from | greedy | best T | pass@k | val loss | parent's greedy errors | samples drawn | stage time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, parent in rows:
        e = m["eval"]
        best, passes = best_view(e), e.get("chat_pass_k")
        best_cell = f"{best[1]['accuracy']:.3f} (T={best[0]:g})" if best else "—"
        pass_cell = f"{passes['pass_at_' + str(passes['k'])]:.3f} (k={passes['k']})" if passes else "—"
        removed = errors_removed(parent["eval"], e) if parent else f"{wrong_answers(e['chat'])} errors"
        samples = m["train"].get("samples")
        lines.append(
            f"| {m['name']} | {parent['name'] if parent else '—'} | {e['chat']['accuracy']:.3f} | {best_cell} | "
            f"{pass_cell} | {e['val_loss']:.3f} | {removed} | {f'{samples:,.0f}' if samples else '—'} | "
            f"{m['wall_seconds']:.0f} s |"
        )
    return lines


def tuned_sentence(m: dict, parent: dict) -> str:
    """A model tuned from another (SFT, GRPO): what it moved, greedy, sampled and pass@k, and the val loss."""
    e, source, families = m["eval"], parent["eval"], families_of(m["eval"])
    rewarded = m["provenance"].get("params", {}).get(m["provenance"].get("stage"), {}).get("families")
    reward = f", rewarding {', '.join(rewarded)}" if rewarded else ""
    cost = e["val_loss"] - source["val_loss"]
    sentence = (
        f"- **{m['name']}** (from {parent['name']}{reward}) moved chat accuracy "
        + ", ".join(change(source["chat"], e["chat"], f) for f in families)
        + f"; greedy errors {errors_removed(source, e)}; the val loss {source['val_loss']:.3f} → {e['val_loss']:.3f} "
        f"({cost:+.3f} nats)"
    )
    if "chat_sampled" in e and "chat_sampled" in source:
        sampled = ", ".join(change(source["chat_sampled"], e["chat_sampled"], f) for f in families)
        sentence += f"; sampled at T={e['chat_sampled']['temperature']:g}: {sampled}"
    sentence += at_best_temperatures(source, e, (parent["name"], m["name"]), families)
    passes, passes_before = pass_view(e), pass_view(source)
    if passes and passes_before:
        (asked, after), (_, before) = passes, passes_before
        sentence += f"; {asked.removeprefix('chat, ')}: " + ", ".join(change(before, after, f) for f in after)
    return sentence + "."


def lineage_lines(m: dict) -> list[str]:
    prov = m["provenance"]
    git = prov.get("git", {})
    commit = (git.get("commit") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    inputs = ", ".join(f"{k} `{v['sha256'][:12]}`" for k, v in prov.get("inputs", {}).items())
    return [f"- **{m['name']}**: commit `{commit}`, params `{params_hash(prov.get('params', {}))}`, inputs: {inputs}"]


def render(runs: Path, models: list[str], figures: Path, report_path: Path, benchmark: dict | None = None) -> str:
    """Write the curves into `figures` and return the Markdown of the report."""
    summaries = [model_summary(runs, name) for name in models]
    rel = figures.relative_to(report_path.parent) if figures.is_relative_to(report_path.parent) else figures
    out = [
        "# stagelm report",
        "",
        "One row per model; accuracy is on the held-out eval set, ± one standard error.",
        "Base models report the better of the completion and chat formats; tuned models report chat.",
        "",
    ]
    out += ["## Stage by stage", "", *stage_table(summaries), "", *stage_sentences(summaries), ""]
    side_by_side = post_training_table(summaries)
    if side_by_side:
        out += ["### Post-training side by side", "", *side_by_side, ""]
    out += ["## Models", "", *model_table(summaries), "", "### Accuracy per task family", "", *family_table(summaries)]
    lm_eval = lm_eval_table(summaries)
    if lm_eval:
        out += ["", "### lm-eval tasks", "", "lm-evaluation-harness's figures (`eval.lm_eval_tasks`).", "", *lm_eval]
    if benchmark:
        env = benchmark.get("environment", {})
        out += [
            "",
            "## Benchmark",
            "",
            f"On {env.get('device_count')}× {env.get('device_kind')} ({env.get('cpu')}), "
            "medians of the benchmark stage (random weights, its own shape):",
            "",
        ]
        out += ["| measure | median |", "|---|---|"]
        out += [
            f"| {k} | {v:,.4g} |"
            for k, v in flat_numbers(benchmark, skip=("summaries", "environment", "schema_version"))
        ]
    out += ["", "## Training curves", ""]
    for m in summaries:
        png = figures / f"{m['name']}_loss.png"
        plots = runs / m["name"] / "plots" / "metrics"
        loss_curve(plots, f"{m['name']}: loss", png)
        out += [f"![{m['name']} loss]({rel / png.name})", ""]
        if (plots / "rollout" / "reward.tsv").is_file():  # RL stages: the sampled reward and accuracy
            png = figures / f"{m['name']}_reward.png"
            rl = (("rollout/reward.tsv", "-"), ("rollout/accuracy.tsv", "--"))
            loss_curve(plots, f"{m['name']}: sampled reward", png, rl, "mean over the rollout")
            out += [f"![{m['name']} reward]({rel / png.name})", ""]
            png = figures / f"{m['name']}_dynamics.png"
            dynamics_figure(plots, f"{m['name']}: dynamics", png)
            out += [f"![{m['name']} dynamics]({rel / png.name})", ""]
    out += ["## Samples", ""]
    for name in models:
        for record in read_jsonl(runs / "samples" / f"{name}.jsonl")[:3]:
            text = record["completion"].replace("\n", " ⏎ ")
            out.append(f"- **{name}** ({record['format']}) `{record['prompt']}` → {text}")
    out += ["", "## Lineage", ""]
    for m in summaries:
        out += lineage_lines(m)
    return "\n".join(out) + "\n"
