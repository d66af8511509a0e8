"""The task seam: what the engine needs from a model and its data, and how a config names one.

A task is built by a factory, ``factory(cfg, task_args) -> Task``, named by the
config's ``task``: a built-in name (:data:`BUILTIN`), ``package.module:factory``
or ``path/to/file.py:factory``.  The engine (agents, checkpoints, resharding,
the exact data position) knows nothing else about the model or the data: it
shards what :meth:`Task.init` returns by its logical axes, differentiates
:meth:`Task.loss`, and serves :attr:`TaskData.train` example by example, the
element index being the data position.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

    from training.config import Config

Batch = Mapping[str, Any]  # field -> array with the batch as its leading axis
Metrics = dict[str, "jax.Array"]  # name -> scalar array

BUILTIN: dict[str, str] = {"lm": "training.tasks.lm:make_task", "maxtext": "training.tasks.maxtext:make_task"}


_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("rtrain_task_mesh", default=None)


def current_mesh() -> Mesh | None:
    """The mesh the engine traces the task's code on (None outside the trainer: host validation, one device).

    For a task whose model needs the concrete mesh (a ``shard_map``, or a model built for a mesh): JAX hands
    traced code only the abstract one.
    """
    return _MESH.get()


@contextlib.contextmanager
def on_mesh(mesh: Mesh) -> Iterator[None]:
    """The trainer's context for tracing a task on ``mesh`` (what :func:`current_mesh` returns within)."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


class TaskError(ValueError):
    """A task that cannot be found, imported or built, with a message that names it."""


class TaskCodeError(TaskError):
    """An exception from a task's own code, in one line: the task, the method that raised and the error.

    The original exception is its ``__cause__`` (its traceback goes to the worker's log).
    """

    def __init__(self, task: str, method: str, error: BaseException) -> None:
        super().__init__(f"task {task!r}: {method} raised {type(error).__name__}: {_first_line(error)}")
        self.task, self.method = task, method


@dataclass(frozen=True)
class ExampleSpec:
    """One field of an example: its shape (without the batch axis) and dtype name."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TaskData:
    """A task's data: random-access sources (grain ``MapDataset``) whose element ``i`` is example ``i``.

    Each example is a dict of numpy arrays with the shapes of
    :meth:`Task.example_spec`.  ``fingerprint`` names the data: a checkpoint
    trained on other data is refused, or restarted at the first example.
    """

    train: Any
    validation: Any | None
    fingerprint: str


@runtime_checkable
class Task(Protocol):
    """A model, its loss and its data, as the engine trains, validates and plans it."""

    def init(self, rng: jax.Array) -> Any:
        """Parameters, boxed with logical axis names (``flax.linen.with_logical_partitioning``) where sharded.

        Called under ``jax.eval_shape`` (shapes only) and under ``jax.jit`` with
        the mesh's shardings, so it must be a pure function of ``rng``.
        """
        ...

    def loss(self, params: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, Metrics]:
        """The scalar loss of a batch to differentiate, and scalar metrics to log (``loss`` is added)."""
        ...

    def evaluate(self, params: Any, batch: Batch) -> Metrics:
        """Scalar validation metrics of a batch, ``loss`` among them (averaged over the evaluation set)."""
        ...

    def example_spec(self) -> dict[str, ExampleSpec]:
        """The fields of one example, as the data source yields them."""
        ...

    def data(self) -> TaskData:
        """The train and validation sources (opened here, once per process)."""
        ...

    def tokens_per_example(self) -> int:
        """Tokens (or other units) in one example, for throughput figures."""
        ...

    # Optional: ``logical_rules() -> tuple[(logical name, mesh axes), ...]``, the task's own axis names mapped onto
    # the mesh axes ``data``, ``fsdp`` and ``tensor``; they come before the engine's (``training.mesh``).


def load_task(cfg: Config) -> Task:
    """The task a config names, built; a :class:`TaskError` naming it when that fails."""
    name = cfg.task
    factory = _factory(name)
    try:
        task = factory(cfg, dict(cfg.task_args))
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's factory may raise anything: name it in one line
        raise TaskCodeError(name, f"its factory {getattr(factory, '__name__', '')}()", e) from e
    missing = [
        m for m in ("init", "loss", "evaluate", "example_spec", "data", "tokens_per_example") if not hasattr(task, m)
    ]
    if missing:
        raise TaskError(f"task {name!r}: its factory returned {type(task).__name__}, which lacks {', '.join(missing)}")
    return task


METHODS = ("init", "loss", "evaluate", "example_spec", "data", "tokens_per_example", "logical_rules")


class NamedTask:
    """A user's task as the engine calls it: an exception from one of its methods is a :class:`TaskCodeError`
    that names the task and the method (under ``jax.jit`` and ``jax.eval_shape`` too: they trace the call)."""

    def __init__(self, task: Task, name: str) -> None:
        self._task, self._name = task, name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._task, attr)
        if attr not in METHODS or not callable(value):
            return value
        name = self._name

        @functools.wraps(value)  # its name and signature, as JAX names and binds the programs it traces
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except TaskCodeError:
                raise
            except Exception as e:  # noqa: BLE001 - a user's method may raise anything: name it in one line
                raise TaskCodeError(name, f"its {attr}()", e) from e

        return call


def named(task: Task, name: str) -> Task:
    """``task`` (the config's ``task`` is its ``name``) whose methods' exceptions name it and the method; a
    built-in task as it is (its errors are the engine's own, e.g. a dataset's)."""
    if name in BUILTIN:
        return task
    return NamedTask(task, name)  # the same methods, by delegation (its __getattr__)


def _factory(name: str) -> Callable[[Config, dict[str, Any]], Task]:
    target = BUILTIN.get(name, name)
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise TaskError(
            f"task {name!r}: not a built-in task ({', '.join(sorted(BUILTIN))}) nor 'package.module:factory' "
            "or 'path/to/file.py:factory'"
        )
    try:
        module = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except TaskError as e:
        raise TaskError(f"task {name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - an import error of user code, named in one line
        raise TaskError(f"task {name!r}: cannot import {module_name}: {type(e).__name__}: {_first_line(e)}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"task {name!r}: {module_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def _import_file(path: str) -> Any:
    """A module from a file (its directory goes on sys.path, so its own sibling imports work)."""
    file = Path(path)
    if not file.is_file():
        raise TaskError(f"task file {path} does not exist")
    module_name = f"rtrain_task_{file.stem}_{hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise TaskError(f"task file {path} cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
