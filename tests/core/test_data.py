"""Reading datasets into Samples: file types, record formats, images and bad records."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
from PIL import Image

from grouprl.data import (
    DataError,
    Sample,
    SampleDataset,
    load_samples,
    resize_to_pixel_range,
    samples_from_records,
)

# ---------------------------------------------------------------- helpers


def make_png(path, size=(8, 6), color=(200, 30, 30), mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color if mode == "RGB" else 128).save(path)
    return path


def png_bytes(size=(5, 4), color=(0, 0, 255)):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_json(path, records):
    path.write_text(json.dumps(records, indent=2))
    return path


def easyr1_records(tmp_path, n=3):
    make_png(tmp_path / "img" / "a.png")
    return [
        {"problem": f"<image>What is shown? {i}", "answer": f"ans{i}", "images": ["img/a.png"], "id": f"r{i}"}
        for i in range(n)
    ]


def contents(sample: Sample, role="user"):
    return next(m["content"] for m in sample.messages if m["role"] == role)


# ---------------------------------------------------------------- file types


def test_jsonl_easyr1(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", easyr1_records(tmp_path))
    ds = load_samples(path)
    assert isinstance(ds, SampleDataset) and len(ds) == 3 and ds.skipped == 0
    s = ds[1]
    assert s.messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown? 1"}]}
    ]
    assert s.answer == "ans1"
    assert s.columns == {"id": "r1", "answer": "ans1"}
    assert s.id == "r1" and s.index == 1 and s.source == str(path)
    assert len(s.images) == 1 and s.images[0].mode == "RGB" and s.images[0].size == (8, 6)
    assert s.prompt_text() == "<image>What is shown? 1"
    assert ds.source == str(path)


def test_json_list_and_json_holding_jsonl(tmp_path):
    records = easyr1_records(tmp_path)
    ds = load_samples(write_json(tmp_path / "a.json", records))
    assert [s.answer for s in ds] == ["ans0", "ans1", "ans2"]
    # JSON lines under a .json name are recognised.
    ds = load_samples(write_jsonl(tmp_path / "b.json", records))
    assert [s.answer for s in ds] == ["ans0", "ans1", "ans2"]


def test_parquet_with_embedded_image_bytes(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "problem": ["<image>Describe.", "Text only question"],
            "answer": ["red", "42"],
            # The Hugging Face Image feature's storage: a struct of bytes and path.
            "images": [[{"bytes": png_bytes(), "path": "x.png"}], []],
        }
    )
    pq.write_table(table, tmp_path / "train.parquet")
    ds = load_samples(tmp_path / "train.parquet")
    assert ds[0].images[0].size == (5, 4)
    assert ds[1].images == []
    assert ds[1].messages == [{"role": "user", "content": [{"type": "text", "text": "Text only question"}]}]


def test_saved_hf_dataset_and_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    image = Image.new("RGB", (7, 7), (0, 255, 0))
    train = datasets.Dataset.from_dict(
        {"problem": ["<image>Colour?"], "answer": ["green"], "images": [[image]]},
        features=datasets.Features(
            {
                "problem": datasets.Value("string"),
                "answer": datasets.Value("string"),
                "images": datasets.List(datasets.Image()),
            }
        ),
    )
    test = datasets.Dataset.from_dict({"problem": ["2+2?"], "answer": ["4"], "images": [[]]}, features=train.features)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "ds"))
    ds = load_samples(tmp_path / "ds")
    assert len(ds) == 1 and ds[0].answer == "green" and ds[0].images[0].getpixel((0, 0)) == (0, 255, 0)
    assert load_samples(tmp_path / "ds", split="test")[0].answer == "4"
    with pytest.raises(DataError, match=r"no split 'validation'; splits: train, test"):
        load_samples(tmp_path / "ds", split="validation")
    # A plain Dataset (no splits) ignores the split option.
    train.save_to_disk(str(tmp_path / "plain"))
    assert load_samples(tmp_path / "plain", split="anything")[0].answer == "green"


def test_several_files_concatenate(tmp_path):
    records = easyr1_records(tmp_path)
    a = write_jsonl(tmp_path / "a.jsonl", records[:2])
    b = write_json(tmp_path / "b.json", records[2:])
    for paths in ([a, b], f"{a},{b}", f"{a}, {b}"):
        ds = load_samples(paths)
        assert [s.answer for s in ds] == ["ans0", "ans1", "ans2"]
        assert [(s.source, s.index) for s in ds] == [(str(a), 0), (str(a), 1), (str(b), 0)]
    assert load_samples([a, b], max_samples=2)[1].answer == "ans1"
    assert len(load_samples([a, b], max_samples=2)) == 2


def test_missing_file_and_unsupported_type(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        load_samples(tmp_path / "nope.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported data file type"):
        load_samples(tmp_path / "data.csv")


# ---------------------------------------------------------------- record formats


def test_llava_multi_turn_with_system_turn(tmp_path):
    make_png(tmp_path / "x.png")
    record = {
        "id": "study-1",
        "image": "x.png",
        "conversations": [
            {"from": "system", "value": "You are a radiologist."},
            {"from": "human", "value": "<image>\nDescribe the image."},
            {"from": "gpt", "value": "A red square."},
            {"from": "human", "value": "Any effusion?"},
            {"from": "gpt", "value": "No pleural effusion."},
        ],
    }
    ds = load_samples(write_jsonl(tmp_path / "llava.jsonl", [record]), format="llava")
    s = ds[0]
    assert s.messages == [
        {"role": "system", "content": [{"type": "text", "text": "You are a radiologist."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nDescribe the image."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
        {"role": "user", "content": [{"type": "text", "text": "Any effusion?"}]},
    ]
    assert s.answer == "No pleural effusion."
    assert s.columns == {"id": "study-1", "answer": "No pleural effusion."}
    assert len(s.images) == 1


def test_llava_image_list_and_text_only(tmp_path):
    make_png(tmp_path / "a.png")
    make_png(tmp_path / "b.png", size=(3, 3))
    records = [
        {"id": 1, "image": ["a.png", "b.png"], "conversations": [
            {"from": "human", "value": "Compare."}, {"from": "gpt", "value": "Different sizes."}]},
        {"id": 2, "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    ]
    ds = load_samples(write_json(tmp_path / "l.json", records))  # detected
    assert contents(ds[0]) == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]
    assert [im.size for im in ds[0].images] == [(8, 6), (3, 3)]
    assert ds[1].messages == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


def test_swift_answer_from_assistant_or_solution(tmp_path):
    make_png(tmp_path / "a.png")
    records = [
        {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "Red."}],
         "images": ["a.png"], "solution": "red"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>Colour?"}],
         "images": ["a.png"], "solution": "red", "question_type": "colour"},
    ]
    ds = load_samples(write_jsonl(tmp_path / "swift.jsonl", records))
    assert ds[0].answer == "Red." and ds[0].columns == {"solution": "red", "answer": "Red."}
    assert contents(ds[0]) == [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    assert len(ds[0].messages) == 1
    assert ds[1].answer == "red"
    assert ds[1].columns == {"solution": "red", "question_type": "colour", "answer": "red"}
    assert [m["role"] for m in ds[1].messages] == ["system", "user"]


def test_swift_single_image_field(tmp_path):
    """CheXPO's ms-swift records name one image under `image`; it must not be dropped."""
    make_png(tmp_path / "a.png")
    records = [{"messages": [{"role": "user", "content": "Findings?"}], "image": "a.png", "solution": "effusion"}]
    ds = load_samples(write_jsonl(tmp_path / "swift.jsonl", records), format="swift")
    assert len(ds[0].images) == 1 and contents(ds[0])[0] == {"type": "image"}
    assert "image" not in ds[0].columns
    missing = [{"messages": [{"role": "user", "content": "Findings?"}], "image": "nope.png", "solution": "x"}]
    with pytest.raises(DataError, match="record 0: field 'image'"):
        load_samples(write_jsonl(tmp_path / "bad.jsonl", missing), format="swift")


