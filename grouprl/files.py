"""Writing a file so that a crash never leaves it half written, and reading JSON / JSON-lines records.

Every file grouprl writes for a later step, a resumed run or a person to read (configs,
checkpoint markers, summaries, data sets, images) goes through :class:`AtomicFile`: the
bytes go to a temporary file beside the target, are flushed and fsynced, and the
temporary file is renamed over the target, after which the directory is fsynced (where
the platform can open a directory). A reader, or a run killed at any moment, sees the
old file or the new one, never a mix, and a completed write survives a power loss.
Temporary names start with a dot (``.<name>.<random>.tmp``) so that listings of results
can leave them out.

Every JSON or JSON-lines file of records (data sets, predictions, sample selections,
metrics) is read by :func:`read_json_records`, whose errors name the file and the line
or record at fault.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from pathlib import Path
from typing import IO, Any

# POSIX only: Windows can neither open a directory nor fsync one, and makes renames durable itself.
_O_DIRECTORY = getattr(os, "O_DIRECTORY", None)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries durable: the renames, creations and deletions in it (no-op on Windows)."""
    if _O_DIRECTORY is None:
        return
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A file written beside ``path`` that takes its place only when complete::

        with AtomicFile(path, "wb") as fh:
            image.save(fh, format="PNG")

    ``mode`` is ``"w"`` (text: UTF-8, written exactly as given, no newline translation)
    or ``"wb"``. On a clean exit the file is flushed, fsynced and renamed over ``path``,
    and the directory is fsynced. On an exception, or after :meth:`discard`, the
    temporary file is deleted and ``path`` is left as it was. Missing parent directories
    are created.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "w"):
        if mode not in ("w", "wb"):
            raise ValueError(f"AtomicFile mode must be 'w' or 'wb', got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        self._tmp: Path | None = None
        self._file: IO | None = None
        self._discarded = False

    def __enter__(self) -> IO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = _create_beside(self.path)
        if self.mode == "wb":
            self._file = os.fdopen(fd, "wb")
        else:
            self._file = os.fdopen(fd, "w", encoding="utf-8", newline="")
        return self._file

    def discard(self) -> None:
        """Leave ``path`` untouched at the end of the ``with`` block (the temporary file is deleted)."""
        self._discarded = True

    def __exit__(self, exc_type, exc, tb) -> None:
        renamed = False
        try:
            if exc_type is None and not self._discarded:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                os.replace(self._tmp, self.path)
                renamed = True
                fsync_dir(self.path.parent)
        finally:
            if not renamed:
                with contextlib.suppress(OSError):  # a failed flush fails again on close; the error is already raised
                    self._file.close()
                self._tmp.unlink(missing_ok=True)


def _create_beside(path: Path) -> tuple[int, Path]:
    """A new, empty temporary file in ``path``'s directory: its descriptor and name.

    Created with mode 0666 less the umask, as ``open`` would (``tempfile.mkstemp`` makes
    0600 files, which would change the target's permissions on the rename). The random
    part keeps concurrent writers of one target (several processes) apart.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def _in_the_way(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists and is not a directory, if any."""
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


def check_writable_dir(path: str | os.PathLike, what: str = "output directory", *, create: bool = True) -> Path:
    """Create the directory ``path`` (with its parents) and write and remove a small file in it.

    Run before anything slow (a model loading), so that a read-only file system, a file where
    the directory should be or a missing permission is an :class:`~grouprl.errors.OutputError`
    naming ``what``, the path and the operating system's reason, not a traceback once the
    model has loaded. The probe file is hidden (``.grouprl-write-probe.<random>``); returns ``path``.
    ``create`` False: a missing ``path`` is not made; the probe goes to its nearest existing
    parent instead (for a command that may still refuse its arguments, and should then leave nothing).
    """
    from grouprl.errors import OutputError

    path = Path(path)
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
            where = path
        else:
            where = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
            if not where.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(where))
        probe = where / f".grouprl-write-probe.{secrets.token_hex(4)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.write(fd, b"grouprl")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        blocker = _in_the_way(path)
        if blocker is not None:
            reason = (f"{blocker} is a file, not a directory" if blocker == path
                      else f"{blocker} is a file, so no directory can be made under it")
        else:
            reason = exc.strerror or str(exc)
            if exc.filename and Path(exc.filename) != path:
                reason = f"{reason}: {exc.filename}"
        raise OutputError(f"cannot write to the {what} {path}: {reason}", str(path), exc.errno) from exc
    return path


