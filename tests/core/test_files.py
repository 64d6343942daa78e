"""grouprl.files: the atomic writer (old file or new, never a mix; durable) and the JSON / JSON-lines reader."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from grouprl import files
from grouprl.files import (
    AtomicFile,
    RecordsError,
    fsync_dir,
    json_layout,
    read_json_records,
    write_bytes_atomic,
    write_text_atomic,
)


def leftovers(directory: Path, keep: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p != keep)


# ---------------------------------------------------------------------------- writing


def test_write_replaces_the_file_with_exactly_the_text(tmp_path):
    path = tmp_path / "sub" / "dir" / "out.txt"  # missing parents are created
    write_text_atomic(path, "old\n")
    text = "é ünïcode\r\nwindows line, \u2028 separator\n"
    write_text_atomic(path, text)
    assert path.read_bytes() == text.encode("utf-8")  # UTF-8, no newline translation
    write_bytes_atomic(path, b"\x00\xffbytes")
    assert path.read_bytes() == b"\x00\xffbytes"
    assert leftovers(path.parent, path) == []


class Boom(Exception):
    pass


def test_a_failure_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"complete": true}')
    with pytest.raises(Boom):
        with AtomicFile(path, "w") as fh:
            fh.write('{"comp')  # half a record written, then the writer fails
            fh.flush()
            raise Boom
    assert path.read_text() == '{"complete": true}'
    assert leftovers(tmp_path, path) == []

    # a write that fails before anything exists leaves nothing either
    with pytest.raises(Boom):
        with AtomicFile(tmp_path / "new.json", "wb") as fh:
            fh.write(b"partial")
            raise Boom
    assert leftovers(tmp_path, path) == []


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_fsync_or_rename_leaves_the_old_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "config.yaml"
    path.write_text("old: 1\n")

    def fail(*args, **kwargs):
        raise OSError(f"{failing} failed")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match=f"{failing} failed"):
        write_text_atomic(path, "new: 2\n")
    monkeypatch.undo()
    assert path.read_text() == "old: 1\n"
    assert leftovers(tmp_path, path) == []


def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def spy_fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        return real_fsync(fd)

    def spy_replace(src, dst):
        events.append(f"rename {Path(src).name} -> {Path(dst).name}")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    write_text_atomic(tmp_path / "out.txt", "data")
    monkeypatch.undo()
    assert len(events) == 3
    assert events[0] == "fsync file"
    assert events[1].startswith("rename .out.txt.") and events[1].endswith(".tmp -> out.txt")
    if files._O_DIRECTORY is not None:  # POSIX: the rename itself is made durable
        assert events[2] == "fsync dir"


def test_fsync_dir_fsyncs_the_directory(tmp_path, monkeypatch):
    if files._O_DIRECTORY is None:
        pytest.skip("directories cannot be fsynced on this platform")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd))[1])
    fsync_dir(tmp_path)
    assert synced == [tmp_path.stat().st_ino]


def test_discard_leaves_the_target_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("kept\n")
    target = AtomicFile(path, "w")
    with target as fh:
        fh.write("rewritten\n")
        target.discard()
    assert path.read_text() == "kept\n"
    assert leftovers(tmp_path, path) == []


@pytest.mark.skipif(os.name == "nt", reason="POSIX permissions")
def test_a_new_file_gets_the_permissions_open_would_give(tmp_path):
    old_umask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "data.jsonl", "{}\n")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "data.jsonl").stat().st_mode) == 0o644  # not mkstemp's 0600


# ---------------------------------------------------------------------------- reading


def test_reads_a_json_list_and_json_lines(tmp_path):
    records = [{"id": 1, "text": "a\u2028b"}, {"id": 2, "text": "ü"}]
    as_list = tmp_path / "r.json"
    as_list.write_text(json.dumps(records, indent=1))
    lines = tmp_path / "r.jsonl"
    # ensure_ascii=False writes U+2028 raw; it is not a line break in JSON lines
    lines.write_text("\ufeff" + "\n\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\r\n",
                     encoding="utf-8")
    assert read_json_records(as_list) == records
    assert read_json_records(lines) == records  # byte-order mark, blank lines and CRLF are fine
    assert (json_layout(as_list), json_layout(lines)) == ("json", "jsonl")


def test_a_json_file_holding_one_object_is_one_record(tmp_path):
    path = tmp_path / "one.json"
    path.write_text('{\n  "problem": "a",\n  "answer": "b"\n}\n')
    assert read_json_records(path) == [{"problem": "a", "answer": "b"}]
    assert json_layout(path) == "jsonl"


def test_errors_name_the_file_and_the_line_or_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": oops}\n{"a": 3}\n')
    with pytest.raises(RecordsError) as err:
        read_json_records(path)
    assert str(err.value).startswith(f"{path}: line 3 (record 1): invalid JSON: Expecting value (column 7)")

    broken_list = tmp_path / "bad.json"
    broken_list.write_text('[\n {"a": 1},\n {"a": }\n]')
    with pytest.raises(RecordsError, match=r"bad.json: line 3: invalid JSON: .* \(column 8\)"):
        read_json_records(broken_list)

    not_objects = tmp_path / "list.json"
    not_objects.write_text('[{"a": 1}, ["x"]]')
    with pytest.raises(RecordsError, match=r"list.json: record 1: expected an object, got list"):
        read_json_records(not_objects)

    with pytest.raises(RecordsError, match=r"missing.jsonl: file not found"):
        read_json_records(tmp_path / "missing.jsonl")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"a": "é"}\n'.encode("latin-1"))
    with pytest.raises(RecordsError, match=r"latin.jsonl: not UTF-8 text"):
        read_json_records(latin)


def test_the_first_bad_record_in_file_order_is_reported(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text('{"a": 1}\n{"a": oops}\n[1, 2]\n')
    with pytest.raises(RecordsError, match=r"line 2 \(record 1\): invalid JSON"):
        read_json_records(path)


def test_keep_bad_puts_each_bad_record_in_its_place(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"a": 1}\n{not json\n"a string"\n{"a": 4}\n')
    records = read_json_records(path, keep_bad=True)
    assert records[0] == {"a": 1} and records[3] == {"a": 4}
    assert isinstance(records[1], RecordsError) and "line 2 (record 1): invalid JSON" in str(records[1])
    assert isinstance(records[2], RecordsError) and "record 2: expected an object, got str" in str(records[2])