def test_easyr1_custom_keys(tmp_path):
    make_png(tmp_path / "a.png")
    record = {"question": "<image>Q?", "solution": "S", "pics": ["a.png"], "question_type": "mcq"}
    path = write_jsonl(tmp_path / "c.jsonl", [record])
    ds = load_samples(path, prompt_key="question", answer_key="solution", image_key="pics")
    s = ds[0]
    assert s.answer == "S" and len(s.images) == 1
    assert s.columns == {"solution": "S", "question_type": "mcq", "answer": "S"}
    with pytest.raises(DataError, match="cannot detect the record format"):
        load_samples(path)  # default keys do not fit


def test_detection_failure_lists_keys(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"query": "q", "response": "r"}])
    with pytest.raises(DataError) as err:
        load_samples(path)
    text = str(err.value)
    assert str(path) in text and "['query', 'response']" in text
    for expected in ("easyr1", "'problem'", "llava", "'conversations'", "swift", "'messages'"):
        assert expected in text


def test_unknown_format_name_lists_valid():
    with pytest.raises(DataError, match="valid formats: auto, easyr1, llava, swift"):
        load_samples("x.jsonl", format="sharegpt")


def test_forced_format_is_checked_on_every_record(tmp_path):
    records = easyr1_records(tmp_path, 2)
    records.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    with pytest.raises(DataError, match=r"record 2: field 'problem': missing"):
        load_samples(path)
    with pytest.raises(DataError, match=r"record 0: field 'conversations': missing"):
        load_samples(path, format="llava")


