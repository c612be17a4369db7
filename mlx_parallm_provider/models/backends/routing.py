"""Point one model's mlx-lm layers at its backend, leaving mlx-lm's modules as they are.

mlx-lm's model files call ``scaled_dot_product_attention`` and ``swiglu``, names each model
module imports from ``mlx_lm.models.base`` / ``.activations`` and looks up in its own globals
at every call. :func:`route` gives the model's layers, per instance, a subclass of their own
class whose methods calling those names are the same code objects run over a copy of their
defining module's globals in which the names are the backend's methods (the defining module:
the layer's class's or a base class's, whatever module the model's top class comes from).
The module itself, its classes, and every other model loaded from it (the benchmark's mlx-lm
peers, a user's own model) are untouched. Where the backend :attr:`~.MLXOps.folds_rows`, the
model's quantized linear layers (and a quantized embedding's ``as_linear``) get such a subclass
too, multiplying a step's rows as one matrix (:mod:`.folded_rows`). Where it
:attr:`~.MLXOps.stacks_siblings`, plain llama / qwen2 attention and MLP classes make their
q/k/v and gate/up as one product each where loading stacked them (:mod:`.stacked`).
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Optional

from ..attention import mlx_lm_attention, mlx_lm_swiglu
from .attention_step import ORIGINAL, fusable, original_class, stepping
from .folded_rows import folded_methods
from .layer_step import fusable_block, stepping_block
from .softcapped import attending, softcapped
from .stacked import GATE_UP, qkv_projections, siblings_of_class, stacking_mlp

_BACKEND = "_parallm_backend"  # on a routed subclass: the backend its methods call
_MADE = "_routed_classes"  # on the backend: its subclasses, made once (a model switched back gets the same)


_REPLACED = {"scaled_dot_product_attention": (mlx_lm_attention, "attend"), "swiglu": (mlx_lm_swiglu, "swiglu")}
"""The global names a backend replaces: the mlx-lm function each must still be, the backend's method."""


def _overrides(module: types.ModuleType, backend: Any) -> dict[str, Callable[..., Any]]:
    """The module's globals that ``backend`` replaces (only where they are still mlx-lm's)."""
    return {name: getattr(backend, method) for name, (fn, method) in _REPLACED.items() if getattr(module, name, None) is fn}


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


def _subclass(cls: type, backend: Any, namespaces: dict[str, Optional[dict[str, Any]]]) -> tuple[type, set[str]]:
    """``cls`` with each method that calls a name ``backend`` replaces in the module defining
    that method (``cls``'s own module or a base class's: SmolLM3's layers are llama's, Gemma 3's
    text model sits inside its multimodal wrapper) rebound over that module's globals with the
    names replaced, and which names those methods call; ``cls`` itself where none does.
    ``namespaces`` caches each module's replaced globals (None: the module replaces none)."""
    winners: dict[str, tuple[type, Any]] = {}
    for klass in reversed(cls.__mro__):  # later (more derived) definitions win
        winners.update((n, (klass, v)) for n, v in vars(klass).items())
    body: dict[str, Any] = {}
    calls: set[str] = set()
    for name, (klass, fn) in winners.items():
        if not isinstance(fn, types.FunctionType):
            continue
        if klass.__module__ not in namespaces:
            module = sys.modules.get(klass.__module__)
            overrides = _overrides(module, backend) if module is not None else {}
            namespaces[klass.__module__] = {**vars(module), **overrides} if overrides else None
        namespace = namespaces[klass.__module__]
        called = _names(fn.__code__) & set(_REPLACED) if namespace is not None else set()
        if called:
            body[name] = _rebound(fn, namespace)
            calls |= called
    stacks = getattr(backend, "stacks_siblings", False)
    if softcapped(cls):  # (gemma2: its own scores, now the backend's attention)
        body["__call__"] = attending(backend)
        calls.add("scaled_dot_product_attention")
    elif fusable(cls) and "scaled_dot_product_attention" in calls and hasattr(backend, "steps_attention"):
        project = qkv_projections if stacks else None  # (q/k/v by one product where stacked)
        body["__call__"] = stepping(body["__call__"], backend, project)  # (a decode step's attention as one op, where it can)
    elif fusable_block(cls) and getattr(backend, "steps_layers", False):
        body["__call__"] = stepping_block(body.get("__call__", cls.__call__), backend)  # (a whole layer's step, where it can)
    elif stacks and siblings_of_class(cls) == GATE_UP:
        body["__call__"] = stacking_mlp(backend)  # (gate/up by one product where stacked)
    if getattr(backend, "folds_rows", False):
        body.update(folded_methods(cls))  # (quantized products over a step's rows as one matrix)
    if not body:
        return cls, calls
    body.update({ORIGINAL: cls, _BACKEND: backend, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return type(cls.__name__, (cls,), body), calls


def route(model: Any, backend: Any) -> bool:
    """Make ``model``'s layers call ``backend.attend`` and ``backend.swiglu`` where the mlx-lm
    module defining their code calls mlx-lm's functions by those names, and gemma2's attention
    call ``backend.attend`` with its softcap (:mod:`.softcapped`), replacing an earlier
    backend's routing. Returns whether its attention now goes through ``backend.attend`` (if
    not, caches' ``attend`` methods are never used)."""
    if not hasattr(model, "named_modules"):  # not an mlx.nn.Module: nothing to route
        return False
    made: dict[type, tuple[type, set[str]]] = vars(backend).setdefault(_MADE, {})
    namespaces: dict[str, Optional[dict[str, Any]]] = {}
    attends = False
    for _, layer in model.named_modules():
        original = original_class(layer)
        if original not in made:
            made[original] = _subclass(original, backend, namespaces)
        layer.__class__ = made[original][0]
        attends |= "scaled_dot_product_attention" in made[original][1]
    return attends


def unroute(model: Any) -> None:
    """Give ``model``'s layers back the classes :func:`route` derived theirs from."""
    for _, layer in model.named_modules():
        original = getattr(type(layer), ORIGINAL, None)
        if original is not None:
            layer.__class__ = original


def routed_backend(layer: Any) -> Any:
    """The backend a routed layer calls, or None for one :func:`route` did not touch."""
    return getattr(type(layer), _BACKEND, None)
