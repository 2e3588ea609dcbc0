"""Whole-string rendering, prefix keys at variable boundaries, the per-engine key index, and
system prompts computed once across calls and sessions through the engine's prefix cache."""

from __future__ import annotations

import time

import parrot as P
from parrot.engine.local import LocalEngine
from parrot.manager.dag.graph import Call, OutputSpec, Variable
from parrot.manager.dag.prefix import PrefixIndex, prefix_keys
from parrot.manager.dag.render import render
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


def test_the_prompt_is_tokenized_as_one_string_like_a_request(tiny_model):
    tok = tiny_model.tokenizer
    template = SYSTEM + "Q: {{input:q}} A: {{output:a}}"
    rendered = render(make_call(template, q="why?"), tok, 4096)
    bos = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
    assert rendered.steps[0].tokens == bos + tok.encode(SYSTEM + "Q: why? A: ")
    key = prefix_keys(make_call(template, q="x"))[0]
    assert rendered.constant_prefix == (key, len(tok.encode(SYSTEM + "Q: ")))


def test_text_between_outputs_is_one_string_and_text_after_the_last_is_not_filled(tiny_model):
    tok = tiny_model.tokenizer
    call = make_call("A {{input:x}} B{{output:o1}} C {{input:y}} D{{output:o2}} tail", x="1", y="2")
    steps = render(call, tok, 4096).steps
    assert [type(s).__name__ for s in steps] == ["FillStep", "GenerateStep", "FillStep", "GenerateStep"]
    assert steps[2].tokens == tok.encode(" C 2 D")


def test_the_leading_constant_text_is_tokenized_once(tiny_model):
    tok = tiny_model.tokenizer
    seen: list[str] = []

    class Counting:  # the tiny tokenizer, recording what it is asked to encode
        add_bos, bos_token_id, chat = tok.add_bos, tok.bos_token_id, tok.chat
        max_token_bytes, min_tokens = tok.max_token_bytes, staticmethod(tok.min_tokens)

        def encode(self, text: str) -> list[int]:
            seen.append(text)
            return tok.encode(text)

    counting = Counting()
    template = SYSTEM + "Q: {{input:q}} A: {{output:a}}"
    render(make_call(template, q="why?"), counting, 4096)
    render(make_call(template, q="how?"), counting, 4096)
    assert seen.count(SYSTEM + "Q: ") == 1  # its token count, once for both calls


def test_same_constant_prefix_same_key_across_calls():
    a = make_call(SYSTEM + "Q: {{input:q}} A: {{output:a}}", q="why?")
    b = make_call(SYSTEM + "Q: {{input:q}} A: {{output:a}}", q="how?")
    ka, kb = prefix_keys(a), prefix_keys(b)
    assert len(ka) == len(kb) == 3  # after the system prompt, after the question, before the output
    assert ka[0] == kb[0]  # the system prompt is shared
    assert ka[1] != kb[1] and ka[2] != kb[2]  # the question differs


def test_keys_depend_on_text_and_chat_and_stop_at_unknown_inputs():
    base = prefix_keys(make_call(SYSTEM + "{{input:q}}{{output:a}}", q="x"))
    assert prefix_keys(make_call(SYSTEM + "!{{input:q}}{{output:a}}", q="x"))[0] != base[0]
    assert prefix_keys(make_call(SYSTEM + "{{input:q}}\n{{output:a}}", chat=True, q="x"))[0] != base[0]
    pending = Variable("v-q", "s")
    keys = prefix_keys(make_call(SYSTEM + "{{input:q}} then {{output:a}}", q=pending))
    assert len(keys) == 1  # known up to the unresolved input only
    pending.value = "x"
    assert len(prefix_keys(make_call(SYSTEM + "{{input:q}} then {{output:a}}", q=pending))) == 3


def test_a_value_read_by_two_templates_gives_them_a_common_key():
    """A document read by a call and then by its dependent call: their templates differ
    right after the document, but both have a key right after it."""
    doc = "a long document " * 20
    k1 = prefix_keys(make_call("{{input:doc}}\n\nSummarise it: {{output:s}}", doc=doc))
    k2 = prefix_keys(make_call("{{input:doc}}\n\nAnswer about it: {{output:a}}", doc=doc))
    assert k1[0] == k2[0] and k1[1] != k2[1]


def test_value_boundaries_do_not_collide_with_text():
    # "ab" + value "c" vs "a" + value "bc": same characters, different pieces
    k1 = prefix_keys(make_call("ab{{input:x}}!{{output:o}}", x="c"))
    k2 = prefix_keys(make_call("a{{input:x}}!{{output:o}}", x="bc"))
    assert k1[-1] != k2[-1]


def test_index_remembers_recent_keys_per_engine_and_reports_changes():
    index = PrefixIndex(keys_per_engine=3)
    index.record("e1", ["k0", "k1"])
    assert index.take_changed() == {"e1"} and index.take_changed() == set()
    first = index.keys_on("e1")
    assert first == {"k0", "k1"} and index.keys_on("e1") is first  # the same object until it changes
    index.record("e1", ["k0"])  # known keys: refreshed, not a change
    assert index.take_changed() == set() and index.keys_on("e1") is first
    index.record("e1", ["k2", "k3"])  # over the bound: the least recently placed (k1) goes
    assert index.keys_on("e1") == {"k0", "k2", "k3"} and index.take_changed() == {"e1"}
    assert index.engines_holding("k2") == ["e1"] and index.holds("k0", "e1")
    index.forget_engine("e1")
    assert index.keys_on("e1") == frozenset() and index.take_changed() == {"e1"}


