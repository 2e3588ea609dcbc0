"""Semantic functions: prompt templates that are called like Python functions.

Two ways to build one::

    @P.semantic_function(chat=True)
    def write_code(task: P.Input, code: P.Output(max_tokens=200)):
        \"\"\"Write python code of {{task}}. Code: {{code}}\"\"\"

    write_code = P.template_function("Write python code of {{input:task}}. Code: {{output:code}}",
                                     name="write_code", code=P.Output(max_tokens=200))

Invariants of a :class:`SemanticFunction`: its template has every
placeholder's direction resolved; the inputs are exactly the template's input
names and the outputs exactly its output names (at least one); every output
has validated sampling settings and transform.  All of this is checked when
the function is built, so a mistake in a prompt or in its settings raises at
decoration time, not at the first call.

Calling a function submits it to the current session (see
:mod:`parrot.frontend.client`) and returns the output variable, or a tuple of
them in template order when there are several.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from types import FrameType, MappingProxyType
from typing import Any

from parrot.frontend.client import current_session
from parrot.frontend.variable import Criteria, SemanticVariable, check_criteria, check_value
from parrot.protocol.constraint import Constraint, check_compiles
from parrot.protocol.errors import BindingError, InvalidTemplate, ParrotError
from parrot.protocol.sampling import DEFAULT_SAMPLING, SamplingParams
from parrot.protocol.schemas import SubmitCall, SubmitCallOp
from parrot.protocol.template import Direction, Template, parse_template, prompt_text
from parrot.protocol.tokenizer import ChatFormat
from parrot.protocol.transforms import TransformChain, parse_transforms

_D = DEFAULT_SAMPLING


class Input:
    """Marks a parameter (or a template placeholder) as an input.

    Use it bare (``task: P.Input``) or called (``task: P.Input()``).
    """

    direction: Direction = "input"

    def __repr__(self) -> str:
        return "Input()"


class Output:
    """Marks a parameter (or a template placeholder) as an output and holds how
    to generate it.  Use it bare (``code: P.Output``, default settings) or
    called with settings; they are validated here, so mistakes raise at once.

    ``json_schema`` (a JSON schema as a dict), ``regex`` or ``choices`` (a list of
    strings), at most one of them, constrain the output while it is generated: the
    engine only lets the model produce text of that language (see
    docs/structured-outputs.md).  A constrained output cut short by ``max_tokens`` is
    incomplete (its call's ``finish_reason`` is ``length``).

    ``stop`` may be a single string.  ``transform`` is anything
    :func:`~parrot.protocol.transforms.parse_transforms` accepts (e.g.
    ``P.transforms.strip()``).  ``criteria`` is an optional performance hint
    (``P.LATENCY`` / ``P.THROUGHPUT``) sent with the call.
    """

    direction: Direction = "output"
    __slots__ = ("criteria", "sampling", "transform")

    def __init__(
        self,
        *,
        max_tokens: int = _D.max_tokens,
        temperature: float = _D.temperature,
        top_p: float = _D.top_p,
        top_k: int = _D.top_k,
        seed: int | None = _D.seed,
        stop: str | list[str] | tuple[str, ...] = (),
        stop_token_ids: list[int] | tuple[int, ...] = (),
        ignore_eos: bool = _D.ignore_eos,
        transform: Any = None,
        criteria: Criteria | None = None,
        json_schema: dict[str, Any] | None = None,
        regex: str | None = None,
        choices: list[str] | tuple[str, ...] | None = None,
    ):
        if isinstance(stop, str):
            stop = (stop,)
        self.sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos,
            constraint=Constraint.of(json_schema, regex, choices),
        )
        if self.sampling.constraint is not None:  # about a millisecond; a bad regex fails here
            check_compiles(self.sampling.constraint)
        self.transform: TransformChain | None = parse_transforms(transform)
        self.criteria: Criteria | None = None if criteria is None else check_criteria(criteria)

    def binding(self, name: str) -> dict[str, Any]:
        """This output's ``PlaceholderBinding`` in a ``SubmitCall`` body."""
        return {
            "name": name,
            "direction": "output",
            "sampling": self.sampling.to_dict(),
            "transform": None if self.transform is None else self.transform.to_spec(),
            "criteria": self.criteria,
        }

    def __repr__(self) -> str:
        return f"Output(sampling={self.sampling!r}, transform={self.transform!r}, criteria={self.criteria!r})"


def _marker(annotation: Any) -> Input | Output | None:
    """The Input/Output an annotation denotes, or ``None`` if it is neither."""
    if annotation is Input or isinstance(annotation, Input):
        return Input()
    if annotation is Output:
        return Output()
    if isinstance(annotation, Output):
        return annotation
    return None


class SemanticFunction:
    """A validated prompt template plus its outputs' settings; call it to submit."""

    def __init__(
        self,
        template: Template,
        outputs: Mapping[str, Output],
        *,
        name: str | None = None,
        model: str | None = None,
        chat: bool = False,
        defaults: Mapping[str, str] | None = None,
    ):
        names = template.names
        inputs = tuple(n for n in names if template.direction_of(n) == "input")
        output_names = tuple(n for n in names if template.direction_of(n) == "output")
        if len(inputs) + len(output_names) != len(names):
            raise InvalidTemplate("every placeholder needs a direction")
        if not output_names:
            raise BindingError(f"semantic function {name or '<anonymous>'!r} has no output placeholder")
        if set(outputs) != set(output_names):
            raise BindingError(
                f"output settings {sorted(outputs)} do not match "
                f"the template's outputs {sorted(output_names)}"
            )
        if model is not None and not isinstance(model, str):
            raise BindingError(f"model must be a string or None, got {type(model).__name__}")
        if name is not None and not isinstance(name, str):
            raise BindingError(f"name must be a string or None, got {type(name).__name__}")
        self.template = template
        self.name = name
        self.model = model
        self.chat = bool(chat)
        self.inputs: tuple[str, ...] = inputs
        self.outputs: Mapping[str, Output] = MappingProxyType({n: outputs[n] for n in output_names})
        self.defaults: Mapping[str, str] = MappingProxyType(dict(defaults or {}))
        self.__name__ = name or "semantic_function"
        self.__doc__ = template.source

    def __repr__(self) -> str:
        return f"SemanticFunction({self.name!r}, inputs={list(self.inputs)}, outputs={list(self.outputs)})"

    def __call__(self, *args: Any, **kwargs: Any) -> SemanticVariable | tuple[SemanticVariable, ...]:
        """Submit a call to the current session; returns the output future(s)."""
        return current_session().call(self, *args, **kwargs)

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Map call arguments to input names, like Python does for parameters.

        Raises :class:`BindingError` for missing, unknown or doubly given
        inputs.  Values are returned unchecked (the session checks them).
        """
        label = f"{self.__name__}()"
        if len(args) > len(self.inputs):
            raise BindingError(f"{label} takes {len(self.inputs)} input(s) but {len(args)} were given")
        bound = dict(zip(self.inputs, args, strict=False))
        for key, value in kwargs.items():
            if key in self.outputs:
                raise BindingError(f"{label}: {key!r} is an output; it is returned, not passed")
            if key not in self.inputs:
                raise BindingError(f"{label} got an unexpected input {key!r}")
            if key in bound:
                raise BindingError(f"{label} got multiple values for input {key!r}")
            bound[key] = value
        for key, value in self.defaults.items():
            bound.setdefault(key, value)
        missing = [n for n in self.inputs if n not in bound]
        if missing:
            raise BindingError(f"{label} missing input(s) {missing}")
        return {n: bound[n] for n in self.inputs}

    def render(self, inputs: Mapping[str, Any], chat_format: ChatFormat | None = None) -> str:
        """The prompt the model reads for a call with these input values, as one
        string: what a request-level client sends to ``POST /v1/completions``
        (which adds BOS like every call) to generate this function's output.

        ``inputs`` maps every input name to its value (``str``, or an
        ``int``/``float`` converted as in a call; defaults fill the rest).
        With ``chat=True``, ``chat_format`` is the served model's chat markup
        (``GET /v1/models`` gives it as ``chat_format``), wrapped around the
        user's text exactly as the manager wraps a call.  Only functions with
        one output can be rendered: a later output's prompt would contain the
        earlier ones as generated.
        """
        if len(self.outputs) != 1:
            raise BindingError(
                f"{self.__name__}(): render() needs a function with one output, it has {list(self.outputs)}"
            )
        values = {
            name: check_value(value, f"{self.__name__}(): input {name!r}")
            for name, value in self.bind((), inputs).items()
        }
        wrap = None
        if self.chat:
            if chat_format is None:
                raise BindingError(f"{self.__name__}() has chat=True: render() needs the model's chat_format")
            wrap = chat_format.wrap()
        return prompt_text(self.template, values, chat=self.chat, chat_wrap=wrap)

    def submit_body(self, inputs: Mapping[str, str | SemanticVariable]) -> dict[str, Any]:
        """The ``SubmitCall`` JSON body for already-checked ``inputs``.

        Every variable among them must have its id.  Inputs bind by
        ``var_id`` (a variable) or ``value`` (a constant); outputs carry
        their sampling, transform and criteria.
        """
        body = self._body(inputs, lambda _: None, {})
        SubmitCall.model_validate(body)  # the wire schema, checked before anything is sent
        return body

    def batch_op(
        self,
        inputs: Mapping[str, str | SemanticVariable],
        ref_of: Callable[[SemanticVariable], str | None],
        output_refs: Mapping[str, str],
    ) -> dict[str, Any]:
        """The ``submit_call`` op of a ``BatchRequest``: like :meth:`submit_body`,
        but a variable that ``ref_of`` knows (one recorded in the same batch)
        binds by that ``ref``, and output ``n`` defines ref ``output_refs[n]``."""
        body = {"op": "submit_call", **self._body(inputs, ref_of, output_refs)}
        SubmitCallOp.model_validate(body)
        return body

    def _body(
        self,
        inputs: Mapping[str, str | SemanticVariable],
        ref_of: Callable[[SemanticVariable], str | None],
        output_refs: Mapping[str, str],
    ) -> dict[str, Any]:
        placeholders: list[dict[str, Any]] = []
        for name in self.template.names:
            if name in self.outputs:
                binding = self.outputs[name].binding(name)
                if name in output_refs:
                    binding["define_ref"] = output_refs[name]
                placeholders.append(binding)
                continue
            value = inputs[name]
            if isinstance(value, SemanticVariable):
                placeholders.append({"name": name, "direction": "input", **_names(name, value, ref_of)})
            else:
                placeholders.append({"name": name, "direction": "input", "value": value})
        return {
            "template": self.template.to_inline(),
            "placeholders": placeholders,
            "name": self.name,
            "model": self.model,
            "chat": self.chat,
        }


def _names(
    name: str, var: SemanticVariable, ref_of: Callable[[SemanticVariable], str | None]
) -> dict[str, str]:
    """How input ``name`` names ``var`` on the wire: by its batch ref, else by its id."""
    ref = ref_of(var)
    if ref is not None:
        return {"ref": ref}
    if var.id is None:
        raise ParrotError(f"input {name!r} has no variable id yet", code="client_error")
    return {"var_id": var.id}


# ------------------------------------------------------------------ builders
def semantic_function(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    model: str | None = None,
    chat: bool = False,
) -> Any:
    """Decorator: the docstring is the template, the annotations give directions.

    Usable bare (``@P.semantic_function``) or with options.  Every parameter
    must be annotated ``P.Input`` or ``P.Output(...)`` and appear as a
    placeholder, and every placeholder must be a parameter
    (:class:`BindingError` otherwise).  Inputs may have ``str``/``int``/
    ``float`` defaults.  String annotations (``from __future__ import
    annotations``) are evaluated in the function's globals and the locals of
    the scope that applies the decorator.
    """
    if fn is not None:
        return _from_callable(fn, name=name, model=model, chat=chat, frame=sys._getframe(1))

    def decorate(f: Callable[..., Any]) -> SemanticFunction:
        return _from_callable(f, name=name, model=model, chat=chat, frame=sys._getframe(1))

    return decorate


def template_function(
    template: str,
    /,
    *,
    name: str | None = None,
    model: str | None = None,
    chat: bool = False,
    **placeholders: Any,
) -> SemanticFunction:
    """A semantic function from a template string.

    Keyword arguments other than ``name``/``model``/``chat`` configure
    placeholders by name: ``P.Output(...)`` (or bare ``P.Output``) for an
    output, ``P.Input`` for an input.  A bare ``{{x}}`` placeholder that is
    not configured is an input; outputs without settings get the defaults.
    """
    parsed = parse_template(template)
    names = set(parsed.names)
    markers: dict[str, Input | Output] = {}
    for key, annotation in placeholders.items():
        marker = _marker(annotation)
        if marker is None:
            raise BindingError(
                f"placeholder {key!r} must be configured with P.Input or P.Output, got {annotation!r}"
            )
        if key not in names:
            raise BindingError(f"{key!r} is configured but is not a placeholder of the template")
        markers[key] = marker
    directions: dict[str, Direction] = {n: "input" for n in parsed.names if parsed.direction_of(n) is None}
    directions.update({n: m.direction for n, m in markers.items()})
    resolved = parsed.with_directions(directions)
    outputs = {
        n: m if isinstance(m := markers.get(n), Output) else Output()
        for n in resolved.names
        if resolved.direction_of(n) == "output"
    }
    return SemanticFunction(resolved, outputs, name=name, model=model, chat=chat)


def _from_callable(
    fn: Callable[..., Any], *, name: str | None, model: str | None, chat: bool, frame: FrameType | None
) -> SemanticFunction:
    label = getattr(fn, "__qualname__", repr(fn))
    if not callable(fn):
        raise BindingError(f"@semantic_function decorates a function, got {fn!r}")
    doc = fn.__doc__
    if not doc or not doc.strip():
        raise InvalidTemplate(f"semantic function {label} has no docstring; the docstring is its template")
    template = parse_template(inspect.cleandoc(doc))
    annotations = _annotations(fn, label, frame)
    directions: dict[str, Direction] = {}
    outputs: dict[str, Output] = {}
    defaults: dict[str, str] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise BindingError(f"{label}: *args/**kwargs parameters are not supported ({param.name!r})")
        marker = _marker(annotations.get(param.name, param.empty))
        if marker is None:
            raise BindingError(
                f"{label}: parameter {param.name!r} must be annotated P.Input or P.Output(...)"
            )
        directions[param.name] = marker.direction
        if isinstance(marker, Output):
            outputs[param.name] = marker
            if param.default is not param.empty:
                raise BindingError(f"{label}: output parameter {param.name!r} cannot have a default")
        elif param.default is not param.empty:
            defaults[param.name] = check_value(param.default, f"{label}: default of input {param.name!r}")
    params, holes = set(directions), set(template.names)
    if params != holes:
        problems = []
        if params - holes:
            problems.append(f"parameter(s) {sorted(params - holes)} not in the docstring template")
        if holes - params:
            problems.append(f"placeholder(s) {sorted(holes - params)} are not parameters")
        raise BindingError(f"{label}: " + "; ".join(problems))
    resolved = template.with_directions(directions)
    return SemanticFunction(
        resolved,
        outputs,
        name=name or getattr(fn, "__name__", None),
        model=model,
        chat=chat,
        defaults=defaults,
    )


def _annotations(fn: Callable[..., Any], label: str, frame: FrameType | None) -> dict[str, Any]:
    """The function's annotations with string ones evaluated.

    ``Output(...)`` errors (bad sampling or transform) propagate unchanged;
    an annotation that cannot be evaluated raises :class:`BindingError`.
    """
    raw = inspect.get_annotations(fn)
    if not any(isinstance(a, str) for a in raw.values()):
        return dict(raw)
    globalns = getattr(fn, "__globals__", {})
    localns = dict(frame.f_locals) if frame is not None else {}
    resolved: dict[str, Any] = {}
    for key, annotation in raw.items():
        for _ in range(2):  # a quoted annotation under `from __future__ import annotations` is a str twice
            if not isinstance(annotation, str):
                break
            try:
                annotation = eval(annotation, globalns, localns)
            except ParrotError:
                raise
            except Exception as exc:
                raise BindingError(f"{label}: cannot evaluate the annotation of {key!r}: {exc}") from exc
        resolved[key] = annotation
    return resolved
