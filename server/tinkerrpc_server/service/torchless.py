"""The `tinkerrpc serve` process runs without torch: only its engine child computes, and torch would
cost the server process hundreds of MiB for nothing.

The tinker SDK and transformers import torch only when they find it and work without it (tinker's
TensorData takes lists and numpy arrays, transformers' tokenizers are torch-free), so `hide_torch()`
makes torch absent for them. tinker-cookbook's renderers import it unconditionally, only to hold a
supervised example's per-token weights (torch.tensor, cat, zeros and full of 1-D numbers) and to name
torch.Tensor in annotations: their `import torch` gets `RENDERER_TORCH`, those calls over numpy arrays
in torch's default dtypes (float32 for floats, int64 for ints), so the weights are the same numbers.

Building a built-in model takes torch: `resolve_base_model` has a child process build one that is not
built yet."""

from __future__ import annotations

import builtins
import logging
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from tinkerrpc_server import model_store

_RENDERERS_PACKAGE = "tinker_cookbook.renderers"


def _tensor(data: Any, dtype: npt.DTypeLike | None = None) -> npt.NDArray[Any]:
    array = np.asarray(data, dtype=dtype)
    # torch.tensor makes Python floats (and an empty list) float32, numpy float64.
    return array.astype(np.float32) if dtype is None and array.dtype.kind == "f" else array


def _zeros(*size: Any, dtype: npt.DTypeLike | None = None) -> npt.NDArray[Any]:
    shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
    return np.zeros(shape, dtype=np.float32 if dtype is None else dtype)


def _full(size: Sequence[int], fill_value: float, dtype: npt.DTypeLike | None = None) -> npt.NDArray[Any]:
    return np.full(size, fill_value, dtype=_tensor([fill_value]).dtype if dtype is None else dtype)


def _cat(tensors: Iterable[npt.NDArray[Any]], dim: int = 0) -> npt.NDArray[Any]:
    parts = list(tensors)
    joined = np.concatenate(parts, axis=dim)
    # torch joins ints with float32 as float32, numpy as float64.
    floats = [part.dtype for part in parts if part.dtype.kind == "f"]
    return joined.astype(np.result_type(*floats)) if floats else joined


def _installed_torch_version() -> str:
    # What the real torch would say (a renderer may check it); the engine's torch is installed here too.
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "0.0"


RENDERER_TORCH = ModuleType(f"{__name__}.renderer_torch", "What the cookbook's renderers get for torch.")
vars(RENDERER_TORCH).update(
    Tensor=np.ndarray,
    tensor=_tensor,
    cat=_cat,
    zeros=_zeros,
    full=_full,
    float32=np.float32,
    int64=np.int64,
    __version__=_installed_torch_version(),
)

_builtin_import = builtins.__import__


def _import(
    name: str,
    globals: Mapping[str, object] | None = None,
    locals: Mapping[str, object] | None = None,
    fromlist: Sequence[str] | None = (),
    level: int = 0,
) -> ModuleType:
    """`import`, with the cookbook's renderers given RENDERER_TORCH for torch."""
    if name == "torch" and level == 0 and globals is not None:
        importer = str(globals.get("__name__", ""))
        if importer.startswith(f"{_RENDERERS_PACKAGE}.") or importer == _RENDERERS_PACKAGE:
            return RENDERER_TORCH
    return _builtin_import(name, globals, locals, fromlist, level)


def torch_hidden() -> bool:
    return "torch" in sys.modules and sys.modules["torch"] is None


def hide_torch() -> None:
    """Make this process one without torch: first thing in the process, before the service imports."""
    if sys.modules.get("torch") is not None:
        raise RuntimeError("torch is already loaded: hide_torch() must come before the service's imports")
    # A None entry makes `import torch` raise ModuleNotFoundError and importlib.util.find_spec("torch")
    # answer None, which is how tinker and transformers ask.
    sys.modules["torch"] = None  # type: ignore[assignment]
    builtins.__import__ = _import
    # transformers advises installing torch when it finds none; here that is intended.
    logging.getLogger("transformers").addFilter(
        lambda record: not record.getMessage().startswith("PyTorch was not found")
    )


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