def ask_template() -> P.SemanticFunction:
    return P.template_function(
        SYSTEM + "Question: {{input:q}}\nAnswer: {{output:a}}",
        a=P.Output(max_tokens=6, temperature=0.0, ignore_eos=True),
    )


def test_two_sessions_share_one_computed_system_prompt(live, tiny_engine, tiny_model):
    """The second session's call finds the system prompt's whole blocks in the engine's
    prefix cache, and generates what an engine without a prefix cache generates."""
    ask = ask_template()
    bs = live.run_on_loop(tiny_engine.stats()).kv_block_size
    prompts = [SYSTEM + f"Question: {q}\nAnswer: " for q in ("what is a lighthouse?", "who keeps it?")]
    with P.connect(live.url):
        first = ask("what is a lighthouse?").get(timeout=60)
    before = live.run_on_loop(tiny_engine.stats())
    with P.connect(live.url):
        second = ask("who keeps it?").get(timeout=60)
    after = live.run_on_loop(tiny_engine.stats())
    tok = tiny_engine.tokenizer
    shared = len(tok.encode(SYSTEM + "Question: "))  # the two prompts' common tokens
    assert after.cached_tokens - before.cached_tokens == shared // bs * bs

    plain = LocalEngine(tiny_model, prefix_cache=False)
    unshared = Manager(ManagerConfig())
    unshared.pool.register(plain)
    server = start_server(unshared)
    try:
        with P.connect(server.url):
            expected = [ask(q).get(timeout=60) for q in ("what is a lighthouse?", "who keeps it?")]
    finally:
        server.stop()
        plain.close()
    assert [first, second] == expected
    assert all(len(tok.encode(p)) > shared for p in prompts)


def test_concurrent_calls_under_one_system_prompt_compute_it_once(live, tiny_engine):
    ask = ask_template()
    tok = tiny_engine.tokenizer
    before = live.run_on_loop(tiny_engine.stats())
    with P.connect(live.url) as session:
        with session.batch():  # the four calls reach the scheduler together
            outs = [ask(f"question number {i}?") for i in range(4)]
        values = [o.get(timeout=60) for o in outs]
    after = live.run_on_loop(tiny_engine.stats())
    assert all(isinstance(v, str) for v in values)
    whole = len(tok.encode(SYSTEM + "Question: question number ")) // before.kv_block_size
    # computed by the first call (or an earlier test), taken from the cache by the other three at least
    assert after.cached_tokens - before.cached_tokens >= 3 * whole * before.kv_block_size
    deadline = time.monotonic() + 5
    while live.run_on_loop(tiny_engine.stats()).num_contexts != before.num_contexts:
        assert time.monotonic() < deadline, "per-call contexts were not freed"
        time.sleep(0.02)


def test_a_prefix_is_computed_once_across_the_stages_of_an_app(live, tiny_engine):
    """Tree of thought: every call of every stage starts with the same system prompt and
    question (given as values), and each stage depends on the previous one.  The shared
    prefix is computed by the first call only; every later call, in any stage, takes it
    from the cache."""
    question = "Question: how far can a lighthouse be seen at sea on a clear night? "
    propose = P.template_function(
        "{{system}}{{question}}Idea {{n}}:{{idea}}", idea=P.Output(max_tokens=4, temperature=0.0)
    )
    judge = P.template_function(
        "{{system}}{{question}}Ideas: {{a}} / {{b}}. Best:{{best}}",
        best=P.Output(max_tokens=4, temperature=0.0),
    )
    bs = live.run_on_loop(tiny_engine.stats()).kv_block_size
    whole = len(tiny_engine.tokenizer.encode(SYSTEM + question)) // bs * bs
    before = live.run_on_loop(tiny_engine.stats())
    with P.connect(live.url):
        ideas = [propose(SYSTEM, question, str(i)) for i in range(2)]
        best = judge(SYSTEM, question, *ideas)
        judge(SYSTEM, question, best, ideas[0]).get(timeout=60)  # a third stage
    after = live.run_on_loop(tiny_engine.stats())
    assert after.cached_tokens - before.cached_tokens >= 3 * whole  # 4 calls: 3 reuse it


def test_a_document_read_by_a_call_and_its_dependent_is_computed_once(live, tiny_engine):
    doc = "The keeper climbed the tower every evening to light the lamp. " * 6
    summarise = P.template_function("{{doc}}\n\nSummary:{{s}}", s=P.Output(max_tokens=4, temperature=0.0))
    answer = P.template_function(
        "{{doc}}\n\nGiven the summary {{s}}, who climbed the tower?{{a}}",
        a=P.Output(max_tokens=4, temperature=0.0),
    )
    bs = live.run_on_loop(tiny_engine.stats()).kv_block_size
    before = live.run_on_loop(tiny_engine.stats())
    with P.connect(live.url):
        answer(doc, summarise(doc)).get(timeout=60)
    after = live.run_on_loop(tiny_engine.stats())
    assert after.cached_tokens - before.cached_tokens >= len(tiny_engine.tokenizer.encode(doc)) // bs * bs
