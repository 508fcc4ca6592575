"""Sweep params with the lab's own experiments: queue a grid over seeds, then tabulate it.

    python benchmarks/sweep.py queue grpo.lr=5e-5,1e-4 grpo.advantages=group,none --seeds 0 1 2
    dvc queue start --jobs 1        # or: dvc exp run --run-all
    python benchmarks/sweep.py table grpo.lr grpo.advantages > sweep.md   # --rev <commit>: its experiments only

`queue` adds one `dvc exp run --queue` per point of the grid and seed, each with its `-S`
settings (every value as DVC writes it into params.yaml, so `5e-5` is a float). `table`
reads `dvc exp show --csv` and prints a Markdown table with one row per point of the
grid: the mean over its seeds of each metric (and the spread, max − min, when there are
several) and how many seeds finished, below the rows of the commits the experiments
started from (the checked-out commit's defaults, for reference). The default metrics are GRPO's on
arithmetic (greedy, sampled, pass@8), its corpus val loss and its reward; `--metric file:key` picks
others.
"""

import argparse
import csv
import io
import itertools
import statistics
import subprocess
import sys
from collections import defaultdict

GRPO = "runs/eval/grpo/metrics.json"
DEFAULT_METRICS = [
    f"{GRPO}:chat.arithmetic.accuracy",
    f"{GRPO}:chat_sampled.arithmetic.accuracy",
    f"{GRPO}:chat_pass_k.arithmetic.pass_at_8",
    f"{GRPO}:val_loss",
    "runs/grpo/metrics.json:reward_first10",
    "runs/grpo/metrics.json:reward_last10",
]


def queue(settings: list[str], seeds: list[int], prefix: str) -> None:
    grid = []
    for setting in settings:
        key, sep, values = setting.partition("=")
        if not sep or not values:
            sys.exit(f"error: {setting!r}: expected key=value[,value...], e.g. grpo.lr=5e-5,1e-4")
        grid.append([f"{key}={v}" for v in values.split(",")])
    varying = [i for i, values in enumerate(grid) if len(values) > 1]  # what tells the points apart
    for point in itertools.product(*grid):
        for seed in seeds:
            parts = [point[i].partition("=") for i in varying]
            name = "-".join([prefix] + [f"{k.rpartition('.')[2]}{v}" for k, _, v in parts] + [f"s{seed}"])
            name = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
            cmd = ["dvc", "exp", "run", "--queue", "--name", name, "-S", f"seed={seed}"]
            cmd += [arg for p in point for arg in ("-S", p)]
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
    t = sub.add_parser("table", help="a Markdown table of the finished experiments, averaged over seeds")
    t.add_argument("params", nargs="+", help="the params that tell the points of the grid apart")
    t.add_argument("--metric", action="append", help="file:key columns (default: GRPO's on arithmetic)")
    t.add_argument("--rev", help="only the experiments started from this commit (default: from every commit)")
    args = parser.parse_args()
    if args.command == "queue":
        queue(args.settings, args.seeds, args.prefix)
    else:
        print(table(args.params, args.metric or DEFAULT_METRICS, args.rev))


if __name__ == "__main__":
    main()
