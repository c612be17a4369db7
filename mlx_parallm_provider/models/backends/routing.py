"""Point one model's mlx-lm layers at its backend, leaving mlx-lm's modules as they are.

mlx-lm's model files call ``scaled_dot_product_attention`` and ``swiglu``, names each model
module imports from ``mlx_lm.models.base`` / ``.activations`` and looks up in its own globals
at every call. :func:`route` gives the model's layers, per instance, a subclass of their own
class whose methods are the same code objects run over a copy of the module's globals in
which those two names are the backend's methods. The module itself, its classes, and every
other model loaded from it (the benchmark's mlx-lm peers, a user's own model) are untouched.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

from ..attention import mlx_lm_attention, mlx_lm_swiglu

_ORIGINAL = "_parallm_original_class"  # on a routed subclass: the mlx-lm class it derives from
_BACKEND = "_parallm_backend"  # on a routed subclass: the backend its methods call
_MADE = "_routed_classes"  # on the backend: its subclasses, made once (a model switched back gets the same)


def _overrides(module: types.ModuleType, backend: Any) -> dict[str, Callable[..., Any]]:
    """The module's globals that ``backend`` replaces (only where they are still mlx-lm's)."""
    names: dict[str, Callable[..., Any]] = {}
    if getattr(module, "scaled_dot_product_attention", None) is mlx_lm_attention:
        names["scaled_dot_product_attention"] = backend.attend
    if getattr(module, "swiglu", None) is mlx_lm_swiglu:
        names["swiglu"] = backend.swiglu
    return names


def _rebound(fn: types.FunctionType, namespace: dict[str, Any]) -> types.FunctionType:
    """``fn``'s code over ``namespace`` as its globals (closures and defaults kept, so a
    zero-argument ``super()`` still names the original class, which the subclass derives from)."""
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__dict__ = fn.__qualname__, fn.__doc__, dict(fn.__dict__)
    return new


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the functions nested in it look up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _subclass(cls: type, module: types.ModuleType, namespace: dict[str, Any], replaced: set[str], backend: Any) -> tuple[type, set[str]]:
    """``cls`` with every method defined in ``module`` (its own or inherited) rebound over
    ``namespace``, and which of the ``replaced`` names those methods call; ``cls`` itself
    where they call none."""
    methods: dict[str, types.FunctionType] = {}
    for klass in reversed(cls.__mro__):  # later (more derived) definitions win
        if klass.__module__ == module.__name__:
            methods.update((n, v) for n, v in vars(klass).items() if isinstance(v, types.FunctionType))
    calls = set().union(*(_names(fn.__code__) for fn in methods.values())) & replaced
    if not calls:
        return cls, calls
    body: dict[str, Any] = {name: _rebound(fn, namespace) for name, fn in methods.items()}
    body.update({_ORIGINAL: cls, _BACKEND: backend, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return type(cls.__name__, (cls,), body), calls


def route(model: Any, backend: Any) -> bool:
    """Make ``model``'s layers call ``backend.attend`` and ``backend.swiglu`` where its mlx-lm
    module calls mlx-lm's functions by those names (replacing an earlier backend's routing).
    Returns whether its attention now goes through ``backend.attend`` (if not, caches'
    ``attend`` methods are never used, which is correct, only slower)."""
    module = sys.modules.get(getattr(type(model), _ORIGINAL, type(model)).__module__)
    if module is None:
        return False
    overrides = _overrides(module, backend)
    if not overrides:
        return False
    namespace = {**vars(module), **overrides}
    made: dict[type, tuple[type, set[str]]] = vars(backend).setdefault(_MADE, {})
    seen: set[type] = set()
    for _, layer in model.named_modules():
        original = getattr(type(layer), _ORIGINAL, type(layer))
        if original.__module__ != module.__name__:
            continue
        seen.add(original)
        if original not in made:
            made[original] = _subclass(original, module, namespace, set(overrides), backend)
        layer.__class__ = made[original][0]
    return any("scaled_dot_product_attention" in made[c][1] for c in seen)


def unroute(model: Any) -> None:
    """Give ``model``'s layers back the classes :func:`route` derived theirs from."""
    for _, layer in model.named_modules():
        original = getattr(type(layer), _ORIGINAL, None)
        if original is not None:
            layer.__class__ = original


def routed_backend(layer: Any) -> Any:
    """The backend a routed layer calls, or None for one :func:`route` did not touch."""
    return getattr(type(layer), _BACKEND, None)
