"""The docs site's griffe extension (mkdocs.yml): the strategies as Python sees them once imported, in Markdown.

mkdocstrings reads the package's source without importing it, which misses two things about the strategies:

- their ``Args:`` blocks, which ``document_federation_args`` appends at import time from the one description of the
  federation arguments (:class:`~lightning_fedshard.FederationConfig`);
- their constructor: the first ``__init__`` takes the backend's arguments and passes ``**kwargs`` down a chain of
  constructors (the federation's, then Lightning's), so the source shows neither the federation arguments nor
  Lightning's that the docstring describes.

For the classes with such a decorator this extension takes the docstring of the imported class, and a signature of
the first constructor's parameters followed, as keyword-only, by every documented parameter of the constructors its
``**kwargs`` reach (importing the package needs no GPU and no network). It also writes the Sphinx roles of every
docstring (``:class:`~a.B```) as code spans, which Markdown would otherwise show with their role.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from typing import Any

import griffe

#: The decorators that complete a docstring at import time.
RUNTIME_DOCSTRING_DECORATORS = ("document_federation_args",)
#: ``:class:`~pkg.Name``` or ``:func:`pkg.name```: a Sphinx role around a dotted name.
SPHINX_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _code_span(match: re.Match[str]) -> str:
    """A Sphinx role as a code span: the last part of the name where the role says ``~``, else the whole name."""
    short, name = match.groups()
    return f"`{name.rsplit('.', 1)[-1] if short else name.lstrip('.')}`"


def _documented(docstring: griffe.Docstring) -> set[str]:
    """The parameter names of a docstring's ``Args:`` block."""
    sections = docstring.parse("google", warnings=False)
    return {p.name for s in sections if s.kind is griffe.DocstringSectionKind.parameters for p in s.value}


def _parameter(param: inspect.Parameter, kind: inspect._ParameterKind | None = None) -> griffe.Parameter:
    """A runtime parameter as griffe's (annotations are source text under ``from __future__ import annotations``)."""
    annotation = param.annotation
    if annotation is inspect.Parameter.empty:
        annotation = None
    elif not isinstance(annotation, str):
        annotation = inspect.formatannotation(annotation)
    default = None if param.default is inspect.Parameter.empty else repr(param.default)
    return griffe.Parameter(
        param.name, annotation=annotation, kind=griffe.ParameterKind((kind or param.kind).description), default=default
    )


def _constructor_chain(runtime: type, documented: set[str]) -> griffe.Parameters:
    """The first constructor's parameters, then the documented ones of every constructor its ``**kwargs`` reach."""
    inits = [klass.__dict__["__init__"] for klass in runtime.__mro__ if "__init__" in klass.__dict__]
    first, *rest = (list(inspect.signature(init).parameters.values())[1:] for init in inits)  # without self
    params = [_parameter(p) for p in first if p.kind not in _VARIADIC]
    names = {p.name for p in params}
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in first)
    for signature in rest:
        if not passes_on:
            break
        for p in signature:
            if p.name in documented and p.kind not in _VARIADIC and p.name not in names:
                params.append(_parameter(p, inspect.Parameter.KEYWORD_ONLY))
                names.add(p.name)
        passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature)
    if documented & {"kwargs", "**kwargs"}:
        params.append(griffe.Parameter("kwargs", annotation="Any", kind=griffe.ParameterKind.var_keyword))
    return griffe.Parameters(*params)


class RuntimeDocstrings(griffe.Extension):
    """The strategies' docstrings and constructors as imported, and Sphinx roles as code spans."""

    def on_class_instance(self, *, node: ast.AST | griffe.ObjectNode, cls: griffe.Class, **kwargs: Any) -> None:
        """Give a class whose decorator rewrites its docstring the imported docstring and constructor."""
        if not any(str(d.value).startswith(RUNTIME_DOCSTRING_DECORATORS) for d in cls.decorators):
            return
        runtime = getattr(importlib.import_module(cls.module.path), cls.name)
        value = SPHINX_ROLE.sub(_code_span, inspect.cleandoc(runtime.__doc__ or ""))
        lineno = cls.docstring.lineno if cls.docstring else cls.lineno
        cls.docstring = griffe.Docstring(value, lineno=lineno, parent=cls)
        parameters = _constructor_chain(runtime, _documented(cls.docstring))
        init = griffe.Function("__init__", lineno=cls.lineno, endlineno=cls.lineno, parameters=parameters)
        init.returns = "None"
        cls.set_member("__init__", init)

    def on_instance(self, *, node: ast.AST | griffe.ObjectNode, obj: griffe.Object, **kwargs: Any) -> None:
        """Write every Sphinx role of the docstring as a code span."""
        if obj.docstring is not None:
            obj.docstring.value = SPHINX_ROLE.sub(_code_span, obj.docstring.value)
