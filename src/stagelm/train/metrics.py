"""Metric history of a training run: dvclive files for DVC, progress for the person watching.

Rows are dicts keyed by metric name (`train/loss`, `val/loss`, `perf/tokens_per_sec`,
...) with a `step`. dvclive writes them as `<out>/plots/metrics/<name>.tsv` (the plots
dvc.yaml declares) and the final summary as `<out>/metrics.json`. On resume the rows
saved in the checkpoint are replayed first, so the files equal an uninterrupted run's.

On a terminal the run shows a tqdm bar; in a pipe, one compact line every `log_every` steps.
"""

import sys
import time
from pathlib import Path
from typing import Any

from dvclive import Live
from tqdm import tqdm


class MetricLog:
    def __init__(
        self,
        out_dir: str | Path,
        history: list[dict],
        *,
        total_steps: int,
        log_every: int,
        writer: bool = True,
    ):
        self.history: list[dict[str, Any]] = []
        self.total, self.log_every = total_steps, log_every
        self.live = Live(dir=str(out_dir), dvcyaml=False, save_dvc_exp=False, report=None) if writer else None
        for row in history:
            self._write(row)
            self.history.append(row)
        start = history[-1]["step"] if history else 0
        self.bar = (
            tqdm(total=total_steps, initial=start, unit="step", dynamic_ncols=True)
            if writer and sys.stderr.isatty()
            else None
        )
        self.t0, self.start = time.perf_counter(), start

    def _write(self, row: dict[str, Any]) -> None:
        if self.live is None:
            return
        self.live.step = row["step"]
        for key, value in row.items():
            if key != "step":
                self.live.log_metric(key, value)

    def add(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self._write(row)
        step = row["step"]
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{row['train/loss']:.3f}", tok_s=f"{row.get('perf/tokens_per_sec', 0):,.0f}")
        elif self.live is not None and (step % self.log_every == 0 or step == self.total):
            print(self.line(row), flush=True)

    def add_to_last(self, values: dict[str, float]) -> None:
        self.history[-1].update(values)
        self._write({"step": self.history[-1]["step"], **values})
        if self.bar is None and self.live is not None:
            print(
                f"step {self.history[-1]['step']}: " + " ".join(f"{k} {v:.4f}" for k, v in values.items()),
                flush=True,
            )

    def line(self, row: dict[str, Any]) -> str:
        step = row["step"]
        elapsed = time.perf_counter() - self.t0
        done = step - self.start
        eta = elapsed / done * (self.total - step) if done else 0.0
        rate = row.get("perf/tokens_per_sec")
        rate_text = f" {rate:,.0f} tok/s" if rate else ""
        return f"step {step}/{self.total} loss {row['train/loss']:.4f}{rate_text} eta {eta:.0f}s"

    def close(self, summary: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.live is not None:
            self.live.summary = {k: v for k, v in summary.items() if v is not None}
            self.live.step = summary["step"]
            self.live.make_summary()
            self.live.end()
