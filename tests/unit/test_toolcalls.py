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
