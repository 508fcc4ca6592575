"""Issue 56's tables from `dvc exp show --json`: each model at its best temperature beside its parent,
and the distilled student beside its control, for the named experiments and the workspace (seed 0).

    python benchmarks/post_training_table.py defaults-s1 defaults-s2          # the defaults on seeds 1, 2
    python benchmarks/post_training_table.py d3seq-s0 d3seq-s1 d3seq-s2       # a distillation recipe
    python benchmarks/post_training_table.py b1full600-s0 b1full600-s1 --rev 7385f41  # another commit's

Accuracy is on the held-out arithmetic prompts (pooled over the families: one family by default);
a difference is in standard errors of the difference. A queued or running experiment that has not
finished is left out.
"""

import argparse
import json
import math
import subprocess

from stagelm.measure.report import best_view


def runs(names: list[str], rev: str | None = None) -> dict[str, dict]:
    """{name: {eval file: metrics}} of the workspace (as `workspace`) and the named experiments (of the
    commit `rev` when given, else of HEAD)."""
    cmd = ["dvc", "exp", "show", "--json", *(["--rev", rev] if rev else [])]
    shown = json.loads(subprocess.run(cmd, capture_output=True, text=True).stdout)
    found = {}
    for commit in shown:
        revs = [("workspace", commit)] if commit["rev"] == "workspace" else []
        revs += [(r["name"], r) for e in commit.get("experiments") or [] for r in e["revs"]]
        for name, rev in revs:
            if name != "workspace" and (rev.get("data") or {}).get("rev") == "workspace":
                continue  # running: its metrics are its temporary workspace's, the baseline's until it ends
            metrics = ((rev.get("data") or {}).get("metrics")) or {}
            files = {path: v.get("data", {}) for path, v in metrics.items()}
            if name in names and files.get("runs/eval/distill/metrics.json"):
                found[name] = files
    return found


def se_diff(a: dict, b: dict) -> str:
    se = math.hypot(a["accuracy_se"], b["accuracy_se"])
    return f"{(b['accuracy'] - a['accuracy']) / se:+.1f} SE" if se else "±0"


def best(e: dict) -> dict:
    """The eval's metrics at its best temperature (the report's reading of them)."""
    return best_view(e)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=["workspace"], help="experiment names (default: the workspace)")
    parser.add_argument("--rev", help="the commit the experiments started from (default: HEAD)")
    args = parser.parse_args()
    names = args.names
    found = runs(names, args.rev)
    ev = {
        n: {m: found[n][f"runs/eval/{m}/metrics.json"] for m in ("sft", "grpo", "distill", "distill_control")}
        for n in names
        if n in found
    }
    print(
        "| run | SFT greedy | SFT at T 0.3 / 0.6 / 1.0 (best) | GRPO greedy (vs SFT) | GRPO best T (vs SFT's best) | "
        "GRPO at T 1 (vs SFT) | pass@8 SFT → GRPO | val loss change | samples |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n, e in ev.items():
        s, g = e["sft"], e["grpo"]
        temps = " / ".join(f"{v['accuracy']:.3f}" for v in s["chat_temperatures"].values())
        passes = (x["chat_pass_k"]["arithmetic"]["pass_at_8"] for x in (s, g))
        samples = found[n].get("runs/grpo/metrics.json", {}).get("samples", float("nan"))
        print(
            f"| {n} | {s['chat']['accuracy']:.3f} | {temps} ({s['chat_best_temperature']:g}) | "
            f"{g['chat']['accuracy']:.3f} ({se_diff(s['chat'], g['chat'])}) | "
            f"{best(g)['accuracy']:.3f} at {g['chat_best_temperature']:g} ({se_diff(best(s), best(g))}) | "
            f"{g['chat_sampled']['accuracy']:.3f} ({se_diff(s['chat_sampled'], g['chat_sampled'])}) | "
            "{:.2f} → {:.2f} | ".format(*passes)
            + f"{g['val_loss'] - s['val_loss']:+.4f} | {samples:,.0f} |"
        )
    print()
    print(
        "| run | student greedy | control greedy | greedy diff | student best T | control best T | diff | "
        "val loss student / control |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n, e in ev.items():
        d, c = e["distill"], e["distill_control"]
        print(
            f"| {n} | {d['chat']['accuracy']:.3f} | {c['chat']['accuracy']:.3f} | {se_diff(c['chat'], d['chat'])} | "
            f"{best(d)['accuracy']:.3f} ({d['chat_best_temperature']:g}) | {best(c)['accuracy']:.3f} "
            f"({c['chat_best_temperature']:g}) | {se_diff(best(c), best(d))} | "
            f"{d['val_loss']:.4f} / {c['val_loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
