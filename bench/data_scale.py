"""Corpora at scale: `continuumlm prepare` on a generated corpus of 1 GB or more, and training
from the prepared (memory-mapped) files.

    python bench/data_scale.py [--size-gb 1.0] [--redo]

The corpus is written from local text (this Python's standard-library sources, concatenated in
seeded shuffles of their order until the size is reached; nothing is downloaded) into
runs/bench/data_scale/. Each measurement runs in a child process whose peak RSS is read from
its resource usage (the largest of the process and its descendants), and is saved to
bench/results/data_scale.json as soon as it finishes, so an interrupted run continues where it
stopped.

Measurements (targets from the corpora issue, 2 CPU cores):
- prepare (bpe, 8192 tokens) of the whole corpus: wall time, peak RSS (<= 2 GB), the time to
  train the tokenizer on its sample (<= 2 min), the encoding rate;
- the tokenizers library's own ``encode_batch`` on a slice of the same text, same tokenizer and
  cores: the limit our encoding rate is compared with (>= 0.8x);
- training a small model (hidden 128, 2 layers, 1.44 M parameters) from the prepared corpus vs from a 1 MB corpus: peak RSS
  (within 10%), time from the start of `continuumlm train` to step 0 (<= 10 s), and with two
  DDP processes, the peak RSS of a rank (within 10% of one process);
- tokens/s of training steps whose batches come from the memmap, from the same ids in RAM, and
  from nanoGPT's getter (a new uint16 memmap per batch, one slice per row): within 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, RUNS, machine, replace_json  # noqa: E402

NAME = "data_scale"
WORK = RUNS / "data_scale"
VOCAB = 8192
MODEL = ["model.hidden_size=128", "model.num_heads=4", "model.num_layers=2"]
TRAIN = ["train.batch_size=12", "train.seq_len=64", "train.max_steps=40", "train.eval_interval=40",
         "train.eval_iters=2", "train.log_interval=10", "train.checkpoint_interval=40",
         "train.device=cpu"]


def rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def make_corpus(size: int, path: Path) -> Path:
    """Standard-library sources, concatenated in seeded shuffles of their order."""
    if path.is_file() and path.stat().st_size >= size:
        return path
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts)
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    rng = random.Random(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    written = 0
    with open(tmp, "w", encoding="utf-8") as out:
        while written < size:
            order = list(range(len(texts)))
            rng.shuffle(order)
            for i in order:
                out.write(texts[i])
                written += len(texts[i].encode("utf-8"))
                if written >= size:
                    break
    os.replace(tmp, path)
    return path


def first_mb(src: Path, dest: Path, n: int = 1 << 20) -> Path:
    if not dest.is_file():
        with open(src, encoding="utf-8") as f:
            text = f.read(n)
        dest.write_text(text[:text.rfind("\n") + 1], encoding="utf-8")
    return dest


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _status_mb(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) of ``pid`` in MB: private memory and mapped file pages."""
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) // 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) // 1024
    except OSError:
        pass
    return anon, file


def run_measured(cmd: list[str], step0_marker: str | None = None, env=None) -> dict:
    """Run ``cmd``; wall seconds, peak RSS (GB) of it and its descendants (the largest single
    process, from its resource usage), the peaks of its private memory (RssAnon) and mapped file
    pages (RssFile) sampled every 50 ms, and the seconds until a stdout line containing
    ``step0_marker`` appeared."""
    import threading

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=env or os.environ.copy())
    peaks = {"anon": 0, "file": 0}
    done = threading.Event()

    def sample():
        while not done.wait(0.05):
            for p in _tree(proc.pid):
                anon, file = _status_mb(p)
                peaks["anon"], peaks["file"] = max(peaks["anon"], anon), max(peaks["file"], file)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    marker_s, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if step0_marker and marker_s is None and step0_marker in line:
            marker_s = time.perf_counter() - t0
    done.set()
    watcher.join()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{''.join(lines[-30:])}")
    return {"wall_s": round(wall, 2), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 3),
            "peak_anon_gb": round(peaks["anon"] / 1024, 3),
            "peak_file_gb": round(peaks["file"] / 1024, 3),
            "step0_s": None if marker_s is None else round(marker_s, 2), "output": lines}


CLI = [sys.executable, "-m", "continuumlm"]


