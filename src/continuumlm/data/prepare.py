"""Out-of-core corpus preparation: sources -> tokenizer + one token file per split.

The engine behind ``continuumlm prepare`` and behind every raw-text config (which is prepared
once into the user cache and memory-mapped). Memory is bounded by a block of text, a chunk of
token ids and the tokenizer's training sample, whatever the corpus size.

Three passes over the sources:

1. *count*: characters per source (the split points of a single-stream corpus are character
   positions, as in the in-memory split of earlier versions: the first ``train_fraction`` of
   the characters train, then validation, then ``test_fraction`` test);
2. *sample* (only when a tokenizer is trained): the character set (char), or the training text
   itself when it is at most ``sample_chars`` characters, else a seeded sample of blocks of it
   (word, bpe);
3. *encode*: each split streamed through the tokenizer into ``SPLIT.bin.part``.

Files are written under temporary names and renamed at the end, ``meta.json`` last, so a folder
with a ``meta.json`` is complete and a prepare killed midway leaves nothing that loads.

Documents (the files of a folder, the records of a JSON Lines/Parquet/Arrow file) are joined
with ``<|endoftext|>`` (bpe) or so that each starts on a new line (char, word: a newline is put
after a document that does not end with one).
"""


from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from ..errors import DataError, DiskError
from .encode import PART, _Encoder, dtype_for, encode_splits  # noqa: F401 - importable here
from .plan import (  # noqa: F401 - importable here as before
    DEFAULT_SAMPLE_CHARS,
    SPLIT_NAMES,
    Counts,
    Plan,
    TokenizerSpec,
    build_tokenizer,
    count,
    plan_key,
    source_digests,
    walk,
)
from .shards import FORMAT, META_FILE, VERSION, Prepared, read_meta
from .tokenizers import (
    TOKENIZER_FILE,
    tokenizer_json,
)


def warn_unknown(meta: dict) -> None:
    """The warning of a char vocabulary that mapped characters to <unk> (every time a prepared
    corpus with such characters is opened)."""
    for split, st in meta["splits"].items():
        n = st.get("unknown_chars", 0)
        if n:
            print(f"warning: {n:,} characters of the {split} split are not in the char vocabulary "
                  f"(built from the training text) and are read as <unk>; set "
                  f"data.vocab_source = \"all\" to include them, or data.unknown_chars = "
                  f"\"error\" to refuse such text.", file=sys.stderr)


def _disk_error(what: Path, e: OSError) -> DiskError:
    return DiskError(f"preparing the corpus failed writing {what}: {e.strerror or e}; nothing in "
                     f"{what.parent} looks complete (meta.json is written last). Free space (or "
                     f"choose another --out on a disk with room) and run prepare again.")


def prepare_into(folder: Path, plan: Plan, spec: TokenizerSpec, key: str,
                 digests: list[tuple[str, str]], dtype: str = "auto", quiet: bool = False,
                 log=None) -> dict:
    """Prepare into an empty (or new) ``folder``; returns the meta it wrote."""
    log = log or (lambda m: None)
    t0 = time.time()
    counts = count(plan)
    log(f"read {sum(counts.chars.values()):,} characters in "
        f"{sum(len(v) for v in plan.splits.values())} source file(s) ({time.time() - t0:.0f} s)")
    t1 = time.time()
    tok = build_tokenizer(plan, counts, spec, log)
    if spec.given is None:
        log(f"{tok.kind} tokenizer of {tok.vocab_size:,} tokens ({time.time() - t1:.0f} s)")
    dt = dtype_for(tok.vocab_size, dtype)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tok_json = tokenizer_json(tok)
        (folder / (TOKENIZER_FILE + PART)).write_text(tok_json, encoding="utf-8")
        t2 = time.time()
        stats = encode_splits(plan, counts, tok, folder, dt, quiet)
    except OSError as e:
        raise _disk_error(folder / "train.bin", e) from None
    t3 = time.time()
    rate = sum(s["chars"] for s in stats.values()) / max(t3 - t2, 1e-9) / 1e6
    log(f"encoded {sum(s['tokens'] for s in stats.values()):,} tokens ({rate:.1f} M chars/s)")
    meta = {
        "format": FORMAT, "version": VERSION, "key": key, "dtype": dt.name,
        "vocab_size": tok.vocab_size,
        "tokenizer": {"file": TOKENIZER_FILE, "kind": tok.kind,
                      "sha256": hashlib.sha256(tok_json.encode()).hexdigest()},
        "splits": stats,
        "sources": [{"path": str(s.path), "split": split, "bytes": s.bytes, "sha256": d}
                    for s, (split, d) in zip((s for v in plan.splits.values() for s in v),
                                             digests)],
        "split_rule": plan.describe(),
        "tokenizer_settings": spec.describe(),
        "separator": ("<|endoftext|>" if tok.kind == "bpe" and tok.eos_id is not None
                      else "newline"),
        "seconds": {"count": round(t1 - t0, 3), "tokenizer": round(t2 - t1, 3),
                    "encode": round(t3 - t2, 3)},
    }
    try:
        for name in [TOKENIZER_FILE] + [st["file"] for st in stats.values()]:
            os.replace(folder / (name + PART), folder / name)
        tmp = folder / (META_FILE + PART)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / META_FILE)
    except OSError as e:
        raise _disk_error(folder / META_FILE, e) from None
    return meta


