"""The frontend (semantic functions, variables, sessions) against a fake manager.

``FakeManager`` is an ``httpx.MockTransport`` handler speaking the manager's
HTTP API from :mod:`parrot.protocol.schemas`: it validates request bodies
against the schemas, records every request, and computes each output as
``"<fn>(<input values>)"`` from the values its inputs resolve to *on the
server*, so a chain's final value proves the wiring happened server-side.
Its statuses and error codes are the real manager's: the last test sends the
same requests to both and compares the answers.
"""

import asyncio
import itertools
import json
import re
import time
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest

import parrot as P
from parrot.protocol.schemas import CreateVariable, SetVariable, SubmitCall

URL = "http://parrot.test:9000"


class FakeManager:
    """A tiny in-memory manager.  Knobs: ``pending_polls`` (GETs answered
    ``pending`` before an output is ready), ``fail`` (output name -> error
    body of a failed output), ``submit_error`` ((status, body) for every
    submit), ``error_for`` (method+path regex -> (status, body))."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.sessions: dict[str, str] = {}
        self.deleted: list[str] = []
        self.vars: dict[str, dict[str, Any]] = {}
        self.calls: list[dict[str, Any]] = []
        self.pending_polls = 0
        self.fail: dict[str, dict[str, Any]] = {}
        self.submit_error: tuple[int, Any] | None = None
        self.error_for: list[tuple[str, tuple[int, Any]]] = []
        self.stream_chunks = 3
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ helpers
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def of(self, method: str, pattern: str = "") -> list[httpx.Request]:
        return [r for r in self.requests if r.method == method and re.search(pattern, r.url.path)]

    def submits(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.of("POST", r"/calls$")]

    @staticmethod
    def error(status: int, code: str, message: str) -> httpx.Response:
        return httpx.Response(status, json={"error": {"code": code, "message": message, "detail": {}}})

    def value_of(self, vid: str) -> str:
        var = self.vars[vid]
        if var["value"] is None and var["call"] is not None:
            call = var["call"]
            args = [self.value_of(b["var_id"]) if "var_id" in b else b["value"] for b in call["inputs"]]
            var["value"] = f"{call['name']}({', '.join(args)})"
        return var["value"]

    def info(self, vid: str) -> dict[str, Any]:
        var = self.vars[vid]
        body: dict[str, Any] = {"var_id": vid, "name": var["name"], "state": var["state"]}
        if var["state"] == "ready":
            body["value"] = self.value_of(vid)
        if var["state"] == "failed":
            body["error"] = var["error"]
        return body

    def advance(self, vid: str) -> None:
        var = self.vars[vid]
        if var["state"] != "pending" or var["call"] is None:
            return
        if var["polls_left"] > 0:
            var["polls_left"] -= 1
        elif var["name"] in self.fail:
            var["state"], var["error"] = "failed", self.fail[var["name"]]
        else:
            upstream = [b["var_id"] for b in var["call"]["inputs"] if "var_id" in b]
            for up in upstream:
                while self.vars[up]["state"] == "pending":
                    self.advance(up)
                if self.vars[up]["state"] == "failed":
                    var["state"], var["error"] = "failed", self.vars[up]["error"]
                    return
            var["state"] = "ready"

    # ------------------------------------------------------------ routing
    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path, method = request.url.path, request.method
        for pattern, (status, body) in self.error_for:
            if re.fullmatch(pattern, f"{method} {path}"):
                return (
                    httpx.Response(status, json=body)
                    if not isinstance(body, str)
                    else httpx.Response(status, text=body)
                )
        if method == "POST" and path == "/v1/sessions":
            sid, token = f"s{next(self._ids)}", f"tok-{next(self._ids)}"
            self.sessions[sid] = token
            return httpx.Response(201, json={"session_id": sid, "token": token})
        match = re.fullmatch(r"/v1/sessions/([^/]+)(/.*)?", path)
        if match is None:
            return self.error(404, "not_found", f"no route {path}")
        sid, rest = match.group(1), match.group(2) or ""
        if sid not in self.sessions:
            return self.error(404, "session_not_found", f"session {sid} does not exist")
        presented = request.headers.get("authorization")
        if presented is None:
            return self.error(401, "unauthorized", "missing session token")
        if presented != f"Bearer {self.sessions[sid]}":
            return self.error(403, "forbidden", f"the token does not open session {sid}")
        if method == "DELETE" and rest == "":
            self.deleted.append(sid)
            return httpx.Response(204)
        if method == "POST" and rest == "/calls":
            return self.submit(json.loads(request.content))
        if method == "POST" and rest == "/variables":
            body = CreateVariable.model_validate(json.loads(request.content))
            vid = f"v{next(self._ids)}"
            ready = body.value is not None
            self.vars[vid] = {
                "name": body.name,
                "state": "ready" if ready else "pending",
                "value": body.value,
                "error": None,
                "call": None,
                "polls_left": 0,
            }
            return httpx.Response(201, json=self.info(vid))
        var_match = re.fullmatch(r"/variables/([^/]+)(/stream)?", rest)
        if var_match is None or var_match.group(1) not in self.vars:
            return self.error(404, "variable_not_found", f"variable at {rest} does not exist in this session")
        vid = var_match.group(1)
        if method == "PUT" and not var_match.group(2):
            body = SetVariable.model_validate(json.loads(request.content))
            if self.vars[vid]["call"] is not None:
                return self.error(409, "variable_has_producer", f"variable {vid} is produced by a call")
            if self.vars[vid]["state"] != "pending":
                return self.error(
                    409, "variable_not_pending", f"variable {vid} is already {self.vars[vid]['state']}"
                )
            self.vars[vid].update(state="ready", value=body.value)
            return httpx.Response(200, json=self.info(vid))
        if method == "GET" and not var_match.group(2):
            query = parse_qs(request.url.query.decode())
            assert 0 <= float(query["wait"][0]) <= 30
            assert query["criteria"][0] in ("LATENCY", "THROUGHPUT")
            self.advance(vid)
            return httpx.Response(200, json=self.info(vid))
        if method == "GET":
            while self.vars[vid]["state"] == "pending" and self.vars[vid]["call"] is not None:
                self.advance(vid)
            var = self.vars[vid]
            lines = []
            if var["state"] == "ready":
                value = self.value_of(vid)
                step = max(1, -(-len(value) // self.stream_chunks))
                lines = [{"text": value[i : i + step]} for i in range(0, len(value), step)]
                lines.append({"done": True, "state": "ready", "error": None})
            else:
                lines = [{"text": "partial"}, {"done": True, "state": "failed", "error": var["error"]}]
            return httpx.Response(200, text="\n".join(json.dumps(x) for x in lines) + "\n\n")
        return self.error(405, "method_not_allowed", f"{method} {path}")

    def submit(self, raw: dict[str, Any]) -> httpx.Response:
        if self.submit_error is not None:
            status, body = self.submit_error
            return httpx.Response(status, json=body)
        call = SubmitCall.model_validate(raw)  # the wire schema, strictly
        inputs, outputs = [], {}
        for binding in call.placeholders:
            if binding.direction == "input":
                if (binding.var_id is None) == (binding.value is None):
                    return self.error(400, "invalid_binding", f"input {binding.name} needs var_id xor value")
                if binding.var_id is not None and binding.var_id not in self.vars:
                    return self.error(
                        404, "variable_not_found", f"variable {binding.var_id} does not exist in this session"
                    )
                inputs.append(binding.model_dump(exclude_none=True))
        cid = f"c{next(self._ids)}"
        record = {"call_id": cid, "name": call.name, "inputs": inputs}
        for binding in call.placeholders:
            if binding.direction == "output":
                vid = f"v{next(self._ids)}"
                self.vars[vid] = {
                    "name": binding.name,
                    "state": "pending",
                    "value": None,
                    "error": None,
                    "call": record,
                    "polls_left": self.pending_polls,
                }
                outputs[binding.name] = vid
        self.calls.append(record)
        return httpx.Response(201, json={"call_id": cid, "outputs": outputs})


@pytest.fixture
def fake() -> FakeManager:
    return FakeManager()


def session(fake: FakeManager, **kwargs: Any) -> P.Session:
    return P.connect(URL, transport=fake.transport(), **kwargs)


def asession(fake: FakeManager, **kwargs: Any) -> P.AsyncSession:
    return P.aconnect(URL, transport=fake.transport(), **kwargs)


@P.semantic_function(chat=True)
def write_code(
    task: P.Input,
    code: P.Output(max_tokens=200, temperature=0.0, stop=["\n\n"], transform=P.transforms.strip()),
):
    """You are an expert software engineer.
        Write python code of {{task}}.
    Code: {{code}}"""


@P.semantic_function
def first(x: P.Input, a: P.Output):
    """A {{x}} -> {{a}}"""


@P.semantic_function(name="second", model="tiny")
def second_fn(a: P.Input, b: P.Output(max_tokens=5)):
    """B {{a}} -> {{b}}"""


@P.semantic_function
def third(b: P.Input, x: P.Input, c: P.Output(criteria=P.THROUGHPUT)):
    """C {{b}} {{x}} -> {{c}}"""


# ------------------------------------------------------------ building
def test_decorator_builds_inline_template_and_bindings():
    assert isinstance(write_code, P.SemanticFunction)
    assert write_code.name == "write_code" and write_code.chat is True and write_code.model is None
    assert write_code.inputs == ("task",)
    assert list(write_code.outputs) == ["code"]
    assert write_code.template.to_inline() == (
        "You are an expert software engineer.\n"
        "    Write python code of {{input:task}}.\n"
        "Code: {{output:code}}"
    )
    body = write_code.submit_body({"task": "a sort function"})
    assert body["template"] == write_code.template.to_inline()
    assert body["name"] == "write_code" and body["chat"] is True and body["model"] is None
    assert body["placeholders"] == [
        {"name": "task", "direction": "input", "value": "a sort function"},
        {
            "name": "code",
            "direction": "output",
            "sampling": P.SamplingParams(max_tokens=200, temperature=0.0, stop=("\n\n",)).to_dict(),
            "transform": [{"kind": "strip"}],
            "criteria": None,
        },
    ]
    assert second_fn.name == "second" and second_fn.model == "tiny"
    assert P.Output(stop="\n").sampling.stop == ("\n",)  # one stop string, not its characters
    assert third.outputs["c"].criteria == "THROUGHPUT"


def test_explicit_directions_in_docstring_are_allowed_when_consistent():
    @P.semantic_function
    def f(q: P.Input, ans: P.Output()):
        """Q: {{input:q}} again {{q}} A: {{ans}}"""

    assert f.template.to_inline() == "Q: {{input:q}} again {{input:q}} A: {{output:ans}}"

    with pytest.raises(P.InvalidTemplate, match="marked output"):

        @P.semantic_function
        def g(q: P.Input, ans: P.Output()):
            """Q: {{output:q}} A: {{ans}}"""


def test_string_annotations_resolve_globals_and_enclosing_locals():
    n_tokens = 7
    pattern = r"(\d+)"

    @P.semantic_function
    def f(task: "P.Input", out: "P.Output(max_tokens=n_tokens, transform=P.transforms.regex(pattern))"):
        """{{task}} {{out}}"""

    assert f.outputs["out"].sampling.max_tokens == 7
    assert f.outputs["out"].transform.to_spec() == [{"kind": "regex", "pattern": pattern, "group": 1}]

    source = (
        "from __future__ import annotations\n"
        "@P.semantic_function(chat=True)\n"
        "def h(task: P.Input, out: P.Output(max_tokens=3)):\n"
        "    '''Do {{task}}: {{out}}'''\n"
    )
    namespace: dict[str, Any] = {"P": P}
    exec(compile(source, "<future>", "exec"), namespace)
    h = namespace["h"]
    assert h.template.to_inline() == "Do {{input:task}}: {{output:out}}"
    assert h.outputs["out"].sampling.max_tokens == 3

    with pytest.raises(P.BindingError, match="cannot evaluate the annotation of 'out'"):

        @P.semantic_function
        def bad(task: "P.Input", out: "NoSuchThing"):  # noqa: F821
            """{{task}} {{out}}"""


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: P.semantic_function(_fn_extra_param), r"parameter\(s\) \['extra'\] not in the docstring"),
        (
            lambda: P.semantic_function(_fn_extra_placeholder),
            r"placeholder\(s\) \['missing'\] are not parameters",
        ),
        (lambda: P.semantic_function(_fn_unannotated), "'task' must be annotated P.Input or P.Output"),
        (lambda: P.semantic_function(_fn_no_output), "has no output"),
        (lambda: P.semantic_function(_fn_varargs), r"\*args/\*\*kwargs"),
        (lambda: P.semantic_function(_fn_output_default), "cannot have a default"),
    ],
)
def test_binding_mistakes_raise_at_decoration(make, needle):
    with pytest.raises(P.BindingError, match=needle):
        make()


def _fn_extra_param(task: P.Input, extra: P.Input, out: P.Output):
    """{{task}} {{out}}"""


def _fn_extra_placeholder(task: P.Input, out: P.Output):
    """{{task}} {{missing}} {{out}}"""


def _fn_unannotated(task, out: P.Output):
    """{{task}} {{out}}"""


def _fn_no_output(task: P.Input):
    """{{task}}"""


def _fn_varargs(task: P.Input, out: P.Output, *rest: P.Input):
    """{{task}} {{out}}"""


def _fn_output_default(task: P.Input, out: P.Output = "x"):
    """{{task}} {{out}}"""


def test_missing_docstring_is_rejected():
    def f(task: P.Input, out: P.Output):
        pass

    with pytest.raises(P.InvalidTemplate, match="no docstring"):
        P.semantic_function(f)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_tokens": 0}, P.InvalidSampling),
        ({"temperature": -1.0}, P.InvalidSampling),
        ({"top_p": 0.0}, P.InvalidSampling),
        ({"stop": [""]}, P.InvalidSampling),
        ({"transform": {"kind": "nope"}}, P.InvalidTransform),
        ({"transform": {"kind": "regex", "pattern": "("}}, P.InvalidTransform),
        ({"criteria": "FAST"}, P.BadRequest),
    ],
)
def test_bad_output_settings_raise_at_decoration(kwargs, error):
    with pytest.raises(error):

        @P.semantic_function
        def f(task: P.Input, out: P.Output(**kwargs)):
            """{{task}} {{out}}"""

    # the same mistake in a string annotation raises at decoration as well
    settings = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    with pytest.raises(error):

        @P.semantic_function
        def g(task: "P.Input", out: f"P.Output({settings})"):
            """{{task}} {{out}}"""


def test_template_function_form():
    fn = P.template_function(
        "Translate {{input:text}} into {{lang}}: {{output:result}} Note: {{output:note}}",
        name="translate",
        model="m",
        result=P.Output(max_tokens=100),
    )
    assert fn.name == "translate" and fn.model == "m" and fn.chat is False
    assert fn.inputs == ("text", "lang")
    assert list(fn.outputs) == ["result", "note"]
    assert fn.outputs["result"].sampling.max_tokens == 100
    assert fn.outputs["note"].sampling == P.SamplingParams()  # defaults
    assert fn.template.to_inline() == (
        "Translate {{input:text}} into {{input:lang}}: {{output:result}} Note: {{output:note}}"
    )
    bare = P.template_function("Sum {{doc}}: {{summary}}", summary=P.Output)
    assert bare.inputs == ("doc",) and list(bare.outputs) == ["summary"]

    with pytest.raises(P.BindingError, match="not a placeholder"):
        P.template_function("{{input:a}} {{output:b}}", c=P.Output())
    with pytest.raises(P.InvalidTemplate):
        P.template_function("{{input:a}} {{output:b}}", a=P.Output())
    with pytest.raises(P.BindingError, match="no output"):
        P.template_function("only {{input:a}}")
    with pytest.raises(P.InvalidTemplate):
        P.template_function("broken {{input:a")


# ------------------------------------------------------------ sync session
def test_session_lifecycle_and_auth(fake):
    with session(fake) as s:
        assert P.current_session() is s
        assert s.session_id in fake.sessions
        out = write_code("a sort function")
    assert fake.deleted == [s.session_id]
    assert s.closed
    with pytest.raises(P.NoSession, match="no Parrot session is active"):
        write_code("x")
    creation, *rest = fake.requests
    assert creation.method == "POST" and creation.url.path == "/v1/sessions"
    assert "authorization" not in creation.headers
    assert rest and all(r.headers["authorization"] == f"Bearer {s.token}" for r in rest)
    assert [r.method for r in rest] == ["POST", "DELETE"]
    assert out.id is not None and "value" not in repr(out)


def test_session_is_deleted_even_when_the_body_raises(fake):
    with pytest.raises(RuntimeError, match="boom"), session(fake) as s:
        write_code("x")
        raise RuntimeError("boom")
    assert fake.deleted == [s.session_id]
    with pytest.raises(P.NoSession):
        P.current_session()


def test_close_failure_does_not_mask_the_body_error_but_is_raised_otherwise(fake):
    fake.error_for.append(
        (r"DELETE /v1/sessions/.*", (500, {"error": {"code": "internal_error", "message": "x"}}))
    )
    with pytest.raises(KeyError), session(fake):
        raise KeyError("body")
    with pytest.raises(P.ParrotError, match="x"), session(fake):
        pass


def test_three_step_chain_is_three_posts_wired_by_var_id(fake):
    with session(fake):
        a = first("x0")
        b = second_fn(a)
        c = third(b, x=3)
        assert (len(fake.of("POST", "/calls$")), len(fake.of("GET"))) == (3, 0)
        assert c.get() == "third(second(first(x0)), 3)"
    submits = fake.submits()
    assert [body["name"] for body in submits] == ["first", "second", "third"]
    assert submits[1]["placeholders"][0] == {"name": "a", "direction": "input", "var_id": a.id}
    assert submits[2]["placeholders"][0] == {"name": "b", "direction": "input", "var_id": b.id}
    assert submits[2]["placeholders"][1] == {"name": "x", "direction": "input", "value": "3"}
    gets = fake.of("GET")
    assert gets and all(r.url.path.endswith(f"/variables/{c.id}") for r in gets)  # no GET for intermediates
    assert len(fake.of("POST")) == 1 + 3  # session + one per call


def test_get_long_polls_until_ready_then_caches(fake):
    fake.pending_polls = 2
    with session(fake):
        out = write_code(task="sorting")
        assert out.get(P.THROUGHPUT) == "write_code(sorting)"
        polls = fake.of("GET")
        assert len(polls) == 3
        query = parse_qs(polls[0].url.query.decode())
        assert query == {"wait": ["30"], "criteria": ["THROUGHPUT"]}
        assert out.get() == "write_code(sorting)"
        assert len(fake.of("GET")) == 3  # cached: no new request
        assert out.is_ready and "sorting" not in repr(out)


def test_get_backs_off_when_the_manager_answers_pending_early(fake):
    fake.pending_polls = 4  # the fake ignores `wait` and answers at once
    with session(fake):
        out = write_code("x")
        started = time.monotonic()
        assert out.get() == "write_code(x)"
        assert time.monotonic() - started >= 0.01 + 0.02 + 0.04 + 0.08  # no busy loop
        assert len(fake.of("GET")) == 5


def test_get_timeout(fake):
    fake.pending_polls = 10**9
    with session(fake):
        out = write_code("slow")
        with pytest.raises(P.Timeout, match="not ready"):
            out.get(timeout=0.05)
        waits = [float(parse_qs(r.url.query.decode())["wait"][0]) for r in fake.of("GET")]
        assert waits and all(w <= 0.05 for w in waits)


def test_failed_variable_raises_the_servers_error(fake):
    fake.fail["code"] = {"code": "call_failed", "message": "engine exploded at token 7", "detail": {}}
    fake.fail["a"] = {"code": "transform_failed", "message": "no match for 'x'", "detail": {}}
    with session(fake):
        out = write_code("x")
        with pytest.raises(P.CallFailed, match="engine exploded at token 7"):
            out.get()
        n = len(fake.of("GET"))
        with pytest.raises(P.CallFailed, match="engine exploded"):
            out.get()
        assert len(fake.of("GET")) == n  # the failure is cached too
        downstream = third(second_fn(first("q")), "y")
        with pytest.raises(P.TransformFailed, match="no match for 'x'") as info:
            downstream.get()
        assert info.value.code == "transform_failed"


@pytest.mark.parametrize(
    ("status", "body", "error", "code"),
    [
        (
            400,
            {"error": {"code": "invalid_template", "message": "bad braces"}},
            P.InvalidTemplate,
            "invalid_template",
        ),
        (400, {"error": {"code": "dependency_cycle", "message": "cycle"}}, P.CycleError, "dependency_cycle"),
        (404, {"error": {"code": "not_found", "message": "no such"}}, P.NotFound, "not_found"),
        (409, {"error": {"code": "conflict", "message": "twice"}}, P.Conflict, "conflict"),
        (403, {"error": {"code": "something_new", "message": "nope"}}, P.Forbidden, "something_new"),
        (503, {"error": {"code": "no_engine", "message": "none"}}, P.NoEngine, "no_engine"),
        (502, "<html>bad gateway</html>", P.ParrotError, "http_error"),
    ],
)
def test_http_errors_become_the_matching_class(fake, status, body, error, code):
    with session(fake):
        fake.submit_error = (status, body) if not isinstance(body, str) else None
        if isinstance(body, str):
            fake.error_for.append((r"POST .*/calls", (status, body)))
        with pytest.raises(error) as info:
            write_code("x")
        assert info.value.code == code
        if isinstance(body, dict):
            assert info.value.message == body["error"]["message"]


def test_get_of_unknown_variable_raises_not_found(fake):
    with session(fake) as s:
        ghost = P.SemanticVariable(s, name="ghost", var_id="v-missing")
        with pytest.raises(P.NotFound, match="does not exist") as info:
            ghost.get()
        assert info.value.code == "variable_not_found"


def test_connection_failure_names_the_url():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with (
        pytest.raises(P.ConnectionFailed, match=r"parrot\.test:9000") as info,
        P.connect(URL, transport=httpx.MockTransport(refuse)),
    ):
        pass
    assert info.value.code == "connection_failed"


def test_read_timeout_becomes_timeout():
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("too slow", request=request)

    with pytest.raises(P.Timeout, match=r"parrot\.test"), P.connect(URL, transport=httpx.MockTransport(slow)):
        pass


def test_inputs_are_checked_client_side(fake):
    with session(fake) as s:
        with pytest.raises(P.BadRequest, match="must be a str or a SemanticVariable"):
            write_code(["not", "a", "string"])
        with pytest.raises(P.BadRequest):
            write_code(True)
        with pytest.raises(P.BindingError, match="missing input"):
            write_code()
        with pytest.raises(P.BindingError, match="multiple values"):
            write_code("a", task="b")
        with pytest.raises(P.BindingError, match="is an output"):
            write_code("a", code="b")
        with pytest.raises(P.BindingError, match="unexpected input"):
            write_code("a", other="b")
        with pytest.raises(P.BindingError, match="takes 1 input"):
            write_code("a", "b")
        assert fake.submits() == []
        s.call(write_code, 2.5)
        assert fake.submits()[0]["placeholders"][0]["value"] == "2.5"


def test_variable_of_another_session_is_rejected(fake):
    with session(fake) as s1, session(fake) as s2:
        assert P.current_session() is s2
        a = s1.call(first, "x")
        with pytest.raises(P.BindingError, match="another session"):
            second_fn(a)
        assert P.current_session() is s2
    assert len(fake.submits()) == 1


def test_variables_create_set_get(fake):
    with session(fake) as s:
        const = s.variable("given", name="c")
        assert const.get() == "given"
        free = s.variable(name="later")
        out = second_fn(free)
        free.set("now")
        assert free.get() == "now"
        assert out.get() == "second(now)"
        with pytest.raises(P.Conflict):
            free.set("again")
    creates = [json.loads(r.content) for r in fake.of("POST", "/variables$")]
    assert creates == [{"name": "c", "value": "given"}, {"name": "later"}]
    assert [json.loads(r.content) for r in fake.of("PUT")] == [{"value": "now"}, {"value": "again"}]
    assert not any(r.url.path.endswith(const.id) for r in fake.of("GET"))


def test_stream_yields_deltas_and_raises_on_failure(fake):
    fake.fail["b"] = {"code": "engine_error", "message": "engine died", "detail": {}}
    with session(fake):
        out = write_code("streamed")
        deltas = list(out.stream())
        assert len(deltas) == 3 and "".join(deltas) == "write_code(streamed)"
        assert fake.of("GET")[-1].url.path.endswith(f"/variables/{out.id}/stream")
        bad = second_fn("x")
        got = []
        with pytest.raises(P.EngineError, match="engine died"):
            for delta in bad.stream():
                got.append(delta)
        assert got == ["partial"]


def test_truncated_stream_is_an_error(fake):
    with session(fake):
        out = write_code("x")
        fake.error_for.append((r"GET .*/stream", (200, '{"text": "a"}\n')))
        with pytest.raises(P.ParrotError, match="ended without its final line"):
            list(out.stream())


def test_criteria_is_validated(fake):
    with session(fake):
        out = write_code("x")
        with pytest.raises(P.BadRequest, match="criteria"):
            out.get("FASTEST")
        assert out.get("latency") == "write_code(x)"
        assert parse_qs(fake.of("GET")[-1].url.query.decode())["criteria"] == ["LATENCY"]


# ------------------------------------------------------------ async session
def run(coro):
    return asyncio.run(coro)


def test_async_calls_do_not_block_and_submit_in_program_order(fake):
    async def main():
        async with asession(fake) as s:
            a = first("x0")
            b = second_fn(a)
            c = third(b, "k")
            assert a.id is None and b.id is None and c.id is None
            assert fake.of("POST", "/calls$") == []  # nothing sent yet: the caller was not blocked
            await s.flush()
            assert len(fake.of("POST", "/calls$")) == 3 and None not in (a.id, b.id, c.id)
            value = await c.aget()
            assert [body["name"] for body in fake.submits()] == ["first", "second", "third"]
            assert fake.submits()[1]["placeholders"][0]["var_id"] == a.id
            assert fake.submits()[2]["placeholders"][0]["var_id"] == b.id
            assert all(r.url.path.endswith(c.id) for r in fake.of("GET"))
            both = await asyncio.gather(a.aget(), b.aget())
            return s, value, both

    s, value, both = run(main())
    assert value == "third(second(first(x0)), k)"
    assert both == ["first(x0)", "second(first(x0))"]
    assert fake.deleted == [s.session_id]


def test_async_submit_failure_raises_from_aget_and_downstream(fake):
    async def main():
        async with asession(fake):
            fake.submit_error = (400, {"error": {"code": "invalid_binding", "message": "bad binding"}})
            a = first("x")
            b = second_fn(a)
            with pytest.raises(P.BindingError, match="bad binding"):
                await a.aget()
            fake.submit_error = None
            with pytest.raises(P.BindingError, match="bad binding"):
                await b.aget()
            ok = first("fine")
            assert await ok.aget() == "first(fine)"

    run(main())  # observed failures are not raised again at exit
    # the failing "x" and then "fine" were sent; b, wired to a failed submission, never was
    assert [body["name"] for body in fake.submits()] == ["first", "first"]
    assert [c["name"] for c in fake.calls] == ["first"]


def test_async_unobserved_submit_failure_is_raised_at_exit(fake):
    async def main():
        async with asession(fake):
            fake.submit_error = (404, {"error": {"code": "not_found", "message": "no model 'gpt-9'"}})
            first("x")

    with pytest.raises(P.NotFound, match="no model 'gpt-9'"):
        run(main())
    assert len(fake.deleted) == 1


def test_async_failed_variable_and_stream(fake):
    fake.fail["a"] = {"code": "call_failed", "message": "generation failed", "detail": {}}
    fake.pending_polls = 1

    async def main():
        async with asession(fake) as s:
            v = s.variable("hello", name="greeting")
            out = s.call(write_code, v)
            deltas = [d async for d in out.astream()]
            assert "".join(deltas) == "write_code(hello)"
            assert await out.aget() == "write_code(hello)"
            assert await v.aget() == "hello"
            with pytest.raises(P.CallFailed, match="generation failed"):
                await first("x").aget()
            free = s.variable()
            await free.aset("later")
            assert await second_fn(free).aget() == "second(later)"
            with pytest.raises(P.BadRequest, match="aget"):
                out.get()

    run(main())
    assert [json.loads(r.content) for r in fake.of("PUT")] == [{"value": "later"}]


def test_async_exit_with_body_error_still_deletes(fake):
    async def main():
        async with asession(fake):
            first("x")
            raise ValueError("body")

    with pytest.raises(ValueError, match="body"):
        run(main())
    assert len(fake.deleted) == 1


def test_sync_variable_supports_aget(fake):
    with session(fake):
        out = write_code("x")
        assert run(out.aget()) == "write_code(x)"


def test_public_namespace_is_complete_and_light():
    import subprocess
    import sys

    names = [
        "semantic_function",
        "template_function",
        "Input",
        "Output",
        "SemanticVariable",
        "connect",
        "aconnect",
        "Session",
        "AsyncSession",
        "LATENCY",
        "THROUGHPUT",
        "SamplingParams",
        "ParrotError",
        "BadRequest",
        "NotFound",
        "CallFailed",
        "Timeout",
        "TransformFailed",
        "InvalidTransform",
        "BindingError",
    ]
    assert all(hasattr(P, n) for n in names)
    for helper in ("strip", "regex", "json_path", "first_line", "first_item"):
        assert callable(getattr(P.transforms, helper))
    code = (
        "import sys, parrot; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'fastapi', 'uvicorn'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _answers(client: httpx.Client) -> list[tuple[int, str | None]]:
    """(status, error code) of one sequence of requests covering the fake's routes."""

    def seen(r: httpx.Response) -> tuple[int, str | None]:
        body = r.json() if r.content else {}
        return r.status_code, (body.get("error") or {}).get("code") if isinstance(body, dict) else None

    out = []
    opened = client.post("/v1/sessions")
    out.append(seen(opened))
    sid, token = opened.json()["session_id"], opened.json()["token"]
    auth = {"Authorization": f"Bearer {token}"}
    out.append(seen(client.get("/v1/sessions/no-such-session/variables/v1", headers=auth)))
    out.append(seen(client.post(f"/v1/sessions/{sid}/variables", json={"name": "a"})))  # no token
    out.append(
        seen(
            client.post(
                f"/v1/sessions/{sid}/variables", json={"name": "a"}, headers={"Authorization": "Bearer x"}
            )
        )
    )
    made = client.post(f"/v1/sessions/{sid}/variables", json={"name": "a", "value": "x"}, headers=auth)
    out.append(seen(made))
    vid = made.json()["var_id"]
    out.append(seen(client.put(f"/v1/sessions/{sid}/variables/{vid}", json={"value": "y"}, headers=auth)))
    out.append(
        seen(
            client.get(
                f"/v1/sessions/{sid}/variables/v-missing",
                params={"wait": 0, "criteria": "LATENCY"},
                headers=auth,
            )
        )
    )
    call = {
        "template": "hi {{input:a}} {{output:b}}",
        "placeholders": [
            {"name": "a", "direction": "input", "var_id": vid},
            {"name": "b", "direction": "output", "sampling": {"max_tokens": 2}},
        ],
    }
    submitted = client.post(f"/v1/sessions/{sid}/calls", json=call, headers=auth)
    out.append(seen(submitted))
    produced = submitted.json()["outputs"]["b"]
    out.append(
        seen(client.put(f"/v1/sessions/{sid}/variables/{produced}", json={"value": "y"}, headers=auth))
    )
    ghost = {
        **call,
        "placeholders": [{**call["placeholders"][0], "var_id": "v-missing"}, call["placeholders"][1]],
    }
    out.append(seen(client.post(f"/v1/sessions/{sid}/calls", json=ghost, headers=auth)))
    out.append(seen(client.delete(f"/v1/sessions/{sid}", headers=auth)))
    return out


def test_the_fake_manager_answers_as_the_real_one_does(fake, live):
    with httpx.Client(transport=fake.transport(), base_url=URL) as client:
        from_fake = _answers(client)
    with httpx.Client(base_url=live.url, timeout=30) as client:
        from_real = _answers(client)
    assert from_fake == from_real
    assert {code for _, code in from_real} >= {
        "session_not_found",
        "unauthorized",
        "forbidden",
        "variable_not_found",
        "variable_not_pending",
        "variable_has_producer",
    }