def prepare_step(corpus: Path, out: Path, tokenizer: Path | None = None) -> dict:
    how = ["--tokenizer", str(tokenizer)] if tokenizer else ["--tokenizer", "bpe", "--vocab-size",
                                                             str(VOCAB)]
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [*CLI, "prepare", "--input", str(corpus), *how, "--out", str(out)]
    r = run_measured(cmd)
    meta = json.loads((out / "meta.json").read_text())
    chars = sum(s["chars"] for s in meta["splits"].values())
    return {"command": " ".join(["continuumlm", *cmd[3:]]).replace(str(ROOT) + "/", ""),
            "wall_s": r["wall_s"], "peak_rss_gb": r["peak_rss_gb"],
            "peak_anon_gb": r["peak_anon_gb"], "peak_file_gb": r["peak_file_gb"],
            "corpus_bytes": corpus.stat().st_size, "chars": chars,
            "tokens": sum(s["tokens"] for s in meta["splits"].values()),
            "seconds": meta["seconds"],
            "encode_mchars_s": round(chars / meta["seconds"]["encode"] / 1e6, 3)}


LIMIT = """
import os, sys, tempfile, time
import numpy as np
sys.path.insert(0, 'src')
from continuumlm.data.encode import _Encoder
from continuumlm.data.tokenizers import load_tokenizer, _pieces
tok = load_tokenizer(sys.argv[1])
with open(sys.argv[2], encoding='utf-8') as f:
    text = f.read(int(sys.argv[3]))
chunk = int(sys.argv[4])
enc = _Encoder(tok, np.dtype(np.uint16))
limit = ours = 0.0
tokens = 0
with tempfile.TemporaryFile() as out:
    for i in range(0, len(text), chunk):  # alternating, so drifts of the machine hit both alike
        part = text[i:i + chunk]
        t = time.perf_counter()
        encs = tok.tok.encode_batch(_pieces(part), add_special_tokens=False)
        limit += time.perf_counter() - t
        del encs
        t = time.perf_counter()
        for ids in enc.feed(part):  # prepare's path: cut, encode, ids to uint16, write
            out.write(memoryview(ids))
            tokens += ids.size
        ours += time.perf_counter() - t
print(len(text), limit, ours, tokens)
"""