def test_system_prompt_option(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"problem": "1+1?", "answer": "2"}])
    s = load_samples(path, system_prompt="Think step by step.")[0]
    assert s.messages[0] == {"role": "system", "content": [{"type": "text", "text": "Think step by step."}]}
    assert s.messages[1] == {"role": "user", "content": [{"type": "text", "text": "1+1?"}]}
    # A record's own system turn is kept rather than doubled.
    rec = {"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}], "solution": "x"}
    s = load_samples(write_jsonl(tmp_path / "s.jsonl", [rec]), system_prompt="Default.")[0]
    assert [m["content"][0]["text"] for m in s.messages] == ["Own.", "Hi"]


EASYR1_MATH_TEMPLATE = Path(__file__).parent / "configs" / "format_prompt" / "math.jinja"


def test_format_prompt_renders_easyr1s_template_around_the_prompt(tmp_path):
    make_png(tmp_path / "a.png")
    template = EASYR1_MATH_TEMPLATE.read_text()
    records = [{"problem": "<image>  What is 2+2?  ", "answer": "4", "images": ["a.png"]}]
    s = load_samples(write_jsonl(tmp_path / "t.jsonl", records), format_prompt=template)[0]
    # EasyR1 renders the raw prompt ({{ content | trim }} trims the whole of it) and only then splits
    # out the image slots
    assert contents(s) == [{"type": "image"}, {"type": "text", "text": (
        "  What is 2+2? You FIRST think about the reasoning process as an internal monologue and then provide "
        "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
        "The final answer MUST BE put in \\boxed{}.")}]
    assert s.answer == "4"
    # in chat formats, the user turn the policy answers (the last), not the history
    rec = {"conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "reply"},
                             {"from": "human", "value": "second"}, {"from": "gpt", "value": "answer"}]}
    s = load_samples(write_jsonl(tmp_path / "l.jsonl", [rec]), format_prompt="Q: {{ content }}")[0]
    assert [m["content"][0]["text"] for m in s.messages] == ["first", "reply", "Q: second"]


@pytest.mark.parametrize("template, message", [
    ("{{ content ", "format_prompt template: unexpected end of template"),
    ("{{ question }}", "templates get one variable, 'content'"),
    ("Answer in one word.", "never renders {{ content }}"),
])
def test_a_bad_format_prompt_is_refused_before_any_record(tmp_path, template, message):
    path = write_jsonl(tmp_path / "t.jsonl", [{"problem": "1+1?", "answer": "2"}])
    with pytest.raises(DataError, match=re.escape(message)):
        load_samples(path, format_prompt=template)


def test_format_prompt_key_reads_the_template_file(tmp_path):
    from grouprl.config import ConfigError, load_config
    from grouprl.data import load_datasets

    data = write_jsonl(tmp_path / "t.jsonl", [{"problem": "1+1?", "answer": "2"}])
    cfg = load_config(None, [f"data.train_files=[{data}]", f"data.format_prompt={EASYR1_MATH_TEMPLATE}"])
    train, _ = load_datasets(cfg.data)
    assert contents(train[0])[0]["text"].startswith("1+1? You FIRST think")
    cfg = load_config(None, [f"data.train_files=[{data}]", f"data.format_prompt={tmp_path}/missing.jinja"])
    with pytest.raises(ConfigError, match=r"config key 'data.format_prompt': cannot read the template file .*missing"):
        load_datasets(cfg.data)


