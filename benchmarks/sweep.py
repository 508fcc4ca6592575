"""Sweep params with the lab's own experiments: queue a grid over seeds, then tabulate it.

    python benchmarks/sweep.py queue grpo.lr=5e-5,1e-4 grpo.advantages=group,none --seeds 0 1 2
    python benchmarks/sweep.py queue grpo.prompts_per_step=32,64 --samples 20480   # GRPO at equal samples
    dvc queue start --jobs 1        # or: dvc exp run --run-all
    python benchmarks/sweep.py table grpo.lr grpo.advantages > sweep.md   # --rev <commit>: its experiments only

`queue` adds one `dvc exp run --queue` per point of the grid and seed, each with its `-S`
settings (every value as DVC writes it into params.yaml, so `5e-5` is a float). With
`--samples N` each point's GRPO run is sized in samples, completions generated, rather than
steps: `grpo.steps` (and its `eval_every` and `checkpoint_every`) become N over the samples
one rollout draws (`prompts_per_step × group_size`, read from the point's settings or
params.yaml) times `updates_per_rollout`, so variants with larger rollouts take fewer
steps. A rollout with dynamic sampling can draw more than one batch of prompts: the table's
`samples` column is what each run generated (runs/grpo/metrics.json).

`table` reads `dvc exp show --csv` and prints a Markdown table with one row per point of the
grid: the mean over its seeds of each metric (and the spread, max − min, when there are
several) and how many seeds finished, below the rows of the commits the experiments
started from (the checked-out commit's defaults, for reference). The default metrics are GRPO's
samples, its arithmetic on held-out prompts (greedy, sampled, pass@8), its corpus val loss and
its rollouts' binary accuracy (first and last ten) and entropy (last ten); `--metric file:key`
picks others.
"""

import argparse
import csv
import io
import itertools
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import yaml

GRPO = "runs/eval/grpo/metrics.json"
DEFAULT_METRICS = [
    "runs/grpo/metrics.json:samples",
    f"{GRPO}:chat.arithmetic.accuracy",
    f"{GRPO}:chat_sampled.arithmetic.accuracy",
    f"{GRPO}:chat_pass_k.arithmetic.pass_at_8",
    f"{GRPO}:val_loss",
    "runs/grpo/metrics.json:accuracy_first10",
    "runs/grpo/metrics.json:accuracy_last10",
    "runs/grpo/metrics.json:entropy_last10",
]


def grpo_setting(point: tuple[str, ...], key: str) -> int:
    """An int `grpo.<key>` of a grid point: its own setting, else params.yaml's."""
    for setting in point:
        name, _, value = setting.partition("=")
        if name == f"grpo.{key}":
            return int(value)
    return int(yaml.safe_load(Path("params.yaml").read_text())["grpo"][key])


def sized_in_samples(point: tuple[str, ...], samples: int) -> list[str]:
    """`-S` settings that give a GRPO run `samples` completions, one prompt batch per rollout."""
    per_rollout = grpo_setting(point, "prompts_per_step") * grpo_setting(point, "group_size")
    steps = max(1, round(samples / per_rollout)) * grpo_setting(point, "updates_per_rollout")
    return [f"grpo.{key}={steps}" for key in ("steps", "eval_every", "checkpoint_every")]


def queue(settings: list[str], seeds: list[int], prefix: str, samples: int | None = None) -> None:
    grid = []
    for setting in settings:
        key, sep, values = setting.partition("=")
        if not sep or not values:
            sys.exit(f"error: {setting!r}: expected key=value[,value...], e.g. grpo.lr=5e-5,1e-4")
        grid.append([f"{key}={v}" for v in values.split(",")])
    varying = [i for i, values in enumerate(grid) if len(values) > 1]  # what tells the points apart
    for point in itertools.product(*grid):
        sized = sized_in_samples(point, samples) if samples else []
        for seed in seeds:
            parts = [point[i].partition("=") for i in varying]
            name = "-".join([prefix] + [f"{k.rpartition('.')[2]}{v}" for k, _, v in parts] + [f"s{seed}"])
            name = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
            cmd = ["dvc", "exp", "run", "--queue", "--name", name, "-S", f"seed={seed}"]
            cmd += [arg for p in (*point, *sized) for arg in ("-S", p)]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)


