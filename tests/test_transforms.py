"""Output transforms: parsing/validation of specs and applying them."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parrot.protocol import errors
from parrot.protocol import transforms as T
from parrot.protocol.errors import CallFailed, InvalidTransform
from parrot.protocol.transforms import TransformChain, TransformFailed, parse_transforms


def apply(spec, text: str) -> str:
    chain = parse_transforms(spec)
    assert chain is not None
    return chain.apply(text)


# ------------------------------------------------------------------ parsing
def test_empty_specs_mean_no_transform():
    assert parse_transforms(None) is None
    assert parse_transforms([]) is None


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("strip", [{"kind": "strip"}]),
        ("first_line", [{"kind": "first_line"}]),
        ("first_item", [{"kind": "first_item"}]),
        ({"kind": "strip"}, [{"kind": "strip"}]),
        ({"kind": "regex", "pattern": r"a(b)"}, [{"kind": "regex", "pattern": r"a(b)", "group": 1}]),
        ({"kind": "regex", "pattern": r"ab"}, [{"kind": "regex", "pattern": r"ab", "group": 0}]),
        (
            {"kind": "regex", "pattern": r"(?P<x>a)", "group": "x"},
            [{"kind": "regex", "pattern": r"(?P<x>a)", "group": "x"}],
        ),
        ({"kind": "json"}, [{"kind": "json", "path": ""}]),
        ({"kind": "json", "path": "a.b[0].c"}, [{"kind": "json", "path": "a.b[0].c"}]),
        (["strip", {"kind": "first_line"}], [{"kind": "strip"}, {"kind": "first_line"}]),
    ],
)
def test_spec_forms_and_canonical_round_trip(spec, canonical):
    chain = parse_transforms(spec)
    assert chain is not None
    assert chain.to_spec() == canonical
    assert parse_transforms(chain.to_spec()) == chain
    assert json.loads(json.dumps(chain.to_spec())) == canonical  # canonical form is plain JSON


def test_helpers_build_the_same_chains_as_specs_and_compose():
    assert T.strip() == parse_transforms("strip")
    assert T.first_line() == parse_transforms("first_line")
    assert T.first_item() == parse_transforms("first_item")
    assert T.regex(r"(\d+)") == parse_transforms({"kind": "regex", "pattern": r"(\d+)", "group": 1})
    assert T.json_path("a[1]") == parse_transforms({"kind": "json", "path": "a[1]"})
    chain = T.strip() + T.regex(r"x=(\d+)")
    assert [s["kind"] for s in chain.to_spec()] == ["strip", "regex"]
    assert parse_transforms(chain) is chain
    assert parse_transforms([T.strip(), "first_line"]).to_spec() == [
        {"kind": "strip"},
        {"kind": "first_line"},
    ]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"kind": "uppercase"}, "unknown kind 'uppercase'"),
        ("lowercase", "unknown shorthand 'lowercase'"),
        ({"pattern": "a"}, "missing field 'kind'"),
        ({"kind": 3}, "unknown kind 3"),
        ({"kind": "regex"}, "missing field(s) ['pattern']"),
        ({"kind": "strip", "extra": 1}, "unknown field(s) ['extra']"),
        ({"kind": "regex", "pattern": "a", "flags": "i"}, "unknown field(s) ['flags']"),
        ({"kind": "regex", "pattern": "(unclosed"}, "does not compile"),
        ({"kind": "regex", "pattern": 5}, "'pattern' must be a string"),
        (
            {"kind": "regex", "pattern": "a(b)", "group": 2},
            "group 2 out of range: the pattern has 1 group(s)",
        ),
        ({"kind": "regex", "pattern": "ab", "group": 1}, "group 1 out of range: the pattern has 0 group(s)"),
        ({"kind": "regex", "pattern": "a(b)", "group": -1}, "group -1 out of range"),
        ({"kind": "regex", "pattern": "(?P<x>a)", "group": "y"}, "unknown group name 'y'"),
        ({"kind": "regex", "pattern": "a", "group": True}, "'group' must be an integer or a group name"),
        ({"kind": "regex", "pattern": "a" * 1001}, "pattern longer than 1000 characters"),
        ({"kind": "json", "path": "a..b"}, "malformed path 'a..b'"),
        ({"kind": "json", "path": ".a"}, "malformed path '.a'"),
        ({"kind": "json", "path": "a."}, "malformed path 'a.'"),
        ({"kind": "json", "path": "a[x]"}, "malformed path 'a[x]'"),
        ({"kind": "json", "path": "a[0]b"}, "malformed path 'a[0]b'"),
        ({"kind": "json", "path": "a["}, "malformed path 'a['"),
        ({"kind": "json", "path": 7}, "'path' must be a string"),
        (42, "expected a list of steps"),
        ([42], "step 0: expected an object"),
        (["strip"] * 33, "at most 32 steps"),
    ],
)
def test_invalid_specs_name_the_problem(spec, needle):
    with pytest.raises(InvalidTransform) as info:
        parse_transforms(spec)
    assert needle in str(info.value)
    assert info.value.code == "invalid_transform"
    assert info.value.status == 400


def test_error_names_the_failing_step_index():
    with pytest.raises(InvalidTransform, match=r"step 1 \(regex\)"):
        parse_transforms(["strip", {"kind": "regex", "pattern": "("}])


def test_pattern_of_exactly_the_limit_is_accepted():
    assert parse_transforms({"kind": "regex", "pattern": "a" * 1000}) is not None


def test_helpers_validate_too():
    with pytest.raises(InvalidTransform):
        T.regex("(")
    with pytest.raises(InvalidTransform):
        T.json_path("a..b")


# ------------------------------------------------------------------ applying
def test_strip():
    assert apply("strip", "  \n hello world \t\n") == "hello world"
    assert apply("strip", "") == ""


def test_regex_default_group_and_named_group():
    assert apply({"kind": "regex", "pattern": r"answer: (\w+)"}, "The answer: 42 (sure)") == "42"
    assert apply({"kind": "regex", "pattern": r"\d+"}, "abc 123 456") == "123"
    assert apply({"kind": "regex", "pattern": r"(?P<n>\d+)-(\d+)", "group": "n"}, "x 7-8") == "7"
    assert apply({"kind": "regex", "pattern": r"(\d+)-(\d+)", "group": 2}, "x 7-8") == "8"
    assert apply({"kind": "regex", "pattern": r"(\d+)-(\d+)", "group": 0}, "x 7-8") == "7-8"


def test_regex_dot_does_not_cross_lines():
    assert apply({"kind": "regex", "pattern": r"start(.*)"}, "start one\ntwo") == " one"


def test_regex_no_match_fails():
    with pytest.raises(TransformFailed, match="does not match") as info:
        apply({"kind": "regex", "pattern": r"answer: (\d+)"}, "no answer here")
    assert info.value.code == "transform_failed"
    assert isinstance(info.value, CallFailed)


def test_regex_group_not_taking_part_fails():
    with pytest.raises(TransformFailed, match="did not take part"):
        apply({"kind": "regex", "pattern": r"(a)|(b)", "group": 1}, "b")


def test_json_finds_object_in_prose_and_fences():
    text = 'Sure! Here it is:\n```json\n{"a": {"b": [{"c": "deep"}, 2]}}\n```\nHope it helps.'
    assert apply({"kind": "json", "path": "a.b[0].c"}, text) == "deep"
    assert apply({"kind": "json", "path": "a.b[1]"}, text) == "2"
    assert apply({"kind": "json", "path": "a.b[-1]"}, text) == "2"
    assert json.loads(apply({"kind": "json", "path": "a"}, text)) == {"b": [{"c": "deep"}, 2]}
    prose = 'The result is {"name": "Ada", "tags": ["x", "y"]} as requested.'
    assert apply({"kind": "json", "path": "tags"}, prose) == '["x", "y"]'
    assert apply({"kind": "json", "path": "name"}, prose) == "Ada"


def test_json_skips_brackets_that_are_not_json():
    text = "See [1] {not json} and then [1, 2, 3]"
    # "[1]" is valid JSON and comes first
    assert apply({"kind": "json"}, text) == "[1]"
    assert apply({"kind": "json"}, 'see {not json} then {"k": null}') == '{"k": null}'
    assert apply({"kind": "json", "path": "k"}, 'see {not json} then {"k": null}') == "null"


def test_json_keeps_non_ascii_and_whole_document_scalars():
    assert apply({"kind": "json", "path": "s"}, '{"s": ["héllo"]}') == '["héllo"]'
    assert apply({"kind": "json"}, " 42 ") == "42"


@pytest.mark.parametrize(
    ("text", "path", "needle"),
    [
        ("no json at all", "", "no valid JSON"),
        ('{"a": 1', "", "no valid JSON"),
        ('{"a": 1}', "b", "path 'b' not found"),
        ('{"a": [1]}', "a[3]", "path 'a[3]' not found"),
        ('{"a": [1]}', "a.x", "path 'a.x' not found"),
        ('{"a": {"x": 1}}', "a[0]", "path 'a[0]' not found"),
    ],
)
def test_json_failures(text, path, needle):
    with pytest.raises(TransformFailed, match=needle.replace("[", r"\[").replace("]", r"\]")):
        apply({"kind": "json", "path": path}, text)


def test_json_pathological_nesting_fails_fast():
    start = time.monotonic()
    with pytest.raises(TransformFailed):
        apply({"kind": "json"}, "[" * 200_000)
    assert time.monotonic() - start < 5


def test_first_line():
    assert apply("first_line", "\n\n   first one  \nsecond") == "first one"
    assert apply("first_line", "only") == "only"
    assert apply("first_line", " \n \n") == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Ideas:\n- alpha beta\n- gamma", "alpha beta"),
        ("* star item\n* two", "star item"),
        ("• bullet item", "bullet item"),
        ("Steps:\n1. first step\n2. second", "first step"),
        ("  12) twelfth  \n13) next", "twelfth"),
        ("**Bold** heading\n- real item", "real item"),
        ("-5 degrees today\nsecond line", "-5 degrees today"),
        ("no list here\nsecond line", "no list here"),
        ("\n\n  just text  ", "just text"),
    ],
)
def test_first_item(text, expected):
    assert apply("first_item", text) == expected


def test_chain_applies_in_order():
    chain = parse_transforms(
        ["strip", {"kind": "regex", "pattern": r"^(\w+)"}, {"kind": "regex", "pattern": "[a-z]+"}]
    )
    assert chain is not None
    assert chain.apply("   Hello world") == "ello"


def test_input_over_the_limit_is_refused():
    chain = T.strip()
    assert chain.apply("x" * T.MAX_INPUT_BYTES) == "x" * T.MAX_INPUT_BYTES
    with pytest.raises(TransformFailed, match="exceeds"):
        chain.apply("x" * (T.MAX_INPUT_BYTES + 1))
    with pytest.raises(TransformFailed, match="exceeds"):  # bytes, not characters
        chain.apply("é" * (T.MAX_INPUT_BYTES // 2 + 1))


def test_transform_failed_is_rebuilt_from_its_wire_body():
    error = TransformFailed("no match", detail={"pattern": "x"})
    rebuilt = errors.error_from_body(error.status, error.to_body())
    assert type(rebuilt) is TransformFailed
    assert rebuilt.message == "no match"
    assert rebuilt.detail == {"pattern": "x"}


def test_chain_needs_steps():
    with pytest.raises(InvalidTransform):
        TransformChain(())


@given(st.text(max_size=300))
def test_apply_never_raises_anything_but_transform_failed(text):
    chains = [
        T.strip(),
        T.first_line(),
        T.first_item(),
        T.regex(r"(\w+)"),
        T.json_path(""),
        T.json_path("a[0]"),
    ]
    for chain in chains:
        try:
            out = chain.apply(text)
        except TransformFailed:
            continue
        assert isinstance(out, str)


def test_a_backtracking_pattern_fails_within_its_budget_and_lets_other_threads_run():
    chain = T.regex(r"(a|aa)+$")
    text = "a" * 40 + "!"  # ~fib(40) ways to split the a's before the '!' fails
    ticks = 0
    done = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    start = time.monotonic()
    try:
        with pytest.raises(TransformFailed, match="budget") as info:
            chain.apply(text)
    finally:
        done.set()
        counter.join()
    elapsed = time.monotonic() - start
    assert 0.8 * T.MAX_REGEX_SECONDS <= elapsed < T.MAX_REGEX_SECONDS + 1.0  # the timer is coarse
    assert info.value.detail["pattern"] == r"(a|aa)+$"
    assert ticks > 50  # the other thread kept running while the pattern searched
    assert T.regex(r"(a|aa)+$", group=0).apply("a" * 40) == "a" * 40  # a matching value is quick
