"""docs/accelerators.md's tables from benchmarks/accelerator-*.json (benchmarks/accelerator.py's output).

    python benchmarks/accelerator_table.py            # rewrite the tables in docs/accelerators.md
    python benchmarks/accelerator_table.py --check    # exit 1 when the page is not what the files give

Every train entry of every file is a row, the files in name order; decoding entries form the second
table, and the profiled entries (`--profile`) the third.
"""

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from stagelm.model.footprint import train_step_bytes, training_state_bytes  # noqa: E402

PAGE = ROOT / "docs/accelerators.md"
BEGIN, END = "<!-- accelerator-table: begin -->", "<!-- accelerator-table: end -->"


def kernel(entry: dict) -> str:
    """The splash settings an entry ran: the two-pass backward of the first files, or its `splash`."""
    tuning = dict(entry.get("splash") or {})
    words = ["fused" if tuning.pop("fused_bwd", 0) else "two-pass"]
    if tuning.pop("k_layout", "HEAD_DIM_MINOR") == "SEQ_MINOR":
        words.append("k seq-minor")
    return ", ".join(words + [f"{k} {v}" for k, v in tuning.items()])


def estimate(entry: dict) -> int:
    """`stagelm check`'s arithmetic for the entry's step as the code gives it now: the training
    state (float32 masters, gradients, Adam's moments) and `train_step_bytes` with splash."""
    shape = {k: entry[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size")}
    cfg = SimpleNamespace(**shape, dtype=entry["dtype"], remat=entry["remat"], attention="splash")
    cfg.scan_layers = entry["scan_layers"]
    state = training_state_bytes(entry["params"], "float32")  # every entry trains float32 masters
    return state + train_step_bytes(cfg, entry["micro_batch"], entry["seq_len"])


def tables(files: list[Path]) -> str:
    train = [
        "| file | shape | heads × size | seq | rows (micro × accum) | remat | scan | splash | tok/s | MFU "
        "| first step (s) | XLA bytes | estimate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    profile = [
        "| file | shape | heads × size | splash | MFU | splash kernels | copies | gradient sums | largest op kinds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    decode = [
        "| file | shape | batch | tok/s | bandwidth bound (tok/s) | of the bound |",
        "|---|---|---|---|---|---|",
    ]
    for path in files:
        result = json.loads(path.read_text())
        tag = path.stem.removeprefix("accelerator-")
        for e in result["train"]:
            rows = f"{e['batch']} ({e['micro_batch']} × {e['accumulation']})"
            head = f"{e['name']} | {e['n_heads']} × {e['head_dim']} | {e['seq_len']} | {rows} | {e['remat']} | "
            head += ("yes" if e["scan_layers"] else "no") + f" | {kernel(e)}"
            if "error" in e:
                train.append(f"| {tag} | {head} | {e['error'][:60]} | | | | |")
                continue
            memory = (
                f"{e['compiled_bytes'] / 2**30:.1f} GiB | {estimate(e) / 2**30:.1f} GiB"
                if "compiled_bytes" in e
                else " | "
            )
            train.append(
                f"| {tag} | {head} | {e['tokens_per_sec'] / 1e3:.1f}k | {e['mfu']:.1%} | "
                f"{e['first_step_seconds']:.1f} | {memory} |"
            )
        for e in result["train"]:
            if e.get("profile"):
                shares = e["profile"]["shares"]
                attention = sum(v for k, v in shares.items() if k.startswith("splash"))
                copies = sum(v for k, v in shares.items() if k.split("-")[0] == "copy")
                top = ", ".join(f"{k} {v:.0%}" for k, v in list(shares.items())[:4])
                profile.append(
                    f"| {tag} | {e['name']} | {e['n_heads']} × {e['head_dim']} | {kernel(e)} | {e['mfu']:.1%} | "
                    f"{attention:.0%} | {copies:.0%} | {shares.get('select_add_fusion', 0):.0%} | {top} |"
                )
        for e in result.get("decode", []):
            decode.append(
                f"| {tag} | {e['name']} | {e['decode_batch']} | {e['tokens_per_sec']:,.0f} | "
                f"{e['bandwidth_bound_tokens_per_sec']:,.0f} | {e['fraction_of_bound']:.0%} |"
            )
    return (
        "\n".join(train)
        + "\n\nDecoding (bf16 weights, 128 prompt + 128 new tokens, greedy, KV cache):\n\n"
        + "\n".join(decode)
        + "\n\nWhere one step's device time goes (`--profile`: shares of the XLA ops' time, by op kind):\n\n"
        + "\n".join(profile)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    files = sorted((ROOT / "benchmarks").glob("accelerator-*.json"))
    text = PAGE.read_text()
    before, rest = text.split(BEGIN)
    after = rest.split(END)[1]
    new = f"{before}{BEGIN}\n{tables(files)}\n{END}{after}"
    if args.check:
        sys.exit(0 if new == text else 1)
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