def test_require_answer_false(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "Describe."}])
    with pytest.raises(DataError, match=r"record 0: field 'answer': missing"):
        load_samples(path)
    s = load_samples(path, require_answer=False)[0]
    assert s.answer is None and s.columns == {"answer": None}


# ---------------------------------------------------------------- images


def test_relative_paths_use_file_directory_or_image_dir(tmp_path):
    make_png(tmp_path / "data" / "a.png", size=(4, 4))
    make_png(tmp_path / "pics" / "a.png", size=(9, 9))
    path = write_jsonl(tmp_path / "data" / "t.jsonl", [{"problem": "<image>", "answer": "x", "images": ["a.png"]}])
    assert load_samples(path)[0].images[0].size == (4, 4)
    assert load_samples(path, image_dir=tmp_path / "pics")[0].images[0].size == (9, 9)
    absolute = write_jsonl(tmp_path / "abs.jsonl", [
        {"problem": "<image>", "answer": "x", "images": [str(tmp_path / "pics" / "a.png")]}])
    assert load_samples(absolute, image_dir=tmp_path / "data")[0].images[0].size == (9, 9)


def test_bytes_dict_and_pil_images(tmp_path):
    datasets = pytest.importorskip("datasets")
    pil = Image.new("L", (6, 2), 100)  # grey, converted to RGB on read
    make_png(tmp_path / "p.png", size=(2, 3))
    ds = datasets.Dataset.from_list(
        [{"problem": "<image><image><image>", "answer": "a", "images": [
            {"bytes": png_bytes((5, 4)), "path": None},
            {"bytes": None, "path": "p.png"},
            {"bytes": png_bytes((1, 1)), "path": None},
        ]}]
    )
    ds.save_to_disk(str(tmp_path / "d"))
    s = load_samples(tmp_path / "d")[0]
    assert [im.size for im in s.images] == [(5, 4), (2, 3), (1, 1)]

    # PIL images and raw bytes reach the loader through records built in memory.
    records = [{"problem": "x", "answer": "y", "images": [pil, png_bytes(), "p.png"]}]
    ds = samples_from_records(records, source="generated", image_dir=tmp_path)
    opened = ds[0].images
    assert [im.size for im in opened] == [(6, 2), (5, 4), (2, 3)]
    assert all(im.mode == "RGB" for im in opened) and pil.mode == "L"
    assert ds[0].source == "generated" and ds.source == "generated"
    with pytest.raises(DataError, match=r"^generated: record 0: field 'images\[1\]': cannot decode image"):
        samples_from_records([{"problem": "x", "answer": "y", "images": [pil, b"junk"]}], source="generated")


def test_placeholders_prepended_when_absent(tmp_path):
    make_png(tmp_path / "a.png")
    record = {"problem": "Find the finding.", "answer": "x", "images": ["a.png", "a.png"]}
    path = write_jsonl(tmp_path / "t.jsonl", [record])
    s = load_samples(path)[0]
    assert contents(s) == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Find the finding."}]


def test_placeholders_interleaved_in_order(tmp_path):
    make_png(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"problem": "Before <image> between <image> after", "answer": "x", "images": ["a.png", "a.png"]}])
    assert contents(load_samples(path)[0]) == [
        {"type": "text", "text": "Before "}, {"type": "image"}, {"type": "text", "text": " between "},
        {"type": "image"}, {"type": "text", "text": " after"},
    ]


def test_placeholder_count_mismatch_is_an_error(tmp_path):
    make_png(tmp_path / "a.png")
    good = {"problem": "<image>ok", "answer": "x", "images": ["a.png"]}
    bad = {"problem": "<image> and <image>", "answer": "x", "images": ["a.png"]}
    path = write_jsonl(tmp_path / "t.jsonl", [good, bad])
    with pytest.raises(DataError) as err:
        load_samples(path)
    expected = f"{path}: record 1: field 'problem': 2 <image> placeholders but 1 image in 'images'"
    assert str(err.value).startswith(expected)
    path = write_jsonl(tmp_path / "u.jsonl", [{"problem": "<image>", "answer": "x"}])
    with pytest.raises(DataError, match=r"record 0: field 'problem': 1 <image> placeholder but 0 images"):
        load_samples(path)


