"""The `tinkerrpc serve` process runs without torch: only its engine child computes, and torch would cost
the server process ~200 MiB of its own (bench/memory.py's demo: 2.3x the in-process baseline with torch
here, 1.46x without; the goal is 1.5x).

The tinker SDK and transformers look for torch once, at import, and work without it (tinker's TensorData
takes lists, transformers' tokenizers are torch-free): `hide_torch()` makes torch absent for them.
tinker-cookbook's renderers import torch unconditionally, to name torch.Tensor in annotations and to hold
a supervised example's per-token weights (1-D tensors made with tensor, zeros, full and cat, sliced, read
back with tolist). So `hide_torch()` imports the renderers with RENDERER_TORCH standing in for torch,
then hides torch again: only the modules imported then hold it, and nothing replaces the import system.

RENDERER_TORCH computes exactly what torch would for the 1-D operations above (torch's dtypes: float32
values rounded to float32, int64, bool, and its promotion in cat). Anything else a renderer asks of it
(another function, another shape, a tensor method) loads the real torch into this process and asks it,
so a cookbook release that uses more of torch costs memory (a warning says so), never a wrong or failed
rendering.

Building a built-in model takes torch: `resolve_base_model` has a child process build one that is not
built yet."""

from __future__ import annotations

import array
import contextlib
import importlib
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from tinkerrpc_server import model_store

log = logging.getLogger("tinkerrpc.torchless")

_RENDERERS_PACKAGE = "tinker_cookbook.renderers"


class _DType:
    """A torch dtype of the values RENDERER_TORCH holds itself; the order is torch's promotion order."""

    def __init__(self, name: str, rank: int) -> None:
        self.name = name
        self.rank = rank

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __eq__(self, other: object) -> bool:
        # torch's own dtype of the same name (a tensor torch computed) is this one.
        return other is self or (not isinstance(other, _DType) and str(other) == repr(self))

    def __hash__(self) -> int:
        return hash(repr(self))


_BOOL, _INT64, _FLOAT32 = _DType("bool", 0), _DType("int64", 1), _DType("float32", 2)


def _inferred(values: Sequence[Any]) -> _DType | None:
    """torch.tensor's dtype for a flat list of Python numbers (float32 for floats and for none at all),
    or None when they are not all numbers."""
    if any(not isinstance(v, (bool, int, float)) for v in values):
        return None
    if values and all(isinstance(v, bool) for v in values):
        return _BOOL
    return _INT64 if values and all(isinstance(v, int) for v in values) else _FLOAT32


_real_torch: ModuleType | None = None
_loading = threading.Lock()


def _torch(reason: str) -> ModuleType:
    """The real torch, loaded into this process the first time a renderer needs it."""
    global _real_torch
    with _loading:
        if _real_torch is None:
            log.warning(
                "tinker-cookbook's renderers use torch beyond what this process computes without it (%s): "
                "loading torch, about 200 MiB more for `tinkerrpc serve`",
                reason,
            )
            if "torch" in sys.modules and sys.modules["torch"] in (None, RENDERER_TORCH):
                del sys.modules["torch"]
            _real_torch = importlib.import_module("torch")
        return _real_torch