def limit_step(prepared: Path, corpus: Path, chars: int) -> dict:
    from continuumlm.data.encode import CHUNK_CHARS

    r = subprocess.run([sys.executable, "-c", LIMIT, str(prepared / "tokenizer.json"),
                        str(corpus), str(chars), str(CHUNK_CHARS)], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    n, limit, ours, tokens = r.stdout.split()
    n, limit, ours = int(n), float(limit), float(ours)
    return {"chars": n, "seconds": round(limit, 2), "ours_seconds": round(ours, 2),
            "tokens": int(tokens), "encode_mchars_s": round(n / limit / 1e6, 3),
            "ours_mchars_s": round(n / ours / 1e6, 3)}


def train_step(prepared: Path, out: Path, nproc: int = 1) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    sets = ["data.dataset=prepared", f"data.path={prepared}", *MODEL, *TRAIN]
    cmd = [*CLI, "train", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    r = run_measured(cmd, step0_marker="training ")
    params = next((int(x.split("training ")[1].split(" parameters")[0].replace(",", ""))
                   for x in r["output"] if "training " in x and " parameters" in x), None)
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [e["tokens_per_s"] for e in events if "tokens_per_s" in e]
    return {"command": " ".join(["continuumlm", *cmd[3:]]).replace(str(ROOT) + "/", ""),
            "wall_s": r["wall_s"], "peak_rss_gb": r["peak_rss_gb"], "step0_s": r["step0_s"],
            "peak_anon_gb": r["peak_anon_gb"], "peak_file_gb": r["peak_file_gb"],
            "tokens_per_s_last": round(tps[-1], 1) if tps else None, "parameters": params}


READERS = """
import json, statistics, sys, time
import numpy as np, torch
sys.path.insert(0, 'src')
from continuumlm import LanguageModel, ModelConfig
from continuumlm.data.batches import BatchSampler
from continuumlm.data.shards import Prepared

p = Prepared(sys.argv[1])
mm = p.splits["train"]
B, T = 12, 64
ram = np.array(mm)  # the same ids, read into memory
path, dtype, n = p.folder / "train.bin", mm.dtype, len(mm)

def nanogpt(g):
    data = np.memmap(path, dtype=dtype, mode="r")  # a new memmap per batch, as nanoGPT does
    ix = torch.randint(n - T, (B,), generator=g)
    x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix.tolist()])
    return x, y

samplers = {"memmap": BatchSampler(mm, B, T, seed=0), "ram": BatchSampler(ram, B, T, seed=0)}
g = torch.Generator().manual_seed(0)
getters = {"memmap": lambda: samplers["memmap"].next(), "ram": lambda: samplers["ram"].next(),
           "nanogpt": lambda: nanogpt(g)}
fetch = {}
for name, get in getters.items():
    get()
    t = time.perf_counter()
    for _ in range(2000):
        get()
    fetch[name] = (time.perf_counter() - t) / 2000 * 1e6
torch.manual_seed(0)
model = LanguageModel(ModelConfig(vocab_size=p.tokenizer.vocab_size, hidden_size=128, num_heads=4,
                                  num_layers=2, max_seq_len=T))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

def steps(get, k=15):
    t = time.perf_counter()
    for _ in range(k):
        x, y = get()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return B * T * k / (time.perf_counter() - t)

for get in getters.values():
    steps(get, 5)
rounds = {name: [] for name in getters}
for _ in range(int(sys.argv[2])):  # interleaved, so drifts of the machine hit all alike
    for name, get in getters.items():
        rounds[name].append(steps(get))
print(json.dumps({name: {"fetch_us": round(fetch[name], 1),
                         "tokens_per_s": round(statistics.median(r), 1)}
                  for name, r in rounds.items()}))
"""


def readers_step(prepared: Path, rounds: int = 7) -> dict:
    r = subprocess.run([sys.executable, "-c", READERS, str(prepared), str(rounds)], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--limit-mb", type=int, default=200, help="text the encode_batch limit is "
                    "measured on (a slice of the corpus)")
    ap.add_argument("--redo", action="store_true")
    args = ap.parse_args()
    out_json = RESULTS / f"{NAME}.json"
    res = {} if args.redo or not out_json.is_file() else json.loads(out_json.read_text())
    if res.get("size_gb") != args.size_gb:
        res = {}
    res.update({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "size_gb": args.size_gb,
                "command": "python bench/data_scale.py"
                           + (f" --size-gb {args.size_gb:g}" if args.size_gb != 1.0 else "")})
    m = res.setdefault("measurements", {})

    def save():
        replace_json(out_json, res)

    corpus = make_corpus(int(args.size_gb * 1e9), WORK / "corpus.txt")
    small = first_mb(corpus, WORK / "corpus_1mb.txt")
    big_prep, small_prep = WORK / "prepared", WORK / "prepared_1mb"
    steps = [
        ("prepare", lambda: prepare_step(corpus, big_prep)),
        ("prepare_1mb", lambda: prepare_step(small, small_prep, big_prep / "tokenizer.json")),
        ("encode_batch_limit", lambda: limit_step(big_prep, corpus, args.limit_mb * 10**6)),
        ("train_1mb", lambda: train_step(small_prep, WORK / "train_1mb")),
        ("train_big", lambda: train_step(big_prep, WORK / "train_big")),
        ("train_big_ddp2", lambda: train_step(big_prep, WORK / "train_big_ddp2", nproc=2)),
        ("readers", lambda: readers_step(big_prep)),
    ]
    for name, fn in steps:
        if name in m:
            continue
        if name != "prepare" and not (big_prep / "meta.json").is_file():
            raise SystemExit("the prepared corpus is missing: run with --redo")
        print(f"[{NAME}] {name} ...", flush=True)
        t = time.time()
        m[name] = fn()
        print(f"[{NAME}] {name}: {time.time() - t:.0f} s {json.dumps(m[name])[:300]}", flush=True)
        save()
    res["targets"] = targets(m)
    res["setup"] = setup(res)
    res["table"] = table(res)
    save()
    print(res["table"])


def setup(res: dict) -> str:
    m = res["measurements"]
    p = m["prepare"]
    return (f"a {p['corpus_bytes'] / 1e9:.2f} GB corpus of this Python's standard-library "
            f"sources (concatenated in seeded shuffles of their order), bpe with {VOCAB:,} "
            f"tokens (trained on a seeded 64 M-character sample), {p['tokens']:,} tokens; "
            f"training: a {m['train_big'].get('parameters') or 0:,}-parameter model of hidden 128, 2 layers, "
            f"batch 12 x 64, 40 steps, peak RSS of the process and its children")


def table(res: dict) -> str:
    from common import markdown_table

    m = res["measurements"]
    rows = [{"target": t["target"], "goal": t["goal"], "measured": t["measured"],
             "met": "yes" if t["met"] else "**no**"} for t in res["targets"]]
    out = [markdown_table(rows, [("target", "target"), ("goal", "goal"),
                                 ("measured", "measured"), ("met", "met")]), "",
           "Peak RSS counts the pages of the memory-mapped token files a process has touched: "
           "page cache, shared by every process that maps the file (the two DDP ranks map the "
           "same pages) and given back under memory pressure; random windows fault in a few "
           "neighbouring pages each (the kernel's fault-around), so a run over a large file "
           "shows more of them than one over a 1 MB file. The memory a process holds of its "
           "own, RssAnon, is the same for both corpora.", ""]
    steps = [{"step": k, "wall": f"{v['wall_s']:.1f} s", "rss": f"{v['peak_rss_gb']:.2f} GB",
              "split": f"{v['peak_anon_gb']:.2f} / {v['peak_file_gb']:.2f} GB",
              "extra": (f"to step 0: {v['step0_s']:.1f} s, {v['tokens_per_s_last']:,.0f} tok/s"
                        if "step0_s" in v else
                        f"count {v['seconds']['count']:.0f} s, tokenizer "
                        f"{v['seconds']['tokenizer']:.0f} s, encode {v['seconds']['encode']:.0f} s "
                        f"({v['encode_mchars_s']:.2f} M chars/s)"),
              "command": f"`{v['command']}`"}
             for k, v in m.items() if "wall_s" in v]
    out += [markdown_table(steps, [("step", "run"), ("wall", "wall"), ("rss", "peak RSS"),
                                   ("split", "peak private / file pages"),
                                   ("extra", "details"), ("command", "command")]), ""]
    lim = m["encode_batch_limit"]
    out.append(f"The limit: the tokenizers library's `encode_batch` over the first "
               f"{lim['chars'] / 1e6:.0f} M characters of the corpus, in the chunks prepare "
               f"encodes (4 M characters, each cut into 16 K-character pieces), timing "
               f"`encode_batch` alone (no conversion of ids, no file writing), alternated chunk "
               f"by chunk with prepare's own path over the same text (cut, encode, ids to "
               f"uint16, write): {lim['ours_mchars_s']:.2f} against {lim['encode_mchars_s']:.2f} M chars/s.")
    rd = m["readers"]
    out += ["", markdown_table(
        [{"reader": k, "fetch": f"{v['fetch_us']:.1f} us", "tps": f"{v['tokens_per_s']:,.0f}"}
         for k, v in rd.items()],
        [("reader", "batches from"), ("fetch", "per batch (fetch only)"),
         ("tps", "training tokens/s (median of interleaved rounds)")]),
        "", "`memmap`: the prepared split as `np.memmap` (what training reads); `ram`: the same "
        "ids read into memory first; `nanogpt`: nanoGPT's getter (a new uint16 memmap per batch, "
        "one slice per row), the anchor."]
    return "\n".join(out)


def targets(m: dict) -> list[dict]:
    prep, limit = m["prepare"], m["encode_batch_limit"]
    one, big, ddp = m["train_1mb"], m["train_big"], m["train_big_ddp2"]
    rd = m["readers"]

    def row(what, measured, target, ok):
        return {"target": what, "measured": measured, "goal": target, "met": bool(ok)}

    ratio = limit["ours_mchars_s"] / limit["encode_mchars_s"]
    return [
        row("prepare peak RSS", f"{prep['peak_rss_gb']:.2f} GB", "<= 2 GB",
            prep["peak_rss_gb"] <= 2),
        row("encoding rate vs encode_batch (same chunks, alternated)",
            f"{ratio:.2f}x ({limit['ours_mchars_s']:.2f} vs {limit['encode_mchars_s']:.2f} M "
            f"chars/s; the whole prepare encoded at {prep['encode_mchars_s']:.2f})", ">= 0.8x",
            ratio >= 0.8),
        row("BPE training on its sample", f"{prep['seconds']['tokenizer']:.0f} s", "<= 120 s",
            prep["seconds"]["tokenizer"] <= 120),
        row("train peak RSS, prepared corpus vs 1 MB", f"{big['peak_rss_gb']:.2f} vs "
            f"{one['peak_rss_gb']:.2f} GB", "within 10%",
            big["peak_rss_gb"] <= 1.1 * one["peak_rss_gb"]),
        row("... of which private (RssAnon; the rest is the memmap's page-cache pages)",
            f"{big['peak_anon_gb']:.2f} vs {one['peak_anon_gb']:.2f} GB", "within 10%",
            big["peak_anon_gb"] <= 1.1 * one["peak_anon_gb"]),
        row("start of train to step 0", f"{big['step0_s']:.1f} s", "<= 10 s",
            big["step0_s"] is not None and big["step0_s"] <= 10),
        row("DDP (2 processes) peak RSS per rank vs one process", f"{ddp['peak_rss_gb']:.2f} vs "
            f"{big['peak_rss_gb']:.2f} GB", "within 10%",
            ddp["peak_rss_gb"] <= 1.1 * big["peak_rss_gb"]),
        row("... of which private (RssAnon), largest process",
            f"{ddp['peak_anon_gb']:.2f} vs {big['peak_anon_gb']:.2f} GB", "within 10%",
            ddp["peak_anon_gb"] <= 1.1 * big["peak_anon_gb"]),
        row("tokens/s, batches from the memmap vs from RAM", f"{rd['memmap']['tokens_per_s']:.0f} "
            f"vs {rd['ram']['tokens_per_s']:.0f}", "within 5%",
            rd["memmap"]["tokens_per_s"] >= 0.95 * rd["ram"]["tokens_per_s"]),
    ]


if __name__ == "__main__":
    main()
