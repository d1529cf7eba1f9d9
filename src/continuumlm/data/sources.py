"""Corpus sources, streamed in bounded memory.

A source is a file: UTF-8 text (any suffix not listed below), JSON Lines (``.jsonl``,
``.ndjson``, ``.json``), Parquet (``.parquet``) or Arrow (``.arrow``, the IPC stream or file
format Hugging Face ``datasets`` writes), each optionally gzip-compressed (``.gz``; not Parquet
or Arrow, which compress inside). A text file is one document; a JSON Lines, Parquet or Arrow
file holds one document per record, in its text column.

:func:`expand` turns what a user names (files, folders read recursively in sorted order, glob
patterns) into sources; :func:`documents` streams one source's documents as blocks of text, so
no file is ever held whole. Parquet and Arrow are read with ``pyarrow`` (``pip install
'continuumlm[corpora]'``).
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError
from .corpora import cache_dir, sha256_file

BLOCK_BYTES = 1 << 20  # read size of text files: bounds memory per block
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
DATASET_METADATA = {"state.json", "dataset_info.json", "dataset_dict.json"}


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str          # "text", "jsonl", "parquet" or "arrow"
    gzipped: bool = False

    @property
    def bytes(self) -> int:
        return self.path.stat().st_size


def source_kind(path: Path) -> tuple[str, bool]:
    name = path.name.lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", gz
    if name.endswith(".parquet"):
        kind = "parquet"
    elif name.endswith((".arrow", ".feather")):
        kind = "arrow"
    else:
        return "text", gz
    if gz:
        raise DataError(f"{path}: a gzip-compressed {kind} file cannot be streamed; {kind} files "
                        f"compress inside, so decompress it (gunzip) and name the {kind} file.")
    return kind, False


def _hidden(p: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in p.relative_to(root).parts)


def expand(specs: list[str]) -> list[Source]:
    """The sources named by ``specs``, in order: a file as it is, a folder's files recursively in
    sorted order (hidden files and folders skipped), a glob pattern's matches sorted."""
    out: list[Source] = []
    for spec in specs:
        p = Path(spec).expanduser()
        if p.is_file():
            paths = [p]
        elif p.is_dir():
            # datasets.save_to_disk writes these beside its .arrow files: metadata, not text
            paths = sorted(f for f in p.rglob("*") if f.is_file() and not _hidden(f, p)
                           and f.name not in DATASET_METADATA)
            if not paths:
                raise DataError(f"the folder {spec} holds no files; point --input (or data.path) "
                                f"at a folder of text, JSON Lines, Parquet or Arrow files.")
        elif glob.has_magic(spec):
            paths = sorted(Path(f) for f in glob.glob(os.path.expanduser(spec), recursive=True)
                           if Path(f).is_file())
            if not paths:
                raise DataError(f"the pattern {spec!r} matches no file (patterns are matched from "
                                f"the current folder, {Path.cwd()}); check the pattern, and quote "
                                f"it so the shell passes it unexpanded.")
        else:
            raise DataError(f"{spec} does not exist"
                            + (f" (relative paths are read from the current folder, {Path.cwd()})"
                               if not p.is_absolute() else "")
                            + "; name a file, a folder or a glob pattern.")
        out.extend(Source(f, *source_kind(f)) for f in paths)
    return out


def file_digest(path: Path) -> str:
    """sha256 of a file, memoized in the user cache by (path, size, mtime, ctime, inode) -- a
    rewrite changes ctime even when it keeps the size and restores the mtime -- so a second
    run over an unchanged multi-gigabyte corpus does not read it again to name it."""
    st = path.stat()
    stamp = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}"
    memo = cache_dir() / "digests" / (hashlib.sha256(stamp.encode("utf-8", "surrogateescape"))
                                      .hexdigest()[:32] + ".txt")
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e}); make it readable, or leave "
                        f"it out of the inputs.") from None
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.part")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:
        pass  # the memo saves time only
    return digest


# ----------------------------------------------------------------------------- reading

def _open_binary(src: Source):
    return gzip.open(src.path, "rb") if src.gzipped else open(src.path, "rb")


def _bad_utf8(src: Source, data: bytes, offset: int, e: UnicodeDecodeError) -> DataError:
    where = "uncompressed byte" if src.gzipped else "byte"
    return DataError(f"{src.path} is not valid UTF-8: byte 0x{data[e.start]:02x} at {where} offset "
                     f"{offset + e.start} ({e.reason}). If it is a binary file, remove it from the "
                     f"inputs; if it is text in another encoding, convert it to UTF-8, or set "
                     f"data.errors = \"replace\" (--errors replace) to replace undecodable bytes "
                     f"with U+FFFD.")