OUR_NAMES = {META_FILE, TOKENIZER_FILE, *(f"{s}.bin" for s in SPLIT_NAMES)}


def _ours(p: Path) -> bool:
    """A file prepare writes (or its temporary name); nothing else is ever deleted."""
    return p.is_file() and (p.name in OUR_NAMES or (p.name.endswith(PART)
                                                    and p.name[:-len(PART)] in OUR_NAMES))


def prepare_folder(out: Path, plan: Plan, spec: TokenizerSpec, dtype: str = "auto",
                   force: bool = False, quiet: bool = False, log=None) -> tuple[dict, bool]:
    """``continuumlm prepare --out``: (meta, prepared_now). An ``out`` that already holds this
    very preparation is kept; one holding another is refused unless ``force``; leftovers of an
    interrupted prepare (no meta.json) are cleared; a folder with other files is refused.
    ``force`` prepares again in any case."""
    digests = source_digests(plan)
    key = plan_key(plan, spec, digests, dtype)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; name a folder (new or empty) to prepare into.")
    resolved = out.resolve()
    for srcs in plan.splits.values():
        for src in srcs:
            if resolved in src.path.resolve().parents:
                raise DataError(f"--out {out} lies inside an input ({src.path} is in it): a "
                                f"later prepare would read its own token files as text. "
                                f"Prepare into a folder outside the inputs.")
    if (out / META_FILE).is_file():
        try:
            meta = read_meta(out)
        except DataError as e:
            if not force:
                raise DataError(f"{e} (--force prepares it again in place)") from None
            meta = None
        if meta is not None and meta.get("key") == key and not force:
            return meta, False
        if meta is not None and not force:
            raise DataError(f"{out} already holds a prepared corpus of other inputs or settings "
                            f"(its meta.json); pass --force to replace it, or choose another "
                            f"--out.")
    # --force over a finished preparation builds beside it, unless --out is a mount point
    # (nothing can be renamed into it from its parent's file system): then in place, as below
    target = out.resolve()
    replacing = (force and (out / META_FILE).is_file()
                 and target.parent.stat().st_dev == target.stat().st_dev)
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if not _ours(p)]
        if foreign:
            raise DataError(f"--out {out} holds files prepare did not write ({', '.join(foreign[:5])}"
                            f"{' ...' if len(foreign) > 5 else ''}); prepare into a new or empty "
                            f"folder, so nothing of yours is overwritten.")
        ours = list(out.iterdir())
        interrupted = any(p.name.endswith(PART) for p in ours)
        if ours and not (force or interrupted or (out / META_FILE).is_file()):
            raise DataError(f"--out {out} holds {', '.join(sorted(p.name for p in ours))} but no "
                            f"meta.json and no unfinished .part files, so they may be another "
                            f"tool's (nanoGPT writes train.bin and val.bin too); pass --force "
                            f"to replace them, or prepare into another folder.")
        if not replacing:
            (out / META_FILE).unlink(missing_ok=True)  # first: the folder stops looking complete
            for p in ours:  # an earlier, interrupted or unfinished preparation
                p.unlink(missing_ok=True)
    if not replacing:
        return prepare_into(out, plan, spec, key, digests, dtype, quiet, log), True
    return _replace_preparation(out, plan, spec, key, digests, dtype, quiet, log), True


