"""Whether a class provides what a Protocol of `interfaces` describes, signatures included.

`isinstance(obj, SomeProtocol)` only looks for the members' names. A plugin's tests call
`protocol_mismatches(TheirClass, SomeProtocol)` to also check that each method takes every call
the Protocol allows (positions, keywords, defaults) and that each attribute is an attribute.
"""

from __future__ import annotations

import inspect

import attrs

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_MISSING = object()


def protocol_mismatches(cls: type, protocol: type) -> list[str]:
    """What `cls` lacks of `protocol`, one line a member (`evaluate: takes no keyword
    'doc_starts'`); empty when it conforms."""
    own = vars(protocol)
    names = set(own.get("__annotations__", {})) | {n for n in own if not n.startswith("_")}
    fields = attrs.fields_dict(cls) if attrs.has(cls) else {}
    problems = []
    for name in sorted(names):
        wanted = own.get(name)
        have = inspect.getattr_static(cls, name, _MISSING)
        if have is _MISSING and name not in fields:
            problems.append(f"{name}: missing")
        elif inspect.isfunction(wanted):
            if not inspect.isfunction(have):
                problems.append(f"{name}: not a method")
            else:
                want, got = inspect.signature(wanted), inspect.signature(getattr(cls, name))
                problems += [f"{name}: {p}" for p in _call_problems(_unbound(got), _unbound(want))]
        elif inspect.isfunction(have):
            problems.append(f"{name}: a method, where the Protocol reads an attribute")
    return problems


def _unbound(signature: inspect.Signature) -> list[inspect.Parameter]:
    return list(signature.parameters.values())[1:]  # without self


def _call_problems(have: list[inspect.Parameter], want: list[inspect.Parameter]) -> list[str]:
    """Calls the Protocol's parameters `want` allow that the method's `have` do not take."""
    kinds = {p.kind for p in have}
    var_args = inspect.Parameter.VAR_POSITIONAL in kinds
    var_kwargs = inspect.Parameter.VAR_KEYWORD in kinds
    positional = [p for p in have if p.kind in _POSITIONAL]
    named = {p.name: p for p in have if p.kind in _NAMED}
    problems: list[str] = []
    used: set[str] = set()

    def defaulted(w: inspect.Parameter, h: inspect.Parameter) -> None:
        used.add(h.name)
        if w.default is not w.empty and h.default is h.empty:
            problems.append(f"{h.name!r} needs a default (the Protocol's may be left out)")

    for i, w in enumerate(p for p in want if p.kind in _POSITIONAL):
        if i < len(positional):
            if w.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and positional[i].name != w.name:
                problems.append(f"argument {i + 1} is {positional[i].name!r}, not {w.name!r}")
            defaulted(w, positional[i])
        elif not var_args:
            problems.append(f"takes no positional argument {i + 1} ({w.name!r})")
    for w in want:
        if w.kind is inspect.Parameter.KEYWORD_ONLY:
            if w.name in named:
                defaulted(w, named[w.name])
            elif not var_kwargs:
                problems.append(f"takes no keyword {w.name!r}")
        elif w.kind is inspect.Parameter.VAR_POSITIONAL and not var_args:
            problems.append(f"takes no *{w.name}")
        elif w.kind is inspect.Parameter.VAR_KEYWORD and not var_kwargs:
            problems.append(f"takes no **{w.name}")
    problems += [
        f"needs {p.name!r}, which the Protocol does not pass"
        for p in have
        if p.name not in used and p.default is p.empty and p.kind in (*_POSITIONAL, *_NAMED)
    ]
    return problems
