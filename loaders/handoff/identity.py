"""One identity for a transform: the fields that both the share key
(:class:`~prealign.loaders.handoff.batch_share.BatchShare`,
:class:`~prealign.loaders.handoff.media_share.SharedMediaTransform`) and a sidecar's key
(:func:`~prealign.loaders.index.sidecar.config_key`) are digests of, and that a mismatch message
names.

:func:`identity_fields` ``(transform) -> {field: str}``:

- ``None`` -> ``{"transform": "none"}``; the library's ``numpy_fields`` -> ``{"transform":
  "numpy_fields"}``;
- an object whose type defines ``identity_fields()`` gives its own (a wrapper gives what it wraps:
  :class:`~prealign.loaders.handoff.media_share.SharedMediaTransform`; a
  :class:`~prealign.loaders.media.vlm.VLMSampleTransform` its tokenizer's whole definition,
  processor, family);
- anything else: ``transform`` (its qualified name), ``index_key`` (when it has one) and
  ``transform_code``, a digest of its canonical form (:func:`canonical_digest`; of its class alone
  when its state has none but it has an ``index_key()``, which then names every setting its output
  depends on).

Fields named ``output_*`` decide what a transform outputs but not its lengths (a VLM's dtypes): the
share key covers them, an index key (:func:`index_fields`) does not.

The canonical form is the same in every process (no ``id()``, no address, no hash order):

- a function: its code (bytecode, constants, names; not its file or line numbers), defaults, keyword
  defaults, closure cell values, and every module global its code names (``co_names`` resolved in
  ``__globals__``, of nested code too; a global module of the user's: the attributes of it that the
  code names), recursively;
- a class: its bases and its namespace (methods, class attributes); an instance: its class and its
  state (``__getstate__()`` when the class defines one, else ``__dict__`` and ``__slots__``);
- values: sets sorted by canonical form, dict items sorted by key, floats exactly (``float.hex``),
  arrays and tensors by dtype, shape and a digest of their bytes; a tokenizer by its whole
  definition (:func:`tokenizer_definition`);
- code of installed packages (the standard library, site-packages, prealign) by module, name and
  version.

Cycles are followed once (a recursive function, a class naming itself). What has no canonical form
(an open file, a socket, a lock, a generator, an object of a C type with hidden state) raises
:class:`Unfingerprintable` naming where it was found: the callers refuse with a
:class:`~prealign.schemas.errors.ConfigError` naming the transform, never guess.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import io
import json
import os
import socket
import sys
import sysconfig
import types

import numpy as np

from prealign.loaders.sources.webdataset import numpy_fields
from prealign.schemas.errors import ConfigError

__all__ = [
    "Unfingerprintable",
    "canonical_digest",
    "checked_identity_fields",
    "identity_fields",
    "identity_digest",
    "index_fields",
    "qualified_name",
    "tokenizer_definition",
]


class Unfingerprintable(Exception):
    """No canonical form: ``where`` (a path from the transform) holds ``what``."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where} is {what}")
        self.where, self.what = where, what


def qualified_name(obj) -> str:
    """``module.qualname`` of a function or class, else of the object's type."""
    named = (
        obj if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) else type(obj)
    )
    qualname = getattr(named, "__qualname__", type(named).__qualname__)
    return f"{getattr(named, '__module__', '?')}.{qualname}"


def identity_fields(transform) -> dict[str, str]:
    """The identity of ``transform`` field by field (see the module docstring);
    :class:`Unfingerprintable` when it has none."""
    if transform is None:
        return {"transform": "none"}
    if transform is numpy_fields:
        return {"transform": "numpy_fields"}
    own = getattr(type(transform), "identity_fields", None)
    if callable(own):
        return {str(k): str(v) for k, v in transform.identity_fields().items()}
    fields = {"transform": qualified_name(transform)}
    index_key = getattr(transform, "index_key", None)
    if callable(index_key):
        fields["index_key"] = str(index_key())
    try:
        fields["transform_code"] = canonical_digest(transform, "the transform")
    except Unfingerprintable:
        if "index_key" not in fields:
            raise
        fields["transform_code"] = canonical_digest(type(transform), "the transform's class")
    return fields


