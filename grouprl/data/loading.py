"""Reading dataset files into a sequence of Samples.

``load_samples`` reads JSON, JSON-lines, parquet files and Hugging Face datasets
saved with ``save_to_disk``, takes every record apart with its format
(``formats.py``) and checks every image before returning, so that a bad record
fails at start-up, named by file, record index and field, rather than hours into
a run. Images are decoded only when a sample is read.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from grouprl.data.formats import (FORMATS, DataError, RecordError, RecordKeys, detect_format, parse_record,
                                  prompt_formatter)
from grouprl.data.images import ImageError, ImageRef, check_image, check_pixel_range, open_image, resolve_image
from grouprl.data.sample import Sample
from grouprl.files import RecordsError, read_json_records

logger = logging.getLogger(__name__)

PathArg = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

_JSON_SUFFIXES = (".json", ".jsonl")
_PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class _Entry:
    """A checked record waiting to become a Sample; images are references, not pixels."""

    messages: list[dict[str, Any]]
    image_fields: list[str]
    image_refs: list[ImageRef]
    answer: str | None
    columns: dict[str, Any]
    source: str
    index: int
    chat_template_kwargs: dict[str, Any]
    record_prompt: str | list[dict[str, Any]] | None = None


class SampleDataset(Sequence):
    """The Samples of one or more data files, in file order (a torch-free map-style dataset).

    ``skipped`` counts the bad records left out under ``skip_bad_records`` and
    ``skipped_details`` keeps their messages; ``source`` names the files read.
    """

    def __init__(
        self,
        entries: list[_Entry],
        *,
        source: str,
        skipped_details: list[str] | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        id_key: str = "id",
    ):
        check_pixel_range(min_pixels, max_pixels)
        self._entries = entries
        self.source = source
        self.skipped_details = list(skipped_details or [])
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        # the record field that names a sample (Sample.id reads the "id" column)
        self.id_key = id_key

    @property
    def skipped(self) -> int:
        return len(self.skipped_details)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        entry = self._entries[index]
        images = []
        for field_name, ref in zip(entry.image_fields, entry.image_refs):
            try:
                images.append(open_image(ref, min_pixels=self.min_pixels, max_pixels=self.max_pixels))
            except ImageError as exc:
                # The file was there when the dataset was loaded; say which record lost it.
                raise DataError(_where(entry.source, entry.index, field_name, str(exc))) from exc
        # Copies, so that a consumer editing a Sample cannot change the dataset.
        columns = dict(entry.columns)
        if self.id_key != "id" and self.id_key in columns:
            columns["id"] = columns[self.id_key]
        return Sample(
            messages=copy.deepcopy(entry.messages),
            images=images,
            answer=entry.answer,
            columns=columns,
            source=entry.source,
            index=entry.index,
            chat_template_kwargs=copy.deepcopy(entry.chat_template_kwargs),
            record_prompt=copy.deepcopy(entry.record_prompt),
        )

    def __repr__(self) -> str:
        return f"SampleDataset({len(self)} samples from {self.source}, {self.skipped} skipped)"


def load_samples(
    paths: PathArg,
    *,
    format: str = "auto",
    prompt_key: str | None = None,
    answer_key: str | None = None,
    image_key: str | None = None,
    image_dir: str | os.PathLike | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    system_prompt: str | None = None,
    format_prompt: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    skip_bad_records: bool = False,
    split: str = "train",
    max_samples: int | None = None,
    require_answer: bool = True,
    id_key: str = "id",
) -> SampleDataset:
    """Read ``paths`` (one path, a comma-separated string or a list) into a SampleDataset.

    ``format`` is ``"auto"`` (detected per file from its first record) or one of
    ``easyr1``, ``llava``, ``swift``, ``trl``; ``prompt_key`` / ``answer_key`` /
    ``image_key`` rename EasyR1's fields. Relative image paths are taken
    relative to ``image_dir``, or else to the directory holding the data file.
    ``split`` picks the split of a saved DatasetDict. ``max_samples`` stops after
    that many valid records. A bad record raises DataError unless
    ``skip_bad_records``, which leaves it out and counts it. ``id_key`` names the
    field that identifies a record (CheXPO's data uses ``idx``); it becomes ``Sample.id``.
    ``format_prompt`` is a Jinja template (its text) each prompt is rendered through, as
    ``{{ content }}`` (EasyR1's ``data.format_prompt``; see ``prompt_formatter``).
    ``chat_template_kwargs`` become every sample's ``chat_template_kwargs`` (extra chat template
    variables, e.g. ``{"enable_thinking": False}``); a record's own ``chat_template_kwargs`` field
    (an object) overrides them key by key, as in TRL.
    """
    reader = _Reader(
        format=format,
        keys=_record_keys(prompt_key, answer_key, image_key),
        system_prompt=system_prompt,
        format_prompt=format_prompt,
        chat_template_kwargs=chat_template_kwargs,
        require_answer=require_answer,
        skip_bad_records=skip_bad_records,
        max_samples=max_samples,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    path_list = split_paths(paths)
    _check_image_dir(image_dir)
    for path in path_list:
        if reader.full:
            break
        source = os.fspath(path)
        base_dir = os.fspath(image_dir) if image_dir is not None else os.path.dirname(os.path.abspath(source))
        reader.read(source, _iter_records(source, split), base_dir)
    return reader.dataset(", ".join(os.fspath(p) for p in path_list), id_key=id_key)


def load_datasets(data) -> tuple[SampleDataset, SampleDataset | None]:
    """The training and validation datasets named by a ``data`` config section (``DataConfig``)."""
    if not data.train_files:
        from grouprl.config import ConfigError

        raise ConfigError("config key 'data.train_files' is empty: name at least one training file")
    common = dict(format=data.format, prompt_key=data.prompt_key, answer_key=data.answer_key,
                  image_key=data.image_key, image_dir=data.image_dir, min_pixels=data.min_pixels,
                  max_pixels=data.max_pixels, system_prompt=data.system_prompt,
                  format_prompt=read_format_prompt(data.format_prompt),
                  chat_template_kwargs=data.chat_template_kwargs,
                  skip_bad_records=data.skip_bad_records, id_key=data.id_key)
    train = load_samples(data.train_files, max_samples=data.max_samples, **common)
    val = load_samples(data.val_files, max_samples=data.val_max_samples, **common) if data.val_files else None
    return train, val


def read_format_prompt(path: str | None) -> str | None:
    """The text of the template file that ``data.format_prompt`` names (None: no template)."""
    if path is None:
        return None
    from grouprl.config import ConfigError

    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config key 'data.format_prompt': cannot read the template file {path!r} "
                          f"({exc.strerror or exc})") from exc


def samples_from_records(
    records: Iterable[dict[str, Any]],
    *,
    source: str = "<memory>",
    format: str = "auto",
    prompt_key: str | None = None,
    answer_key: str | None = None,
    image_key: str | None = None,
    image_dir: str | os.PathLike | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    system_prompt: str | None = None,
    format_prompt: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    skip_bad_records: bool = False,
    max_samples: int | None = None,
    require_answer: bool = True,
    id_key: str = "id",
) -> SampleDataset:
    """Records already in memory (e.g. made by a generator, images as PIL) into a SampleDataset.

    Options and checks are those of ``load_samples``; ``source`` names the
    records in messages, and relative image paths are taken relative to
    ``image_dir`` or else the working directory.
    """
    reader = _Reader(
        format=format,
        keys=_record_keys(prompt_key, answer_key, image_key),
        system_prompt=system_prompt,
        format_prompt=format_prompt,
        chat_template_kwargs=chat_template_kwargs,
        require_answer=require_answer,
        skip_bad_records=skip_bad_records,
        max_samples=max_samples,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    _check_image_dir(image_dir)
    base_dir = os.fspath(image_dir) if image_dir is not None else os.getcwd()
    reader.read(source, enumerate(records), base_dir)
    return reader.dataset(source, id_key=id_key)


class _Reader:
    """Checks records source by source and gathers the good ones (and the skipped messages)."""

    def __init__(
        self,
        *,
        format: str,
        keys: RecordKeys,
        system_prompt: str | None,
        format_prompt: str | None,
        require_answer: bool,
        chat_template_kwargs: dict[str, Any] | None,
        skip_bad_records: bool,
        max_samples: int | None,
        min_pixels: int | None,
        max_pixels: int | None,
    ):
        if format not in ("auto", *FORMATS):
            raise DataError(f"unknown data format {format!r}; valid formats: auto, {', '.join(FORMATS)}")
        if max_samples is not None and (
            isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1
        ):
            raise DataError(f"max_samples must be a positive integer or None, got {max_samples!r}")
        try:
            check_pixel_range(min_pixels, max_pixels)
        except ValueError as exc:
            raise DataError(str(exc)) from exc
        self.format = format
        self.keys = keys
        self.system_prompt = system_prompt
        self.format_prompt = prompt_formatter(format_prompt) if format_prompt is not None else None
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise DataError(f"chat_template_kwargs must be a mapping of template variables, "
                            f"got {type(chat_template_kwargs).__name__}")
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.require_answer = require_answer
        self.skip_bad_records = skip_bad_records
        self.max_samples = max_samples
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.entries: list[_Entry] = []
        self.skipped: list[str] = []

    @property
    def full(self) -> bool:
        return self.max_samples is not None and len(self.entries) >= self.max_samples

    def read(self, source: str, records: Iterable[tuple[int, Any]], base_dir: str) -> None:
        file_format = None if self.format == "auto" else self.format
        for index, record in records:
            if self.full:
                break
            if file_format is None and isinstance(record, dict):
                # Outside the skip below: a source whose first record fits no
                # format is a configuration problem, not one bad record.
                file_format = detect_format(record, self.keys, source)
            try:
                if isinstance(record, DataError):
                    raise record
                if not isinstance(record, dict):
                    raise DataError(f"{source}: record {index}: expected an object, got {type(record).__name__}")
                self.entries.append(self._check(record, file_format, base_dir, source, index))
            except DataError as exc:
                if not self.skip_bad_records:
                    raise
                self.skipped.append(str(exc))

    def dataset(self, source: str, *, id_key: str = "id") -> SampleDataset:
        if self.skipped:
            logger.warning("%s: skipped %d bad record(s); first: %s", source, len(self.skipped), self.skipped[0])
        if not self.entries:
            detail = f"; all {len(self.skipped)} record(s) were bad, first: {self.skipped[0]}" if self.skipped else ""
            raise DataError(f"{source}: no valid records{detail}")
        return SampleDataset(
            self.entries,
            source=source,
            skipped_details=self.skipped,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            id_key=id_key,
        )

    def _check(self, record: dict[str, Any], fmt: str, base_dir: str, source: str, index: int) -> _Entry:
        try:
            parsed = parse_record(
                record, fmt, keys=self.keys, system_prompt=self.system_prompt,
                format_prompt=self.format_prompt, require_answer=self.require_answer
            )
        except RecordError as exc:
            raise DataError(_where(source, index, exc.field, exc.message)) from exc
        fields, refs = [], []
        for field_name, value in parsed.images:
            try:
                ref = resolve_image(value, base_dir)
                check_image(ref)
            except ImageError as exc:
                raise DataError(_where(source, index, field_name, str(exc))) from exc
            fields.append(field_name)
            refs.append(ref)
        kwargs = self._chat_template_kwargs(parsed.columns.pop("chat_template_kwargs", None), source, index)
        return _Entry(parsed.messages, fields, refs, parsed.answer, parsed.columns, source, index, kwargs,
                      parsed.record_prompt)

    def _chat_template_kwargs(self, own: Any, source: str, index: int) -> dict[str, Any]:
        """The run's chat template kwargs with the record's own (its ``chat_template_kwargs`` field) over them."""
        if own is None:
            return dict(self.chat_template_kwargs)
        if not isinstance(own, dict):
            raise DataError(_where(source, index, "chat_template_kwargs",
                                   f"expected an object of chat template variables, got {type(own).__name__}"))
        # a parquet struct column gives every row every key, null where the row had none
        return {**self.chat_template_kwargs, **{k: v for k, v in own.items() if v is not None}}


def _record_keys(prompt_key: str | None, answer_key: str | None, image_key: str | None) -> RecordKeys:
    defaults = RecordKeys()
    return RecordKeys(
        prompt=prompt_key or defaults.prompt,
        answer=answer_key or defaults.answer,
        images=image_key or defaults.images,
    )


def _check_image_dir(image_dir: str | os.PathLike | None) -> None:
    if image_dir is not None and not os.path.isdir(image_dir):
        raise DataError(f"image_dir is not a directory: {os.path.abspath(image_dir)}")


def _where(source: str, index: int, field_name: str, message: str) -> str:
    return f"{source}: record {index}: field {field_name!r}: {message}"


def split_paths(paths: PathArg) -> list[str | os.PathLike]:
    """The files of a ``data.*_files`` value: a list, or one string (comma-separated unless it is one path)."""
    if isinstance(paths, (str, os.PathLike)):
        text = os.fspath(paths)
        # A comma-separated list, unless the whole string is itself a path.
        items = [text] if os.path.exists(text) else [p.strip() for p in text.split(",")]
    else:
        items = list(paths)
    items = [p for p in items if os.fspath(p)]
    if not items:
        raise DataError("no data files given")
    return items


def _iter_records(source: str, split: str) -> Iterator[tuple[int, Any]]:
    """(index, record) pairs; an unparseable JSON line comes as a DataError in place of its record."""
    if not os.path.exists(source):
        raise DataError(f"{source}: data file not found ({os.path.abspath(source)})")
    if os.path.isdir(source):
        yield from enumerate(_read_saved_dataset(source, split))
        return
    lower = source.lower()
    if lower.endswith(_PARQUET_SUFFIXES):
        yield from enumerate(_read_parquet(source))
    elif lower.endswith(_JSON_SUFFIXES):
        yield from _read_json(source)
    else:
        raise DataError(
            f"{source}: unsupported data file type; expected .json, .jsonl, .parquet "
            "or a directory written by datasets' save_to_disk"
        )


def _read_json(source: str) -> Iterator[tuple[int, Any]]:
    """(index, record) pairs; a bad record (a line that is not JSON, a value that is not an object) comes as
    a DataError in its place, so that ``skip_bad_records`` can leave it out and count it."""
    try:
        records = read_json_records(source, keep_bad=True)
    except RecordsError as exc:
        raise DataError(str(exc)) from exc
    for index, record in enumerate(records):
        yield index, DataError(str(record)) if isinstance(record, RecordsError) else record


def _read_parquet(source: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # imported here so that `import grouprl.data` stays light

    try:
        return pq.read_table(source).to_pylist()
    except Exception as exc:  # pyarrow's errors do not share a useful base class
        raise DataError(f"{source}: cannot read parquet file: {exc}") from exc


def _read_saved_dataset(source: str, split: str) -> list[dict[str, Any]]:
    import datasets  # imported here: it pulls in pandas and pyarrow

    try:
        loaded = datasets.load_from_disk(source)
    except Exception as exc:  # datasets raises FileNotFoundError/ValueError/... for a wrong directory
        raise DataError(f"{source}: not a Hugging Face dataset saved with save_to_disk: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{source}: no split {split!r}; splits: {', '.join(loaded)}")
        loaded = loaded[split]
    # to_list() returns the stored values: image features come as
    # {"bytes", "path"} dicts, checked and decoded like any other image value.
    return loaded.to_list()
