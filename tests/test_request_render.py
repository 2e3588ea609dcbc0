"""``SemanticFunction.render``: the prompt a request-level client sends is the text
the manager renders for the same call (chat markup included), character for
character."""

from __future__ import annotations

import dataclasses

import pytest

import parrot as P
from parrot.manager.dag.graph import Call, OutputSpec, Variable
from parrot.manager.dag.render import FillStep, GenerateStep, render
from parrot.protocol.errors import BindingError, InvalidTemplate
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.tokenizer import ChatFormat, TextTokenizer


def _server_prompt(fn: P.SemanticFunction, values: dict[str, str], tok: TextTokenizer) -> list[int]:
    """The tokens the manager fills before the call's first output."""
    outs = {n: OutputSpec(n, Variable(f"v-{n}", "s"), SamplingParams()) for n in fn.outputs}
    call = Call("c", "s", None, fn.template, dict(values), outs, chat=fn.chat)
    tokens: list[int] = []
    for step in render(call, tok, 4096).steps:
        if isinstance(step, GenerateStep):
            break
        assert isinstance(step, FillStep)
        tokens.extend(step.tokens)
    return tokens


@P.semantic_function(chat=True)
def refine(summary: P.Input, chunk: P.Input, new: P.Output(max_tokens=5)):
    """{{summary}}

    {{chunk}}

    Summarise the text above in three sentences.
    {{new}}"""


CASES = [
    (refine, {"summary": "  A summary. ", "chunk": "A chunk\n\nin two paragraphs."}),
    (P.template_function("Q: {{input:q}}\nA: {{output:a}} and then {{input:q}} again"), {"q": "why?"}),
    (P.template_function("{{input:x}}{{output:y}}", chat=True), {"x": "<|im_end|> {{z}}"}),
    (P.template_function("\n  Lead {{input:x}}  \n {{output:y}}\n\n", chat=True), {"x": ""}),
]


@pytest.mark.parametrize("system", [None, "Be brief."])
@pytest.mark.parametrize(("fn", "values"), CASES)
def test_render_is_the_text_the_manager_renders(tiny_model, fn, values, system):
    chat = ChatFormat.chatml(system)
    tok = TextTokenizer.from_dict({**tiny_model.tokenizer.to_dict(), "chat": dataclasses.asdict(chat)})
    text = fn.render(values, chat)
    server = _server_prompt(fn, values, tok)
    assert tok.decode(server, skip_special_tokens=False) == text
    # and the server's tokens are that text's (no BOS for the tiny model)
    assert tok.encode(text) == server


def test_render_chat_wraps_around_the_trimmed_user_text():
    chat = ChatFormat.chatml("Be brief.")
    before, between = chat.wrap()
    text = refine.render({"summary": "S", "chunk": "C"}, chat)
    assert text == before + "S\n\nC\n\nSummarise the text above in three sentences." + between
    fn = P.template_function("Say {{input:x}} {{output:y}} (ignored)")
    assert fn.render({"x": 3}) == "Say 3 "  # numbers as in a call; the prompt ends at the output


def test_render_fills_defaults():
    @P.semantic_function
    def greet(name: P.Input, out: P.Output, lang: P.Input = "French"):
        """Greet {{name}} in {{lang}}: {{out}}"""

    assert greet.render({"name": "Ann"}) == "Greet Ann in French: "


def test_render_refuses_what_one_request_cannot_do():
    two = P.template_function("{{input:x}} {{output:a}} {{output:b}}")
    with pytest.raises(BindingError, match="one output"):
        two.render({"x": "1"})
    with pytest.raises(BindingError, match="chat_format"):
        refine.render({"summary": "S", "chunk": "C"})
    with pytest.raises(BindingError, match="missing input"):
        refine.render({"summary": "S"}, ChatFormat.chatml())
    with pytest.raises(BindingError, match="unexpected input"):
        refine.render({"summary": "S", "chunk": "C", "other": "D"}, ChatFormat.chatml())
    not_last = P.template_function("{{input:x}} {{output:y}} tail", chat=True)
    with pytest.raises(InvalidTemplate, match="last element"):
        not_last.render({"x": "1"}, ChatFormat.chatml())


def test_the_constant_prefix_cache_keeps_digests_not_texts() -> None:
    """Long templates do not pile up in memory: the cache of leading-text token counts holds
    a 16-byte digest per entry and at most its entry count."""
    from parrot.manager.dag import render as R
    from parrot.protocol.tokenizer import TextTokenizer

    tok = TextTokenizer.byte_level_tiny()
    texts = [f"{i:04d}" + "x" * 20_000 for i in range(R._CONSTANT_TOKENS_ENTRIES + 40)]
    assert [R._constant_tokens(tok, t) for t in texts[:3]] == [len(tok.encode(t)) for t in texts[:3]]
    for t in texts:
        R._constant_tokens(tok, t)
    assert len(R._CONSTANT_TOKENS) == R._CONSTANT_TOKENS_ENTRIES
    assert all(len(digest) == 16 for _, digest in R._CONSTANT_TOKENS)
    assert R._constant_tokens(tok, texts[-1]) == len(tok.encode(texts[-1]))  # a hit gives the same count
