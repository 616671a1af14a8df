from libra.toolcalls import HermesParser


def test_parses_calls_and_string_arguments() -> None:
    text = (
        'thinking <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    calls = HermesParser().parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("a", {"x": 1}, None),
        ("b", {"y": 2}, None),
    ]


def test_malformed_calls_are_reported_not_raised() -> None:
    p = HermesParser()
    assert p.parse("no calls here") == []
    (bad,) = p.parse("<tool_call>{oops</tool_call>")
    assert bad.error and "not valid JSON" in bad.error
    (unterminated,) = p.parse('<tool_call>{"name": "a"')
    assert unterminated.error and "unterminated" in unterminated.error
    (noname,) = p.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert noname.error and "name" in noname.error
    (badargs,) = p.parse('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')
    assert badargs.name == "a" and badargs.error and "object" in badargs.error


# --- the other formats, as vLLM names them: each format's own documented examples -------


def test_qwen3_coder_xml_calls() -> None:
    """The example in Qwen3-Coder's chat template / model card: one function, typed
    parameters, a multi-line string value, and two calls in one turn."""
    from libra.toolcalls import Qwen3CoderParser

    text = (
        "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "San Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        '<parameter=units>\n{"temp": "C"}\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=write_file>\n<parameter=content>\nline 1\nline 2\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    a, b = Qwen3CoderParser().parse(text)
    assert (a.name, a.arguments, a.error) == (
        "get_weather",
        {"city": "San Francisco", "days": 3, "units": {"temp": "C"}},
        None,
    )
    assert (b.name, b.arguments) == ("write_file", {"content": "line 1\nline 2"})
    [bad] = Qwen3CoderParser().parse("<tool_call>\n<function=f>\n<parameter=x>\n1\n")
    assert bad.error and "unterminated" in bad.error
    [noname] = Qwen3CoderParser().parse('<tool_call>{"name": "f"}</tool_call>')
    assert noname.error and "<function=NAME>" in noname.error
    assert Qwen3CoderParser().parse("no call here") == []


def test_llama3_json_calls() -> None:
    """Llama 3.1's JSON tool calling: `{"name", "parameters"}` after <|python_tag|>, and
    several separated by `;` (vLLM's llama3_json); a JSON answer is not a call."""
    from libra.toolcalls import Llama3JsonParser

    p = Llama3JsonParser()
    [c] = p.parse('<|python_tag|>{"name": "get_current_weather", "parameters": '
                  '{"location": "San Francisco, CA", "unit": "fahrenheit"}}')  # fmt: skip
    assert (c.name, c.arguments) == (
        "get_current_weather",
        {"location": "San Francisco, CA", "unit": "fahrenheit"},
    )
    two = p.parse('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}')
    assert [(x.name, x.arguments) for x in two] == [("a", {"x": 1}), ("b", {})]
    assert p.parse('The answer is {"result": 4}.') == []  # no "name": an answer
    assert p.parse("plain text") == []
    [bad] = p.parse('{"name": "a", "parameters": {"x": }')
    assert bad.error and "not valid JSON" in bad.error


def test_mistral_calls_in_both_tokenizer_versions() -> None:
    """[TOOL_CALLS] with a JSON list (tokenizers before v11, Mistral's function-calling
    docs) and NAME[ARGS]{...} (v11+)."""
    from libra.toolcalls import MistralParser

    p = MistralParser()
    old = p.parse('[TOOL_CALLS] [{"name": "retrieve_payment_status", "arguments": '
                  '{"transaction_id": "T1001"}}]')  # fmt: skip
    assert [(c.name, c.arguments) for c in old] == [
        ("retrieve_payment_status", {"transaction_id": "T1001"})
    ]
    new = p.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                  '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}')  # fmt: skip
    assert [(c.name, c.arguments) for c in new] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]
    [bad] = p.parse("[TOOL_CALLS]get_weather[ARGS]{city: Paris}")
    assert bad.name == "get_weather" and bad.error and "not valid JSON" in bad.error
    assert p.parse("no call") == []


def test_the_parser_follows_the_models_chat_template(tmp_path) -> None:
    """`auto` picks the format the model's template renders; a name picks it; an unknown
    name is one clear error listing vLLM's names."""
    import pytest

    from libra.errors import ConfigError
    from libra.toolcalls import (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        Qwen3CoderParser,
        parser_for,
    )

    qwen_coder = "{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}<parameter="
    assert isinstance(parser_for("auto", qwen_coder), Qwen3CoderParser)
    assert isinstance(parser_for("auto", "{{ '[TOOL_CALLS]' + calls|tojson }}"), MistralParser)
    llama = '<|start_header_id|>assistant<|end_header_id|>{"name": x, "parameters": y}'
    assert isinstance(parser_for("auto", llama), Llama3JsonParser)
    assert isinstance(parser_for("auto", "{{ '<tool_call>' }}"), HermesParser)
    assert isinstance(parser_for("mistral", qwen_coder), MistralParser)  # asked for
    with pytest.raises(ConfigError, match="hermes, qwen3_coder, llama3_json, mistral"):
        parser_for("xml")


def test_arguments_nested_past_the_limit_are_a_call_error_in_every_format() -> None:
    """A model can write arguments nested hundreds of levels deep (a degenerate policy
    repeating brackets). Taken as they came, they went into the record, which then could
    not be written (orjson writes 254 levels), and past ~1,000 levels Python's JSON
    decoder raised RecursionError out of the parser. Now the call is an error, as a
    malformed one is, and the record keeps no arguments."""
    import orjson

    from libra.jsonlimits import MAX_DEPTH
    from libra.record import ToolCall
    from libra.toolcalls import Llama3JsonParser, MistralParser, Qwen3CoderParser

    for levels in (300, 3000):
        deep = "[" * levels + "]" * levels
        texts = {
            HermesParser(): f'<tool_call>{{"name": "a", "arguments": {{"x": {deep}}}}}</tool_call>',
            Qwen3CoderParser(): f"<tool_call>\n<function=a>\n<parameter=x>\n{deep}\n</parameter>\n"
            "</function>\n</tool_call>",
            Llama3JsonParser(): f'{{"name": "a", "parameters": {{"x": {deep}}}}}',
            MistralParser(): f'[TOOL_CALLS]a[ARGS]{{"x": {deep}}}',
        }
        for parser, text in texts.items():
            (call,) = parser.parse(text)  # raises nothing
            orjson.dumps(ToolCall(name=call.name, arguments=call.arguments).model_dump())
            if levels == 300:  # JSON to every parser: refused for its depth
                assert call.error == f"arguments of a nest more than {MAX_DEPTH} levels"
                assert call.arguments == {}
            elif not isinstance(parser, Qwen3CoderParser):  # beyond the JSON decoders
                assert call.error and "not valid JSON" in call.error, (parser, call)
            else:  # a Qwen3-Coder value that does not read as JSON is text
                assert call.error is None and call.arguments == {"x": deep}
    ok = f'<tool_call>{{"name": "a", "arguments": {{"x": {"[" * 60 + "]" * 60}}}}}</tool_call>'
    (call,) = HermesParser().parse(ok)
    assert call.error is None and call.name == "a"
