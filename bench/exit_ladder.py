"""Per-token exit across whole solves (``set_exit(..., ladder=[...])``, model/ladder.py) on
trained one-block models with the memory from the block's input (``model.ode_kv = "block"``):
validation loss and field evaluations per token at each confidence threshold, per ladder,
against the model's own solve and against exiting along its own solver steps.

    python bench/exit_ladder.py RUN [RUN ...] [--max-windows N] [--ladders L;L...]
        [--decode L@TAU;...] [--out NAME]

writes bench/results/exit_ladder.json (or NAME.json). ``--ladders``: the ladders to try,
each its rungs joined by commas, the ladders by semicolons (default every one of LADDERS);
``--decode``: the ladders and thresholds timed when decoding (default DECODE). Each row is ``continuumlm eval --exit-ladder L
--exit-criterion confidence --exit-threshold TAU`` (or ``--exit-criterion C`` without a
ladder) on evenly spread validation windows of the run's training context. A token's field
evaluations are those of every rung it tried (Euler x 1, then RK4 x 1, then RK4 x 4: 1, 5 or
21), what it costs when decoded one token at a time.
"""

from __future__ import annotations

import argparse

import torch
from common import exit_run, machine, markdown_table, write_json

from continuumlm.eval.perplexity import evaluate_contexts

LADDERS = [["rk4:1"], ["euler:2"], ["euler:1"], ["euler:2", "rk4:1"]]
TAUS = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
DECODE = [(["rk4:1"], 0.8), (["rk4:1"], 0.9), (["euler:2"], 0.6)]  # timed when decoding
STEP_EXIT = [("confidence", t) for t in (0.3, 0.1)] + [("state", t) for t in (0.3, 0.1)]
LOSS_TARGET = 0.005  # within 0.5% of the own solve's loss
SPEED_TARGET = 2.0  # field evaluations per token, full / this


def measure(run: str, max_windows: int, ladders: list[list[str]] = LADDERS,
            decode: list[tuple[list[str], float]] = DECODE) -> list[dict]:
    model, cfg, split, full_nfe, name = exit_run(run)
    device = torch.device("cpu")

    def row(ladder, criterion, tau):
        model.set_exit(tau, criterion, ladder=ladder) if criterion != "full" \
            else model.set_exit(None)
        [r] = evaluate_contexts(model, split, [cfg.train.seq_len], False, device,
                                max_windows=max_windows)
        return {"model": name, "exit": "+".join(ladder) + " then own" if ladder else
                ("solver steps" if criterion != "full" else "none"),
                "criterion": criterion, "tau": tau, "val_loss": round(r["loss"], 4),
                "nfe_per_token": round(r.get("nfe_per_token", full_nfe), 2)}

    rows = [row(None, "full", None)]
    # each coarse solve alone (every token at the first rung): what a fixed solve gives
    for rung in dict.fromkeys(r for ladder in ladders for r in ladder):
        fixed = row([rung], "confidence", float("inf"))
        rows.append({**fixed, "exit": f"{rung} alone", "criterion": "fixed", "tau": None})
    rows += [row(ladder, "confidence", t) for ladder in ladders for t in TAUS]
    rows += [row(None, c, t) for c, t in STEP_EXIT]
    base = rows[0]["val_loss"]
    for r in rows:
        r["loss_change"] = f"{100 * (r['val_loss'] / base - 1):+.2f}%"
        r["fewer_evaluations"] = round(full_nfe / r["nfe_per_token"], 2)
        r["within_target"] = r["val_loss"] <= base * (1 + LOSS_TARGET)
        print(r, flush=True)
    return rows + decode_rows(model, split, name, decode)


