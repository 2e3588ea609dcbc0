"""The LangChain integration (parrot.integrations.langchain) against a real manager
HTTP server on loopback with the tiny seeded engine: the models answer as the OpenAI
routes do, and an LCEL pipeline run as one Parrot DAG gives the same outputs as the
same pipeline run request by request, in one batch request."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("langchain_core", reason="langchain-core is not installed (extra 'langchain')")

from langchain_core.language_models.fake import FakeListLLM
from langchain_core.messages import ChatMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough

import parrot as P
from parrot.integrations.langchain import (
    ParrotChatModel,
    ParrotLLM,
    UnsupportedRunnable,
    batch_as_dag,
    invoke_as_dag,
    submit_as_dag,
)
from parrot.protocol.errors import NoEngine
from tests.conftest import LiveServer

CHUNKS = ["The lighthouse keeper lit the lamp at dusk.", "Ships passed the rocks safely all night."]


def llm(live: LiveServer, **kw: Any) -> ParrotLLM:
    return ParrotLLM(base_url=live.url, max_tokens=kw.pop("max_tokens", 8), **kw)


def map_reduce(model: Any) -> Any:
    """An LCEL map-reduce summariser: map a chain over the chunks, join, reduce."""
    map_chain = PromptTemplate.from_template("Summarise: {chunk}\nSummary:") | model | StrOutputParser()
    reduce_chain = (
        PromptTemplate.from_template("Combine these summaries:\n{summaries}\nFinal summary:")
        | model
        | StrOutputParser()
    )
    join = RunnableLambda(lambda parts: "\n\n".join(p.strip() for p in parts))
    return {"summaries": map_chain.map() | join} | reduce_chain


def submissions(live: LiveServer, since: int) -> list[tuple[str, str]]:
    """Requests since ``since`` that submit work: batches, single calls, completions."""
    return [
        (m, p)
        for m, p in live.requests[since:]
        if m == "POST" and (p.endswith("/batch") or p.endswith("/calls") or "completions" in p)
    ]


def test_llm_answers_as_a_direct_completion(live: LiveServer) -> None:
    prompt = "Once upon a time"
    direct = httpx.post(
        f"{live.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=30,
    ).json()["choices"][0]["text"]
    model = llm(live)
    assert model.invoke(prompt) == direct
    chunks = list(model.stream(prompt))
    assert "".join(chunks) == direct
    assert len(chunks) > 1  # streamed, not one block


def test_chat_model_answers_as_a_direct_chat_completion(live: LiveServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    direct = httpx.post(
        f"{live.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8, "temperature": 0},
        timeout=30,
    ).json()["choices"][0]["message"]["content"]
    chat = ParrotChatModel(base_url=live.url, max_tokens=8)
    lc_messages = [("system", "Be brief."), HumanMessage("Hello there")]
    assert chat.invoke(lc_messages).content == direct
    assert "".join(c.content for c in chat.stream(lc_messages)) == direct
    since = len(live.requests)
    with pytest.raises(ValueError, match="cannot send a 'chat' message"):
        chat.invoke([ChatMessage(role="critic", content="Hello")])
    assert live.requests[since:] == []


def test_model_errors_name_the_problem(live: LiveServer) -> None:
    with pytest.raises(NoEngine, match="nope"):
        llm(live, model="nope").invoke("Hi")
    with pytest.raises(NoEngine, match="nope"):
        list(llm(live, model="nope").stream("Hi"))
    assert llm(live).invoke("Hi")  # the server still answers


def test_map_reduce_as_one_dag_equals_request_level(live: LiveServer) -> None:
    pipeline = map_reduce(llm(live))
    plain = pipeline.invoke(CHUNKS)
    since = len(live.requests)
    with P.connect(live.url) as session:
        pending = submit_as_dag(pipeline, [CHUNKS], session)
        (dag,) = pending.result()
        graph = httpx.get(
            f"{live.url}/v1/sessions/{session.session_id}/graph",
            headers={"Authorization": f"Bearer {session.token}"},
            timeout=30,
        ).json()
    assert dag == plain
    assert isinstance(dag, str) and dag
    assert pending.calls == len(CHUNKS) + 1
    assert len(graph["calls"]) == len(CHUNKS) + 1  # every call in this one session
    assert {c["state"] for c in graph["calls"]} == {"done"}
    assert len(submissions(live, since)) == 1  # one batch request, no completions
    fetched = [p for m, p in live.requests[since:] if m == "GET" and "/variables/" in p]
    assert len(fetched) == 1  # only the final summary travelled back


def test_parallel_and_batch_as_dag_equal_request_level(live: LiveServer) -> None:
    model = llm(live, max_tokens=6)
    title = PromptTemplate.from_template("Title for: {text}\nTitle:") | model | StrOutputParser()
    braces = PromptTemplate.from_template("In JSON {{{{ }}}} form: {text}\n") | model
    pipeline = RunnablePassthrough.assign(title=title) | RunnableParallel(
        title=lambda d: d["title"], both=lambda d: f"{d['title']}|{d['text']}", json=braces
    )
    inputs = [{"text": c} for c in CHUNKS]
    plain = pipeline.batch(inputs)
    since = len(live.requests)
    assert batch_as_dag(pipeline, inputs) == plain  # url taken from the model
    assert len(submissions(live, since)) == 1


def test_chat_model_step_in_a_dag(live: LiveServer) -> None:
    chat = ParrotChatModel(base_url=live.url, max_tokens=6)
    chain = ChatPromptTemplate.from_messages([("human", "Describe {thing}")]) | chat | StrOutputParser()
    out = invoke_as_dag(chain, {"thing": "a lighthouse"}, url=live.url)
    fn = P.template_function(
        "Describe a lighthouse{{output:text}}", chat=True, text=P.Output(max_tokens=6, temperature=0.0)
    )
    with P.connect(live.url) as session:
        expected = fn().get()
        assert session.session_id
    assert out == expected
    assert out == chain.invoke({"thing": "a lighthouse"})  # request level: /v1/chat/completions
    with pytest.raises(UnsupportedRunnable, match=r"one human message, got \['system', 'human'\]"):
        two = ChatPromptTemplate.from_messages([("system", "S"), ("human", "{q}")])
        invoke_as_dag(two | chat, {"q": "x"})


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (FakeListLLM(responses=["x"]), r"FakeListLLM \(FakeListLLM\) cannot run inside a Parrot DAG"),
        (RunnableLambda(lambda s: s[:2]), r"cut or changed"),
        (RunnableLambda(lambda s: len(s)), r"non-text value"),
    ],
)
def test_unsupported_steps_raise_and_send_nothing(live: LiveServer, step: Any, message: str) -> None:
    chain = PromptTemplate.from_template("Q: {q}\nA:") | llm(live) | step | StrOutputParser()
    since = len(live.requests)
    with P.connect(live.url) as session:
        with pytest.raises(UnsupportedRunnable, match=message):
            submit_as_dag(chain, [{"q": "why"}], session)
        graph = httpx.get(
            f"{live.url}/v1/sessions/{session.session_id}/graph",
            headers={"Authorization": f"Bearer {session.token}"},
            timeout=30,
        ).json()
    assert graph["calls"] == []
    assert submissions(live, since) == []
    assert invoke_as_dag(PromptTemplate.from_template("Q: {q}\nA:") | llm(live), {"q": "why"})


def test_input_with_marker_characters_is_refused(live: LiveServer) -> None:
    chain = PromptTemplate.from_template("Q: {q}\nA:") | llm(live)
    since = len(live.requests)
    with pytest.raises(ValueError, match="U\\+E000"):
        invoke_as_dag(chain, {"q": "a\ue000b"})
    assert submissions(live, since) == []


def test_no_parrot_model_needs_a_url() -> None:
    with pytest.raises(ValueError, match="pass url="):
        invoke_as_dag(PromptTemplate.from_template("{q}") | StrOutputParser(), {"q": "x"})


def test_map_reduce_example_runs_both_ways(live: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    examples = Path(__file__).resolve().parent.parent / "examples"
    sys.path.insert(0, str(examples))
    try:
        example = importlib.import_module("langchain_map_reduce")
    finally:
        sys.path.remove(str(examples))
    since = len(live.requests)
    result = example.main(["--url", live.url, "--max-tokens", "8", "--chunk-words", "150"])
    out = capsys.readouterr().out
    chunks = result["chunks"]
    assert chunks > 5
    assert result["dag"] == result["plain"] and result["dag"]
    assert "outputs equal: yes" in out
    assert f"{result['dag_s']:6.2f} s, one batch request" in out
    assert f"{result['plain_s']:6.2f} s, {chunks + 1} chat completions" in out
    seen = live.requests[since:]
    assert seen.count(("POST", "/v1/chat/completions")) == 2 * (chunks + 1)  # untimed run + timed run
    assert len(submissions(live, since)) - seen.count(("POST", "/v1/chat/completions")) == 1
    assert not live.manager.sessions  # the DAG's session was closed


def test_a_dag_over_the_batch_limit_is_refused_before_sending(live: LiveServer) -> None:
    chain = (PromptTemplate.from_template("Q: {q}\nA:") | llm(live)).map()
    since = len(live.requests)
    with pytest.raises(P.BadRequest, match="at most 512 operations"):
        invoke_as_dag(chain, [{"q": str(i)} for i in range(513)])
    assert submissions(live, since) == []
    assert not live.manager.sessions