def checked_identity_fields(transform, *, owner: str) -> dict[str, str]:
    """:func:`identity_fields`, or a :class:`~prealign.schemas.errors.ConfigError` naming the
    transform, what in it has no stable form, and the fix (``owner`` names the caller)."""
    try:
        return identity_fields(transform)
    except Unfingerprintable as exc:
        raise ConfigError(
            f"{owner}: the transform {qualified_name(transform)} cannot be fingerprinted ({exc}), "
            f"so two jobs or two "
            f"indexes with other settings could not be told apart. Give the transform an "
            f"identity_fields() method "
            f"returning {{field: str}} (or an index_key() returning a str) that names every "
            f"setting its output "
            f"depends on, or, for sharing only, pass transform_key='...' (the same on every CP "
            f"peer, another for another configuration)"
        ) from None


def index_fields(transform, *, owner: str) -> dict[str, str]:
    """The fields of :func:`checked_identity_fields` an index's lengths depend on (all but
    ``output_*``)."""
    return {
        k: v
        for k, v in checked_identity_fields(transform, owner=owner).items()
        if not k.startswith("output_")
    }


def identity_digest(fields: dict[str, str]) -> str:
    """16 hex digits of ``fields`` (the key they make)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def canonical_digest(obj, where: str = "the object") -> str:
    """32 hex digits of the canonical form of ``obj`` (the same in every process)."""
    try:
        form = _Canon().value(obj, where)
    except RecursionError:
        raise Unfingerprintable(where, "nested too deeply to follow") from None
    return _digest(form)


def _digest(form) -> str:
    return hashlib.blake2b(
        json.dumps(form, separators=(",", ":")).encode(), digest_size=16
    ).hexdigest()


# ---- what counts as installed code
# ------------------------------------------------------------------------
_INSTALLED = tuple(
    {
        os.path.realpath(p) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)


@functools.lru_cache(maxsize=4096)
def _installed(module: str) -> bool:
    """Code of the standard library, an installed package or prealign (named by version, not
    read)."""
    top = module.partition(".")[0]
    if top in ("prealign", "builtins") or top in sys.builtin_module_names:
        return True
    mod = sys.modules.get(module) or sys.modules.get(top)
    path = getattr(mod, "__file__", None)
    if path is None:  # __main__ of `python -c`, an unknown module: read as the user's code
        return False
    return os.path.realpath(path).startswith(_INSTALLED)


def _version(module: str) -> str:
    top = module.partition(".")[0]
    version = getattr(sys.modules.get(top), "__version__", None)
    return str(version) if version is not None else sys.version.split()[0]


def _c_type(cls: type) -> bool:
    """A class with state Python cannot see: defined in C (not a heap type, or in an extension
    module)."""
    if (
        not cls.__flags__ & (1 << 9) or cls.__module__ in sys.builtin_module_names
    ):  # (Py_TPFLAGS_HEAPTYPE)
        return True
    path = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    return path.endswith((".so", ".pyd", ".dll"))


_VALUE_BASES = (
    object,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    tuple,
    list,
    dict,
    set,
    frozenset,
    BaseException,
)
_HANDLES = (
    io.IOBase,
    socket.socket,
    types.GeneratorType,
    types.CoroutineType,
    types.AsyncGeneratorType,
    types.FrameType,
    types.TracebackType,
)
_CLASS_SKIP = {
    "__module__",
    "__qualname__",
    "__doc__",
    "__dict__",
    "__weakref__",
    "__slotnames__",
    "__firstlineno__",
    "__static_attributes__",
    "__annotations__",
    "__abstractmethods__",
    "__orig_bases__",
    "__parameters__",
}


class _Canon:
    """One canonicalisation: ``value(obj)`` is JSON-able and the same in every process. Compound
    objects (functions, classes, instances, containers) are reduced to a digest; one on the path
    being followed is a cycle (named by its distance up the path); one done already, whose form
    named nothing above it, is reused."""

    def __init__(self):
        self.path: dict[int, int] = {}
        self.done: dict[int, tuple[object, str]] = {}
        self.low = sys.maxsize

    def value(self, obj, where: str):
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        kind = type(obj)
        if kind is int:
            return ["int", str(obj)]
        if kind is float:
            return ["float", obj.hex()]
        if kind is complex:
            return ["complex", obj.real.hex(), obj.imag.hex()]
        if kind in (bytes, bytearray):
            return [kind.__name__, hashlib.blake2b(obj, digest_size=16).hexdigest()]
        if obj is Ellipsis or obj is NotImplemented:
            return ["const", repr(obj)]
        if kind in (range, slice):
            return [
                kind.__name__,
                self.value(obj.start, where),
                self.value(obj.stop, where),
                self.value(obj.step, where),
            ]
        if isinstance(obj, types.ModuleType):
            return ["module", obj.__name__]
        if isinstance(obj, types.CodeType):
            return self._code(obj, where)
        if isinstance(
            obj,
            (
                types.BuiltinFunctionType,
                types.WrapperDescriptorType,
                types.MethodDescriptorType,
                types.MethodWrapperType,
                types.GetSetDescriptorType,
                types.MemberDescriptorType,
                types.ClassMethodDescriptorType,
            ),
        ):
            owner = getattr(obj, "__self__", None)
            if owner is None or isinstance(owner, (types.ModuleType, type)):
                return [
                    "builtin",
                    getattr(obj, "__module__", None) or "",
                    getattr(obj, "__qualname__", repr(obj)),
                    None if owner is None else self.value(owner, where),
                ]
            return ["bound builtin", obj.__qualname__, self.value(owner, f"{where}.__self__")]
        if isinstance(obj, np.dtype):
            return ["dtype", str(obj.descr)]
        if isinstance(obj, np.generic):
            return ["numpy", obj.dtype.str, obj.tobytes().hex()]
        if isinstance(obj, _HANDLES):
            raise Unfingerprintable(
                where, f"a {qualified_name(obj)} (a handle, with no stable form)"
            )
        key = id(obj)
        if key in self.done:
            return self.done[key][1]
        if key in self.path:
            self.low = min(self.low, self.path[key])
            return ["cycle", len(self.path) - self.path[key]]
        depth = self.path[key] = len(self.path)
        outer, self.low = self.low, sys.maxsize
        try:
            form = _digest(self._compound(obj, where))
        finally:
            del self.path[key]
            low, self.low = self.low, outer
        if low >= depth:  # named nothing above it: the same wherever it is met
            self.done[key] = (obj, form)
        else:
            self.low = min(self.low, low)
        return form

    def _compound(self, obj, where: str):
        kind = type(obj)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                return [
                    "ndarray",
                    "O",
                    list(obj.shape),
                    [self.value(v, f"{where}[...]") for v in obj.ravel()],
                ]
            data = np.ascontiguousarray(obj).view(np.uint8).tobytes() if obj.size else b""
            return [
                "ndarray",
                str(obj.dtype.descr),
                list(obj.shape),
                hashlib.blake2b(data).hexdigest(),
            ]
        if kind.__module__.partition(".")[0] == "torch":
            return self._torch(obj, where)
        if isinstance(obj, type):
            return self._class(obj, where)
        if isinstance(obj, types.FunctionType):
            return self._function(obj, where)
        if isinstance(obj, types.MethodType):
            return [
                "method",
                self.value(obj.__func__, where),
                self.value(obj.__self__, f"{where}.__self__"),
            ]
        if isinstance(obj, (staticmethod, classmethod)):
            return [kind.__name__, self.value(obj.__func__, where)]
        if isinstance(obj, property):
            return ["property", *(self.value(f, where) for f in (obj.fget, obj.fset, obj.fdel))]
        if isinstance(obj, functools.partial):
            return [
                "partial",
                self.value(obj.func, where),
                self.value(obj.args, where),
                self.value(obj.keywords, where),
            ]
        if isinstance(obj, enum.Enum):
            return ["enum", self.value(kind, where), obj.name]
        if callable(getattr(kind, "identity_fields", None)):
            return ["fields", self.value(kind, where), sorted(identity_fields(obj).items())]
        if _tokenizer(obj):
            return ["tokenizer", qualified_name(obj), tokenizer_definition(obj)]
        if isinstance(obj, types.MappingProxyType):
            obj, kind = dict(obj), dict
        if isinstance(
            obj, (list, tuple, dict, set, frozenset)
        ):  # (and their subclasses' own attributes)
            extra = self.value(vars(obj), f"{where}.__dict__") if hasattr(obj, "__dict__") else None
        else:
            extra = self._state(obj, where)
        head = [self.value(kind, where), extra]
        if isinstance(obj, (list, tuple)):
            return ["seq", head, [self.value(v, f"{where}[{i}]") for i, v in enumerate(obj)]]
        if isinstance(obj, dict):
            items = [
                (self.value(k, f"{where} key"), self.value(v, f"{where}[{k!r}]"))
                for k, v in obj.items()
            ]
            return [
                "dict",
                head,
                self.value(getattr(obj, "default_factory", None), where),
                sorted(items, key=lambda kv: json.dumps(kv[0])),
            ]
        if isinstance(obj, (set, frozenset)):
            return [
                "set",
                head,
                sorted((self.value(v, f"{where} item") for v in obj), key=json.dumps),
            ]
        return ["object", head]

    def _state(self, obj, where: str):
        kind = type(obj)
        hidden = [c for c in kind.__mro__ if c not in _VALUE_BASES and _c_type(c)]
        if hidden:  # its C part's state, as pickling would take it (and refuses when it cannot)
            return self._reduced(obj, where)
        if any("__getstate__" in vars(c) for c in kind.__mro__ if c is not object):
            return self.value(obj.__getstate__(), f"{where}.__getstate__()")
        slots = {}
        for c in kind.__mro__:
            for name in (
                [vars(c)["__slots__"]]
                if isinstance(vars(c).get("__slots__"), str)
                else vars(c).get("__slots__", ())
            ):
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    slots[name] = getattr(obj, name)
        own = getattr(obj, "__dict__", None)
        return [
            self.value(own, f"{where}.__dict__") if own is not None else None,
            self.value(slots, where) if slots else None,
        ]

    def _reduced(self, obj, where: str):
        try:
            parts = obj.__reduce_ex__(4)
        except (
            Exception
        ) as exc:  # (TypeError "cannot pickle", and whatever a type's __reduce__ raises)
            raise Unfingerprintable(
                where, f"a {qualified_name(obj)}, with no stable form ({type(exc).__name__}: {exc})"
            ) from None
        if isinstance(parts, str):  # a module-level singleton
            return ["global", qualified_name(obj), parts]
        parts = [list(p) if i >= 3 and p is not None else p for i, p in enumerate(parts)]
        return ["reduce", [self.value(p, f"{where} (reduced)") for p in parts]]

    def _torch(self, obj, where: str):
        import torch

        if isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return ["tensor", str(obj.dtype), list(obj.shape), hashlib.blake2b(data).hexdigest()]
        if isinstance(obj, (torch.dtype, torch.device)):
            return ["torch", str(obj)]
        if isinstance(obj, type):
            return self._class(obj, where)
        return ["object", [self.value(type(obj), where), self._state(obj, where)]]

    def _class(self, cls: type, where: str):
        if _installed(cls.__module__):
            return ["installed", cls.__module__, cls.__qualname__, _version(cls.__module__)]
        if _c_type(cls):
            raise Unfingerprintable(where, f"the class {qualified_name(cls)}, defined in C")
        body = [
            (name, self.value(v, f"{cls.__qualname__}.{name}"))
            for name, v in sorted(vars(cls).items())
            if name not in _CLASS_SKIP and not name.startswith("_abc_")
        ]
        return [
            "class",
            cls.__module__,
            cls.__qualname__,
            [self.value(b, where) for b in cls.__bases__],
            body,
        ]

    def _function(self, fn: types.FunctionType, where: str):
        module = fn.__module__ or ""
        if _installed(module):
            return ["installed", module, fn.__qualname__, _version(module)]
        here = f"{fn.__qualname__}"
        names = sorted(_names(fn.__code__))
        reads = []
        for name in names:
            if name not in fn.__globals__:
                continue
            value = fn.__globals__[name]
            if isinstance(value, types.ModuleType) and not _installed(value.__name__):
                attrs = [
                    (a, self.value(getattr(value, a), f"{value.__name__}.{a}"))
                    for a in names
                    if hasattr(value, a)
                ]
                reads.append((name, ["module", value.__name__, attrs]))
            else:
                reads.append((name, self.value(value, f"{here}: global {name}")))
        cells = []
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:
                cells.append(["empty cell"])
                continue
            cells.append(self.value(contents, f"{here}: closure {fn.__code__.co_freevars[i]}"))
        return [
            "function",
            module,
            fn.__qualname__,
            self._code(fn.__code__, here),
            self.value(fn.__defaults__, f"{here}: defaults"),
            self.value(fn.__kwdefaults__, f"{here}: keyword defaults"),
            cells,
            reads,
        ]

    def _code(self, code: types.CodeType, where: str):
        return [
            "code",
            code.co_name,
            code.co_argcount,
            code.co_posonlyargcount,
            code.co_kwonlyargcount,
            code.co_flags,
            code.co_code.hex(),
            getattr(code, "co_exceptiontable", b"").hex(),
            [self.value(c, where) for c in code.co_consts],
            list(code.co_names),
            list(code.co_varnames),
            list(code.co_freevars),
            list(code.co_cellvars),
        ]


def _names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it look up (globals, attributes)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _tokenizer(obj) -> bool:
    """A Hugging Face tokenizer (or a ``tokenizers.Tokenizer``): identified by its whole
    definition."""
    mro = type(obj).__mro__
    return (
        any(c.__name__ == "PreTrainedTokenizerBase" for c in mro)
        or type(obj).__module__.partition(".")[0] == "tokenizers"
    )


# ---- tokenizers
# ------------------------------------------------------------------------------------------
def tokenizer_definition(tok) -> str:
    """16 hex digits of everything that decides how ``tok`` (a chat tokenizer, or the Hugging Face
    tokenizer it wraps) encodes: a fast tokenizer's whole definition
    (``backend_tokenizer.to_str()``: normalizer, pre-tokenizer, model with its vocabulary and
    merges, post-processor), a slow one's state (its SentencePiece model, vocabulary and BPE ranks),
    and either's added and special tokens and chat template. Two tokenizers that differ in any of it
    (merges, a pre-tokenizer rule) get two keys. Computed once per
    tokenizer object (a real tokenizer's definition is megabytes of JSON; the key is asked for every
    shard)."""
    inner = getattr(tok, "tokenizer", tok)
    for known, digest in _DEFINITIONS:
        if known is inner:
            return digest
    digest = _definition_digest(inner)
    _DEFINITIONS[:] = [(inner, digest), *_DEFINITIONS[:3]]
    return digest


_DEFINITIONS: list[tuple[object, str]] = []
"""The last few tokenizers asked about and their :func:`tokenizer_definition` (held, so identity
stays valid)."""


def _definition_digest(inner) -> str:
    parts: dict = {"class": qualified_name(inner)}
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is None and callable(getattr(inner, "to_str", None)) and _tokenizer(inner):
        backend = inner  # a tokenizers.Tokenizer itself
    if backend is not None:
        parts["definition"] = backend.to_str()
    else:
        sp = getattr(inner, "sp_model", None)
        if sp is not None and callable(getattr(sp, "serialized_model_proto", None)):
            parts["sentencepiece"] = hashlib.sha256(sp.serialized_model_proto()).hexdigest()
        if callable(getattr(inner, "get_vocab", None)):
            parts["vocab"] = sorted(inner.get_vocab().items())
        ranks = getattr(inner, "bpe_ranks", None)
        if isinstance(ranks, dict):
            parts["merges"] = sorted((" ".join(map(str, k)), v) for k, v in ranks.items())
        if (
            len(parts) == 1
        ):  # no Hugging Face tokenizer: its plain settings (never an object's address)
            parts["object"] = [
                (k, repr(v))
                for k, v in sorted(getattr(inner, "__dict__", {}).items())
                if " at 0x" not in repr(v)
            ]
    added = getattr(inner, "added_tokens_decoder", None)
    if isinstance(added, dict):
        parts["added"] = sorted((int(i), str(t)) for i, t in added.items())
    parts["special"] = sorted(map(str, getattr(inner, "all_special_tokens", ())))
    parts["chat_template"] = getattr(inner, "chat_template", None)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
