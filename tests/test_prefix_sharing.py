"""Prefix hashing at variable boundaries, and sharing a prefix context across sessions."""

from __future__ import annotations

import time

import parrot as P
from parrot.manager.graph import Call, OutputSpec, Variable
from parrot.manager.prefix import PrefixEntry, PrefixIndex, prefix_keys
from parrot.manager.render import render
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.template import parse_template
from tests.conftest import start_server

SYSTEM = "You are a careful assistant. Answer every question briefly and precisely, in plain words. "


def make_call(template: str, chat: bool = False, **inputs: str | Variable) -> Call:
    t = parse_template(template)
    outs = {
        p.name: OutputSpec(p.name, Variable(f"v-{p.name}", "s"), SamplingParams())
        for p in t.placeholders
        if p.direction == "output"
    }
    return Call("c", "s", None, t, dict(inputs), outs, chat=chat)


def test_constant_text_is_tokenized_once_and_renders_the_same(tiny_model):
    tok = tiny_model.tokenizer
    seen: list[str] = []

    class Counting:  # the tiny tokenizer, recording what it is asked to encode
        add_bos, bos_token_id, chat = tok.add_bos, tok.bos_token_id, tok.chat

        def encode(self, text: str) -> list[int]:
            seen.append(text)
            return tok.encode(text)

    counting = Counting()
    template = SYSTEM + "Q: {{input:q}} A: {{output:a}}"
    first = render(make_call(template, q="why?"), counting, 4096)
    second = render(make_call(template, q="how?"), counting, 4096)
    assert seen.count(SYSTEM + "Q: ") == 1  # the constant text once for both calls
    assert seen.count("why?") == 1 and seen.count("how?") == 1  # input values every time
    assert first.steps[0].tokens == tok.encode(SYSTEM + "Q: ") + tok.encode("why?") + tok.encode(" A: ")
    assert second.steps[0].tokens[: len(tok.encode(SYSTEM + "Q: "))] == tok.encode(SYSTEM + "Q: ")


def test_same_constant_prefix_same_key_across_calls():
    a = make_call(SYSTEM + "Q: {{input:q}} A: {{output:a}}", q="why?")
    b = make_call(SYSTEM + "Q: {{input:q}} A: {{output:a}}", q="how?")
    ka, kb = prefix_keys(a), prefix_keys(b)
    assert len(ka) == len(kb) == 2  # before the input, and before the output
    assert ka[0] == kb[0]  # the system prompt is shared
    assert ka[1] != kb[1]  # the question differs


def test_keys_depend_on_text_and_chat_and_stop_at_unknown_inputs():
    base = prefix_keys(make_call(SYSTEM + "{{input:q}}{{output:a}}", q="x"))
    assert prefix_keys(make_call(SYSTEM + "!{{input:q}}{{output:a}}", q="x"))[0] != base[0]
    assert prefix_keys(make_call(SYSTEM + "{{input:q}}\n{{output:a}}", chat=True, q="x"))[0] != base[0]
    pending = Variable("v-q", "s")
    keys = prefix_keys(make_call(SYSTEM + "{{input:q}} then {{output:a}}", q=pending))
    assert len(keys) == 1  # known up to the unresolved input only
    pending.value = "x"
    assert len(prefix_keys(make_call(SYSTEM + "{{input:q}} then {{output:a}}", q=pending))) == 2


def test_value_boundaries_do_not_collide_with_text():
    # "ab" + value "c" vs "a" + value "bc": same characters, different pieces
    k1 = prefix_keys(make_call("ab{{input:x}}!{{output:o}}", x="c"))
    k2 = prefix_keys(make_call("a{{input:x}}!{{output:o}}", x="bc"))
    assert k1[-1] != k2[-1]


def test_index_pins_used_and_wanted_prefixes_and_evicts_lru():
    index = PrefixIndex(max_unpinned_per_engine=1)
    entries = [PrefixEntry(f"k{i}", "e1", i, 10) for i in range(3)]
    for e in entries:
        index.add(e)
    index.acquire(entries[0])  # in use
    wanted = make_call("x{{input:q}}{{output:a}}", q="1")
    index.add_interest(wanted, ["k1"])  # a queued call will use k1
    assert index.evictable("e1") == []  # only k2 unpinned: within budget
    index.release(entries[0])
    assert index.evictable("e1") == [entries[2]]  # k0 was used after k2 was added
    wanted.state = "done"
    assert index.interest("k1") == 0
    assert index.evictable("e1") == [entries[1], entries[2]]  # least recently used first
    assert index.longest(["k9", "k2", "k5"], "e1") == (1, entries[2])


def ask_template() -> P.SemanticFunction:
    return P.template_function(
        SYSTEM + "Question: {{input:q}}\nAnswer: {{output:a}}",
        a=P.Output(max_tokens=6, temperature=0.0, ignore_eos=True),
    )


def test_two_sessions_share_one_filled_system_prompt(live, tiny_engine):
    ask = ask_template()
    before = live.run_on_loop(tiny_engine.stats())
    with P.connect(live.url):
        first = ask("what is a lighthouse?").get(timeout=60)
    with P.connect(live.url):
        second = ask("who keeps it?").get(timeout=60)
    after = live.run_on_loop(tiny_engine.stats())
    prefix_tokens = len(tiny_engine.tokenizer.encode(SYSTEM + "Question: "))
    suffixes = [
        len(tiny_engine.tokenizer.encode(q)) + len(tiny_engine.tokenizer.encode("\nAnswer: "))
        for q in ("what is a lighthouse?", "who keeps it?")
    ]
    # one fill of the shared prefix, then one fill per call for its own suffix
    assert after.fills - before.fills == 3
    assert after.filled_tokens - before.filled_tokens == prefix_tokens + sum(suffixes)
    assert len(live.manager.executor.prefixes) == 1

    # the forked calls generate exactly what unshared calls generate
    unshared = Manager(ManagerConfig(min_prefix_tokens=10**9))
    unshared.pool.register(tiny_engine)
    server = start_server(unshared)
    try:
        with P.connect(server.url):
            expected = [ask(q).get(timeout=60) for q in ("what is a lighthouse?", "who keeps it?")]
    finally:
        server.stop()
    assert [first, second] == expected


def test_prefix_context_is_reused_while_calls_are_concurrent(live, tiny_engine):
    ask = ask_template()
    before = live.run_on_loop(tiny_engine.stats())
    with P.connect(live.url):
        outs = [ask(f"question number {i}?") for i in range(4)]
        values = [o.get(timeout=60) for o in outs]
    after = live.run_on_loop(tiny_engine.stats())
    assert all(isinstance(v, str) for v in values)
    assert after.fills - before.fills == 1 + 4  # the prefix is filled once, even when calls race
    deadline = time.monotonic() + 5
    while live.run_on_loop(tiny_engine.stats()).num_contexts != before.num_contexts + 1:
        assert time.monotonic() < deadline, "per-call contexts were not freed"
        time.sleep(0.02)
