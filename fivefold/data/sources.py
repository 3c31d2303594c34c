"""Where documents come from: a text file, a folder of files, JSONL, or Python's standard library.

A document is one text (a file, or one JSONL record). Errors name the file (and line) and the fix.
Pre-tokenized token files (.bin / .npy) are not documents: see `fivefold.data.dataset`.
"""
from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from fivefold.data.indexed import half_prefix, parse_blend
from fivefold.errors import UserError

TOKEN_SUFFIXES = (".bin", ".npy")
JSONL_SUFFIXES = (".jsonl", ".json")
FORMATS = ("auto", "text", "jsonl", "tokens", "indexed")


def stdlib_folder() -> Path:
    """The demo's default corpus: the top-level .py files of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_format(path: str | None, fmt: str) -> str:
    """auto -> text / jsonl / tokens / folder from the path; an explicit format is kept."""
    if fmt not in FORMATS:
        raise UserError(f"data.format={fmt!r}: must be one of {', '.join(FORMATS)}")
    if path is None:
        return "stdlib"
    if fmt in ("auto", "indexed") and parse_blend(path) is not None:
        return "indexed"  # Megatron's PREFIX (.bin + .idx), or a weighted blend of prefixes
    if fmt == "indexed":
        raise UserError(f"data.path={path!r}: " + (half_prefix(path) or f"no Megatron indexed dataset there (need "
                                                    f"{path}.bin and {path}.idx)"))
    p = Path(path)
    if not p.exists() and half_prefix(path):
        raise UserError(f"data.path={path!r}: {half_prefix(path)}")
    if not p.exists():
        raise UserError(f"data.path={path!r}: no such file or folder (give a text file, a folder, a .jsonl "
                        "or a token file; leave data.path unset to use Python's standard-library sources)")
    if fmt != "auto":
        return fmt
    if p.is_dir():
        return "folder"
    if p.suffix in TOKEN_SUFFIXES:
        return "tokens"
    return "jsonl" if p.suffix in JSONL_SUFFIXES else "text"


def json_lines(path: Path, *, cut_off_last: bool = False, strict: bool = False) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-empty line of a JSON Lines file; a line that is not JSON is
    refused naming the file and line. `cut_off_last`: a last line with no newline that is not JSON
    is left out (a log whose writer stopped in the middle of it: a killed run's metrics.jsonl).
    `strict`: bytes that are not UTF-8 are refused (see `read_text`), not read as U+FFFD."""
    with open(path, encoding="utf-8", errors="strict" if strict else "replace") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    if cut_off_last and not line.endswith("\n"):
                        return
                    raise UserError(f"{path}:{lineno}: malformed JSON line ({e.msg}, column {e.colno}); "
                                    "each line must be one JSON object") from None
        except UnicodeDecodeError:
            raise _not_utf8(path) from None


BINARY_SHARE, BINARY_MIN_BYTES = 0.1, 8
"""Training refuses a file with more than this share of its bytes not UTF-8, and at least this many:
binary, or text in another encoding, not text with a few odd bytes (a short note's one Latin-1 letter
is a quarter of its bytes and is kept)."""