def _replace_preparation(out: Path, plan: Plan, spec: TokenizerSpec, key: str,
                         digests: list[tuple[str, str]], dtype: str, quiet: bool, log) -> dict:
    """--force over a finished preparation: build the new one beside it and move it in at the
    end, so that a prepare that fails (unreadable input, full disk) leaves the corpus that runs
    may still need as it was. Needs room for both while it runs."""
    target = out.resolve()  # --out may be a symlink to another disk: build beside its target
    for stale in target.parent.glob(f".{target.name}.prepare-*.tmp"):  # of a killed --force
        try:
            os.kill(int(stale.name.rsplit("-", 1)[1].split(".")[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, PermissionError):
            pass
    side = target.parent / f".{target.name}.prepare-{os.getpid()}.tmp"
    shutil.rmtree(side, ignore_errors=True)
    try:
        try:
            meta = prepare_into(side, plan, spec, key, digests, dtype, quiet, log)
        except (DataError, DiskError) as e:
            raise type(e)(f"{e} (the corpus in {out} is unchanged)") from None
        new = {p.name for p in side.iterdir()}
        try:
            (out / META_FILE).unlink(missing_ok=True)  # first: the folder stops looking complete
            for p in out.iterdir():
                if _ours(p) and p.name not in new:
                    p.unlink()
            for name in sorted(new - {META_FILE}) + [META_FILE]:  # meta.json last
                os.replace(side / name, target / name)
        except OSError as e:
            raise _disk_error(out / META_FILE, e) from None
    finally:
        shutil.rmtree(side, ignore_errors=True)
    return meta


def prepare_cached(root: Path, plan: Plan, spec: TokenizerSpec, quiet: bool = True,
                   log=None) -> Path:
    """Prepare into the cache folder ``root/KEY`` unless it is there already. The processes of
    a job on one machine take turns through a file lock (the first prepares, the others then
    find it done, without a collective's timeout); each builds into its own temporary folder
    renamed at the end, so where the lock does not reach (another machine on a shared file
    system) the first rename wins and no reader sees a half-written folder."""
    import fcntl

    digests = source_digests(plan)
    key = plan_key(plan, spec, digests)
    final = root / key[:32]
    if _complete(final):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{key[:32]}.lock", "w")
    except OSError as e:
        raise DataError(f"the data cache folder {root} cannot be written ({e.strerror or e}); set "
                        f"$CONTINUUMLM_CACHE to a writable folder with room for the prepared "
                        f"corpus.") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without locks: the rename below still keeps readers safe
        if _complete(final):  # prepared by the process that held the lock
            return final
        shutil.rmtree(final, ignore_errors=True)  # damaged
        tmp = root / f".{key[:32]}.{socket.gethostname()}.{os.getpid()}.tmp"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            prepare_into(tmp, plan, spec, key, digests, quiet=quiet, log=log)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _complete(final):
                    raise
        except DiskError as e:
            raise DiskError(f"{e} (the data cache is {root}; $CONTINUUMLM_CACHE moves it)") from None
        except OSError as e:
            raise DiskError(f"the prepared corpus could not be moved into the data cache {root} "
                            f"({e.strerror or e}); free space there or set $CONTINUUMLM_CACHE "
                            f"to another folder.") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _complete(folder: Path) -> bool:
    """A cache folder that opens as a prepared corpus (else it is prepared again)."""
    if not (folder / META_FILE).is_file():
        return False
    try:
        Prepared(folder)
        return True
    except DataError:  # damaged or not ours; a transient OSError is no reason to delete it
        return False
