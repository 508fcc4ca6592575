"""Step times of a training run and the summary metrics.json holds: losses, tokens, speed, MFU."""

import time
from typing import Any

import numpy as np


class StepTimer:
    """Steady-state step times: the first step (compile) and steps after eval/checkpoint pauses are
    excluded. Its state goes into every checkpoint, so a resumed run reports the times of the
    steps before it too, and a run resumed at its last step (`dvc repro -f` of a finished run)
    writes the summary the run had."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.times: list[float] = []
        self.first_call: float | None = None
        self.tokens_per_step = 0
        self.t0 = time.perf_counter()

    def get_state(self) -> dict[str, Any]:
        return {"times": self.times, "first_call": self.first_call, "tokens_per_step": self.tokens_per_step}

    def set_state(self, state: dict[str, Any] | None) -> None:
        if state:  # absent from a checkpoint written before the timer was saved
            self.times, self.first_call = list(state["times"]), state["first_call"]
            self.tokens_per_step = state["tokens_per_step"]

    def tick(self, first: bool) -> None:
        now = time.perf_counter()
        if first:
            self.first_call = now - self.t0
        elif self.last is not None:
            self.times.append(now - self.last)
        self.last = now

    def pause(self) -> None:
        self.last = None

    def rate(self) -> float | None:
        return self.tokens_per_step / self.times[-1] if self.times else None


def summarize(
    history: list[dict], timer: StepTimer, flops_per_token: float | None, peak_flops: float | None
) -> dict[str, Any]:
    """metrics.json of a run: its last step's losses, the best val loss, tokens, speed and MFU."""
    tokens_per_step = timer.tokens_per_step
    last = history[-1]
    vals = [r["val/loss"] for r in history if "val/loss" in r]
    step_s = float(np.median(timer.times)) if timer.times else None
    tps = tokens_per_step / step_s if step_s else None
    mfu = tps * flops_per_token / peak_flops if (tps and flops_per_token and peak_flops) else None
    return {
        "step": last["step"],
        "train_loss": last["train/loss"],
        "val_loss": vals[-1] if vals else None,
        "best_val_loss": min(vals) if vals else None,
        "tokens_seen": last["step"] * tokens_per_step,
        "tokens_trained": sum(r["train/tokens"] for r in history),
        "tokens_per_sec": tps,
        "step_seconds": step_s,
        "first_step_seconds": timer.first_call,
        "mfu": mfu,
    }