def read_text(path: Path, *, strict: bool = False) -> str:
    """The file's text. Not strict (training's readers): a few bytes that are not UTF-8 become U+FFFD,
    but a file holding a NUL byte (an image, an archive, UTF-16) or mostly not UTF-8 (BINARY_SHARE) is
    refused naming the file and byte offset, as Hugging Face datasets fail on it rather than train on
    U+FFFD. Strict (`preprocess`, as Megatron's tools/preprocess_data.py decodes): any byte that is not
    UTF-8 is refused, naming the file, line and byte offset of the first one."""
    raw = path.read_bytes()
    nul = raw.find(b"\0")
    if not strict and nul >= 0:  # (valid UTF-8 may hold NUL; text does not)
        raise _binary(path, f"a NUL byte at byte offset {nul}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            raise _not_utf8(path) from None
        first_bad = e.start
    # surrogateescape keeps each invalid byte as one character, ignore drops it
    bad = len(raw.decode("utf-8", errors="surrogateescape")) - len(raw.decode("utf-8", errors="ignore"))
    if bad > BINARY_SHARE * len(raw) and bad >= BINARY_MIN_BYTES:
        raise _binary(path, f"{bad} of its {len(raw)} bytes are not UTF-8, the first at byte offset {first_bad}")
    return raw.decode("utf-8", errors="replace")


def _binary(path: Path, why: str) -> UserError:
    return UserError(f"{path}: {why}: a binary file, or text in another encoding, would be trained on as "
                     "U+FFFD; give UTF-8 text, JSONL or a token file (.bin / .npy) as data.path, move other files "
                     f"out of a folder of texts, and convert a text (e.g. iconv -f latin1 -t utf-8 {path.name} > "
                     f"{path.stem}.utf8{path.suffix}; UTF-16: -f utf-16)")


def _not_utf8(path: Path) -> UserError:
    """The refusal of a file that is not UTF-8, found again by line so that it names where."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):  # a UTF-8 character never holds the byte of "\n"
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = raw[e.start:e.end].hex(" ")
                return UserError(f"{path}:{lineno}: not UTF-8 text (byte offset {offset + e.start}: {bad}, "
                                 f"{e.reason}); text is read as UTF-8, as Megatron's tools/preprocess_data.py reads "
                                 f"it: convert the file (e.g. iconv -f latin1 -t utf-8 {path.name} > "
                                 f"{path.stem}.utf8{path.suffix}) or leave it out")
            offset += len(raw)
    return UserError(f"{path}: not UTF-8 text; convert the file (e.g. iconv -f latin1 -t utf-8) or leave it out")


TRAINING_KEYS = ("data.path", "data.jsonl_field")
"""How messages name the input and its JSONL field: the config keys training reads (`preprocess`
names its flags, --input and --json-keys)."""


def read_jsonl(path: Path, field: str, keys: tuple[str, str] = TRAINING_KEYS, strict: bool = False) -> Iterator[str]:
    """One document per non-empty line: `line[field]`, which must be a string. `strict`: see `read_text`."""
    for lineno, record in json_lines(path, strict=strict):
        if not isinstance(record, dict) or field not in record:
            found = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise UserError(f"{path}:{lineno}: no field {field!r} (found {found}); "
                            f"set {keys[1]} to the field that holds the text") from None
        if not isinstance(record[field], str):
            raise UserError(f"{path}:{lineno}: field {field!r} is {type(record[field]).__name__}, not a string")
        yield record[field]


def _files(folder: Path, suffix: str | None = None) -> list[Path]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.parts))
    return [p for p in files if suffix is None or p.suffix == suffix]


def read_documents(path: str | None, fmt: str, jsonl_field: str = "text",
                   max_documents: int | None = None, keys: tuple[str, str] = TRAINING_KEYS,
                   strict: bool = False) -> Iterator[str]:
    """Documents in a fixed order (sorted file names, file order within a file); `keys`: what the
    messages call the path and the JSONL field; `strict`: a file that is not UTF-8 is refused, not
    read with U+FFFD for its bad bytes (see `read_text`)."""
    kind = resolve_format(path, fmt)
    if kind in ("tokens", "indexed"):
        raise ValueError("token files hold no documents; use fivefold.data.dataset.load_token_file / load_splits")
    if kind == "stdlib":
        stream = (p.read_text(encoding="utf-8", errors="replace") for p in _files_top(stdlib_folder(), ".py"))
    elif kind == "jsonl":
        stream = read_jsonl(Path(path), jsonl_field, keys, strict)
    elif kind == "text":
        stream = iter([read_text(Path(path), strict=strict)])
    else:  # a folder: .jsonl files by record, token files refused, every other file as one document
        stream = _folder_documents(Path(path), jsonl_field, keys, strict)
    for i, doc in enumerate(stream):
        if max_documents is not None and i >= max_documents:
            return
        yield doc


def _files_top(folder: Path, suffix: str) -> list[Path]:
    return sorted(p for p in folder.glob("*" + suffix) if p.is_file())


def source_files(path: str | None, kind: str) -> list[Path]:
    """The files a corpus of `kind` (`resolve_format`'s answer; not "mock") is read from, in a fixed
    order: what `prepare_data`'s cache records, to notice when one is rewritten, added or removed."""
    if kind == "stdlib":
        return _files_top(stdlib_folder(), ".py")
    if kind == "folder":
        return _files(Path(path))
    if kind == "indexed":
        return [Path(prefix + s) for _, prefix in parse_blend(path) for s in (".bin", ".idx")]
    return [Path(path)]


def _folder_documents(folder: Path, jsonl_field: str, keys: tuple[str, str], strict: bool) -> Iterator[str]:
    files = _files(folder)
    if not files:
        raise UserError(f"{keys[0]}={str(folder)!r}: the folder holds no files")
    for p in files:
        if p.suffix in TOKEN_SUFFIXES:
            raise UserError(f"{p}: token files cannot be mixed into a folder of texts; give the token file "
                            f"itself as {keys[0]}")
        if p.suffix in JSONL_SUFFIXES:
            yield from read_jsonl(p, jsonl_field, keys, strict)
        else:
            yield read_text(p, strict=strict)