def _as_real(value: Any) -> Any:
    """`value` with every RENDERER_TORCH tensor and dtype in it (lists, tuples, dicts) torch's own."""
    if type(value) is RendererTensor:
        return value.real()
    if isinstance(value, _DType):
        return getattr(_torch(f"dtype {value}"), value.name)
    if isinstance(value, (list, tuple)):
        return type(value)(_as_real(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_real(v) for k, v in value.items()}
    return value


def _ask_torch(name: str, *args: Any, **kwargs: Any) -> Any:
    real = _torch(f"torch.{name}")
    return getattr(real, name)(*_as_real(args), **_as_real(kwargs))


class _Storage:
    """The numbers of a tensor and of its slices (views, as in torch): held here, as torch stores them
    (float32 rounded), until torch is asked about any of them; then torch's tensor holds them."""

    def __init__(self, values: Sequence[Any], dtype: _DType) -> None:
        self.dtype = dtype
        self.values: Sequence[Any] = (
            array.array("f", values)
            if dtype is _FLOAT32
            else array.array("q", values)
            if dtype is _INT64
            else [bool(v) for v in values]
        )
        self.real: Any = None

    def make_real(self) -> Any:
        if self.real is None:
            torch = _torch("a tensor operation")
            self.real = torch.tensor(list(self.values), dtype=getattr(torch, self.dtype.name))
            self.values = ()
        return self.real


class _TensorType(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        # A tensor torch made, once it is loaded, is a torch.Tensor to the renderers too.
        return type.__instancecheck__(cls, instance) or (
            _real_torch is not None and isinstance(instance, _real_torch.Tensor)
        )


class RendererTensor(metaclass=_TensorType):
    """A 1-D tensor: its length, dtype, slices (views) and tolist() answered here; anything else by
    torch, on torch's tensor of the same storage from then on (so later views and in-place changes are
    torch's too)."""

    __slots__ = ("_positions", "_storage")

    def __init__(self, storage: _Storage, positions: range | None = None) -> None:
        self._storage = storage
        self._positions = range(len(storage.values)) if positions is None else positions

    @classmethod
    def of(cls, values: Sequence[Any], dtype: _DType) -> RendererTensor:
        return cls(_Storage(values, dtype))

    @property
    def native(self) -> bool:
        """Whether torch has not been asked about this tensor's storage yet."""
        return self._storage.real is None

    @property
    def dtype(self) -> Any:
        return self._storage.dtype if self.native else self.real().dtype

    def real(self) -> Any:
        """torch's tensor of these numbers: a view of its storage's, as this tensor is of its storage."""
        positions = self._positions
        return self._storage.make_real()[positions.start : positions.stop : positions.step]

    def tolist(self) -> list[Any]:
        if not self.native:
            return list(self.real().tolist())
        values = self._storage.values
        return [values[i] for i in self._positions]

    def __len__(self) -> int:
        return len(self._positions)

    def __getitem__(self, index: Any) -> Any:
        if self.native and isinstance(index, slice) and (index.step is None or index.step > 0):
            return RendererTensor(self._storage, self._positions[index])
        return self.real()[_as_real(index)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)

    def __repr__(self) -> str:
        return f"tensor({self.tolist()}, dtype={self.dtype})" if self.native else repr(self.real())

    __hash__ = object.__hash__


def _by_torch(name: str, in_place: bool = False) -> Callable[..., Any]:
    def method(self: RendererTensor, *args: Any) -> Any:
        result = getattr(self.real(), name)(*_as_real(args))
        # An in-place operator changed the storage this tensor views: the tensor is its result.
        return self if in_place else result

    method.__name__ = name
    return method


# Operators are looked up on the type, not through __getattr__: each is torch's.
_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")
for _operator in (
    *(f"__{op}__" for op in _ARITHMETIC),
    *(f"__r{op}__" for op in _ARITHMETIC),
    *("__invert__", "__neg__", "__pos__", "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__"),
    *("__ge__", "__iter__", "__contains__", "__bool__", "__float__", "__int__", "__index__", "__setitem__"),
):
    setattr(RendererTensor, _operator, _by_torch(_operator))
for _operator in (f"__i{op}__" for op in _ARITHMETIC):
    setattr(RendererTensor, _operator, _by_torch(_operator, in_place=True))


def _native_dtype(values: Sequence[Any], dtype: Any, options: dict[str, Any]) -> _DType | None:
    """The dtype of a tensor of these Python numbers, when it is one RENDERER_TORCH makes itself (no
    other options, and the values stored plainly: no float made an int, no number made a bool)."""
    inferred = _inferred(values)
    if options or inferred is None or not (dtype is None or isinstance(dtype, _DType)):
        return None
    if dtype is None:
        return inferred
    return dtype if not values or inferred.rank <= dtype.rank else None


def _length(shape: Any) -> int | None:
    """n for a 1-D shape (n,), else None."""
    if isinstance(shape, (list, tuple)) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:
        return shape[0]
    return None


def _tensor(data: Any, dtype: Any = None, **options: Any) -> Any:
    native = _native_dtype(data, dtype, options) if isinstance(data, (list, tuple)) else None
    if native is None:
        return _ask_torch("tensor", data, dtype=dtype, **options)
    return RendererTensor.of(data, native)


def _zeros(*size: Any, dtype: Any = None, **options: Any) -> Any:
    length = _length(size[0] if len(size) == 1 and isinstance(size[0], (list, tuple)) else size)
    native = _native_dtype([False], _FLOAT32 if dtype is None else dtype, options)
    if length is None or native is None:
        return _ask_torch("zeros", *size, dtype=dtype, **options)
    return RendererTensor.of([0] * length, native)


def _full(size: Any, fill_value: Any, dtype: Any = None, **options: Any) -> Any:
    length = _length(size)
    native = _native_dtype([fill_value], dtype, options)
    if length is None or native is None:
        return _ask_torch("full", size, fill_value, dtype=dtype, **options)
    return RendererTensor.of([fill_value] * length, native)


def _cat(tensors: Sequence[Any], dim: int = 0, **options: Any) -> Any:
    parts = list(tensors)
    if (
        not parts
        or options
        or dim not in (0, -1)
        or any(type(p) is not RendererTensor or not p.native for p in parts)
    ):
        return _ask_torch("cat", parts, dim, **options)
    dtype = max((p.dtype for p in parts), key=lambda d: d.rank)
    return RendererTensor.of([v for p in parts for v in p.tolist()], dtype)


def _installed_torch_version() -> str:
    # What the real torch would say (a renderer may check it); the engine's torch is installed here too.
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "0.0"


class _RendererTorch(ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system's and pickle's questions: this is no package
            raise AttributeError(name)
        found = getattr(_torch(f"torch.{name}"), name)
        if not callable(found) or isinstance(found, type):
            return found
        return lambda *args, **kwargs: found(*_as_real(args), **_as_real(kwargs))


RENDERER_TORCH = _RendererTorch(
    f"{__name__}.renderer_torch", "What tinker-cookbook's renderers get for torch."
)
vars(RENDERER_TORCH).update(
    Tensor=RendererTensor,
    tensor=_tensor,
    zeros=_zeros,
    full=_full,
    cat=_cat,
    bool=_BOOL,
    int64=_INT64,
    float32=_FLOAT32,
    __version__=_installed_torch_version(),
)


def torch_hidden() -> bool:
    return "torch" in sys.modules and sys.modules["torch"] is None


def hide_torch() -> None:
    """Make this process one without torch: first thing in the process, before the service's imports."""
    if sys.modules.get("torch") is not None:
        raise RuntimeError("torch is already loaded: hide_torch() must come before the service's imports")
    # A None entry makes `import torch` raise ModuleNotFoundError and importlib.util.find_spec("torch")
    # answer None, which is how tinker and transformers ask: they are imported now, with torch hidden.
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers advises installing torch when it finds none; here that is intended.
    logging.getLogger("transformers").addFilter(
        lambda record: not record.getMessage().startswith("PyTorch was not found")
    )
    import tinker  # noqa: F401
    import transformers  # noqa: F401

    with renderer_imports():
        importlib.import_module(_RENDERERS_PACKAGE)


@contextlib.contextmanager
def renderer_imports() -> Iterator[None]:
    """Where tinker-cookbook's renderers are made (get_renderer imports a renderer's module on first
    use): in a process without torch, a module imported meanwhile gets RENDERER_TORCH for torch."""
    if not torch_hidden():
        yield
        return
    sys.modules["torch"] = RENDERER_TORCH
    try:
        yield
    finally:
        if sys.modules.get("torch") is RENDERER_TORCH:  # else a renderer had this process load torch
            sys.modules["torch"] = None  # type: ignore[assignment]


# The child that builds a built-in model for a process without torch.
_BUILD_IN_CHILD = (
    "import sys, pathlib; from tinkerrpc_server.model_store import resolve_base_model; "
    "resolve_base_model(sys.argv[1], pathlib.Path(sys.argv[2]))"
)


def resolve_base_model(name: str, model_dir: Path) -> Path:
    """model_store.resolve_base_model; without torch here, a child process builds a built-in model that
    is not built yet (a concurrent build elsewhere is safe: the build renames a finished directory)."""
    unbuilt = name in model_store.TINY_MODEL_SHAPES and not (model_dir / name / "config.json").is_file()
    if unbuilt and torch_hidden():
        subprocess.run([sys.executable, "-c", _BUILD_IN_CHILD, name, str(model_dir)], check=True)
    return model_store.resolve_base_model(name, model_dir)
