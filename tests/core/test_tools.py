"""Tools for multi-turn rollouts (grouprl.rollout.tools): schemas, references, call parsing, running, rendering."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from grouprl.models.tiny import build_tokenizer
from grouprl.rollout.tools import (TOOLS, ParsedResponse, Tool, ToolCall, ToolCallError, ToolLimits, ToolLoadError,
                                   ToolRunner, load_tool, load_tools, parse_hermes, parse_llama3_json,
                                   parse_tool_calls, parser_for_template, register_tool, tool_schema)

TEMPLATES = Path(__file__).parent / "chat_templates"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def shout(text: str, times: int = 1) -> str:
    """Upper-case a text.

    Args:
        text: What to shout.
        times: How many times.
    """
    return " ".join([text.upper()] * times)


def untyped(x):
    """No hints.

    Args:
        x: Something.
    """
    return x


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: Numerator.
        b: Denominator.
    """
    return a / b


RELEASE = threading.Event()


def hang(x: int) -> int:
    """Wait until released.

    Args:
        x: Anything.
    """
    RELEASE.wait(30)
    return x


def llama3_template() -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "llama3_1.jinja").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- schemas and references


def test_schema_is_transformers_from_the_hints_and_docstring():
    schema = tool_schema(add)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first integer."},
                                              "b": {"type": "integer", "description": "The second integer."}}
    assert fn["parameters"]["required"] == ["a", "b"]
    assert Tool.from_function(shout).parameters["required"] == ["text"]


def test_a_function_without_type_hints_is_one_line_naming_the_tool():
    with pytest.raises(ToolLoadError, match=r"^tool 'untyped' has no JSON schema .*untyped") as info:
        Tool.from_function(untyped)
    assert "\n" not in str(info.value).strip()


def test_registered_name_and_file_reference(tmp_path, monkeypatch):
    monkeypatch.setitem(TOOLS, "adder", add)
    tool = load_tool("adder")
    assert tool.name == "adder" and tool.fn is add and tool.schema["function"]["name"] == "adder"
    file = tmp_path / "my_tools.py"
    file.write_text('def mul(a: int, b: int) -> int:\n    """Multiply.\n\n    Args:\n        a: x.\n'
                    '        b: y.\n    """\n    return a * b\n')
    tool = load_tool(f"{file}:mul")
    assert tool.name == "mul" and tool.fn(3, 4) == 12


def test_register_tool_decorator_and_unknown_names():
    try:
        assert register_tool("shouter")(shout) is shout
        assert load_tool("shouter").fn is shout
        with pytest.raises(ToolLoadError, match=r"unknown tool 'shoutr'.*shouter"):
            load_tool("shoutr")
    finally:
        TOOLS.unregister("shouter")
    with pytest.raises(ToolLoadError, match=r"more than once"):
        load_tools([add, add])


# ----------------------------------------------------------------------------- parsing


def test_hermes_parses_one_and_several_calls():
    one = parse_hermes('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert one == ParsedResponse("Let me add.", [ToolCall("add", {"a": 1, "b": 2})])
    two = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
                       '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>')
    assert two.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("shout", {"text": "hi"})]
    assert parse_hermes("No tools here.") == ParsedResponse("No tools here.", [])