def column(header: list[str], name: str) -> int | None:
    """The index of `name` (file:key or key) in `dvc exp show --csv`'s header (None, with a word why)."""
    file, _, key = name.rpartition(":")
    for candidate in (name, key if file else name):
        if candidate in header:
            return header.index(candidate)
    print(f"warning: {name}: not a column of `dvc exp show --csv` (no run wrote it): shown as —", file=sys.stderr)
    return None


def number(row: list[str], col: int | None) -> float | None:
    try:
        return float(row[col]) if col is not None else None
    except ValueError:
        return None


def table(params: list[str], metrics: list[str], rev: str | None = None) -> str:
    """The table of every commit's experiments, or with `rev` of the experiments that started from it."""
    which = ["--rev", rev] if rev else ["--all-commits"]
    shown = subprocess.run(["dvc", "exp", "show", "--csv", *which], capture_output=True, text=True, check=True)
    rows = list(csv.reader(io.StringIO(shown.stdout)))
    header, body = rows[0], rows[1:]
    state = header.index("State") if "State" in header else None
    p_cols = [column(header, p) for p in params]
    m_cols = [column(header, m) for m in metrics]
    groups: dict[tuple, list[list[float | None]]] = defaultdict(list)
    name, kind = header.index("rev"), header.index("typ")
    start = rev or "HEAD"
    git = ["git", "rev-parse", "--short=7", start], ["git", "branch", "--format=%(refname:short)", "--points-at", start]
    here = {name for c in git for name in subprocess.run(c, capture_output=True, text=True).stdout.split()} | {start}
    for row in body:
        if state is not None and row[state] not in ("", "Success"):
            continue
        if row[kind] == "baseline" and row[name] not in here:  # of the commits, only the one checked out (or rev)
            continue
        values = [number(row, c) for c in m_cols]
        if values[0] is None:  # not finished
            continue
        # a commit's own row (the defaults it was run with) stands apart from the experiments
        label = f"commit {row[name]}" if row[kind] == "baseline" else "experiments"
        groups[(label, *[row[c] for c in p_cols])].append(values)
    names = [m.rpartition(":")[2] for m in metrics]
    lines = [
        "| " + " | ".join(params + names + ["runs"]) + " |",
        "|" + "---|" * (len(params) + len(names) + 1),
    ]
    for (label, *point), runs in sorted(groups.items(), key=lambda g: (g[0][0] == "experiments", g[0])):
        cells = []
        for i in range(len(metrics)):
            values = [r[i] for r in runs if r[i] is not None]
            if not values:
                cells.append("—")
                continue
            mean = statistics.fmean(values)
            cells.append(f"{mean:.3f}" + (f" ({max(values) - min(values):.3f})" if len(values) > 1 else ""))
        count = f"{len(runs)}" if label == "experiments" else f"{label} (the defaults)"
        lines.append("| " + " | ".join(list(point) + cells + [count]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("queue", help="queue one experiment per point of the grid and seed")
    q.add_argument("settings", nargs="+", help="key=value[,value...]")
    q.add_argument("--seeds", nargs="+", type=int, default=[0])
    q.add_argument("--prefix", default="sweep", help="experiment names start with it")
    q.add_argument("--samples", type=int, help="size each GRPO run in completions generated, not steps")
    t = sub.add_parser("table", help="a Markdown table of the finished experiments, averaged over seeds")
    t.add_argument("params", nargs="+", help="the params that tell the points of the grid apart")
    t.add_argument("--metric", action="append", help="file:key columns (default: GRPO's on arithmetic)")
    t.add_argument("--rev", help="only the experiments started from this commit (default: from every commit)")
    args = parser.parse_args()
    if args.command == "queue":
        queue(args.settings, args.seeds, args.prefix, args.samples)
    else:
        print(table(args.params, args.metric or DEFAULT_METRICS, args.rev))


if __name__ == "__main__":
    main()