def test_resize_to_pixel_range():
    big = Image.new("RGB", (400, 100))
    out = resize_to_pixel_range(big, max_pixels=10_000)
    assert out.width * out.height <= 10_000 and abs(out.width / out.height - 4) < 0.1
    small = Image.new("RGB", (20, 10))
    out = resize_to_pixel_range(small, min_pixels=5_000)
    assert out.width * out.height >= 5_000 and abs(out.width / out.height - 2) < 0.1
    assert resize_to_pixel_range(small, min_pixels=100, max_pixels=1000) is small
    thin = resize_to_pixel_range(Image.new("RGB", (1, 10_000)), max_pixels=100)
    assert thin.size == (1, 100)
    with pytest.raises(ValueError, match="min_pixels"):
        resize_to_pixel_range(small, min_pixels=10, max_pixels=5)


def test_min_max_pixels_applied_on_read(tmp_path):
    make_png(tmp_path / "big.png", size=(200, 100))
    make_png(tmp_path / "small.png", size=(10, 10))
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"problem": "<image>", "answer": "a", "images": ["big.png"]},
        {"problem": "<image>", "answer": "b", "images": ["small.png"]},
    ])
    ds = load_samples(path, min_pixels=400, max_pixels=5000)
    w, h = ds[0].images[0].size
    assert w * h <= 5000 and w == 2 * h
    w, h = ds[1].images[0].size
    assert w * h >= 400 and w == h
    untouched = load_samples(path)
    assert untouched[0].images[0].size == (200, 100)
    with pytest.raises(DataError, match="larger than max_pixels"):
        load_samples(path, min_pixels=10, max_pixels=5)


# ---------------------------------------------------------------- bad records


def _assert_located(err, path, index, field):
    text = str(err.value)
    assert str(path) in text, text
    assert f"record {index}:" in text, text
    assert f"field '{field}'" in text, text


@pytest.mark.parametrize(
    "bad, field, message",
    [
        ({"answer": "x", "images": []}, "problem", "missing"),
        ({"problem": "q", "answer": 3, "images": []}, "answer", "expected a string, got int"),
        ({"problem": "q", "answer": "x", "images": "a.png"}, "images", "expected a list of images, got str"),
        ({"problem": "<image>", "answer": "x", "images": [12]}, "images[0]", "got int"),
        ({"problem": "<image><image>", "answer": "x", "images": ["a.png", "gone.png"]}, "images[1]",
         "image file not found: {tmp}/gone.png"),
        ({"problem": "<image>", "answer": "x", "images": ["broken.png"]}, "images[0]", "cannot decode image"),
        ({"problem": "<image>", "answer": "x", "images": ["http://x.org/a.png"]}, "images[0]", "URLs are not fetched"),
        ({"problem": "", "answer": "x"}, "problem", "prompt is empty"),
    ],
)
def test_easyr1_bad_records(tmp_path, bad, field, message):
    make_png(tmp_path / "a.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    good = {"problem": "q", "answer": "x"}
    path = write_jsonl(tmp_path / "train.jsonl", [good, good, bad])
    with pytest.raises(DataError) as err:
        load_samples(path, format="easyr1")
    _assert_located(err, path, 2, field)
    assert message.format(tmp=tmp_path) in str(err.value)


@pytest.mark.parametrize(
    "bad, field, message",
    [
        ({"conversations": "hello"}, "conversations", "expected a list, got str"),
        ({"conversations": []}, "conversations", "is empty"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, "conversations[0].from", "got 'bot'"),
        ({"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]},
         "conversations[0].value", "expected a string"),
        ({"conversations": [{"from": "human", "value": "q"}]}, "conversations", "no final 'gpt' turn"),
        ({"conversations": [{"from": "gpt", "value": "x"}]}, "conversations", "no user turn"),
        ({"image": "missing.png", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
         "image", "image file not found"),
        ({"image": ["a.png", None], "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
         "image[1]", "got NoneType"),
    ],
)
def test_llava_bad_records(tmp_path, bad, field, message):
    make_png(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "llava.jsonl", [bad])
    with pytest.raises(DataError) as err:
        load_samples(path, format="llava")
    _assert_located(err, path, 0, field)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "bad, field, message",
    [
        ({"messages": {"role": "user"}}, "messages", "expected a list, got dict"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "got 'robot'"),
        ({"messages": [{"role": "user"}], "solution": "x"}, "messages[0].content", "missing"),
        ({"messages": [{"role": "user", "content": "q"}]}, "messages", "no 'solution' field"),
        ({"messages": [{"role": "user", "content": "q"}], "solution": 4}, "solution", "expected a string"),
        ({"messages": [{"role": "user", "content": "q"}], "solution": "x", "images": ["a.png"]}, "images[0]",
         "image file not found"),
    ],
)
def test_swift_bad_records(tmp_path, bad, field, message):
    path = write_jsonl(tmp_path / "swift.jsonl", [bad])
    with pytest.raises(DataError) as err:
        load_samples(path, format="swift")
    _assert_located(err, path, 0, field)
    assert message in str(err.value)


def test_unparseable_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"problem": "a", "answer": "b"}\n\n{"problem": oops}\n')
    with pytest.raises(DataError) as err:
        load_samples(path)
    assert str(err.value).startswith(f"{path}: line 3 (record 1): invalid JSON")
    broken_array = tmp_path / "t.json"
    broken_array.write_text('[\n {"problem": "a", "answer": "b"},\n {"problem": }\n]')
    with pytest.raises(DataError, match=r"t.json: line 3: invalid JSON"):
        load_samples(broken_array)


def test_non_object_record(tmp_path):
    path = write_json(tmp_path / "t.json", [{"problem": "a", "answer": "b"}, ["not", "an", "object"]])
    with pytest.raises(DataError, match=r"t.json: record 1: expected an object, got list"):
        load_samples(path)


def test_skip_bad_records_counts_and_keeps_messages(tmp_path):
    make_png(tmp_path / "a.png")
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"problem": "<image>ok", "answer": "1", "images": ["a.png"]}),
        json.dumps({"problem": "<image>", "answer": "2", "images": ["gone.png"]}),
        "{not json",
        json.dumps({"problem": "fine", "answer": "4"}),
        json.dumps({"problem": "no answer"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    ds = load_samples(path, skip_bad_records=True)
    assert [s.answer for s in ds] == ["1", "4"]
    assert [s.index for s in ds] == [0, 3]
    assert ds.skipped == 3 and len(ds.skipped_details) == 3
    assert "record 1: field 'images[0]': image file not found" in ds.skipped_details[0]
    assert "line 3 (record 2): invalid JSON" in ds.skipped_details[1]
    assert "record 4: field 'answer': missing" in ds.skipped_details[2]
    assert "3 skipped" in repr(ds)


def test_empty_after_skipping_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"problem": "q"}, {"problem": "r", "answer": 1}])
    with pytest.raises(DataError) as err:
        load_samples(path, skip_bad_records=True)
    assert "no valid records" in str(err.value) and "all 2 record(s) were bad" in str(err.value)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="no valid records"):
        load_samples(tmp_path / "empty.jsonl")