def _nul(src: Source, offset: int) -> DataError:
    return DataError(f"{src.path} holds a NUL byte at {'uncompressed ' if src.gzipped else ''}byte "
                     f"offset {offset}: it looks like a binary file, not text. Remove it from the "
                     f"inputs (or name the text files you mean with a glob such as '*.txt').")


def _text_blocks(src: Source, errors: str) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    offset = 0  # of the next block in the (uncompressed) file
    try:
        with _open_binary(src) as f:
            while True:
                block = f.read(BLOCK_BYTES)
                pending = decoder.getstate()[0]
                nul = block.find(b"\0")
                if nul >= 0:
                    raise _nul(src, offset + nul)
                try:
                    text = decoder.decode(block, final=not block)
                except UnicodeDecodeError as e:
                    raise _bad_utf8(src, pending + block, offset - len(pending), e) from None
                offset += len(block)
                if text:
                    yield text
                if not block:
                    return
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        if isinstance(e, (gzip.BadGzipFile, EOFError)):
            raise DataError(f"{src.path} is not a complete gzip file ({e}); it was truncated or "
                            f"is not gzip-compressed: recompress it, or rename it without .gz "
                            f"if it is plain text.") from None
        raise DataError(f"cannot read {src.path}: {e.strerror or e}.") from None


def _jsonl_documents(src: Source, field: str, errors: str) -> Iterator[str]:
    try:
        with _open_binary(src) as f:
            offset = 0
            for lineno, raw in enumerate(f, 1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8", errors)
                except UnicodeDecodeError as e:
                    raise _bad_utf8(src, raw, start, e) from None
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{src.path}, line {lineno}: not valid JSON ({e.msg} at column "
                                    f"{e.colno}); a JSON Lines file holds one JSON object per "
                                    f"line.") from None
                if not isinstance(record, dict) or field not in record:
                    has = (", ".join(repr(k) for k in list(record)[:12])
                           if isinstance(record, dict) else f"a JSON {type(record).__name__}")
                    raise DataError(f"{src.path}, line {lineno}: the record has no {field!r} "
                                    f"field (it has {has or 'no fields'}); name the text field with "
                                    f"--text-field (data.text_field).")
                text = record[field]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(f"{src.path}, line {lineno}: the {field!r} field holds a "
                                    f"{type(text).__name__}, not a string; name the text field "
                                    f"with --text-field (data.text_field).")
                if text:
                    yield text
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"cannot read {src.path}: {getattr(e, 'strerror', None) or e}.") from None


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError("reading Parquet or Arrow files needs pyarrow: pip install "
                        "'continuumlm[corpora]' (or pyarrow).") from None
    import pyarrow as pa

    return pa


def _column_batches(src: Source, field: str) -> Iterator:
    pa = _pyarrow()
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(src.path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{src.path} is not a Parquet file pyarrow can read ({e}).") from None
        names = pf.schema_arrow.names
        if field not in names:
            raise _no_column(src, field, names)
        yield from (b.column(0) for b in pf.iter_batches(batch_size=1024, columns=[field]))
        return
    source = pa.memory_map(str(src.path))
    reader = None
    for opener in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            source.seek(0)
            reader = opener(source)
            break
        except pa.ArrowException:
            continue
    if reader is None:
        raise DataError(f"{src.path} is not an Arrow IPC stream or file pyarrow can read; "
                        f"name the .arrow files Hugging Face datasets writes, or Parquet.")
    names = reader.schema.names
    if field not in names:
        raise _no_column(src, field, names)
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(reader)
    yield from (b.column(field) for b in batches)


def _no_column(src: Source, field: str, names: list[str]) -> DataError:
    return DataError(f"{src.path} has no {field!r} column (it has {', '.join(map(repr, names))}); "
                     f"name the text column with --text-field (data.text_field).")


def _table_documents(src: Source, field: str) -> Iterator[str]:
    pa = _pyarrow()
    for column in _column_batches(src, field):
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise DataError(f"{src.path}: the {field!r} column holds {column.type}, not strings; "
                            f"name the text column with --text-field (data.text_field).")
        for text in column.to_pylist():
            if text:
                yield text


def documents(src: Source, text_field: str = "text",
              errors: str = "strict") -> Iterator[Iterator[str]]:
    """One iterator of text blocks per document of ``src`` (a text file is one document, read
    in blocks of about a megabyte; a record is one document of one block). Empty documents are
    skipped."""
    if src.kind == "text":
        blocks = _text_blocks(src, errors)
        first = next(blocks, None)
        if first is not None:
            yield _chain(first, blocks)
    elif src.kind == "jsonl":
        yield from (iter((d,)) for d in _jsonl_documents(src, text_field, errors))
    else:
        yield from (iter((d,)) for d in _table_documents(src, text_field))


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest
