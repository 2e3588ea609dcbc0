from hypothesis import given
from hypothesis import strategies as st

from parrot.engine.core.stopping import StopStringFilter


def run(deltas, stop):
    f = StopStringFilter(tuple(stop))
    out = "".join(f.push(d) for d in deltas)
    return out + f.flush(), f.stopped


def test_stop_string_split_across_deltas_is_never_emitted():
    out, stopped = run(["Hello wo", "rld. ST", "OP and more"], ["STOP"])
    assert (out, stopped) == ("Hello world. ", True)


def test_no_stop_releases_everything():
    assert run(["a", "b", "c"], []) == ("abc", False)
    assert run(["ab", "cS", "T"], ["STOP"]) == ("abcST", False)


def test_earliest_of_several_stop_strings_wins():
    assert run(["x END y\n\nz"], ["\n\n", "END"]) == ("x ", True)


@given(
    st.lists(st.text(alphabet="abS\n", max_size=6), max_size=12),
    st.lists(st.text(alphabet="abS\n", min_size=1, max_size=3), max_size=3),
)
def test_release_equals_truncated_text(deltas, stops):
    text = "".join(deltas)
    cuts = [i for i in (text.find(s) for s in stops) if i != -1]
    expected = text[: min(cuts)] if cuts else text
    out, stopped = run(deltas, stops)
    assert out == expected
    assert stopped == bool(cuts)