def decode_rows(model, split, name: str, decode, n_prompts: int = 8, prompt_len: int = 8
                ) -> list:
    """Greedy cached decoding, batch 1, eager, from ``n_prompts`` validation prompts: the
    own solve, each ``decode`` setting (a ladder and its threshold), tokens/s over every prompt (the model's positions
    filled), with the field evaluations per token the exit counted."""
    import time

    step = (len(split) - prompt_len) // n_prompts
    prompts = [torch.from_numpy(split[i * step:i * step + prompt_len].astype("int64"))[None]
               for i in range(n_prompts)]
    n = model.config.max_seq_len - prompt_len + 1
    out = []
    # every row through the decoding pass: an exit is refused by the lean step (plain decoding's
    # default at batch 1 on a CPU), so the no-exit row is timed the same way, and its field
    # evaluations per token counted there (the lean step does not set model.last_nfe)
    from continuumlm.decoding import Decoder

    decoder = Decoder(model, lean=False)
    for ladder, tau in [(None, None), *decode]:
        model.set_exit(None) if ladder is None else model.set_exit(tau, "confidence",
                                                                   ladder=ladder)
        decoder.generate(prompts[0], 8, greedy=True)  # warm-up
        if ladder is not None:
            model.depth.exit_totals = [0, 0]
        t0, made = time.perf_counter(), 0
        for p in prompts:
            made += decoder.generate(p, n, greedy=True).shape[1] - p.shape[1]
        seconds = time.perf_counter() - t0
        nfe = (model.depth.exit_totals[0] / model.depth.exit_totals[1] if ladder is not None
               else model.last_nfe)
        out.append({"model": name, "exit": "+".join(ladder) + " then own" if ladder else "none",
                    "criterion": "decoding", "tau": tau, "tok_s": round(made / seconds, 1),
                    "decode_nfe_per_token": round(nfe, 2)})
    model.set_exit(None)
    for r in out:
        r["decode_speedup"] = round(r["tok_s"] / out[0]["tok_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--max-windows", type=int, default=400)
    ap.add_argument("--ladders", help="the ladders, e.g. 'euler:1;euler:1,euler:2' (default: "
                                      + ";".join(",".join(x) for x in LADDERS) + ")")
    ap.add_argument("--decode", help="the ladders and thresholds timed when decoding, e.g. "
                                     "'euler:1@0.8' (default: " + ";".join(
                                         f"{','.join(x)}@{t}" for x, t in DECODE) + ")")
    ap.add_argument("--out", default="exit_ladder", help="the record's name in bench/results/")
    args = ap.parse_args()
    ladders = ([x.split(",") for x in args.ladders.split(";")] if args.ladders else LADDERS)
    try:
        decode = ([(x.split("@")[0].split(","), float(x.split("@")[1]))
                   for x in args.decode.split(";")] if args.decode else DECODE)
    except (IndexError, ValueError):
        raise SystemExit(f"--decode {args.decode!r}: give LADDER@TAU settings joined by "
                         f"semicolons, e.g. 'euler:1@0.8;euler:1,euler:2@0.6'.") from None
    rows = [r for run in args.runs for r in measure(run, args.max_windows, ladders, decode)]
    decoding = [r for r in rows if r["criterion"] == "decoding"]
    rows = [r for r in rows if r["criterion"] != "decoding"]
    decode_table = markdown_table(decoding, [
        ("model", "model"), ("exit", "exit"), ("tau", "tau"), ("tok_s", "tokens/s"),
        ("decode_nfe_per_token", "field evaluations per token"),
        ("decode_speedup", "vs the own solve")])
    print(decode_table)
    table = markdown_table(rows, [("model", "model"), ("exit", "exit"),
                                  ("criterion", "criterion"), ("tau", "tau"),
                                  ("val_loss", "val loss"), ("loss_change", "vs own solve"),
                                  ("nfe_per_token", "field evaluations per token"),
                                  ("fewer_evaluations", "full / this")])
    print(table)
    write_json(args.out, {
        "command": f"python bench/exit_ladder.py {' '.join(args.runs)}"
                   + (f" --max-windows {args.max_windows}" if args.max_windows != 400 else "")
                   + "".join(f" --{flag} '{value}'" for flag, value in (
                       ("ladders", args.ladders), ("decode", args.decode)) if value)
                   + (f" --out {args.out}" if args.out != "exit_ladder" else ""),
        "setup": f"each run's best checkpoint, {args.max_windows} evenly spread validation "
                 f"windows of its training context; a token's field evaluations are every "
                 f"rung's it tried; {machine()}",
        "loss_target": LOSS_TARGET, "speed_target": SPEED_TARGET,
        "decode_setup": "greedy cached decoding, batch 1, eager, 8 validation prompts of 8 "
                        "tokens each continued to the model's 64 positions",
        "rows": rows, "table": table, "decoding": decoding, "decode_table": decode_table})


if __name__ == "__main__":
    main()