def test_hermes_malformed_calls_are_values_next_to_the_good_ones():
    parsed = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>'
                          '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                          '<tool_call>[1, 2]</tool_call><tool_call>{"name": "add"')
    bad_json, good, not_object, unclosed = parsed.calls
    assert isinstance(bad_json, ToolCallError) and "not valid JSON" in bad_json.message
    assert good == ToolCall("add", {"a": 1, "b": 2})
    assert isinstance(not_object, ToolCallError) and "JSON object" in not_object.message
    assert isinstance(unclosed, ToolCallError) and "not closed" in unclosed.message


def test_llama3_json_parses_bare_and_python_tag_calls_and_malformed_ones():
    assert parse_llama3_json('{"name": "add", "parameters": {"a": 1, "b": 2}}').calls == [
        ToolCall("add", {"a": 1, "b": 2})]
    tagged = parse_llama3_json('Adding.<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}')
    assert tagged == ParsedResponse("Adding.", [ToolCall("add", {"a": 5, "b": 6})])
    assert parse_llama3_json("The answer is 3.") == ParsedResponse("The answer is 3.", [])
    (bad,) = parse_llama3_json('{"name": "add", "parameters": {"a": 1').calls
    assert isinstance(bad, ToolCallError) and "not valid JSON" in bad.message
    (empty,) = parse_llama3_json("<|python_tag|>").calls
    assert isinstance(empty, ToolCallError)


def test_parser_chosen_from_real_chat_templates_and_overridable():
    assert parser_for_template((TEMPLATES / "Qwen2.5-Instruct.jinja").read_text()) == "hermes"
    assert parser_for_template((TEMPLATES / "Qwen3.jinja").read_text()) == "hermes"
    assert parser_for_template(llama3_template()) == "llama3_json"
    assert parser_for_template((TEMPLATES / "Qwen3.jinja").read_text(), "llama3_json") == "llama3_json"
    with pytest.raises(ToolLoadError, match="no tool call format"):
        parser_for_template("{{ messages[0]['content'] }}")
    with pytest.raises(ToolLoadError, match="unknown tool call parser 'hermez'"):
        parser_for_template("", "hermez")
    assert parse_tool_calls('{"name": "add", "parameters": {}}', "llama3_json").calls == [ToolCall("add", {})]


# ----------------------------------------------------------------------------- running


def test_results_are_tool_messages_and_calls_are_counted():
    runner = ToolRunner([Tool.from_function(add), Tool.from_function(shout)])
    results = runner.run_turn([ToolCall("add", {"a": 2, "b": 3}), ToolCall("shout", {"text": "hi", "times": 2})])
    assert [r.message for r in results] == [{"role": "tool", "name": "add", "content": "5"},
                                            {"role": "tool", "name": "shout", "content": "HI HI"}]
    assert (runner.calls, runner.errors, runner.per_tool) == (2, 0, {"add": 1, "shout": 1})


def test_a_tool_returning_content_parts_passes_them_on_and_other_values_as_json():
    def look(region: str) -> list:
        """Look at a region.

        Args:
            region: where
        """
        return [{"type": "image", "image": "<pixels>"}, {"type": "text", "text": region}]

    def facts(region: str) -> dict:
        """Facts about a region.

        Args:
            region: where
        """
        return {"region": region, "size": [1, 2]}

    runner = ToolRunner([Tool.from_function(look), Tool.from_function(facts)])
    parts, data = runner.run_turn([ToolCall("look", {"region": "apex"}), ToolCall("facts", {"region": "apex"})])
    assert parts.content == [{"type": "image", "image": "<pixels>"}, {"type": "text", "text": "apex"}]
    assert data.content == '{"region": "apex", "size": [1, 2]}'


def test_raising_bad_arguments_unknown_and_malformed_calls_give_error_text_and_counts():
    runner = ToolRunner([Tool.from_function(divide), Tool.from_function(add)])
    raised, missing, extra, not_dict, unknown, malformed = runner.run_turn([
        ToolCall("divide", {"a": 1.0, "b": 0.0}), ToolCall("add", {"a": 1}), ToolCall("add", {"a": 1, "b": 2, "c": 3}),
        ToolCall("add", [1, 2]), ToolCall("mul", {}), ToolCallError("{bad", "the tool call is not valid JSON")])
    assert raised.error and raised.content == "Error: ZeroDivisionError: float division by zero"
    assert missing.error and "missing required argument(s) b" in missing.content
    assert extra.error and "unknown argument(s) c" in extra.content
    assert not_dict.error and "JSON object" in not_dict.content
    assert unknown.error and "unknown tool 'mul'" in unknown.content and "add, divide" in unknown.content
    assert malformed.error and "malformed tool call: the tool call is not valid JSON" in malformed.content
    assert (runner.calls, runner.errors) == (1, 6)  # only divide ran
    assert runner.per_tool == {"divide": 1}


def test_a_tool_that_times_out_returns_its_error_and_the_rollout_goes_on():
    RELEASE.clear()
    runner = ToolRunner([Tool.from_function(hang), Tool.from_function(add)], ToolLimits(timeout=0.2))
    try:
        timed_out, after = runner.run_turn([ToolCall("hang", {"x": 1}), ToolCall("add", {"a": 1, "b": 1})])
    finally:
        RELEASE.set()  # let the abandoned thread end
    assert timed_out.error and timed_out.content.startswith("Error: TimeoutError: no result within 0.2 s")
    assert (after.content, after.error) == ("2", False)
    assert (runner.calls, runner.errors) == (2, 1)


async def async_add(a: int, b: int) -> int:
    """Add, asynchronously.

    Args:
        a: x.
        b: y.
    """
    return a + b


def test_async_tools_run_with_and_without_a_timeout():
    for limits in (ToolLimits(), ToolLimits(timeout=5)):
        (result,) = ToolRunner([Tool.from_function(async_add)], limits).run_turn([ToolCall("async_add", {"a": 2, "b": 2})])
        assert (result.content, result.error) == ("4", False)


def test_limits_per_turn_and_per_dialogue():
    runner = ToolRunner([Tool.from_function(add)], ToolLimits(per_turn=2, per_dialogue=3))
    call = ToolCall("add", {"a": 1, "b": 1})
    first = runner.run_turn([call, ToolCallError("x", "bad"), call])
    assert [r.error for r in first] == [False, True, True]
    assert first[2].content == "Error: not run: at most 2 tool call(s) per turn"
    second = runner.run_turn([call, call])
    assert [r.content for r in second] == ["2", "Error: not run: at most 3 tool call(s) per dialogue"]
    assert (runner.calls, runner.errors, runner.refused) == (2, 1, 2)
    with pytest.raises(ValueError, match="per_turn"):
        ToolLimits(per_turn=0)


# ----------------------------------------------------------------------------- rendering


def test_a_tool_dialogue_renders_through_the_qwen_template():
    tokenizer = build_tokenizer(["What is 2 plus 3?", "It is 5."])
    tokenizer.chat_template = (TEMPLATES / "Qwen2.5-Instruct.jinja").read_text(encoding="utf-8")
    tool = Tool.from_function(add)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    parsed = parse_tool_calls(text, parser_for_template(tokenizer.chat_template))
    (result,) = ToolRunner([tool]).run_turn(parsed.calls)
    messages = [{"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": parsed.content,
                 "tool_calls": [c.as_message_part() for c in parsed.calls]},
                result.message]
    rendered = tokenizer.apply_chat_template(messages, tools=[tool.schema], tokenize=False, add_generation_prompt=True)
    assert '"name": "add"' in rendered and '"description": "Add two integers."' in rendered  # the schema, in <tools>
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in rendered
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in rendered


@pytest.mark.parametrize("template, header, end", [
    ("Qwen2.5-Instruct", "<|im_start|>assistant\n", "<|im_end|>"),
    ("Qwen3", "<|im_start|>assistant\n", "<|im_end|>"),
    ("llama3_1", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
])
def test_the_chosen_parser_reads_back_the_calls_the_template_writes(template, header, end):
    tokenizer = build_tokenizer(["What is 2 plus 3?"])
    tokenizer.chat_template = (llama3_template() if template == "llama3_1"
                               else (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8"))
    call = ToolCall("add", {"a": 2, "b": 3})
    messages = [{"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": "", "tool_calls": [call.as_message_part()]},
                {"role": "tool", "name": "add", "content": "5"}]
    rendered = tokenizer.apply_chat_template(messages, tools=[tool_schema(add)], tokenize=False)
    written = rendered.split(header)[-1].split(end)[0]  # the assistant turn as the policy would sample it
    assert parse_tool_calls(written, parser_for_template(tokenizer.chat_template)).calls == [call]