def follow_umask(root: str | os.PathLike) -> None:
    """Give every file under ``root`` mode 0666 and every directory 0777, less the umask, as ``open`` would.

    Some writers make private files whatever the umask (safetensors' ``save_file`` writes 0600),
    so a checkpoint or an exported model on a shared cluster would be unreadable to the team.
    """
    mask = os.umask(0)
    os.umask(mask)
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8, as given) to ``path`` atomically and durably; see :class:`AtomicFile`."""
    with AtomicFile(path, "w") as fh:
        fh.write(text)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably; see :class:`AtomicFile`."""
    with AtomicFile(path, "wb") as fh:
        fh.write(data)


# ---------------------------------------------------------------------------- JSON / JSON-lines records


class RecordsError(ValueError):
    """A JSON or JSON-lines file that cannot be read as records; the message names the file and the line or record."""


def read_json_records(path: str | os.PathLike, *, keep_bad: bool = False) -> list[Any]:
    """The records (JSON objects) of a JSON list or a JSON-lines file, in file order.

    A file whose first non-blank character is ``[`` is one JSON list (:func:`json_layout`);
    otherwise each non-blank line is a record (lines end at ``\\n`` only, so a U+2028
    written unescaped inside a string does not split a record), except that a
    non-``.jsonl`` file holding a single object, possibly over several lines, is that one
    record. A UTF-8 byte-order mark is skipped.

    Errors name the file and where: ``<path>: line 3 (record 1): invalid JSON: ...``,
    ``<path>: record 4: expected an object, got list``. ``keep_bad``: a line that is not
    JSON and a record that is not an object become a :class:`RecordsError` in their place
    instead of raising, for a caller that skips bad records and reports them; a file that
    cannot be read at all (missing, not UTF-8, a broken JSON list) raises either way.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError as exc:
        raise RecordsError(f"{path}: file not found") from exc
    except UnicodeDecodeError as exc:
        raise RecordsError(f"{path}: not UTF-8 text: {exc}") from exc
    records = _parse(path, text)
    for index, record in enumerate(records):
        if not isinstance(record, (dict, RecordsError)):
            records[index] = RecordsError(f"{path}: record {index}: expected an object, got {type(record).__name__}")
        if isinstance(records[index], RecordsError) and not keep_bad:
            raise records[index]
    return records


def json_layout(path: str | os.PathLike) -> str:
    """How a records file is laid out: ``json`` for a JSON list (its first non-blank character is ``[``), else ``jsonl``."""
    with open(path, encoding="utf-8-sig") as fh:
        while chunk := fh.read(4096):
            if chunk.strip():
                return "json" if chunk.lstrip()[0] == "[" else "jsonl"
    return "jsonl"


def _parse(path: str | os.PathLike, text: str) -> list[Any]:
    """The parsed values of the text, a RecordsError in place of each JSON line that does not parse."""
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise RecordsError(f"{path}: line {exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from exc
    if text.lstrip().startswith("{") and not str(path).lower().endswith(".jsonl"):
        try:
            single = json.loads(text)
        except json.JSONDecodeError:
            pass  # more than one object: JSON lines under a .json name
        else:
            return [single]
    records: list[Any] = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            records.append(RecordsError(f"{path}: line {line_number} (record {len(records)}): invalid JSON: "
                                        f"{exc.msg} (column {exc.colno})"))
    return records