def test_image_removed_after_loading_is_reported_on_access(tmp_path):
    image = make_png(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "t.jsonl", [{"problem": "<image>", "answer": "x", "images": ["a.png"]}])
    ds = load_samples(path)
    os.remove(image)
    with pytest.raises(DataError, match=r"record 0: field 'images\[0\]': image file not found"):
        ds[0]


def test_samples_are_independent_copies(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"problem": "q", "answer": "x", "id": "1"}])
    ds = load_samples(path)
    first = ds[0]
    first.messages[0]["content"].append({"type": "text", "text": "edited"})
    first.columns["id"] = "changed"
    assert ds[0].messages[0]["content"] == [{"type": "text", "text": "q"}] and ds[0].id == "1"
    assert ds[-1].answer == "x" and len(ds[0:1]) == 1


def test_detection_uses_first_readable_record_and_rejects_ambiguity(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("{broken\n" + json.dumps({"problem": "q", "answer": "a"}) + "\n")
    ds = load_samples(path, skip_bad_records=True)
    assert len(ds) == 1 and ds.skipped == 1
    both = write_jsonl(tmp_path / "both.jsonl", [{"problem": "q", "answer": "a", "messages": []}])
    with pytest.raises(DataError, match=r"fits several formats \(easyr1, swift\)"):
        load_samples(both)
    assert load_samples(both, format="easyr1")[0].columns == {"messages": [], "answer": "a"}


def test_id_key_names_the_sample(tmp_path):
    records = [{"problem": "Q?", "answer": "A", "idx": "case-7"}]
    ds = load_samples(write_jsonl(tmp_path / "r.jsonl", records), id_key="idx")
    assert ds[0].id == "case-7"
    assert load_samples(write_jsonl(tmp_path / "s.jsonl", records))[0].id.endswith("#0")
