"""A user's own task through the engine: the example in examples/regression, and the errors a bad task gives.

Fast: what ``training.tasks.load_task`` says about a task that cannot be found, imported or built (one
line, naming the task), the example's data and parameters, and ``rtrain train`` refusing a bad task
before anything starts.  Slow: the example trains on 2 hosts, loses one, finishes on the exact examples
the pipeline defines, and its checkpoint is validated with the task's own metrics; and the README's
"Train your own model" commands run as written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest

from training.config import Config, load_config
from training.tasks import TaskError, load_task

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/regression/task.py:make_task"
RTRAIN = str(Path(sys.executable).parent / "rtrain")


def config(task: str, task_args: dict[str, Any] | None = None, base: Path = REPO, **overrides: Any) -> Config:
    return load_config("tiny", None, {"task": task, "task_args": task_args or {}, **overrides}, base_dir=base)


def user_file(tmp_path: Path, name: str, body: str) -> Path:
    """A task file of its own name: modules loaded from files are cached by their stem."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def refused(cfg: Config) -> str:
    with pytest.raises(TaskError) as e:
        load_task(cfg)
    message = str(e.value)
    # One line that names the task: its module or file at least (a missing file is named alone).
    assert "\n" not in message and cfg.task.rpartition(":")[0] in message, message
    return message


# --- what a bad task says ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_args", "says"),
    [
        ({"hiden": 32}, "task_args: unknown key 'hiden'"),
        ({"hidden": "wide"}, "task_args.hidden: expected int, got str"),
        ({"noise": True}, "task_args.noise: expected float, got bool"),
        ({"features": 0}, "task_args.features: must be >= 1"),
    ],
)
def test_bad_task_args_are_named_in_one_line(task_args: dict[str, Any], says: str) -> None:
    message = refused(config(EXAMPLE, task_args))
    assert says in message and "its factory make_task() raised ValueError" in message, message


def test_an_unknown_task_name_is_refused() -> None:
    message = refused(config("regression"))
    assert "not a built-in task (lm, maxtext)" in message and "package.module:factory" in message, message
    assert "cannot import nonexistent.mod" in refused(config("nonexistent.mod:make_task"))


def test_a_task_file_that_is_missing_or_does_not_import_is_named(tmp_path: Path) -> None:
    assert f"{tmp_path / 'missing_task.py'} does not exist" in refused(
        config("missing_task.py:make_task", base=tmp_path)
    )
    user_file(tmp_path, "broken_import", "import no_such_package_here\n")
    message = refused(config("broken_import.py:make_task", base=tmp_path))
    assert "cannot import" in message and "ModuleNotFoundError: No module named 'no_such_package_here'" in message
    user_file(tmp_path, "broken_syntax", "def make_task(cfg, args)\n    return None\n")
    assert "SyntaxError" in refused(config("broken_syntax.py:make_task", base=tmp_path))


def test_a_factory_that_raises_or_is_missing_or_returns_no_task_is_named(tmp_path: Path) -> None:
    user_file(
        tmp_path,
        "raising_task",
        """
        def make_task(cfg, args):
            raise RuntimeError("no GPU in this cupboard\\nsecond line")

        def make_nothing(cfg, args):
            return object()
        """,
    )
    message = refused(config("raising_task.py:make_task", base=tmp_path))
    assert message.endswith("its factory make_task() raised RuntimeError: no GPU in this cupboard"), message
    assert "has no callable 'make_other'" in refused(config("raising_task.py:make_other", base=tmp_path))
    assert "which lacks init, loss" in refused(config("raising_task.py:make_nothing", base=tmp_path))


def test_rtrain_train_refuses_a_bad_task_before_anything_starts(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for task, says in (
        ("nonexistent.mod:f", "cannot import nonexistent.mod"),
        (EXAMPLE, "unknown key 'hiden'"),
    ):
        r = subprocess.run(
            [RTRAIN, "train", "--preset", "tiny", f"task={task}", "task_args={hiden: 3}", f"root={root}", "run_name=x"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
        [line] = r.stderr.strip().splitlines()
        assert line.startswith("rtrain: error: task ") and says in line, line
        assert not root.exists() or not any(root.iterdir()), "nothing was written"


# --- what a task's own code raising says -------------------------------------------------------------------

JAX_TASK = "tests/training/jax_task.py:make_task"  # a task that uses JAX everywhere; ``fail`` breaks one stage


@pytest.mark.parametrize(
    ("stage", "method"),
    [("factory", "its factory make_task()"), ("data", "its data()"), ("init", "its init()"), ("loss", "its loss()")],
)
def test_an_error_in_the_task_s_code_is_one_line_naming_the_task_the_method_and_the_error(
    monkeypatch: pytest.MonkeyPatch, stage: str, method: str
) -> None:
    """As a worker meets it: building the task and its data, its parameters' shapes, its step's tracing."""
    from training.elastic.codes import WorkerExit
    from training.elastic.worker.main import error_line
    from training.elastic.worker.taskbuild import build
    from training.mesh import build_mesh, plan_mesh
    from training.trainer import Trainer

    cfg = config(JAX_TASK, {"fail": stage}, devices_per_worker=1)
    monkeypatch.setenv("RTRAIN_HOST", "h0")  # it breaks in a job's worker only
    with pytest.raises(TaskError) as e:
        trainer = Trainer(
            cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 1)), build(cfg).task
        )  # init: under jax.eval_shape
        trainer.lower()  # loss: traced under jax.jit and jax.value_and_grad
    code, line = error_line(e.value)
    assert code == WorkerExit.TASK
    assert line == f"task {cfg.task!r}: {method} raised RuntimeError: {stage} is broken on purpose", line
    # The user's own exception, with its traceback, is the cause: what the worker's log shows.
    cause = e.value.__cause__
    assert isinstance(cause, RuntimeError) and "second line" in str(cause)
    assert any(f.f_code.co_filename.endswith("jax_task.py") for f, _ in traceback.walk_tb(cause.__traceback__))


def test_an_engine_error_and_a_dataset_s_stay_the_engine_s_own() -> None:
    from training.data.errors import DatasetError
    from training.elastic.codes import WorkerExit
    from training.elastic.worker.main import error_line

    assert error_line(DatasetError("shard 3: sha256 does not match")) == (
        WorkerExit.ERROR,
        "dataset: shard 3: sha256 does not match",
    )
    assert error_line(OSError("gone\nmore")) == (WorkerExit.ERROR, "OSError: gone")


# --- the example -------------------------------------------------------------------------------------


def test_the_example_s_data_is_a_pure_function_of_its_args_and_the_index() -> None:
    import numpy as np

    task = load_task(config(EXAMPLE, {"train_examples": 100, "validation_examples": 20}))
    data = task.data()
    assert len(data.train) == 100 and len(data.validation) == 20
    spec = task.example_spec()
    for i in (0, 57, 99):
        a, b = data.train[i], task.data().train[i]  # another opening, as another process would
        assert set(a) == set(spec)
        for k, s in spec.items():
            assert a[k].shape == s.shape and a[k].dtype == np.dtype(s.dtype), k
            np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(data.train[0]["x"], data.validation[0]["x"]), "the splits are different examples"
    same = load_task(config(EXAMPLE, {"train_examples": 100, "validation_examples": 20, "hidden": 8})).data()
    other = load_task(config(EXAMPLE, {"train_examples": 100, "validation_examples": 20, "seed": 1})).data()
    assert same.fingerprint == data.fingerprint, "the model's width is not the data"
    assert other.fingerprint != data.fingerprint


def test_the_example_s_parameters_carry_logical_axes() -> None:
    import flax.linen as nn
    import jax

    task = load_task(config(EXAMPLE, {"features": 8, "hidden": 16}))
    boxed = jax.eval_shape(task.init, jax.random.key(0))
    specs = nn.get_partition_spec(boxed)
    assert tuple(specs["Dense_0"]["kernel"]) == ("embed", "mlp")
    assert tuple(specs["Dense_1"]["kernel"]) == ("mlp", None)
    assert nn.unbox(boxed)["Dense_0"]["kernel"].shape == (8, 16)


# --- through the engine -------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_example_trains_through_a_lost_host_on_the_exact_examples_and_validates(
    tmp_path: Path, jax_cache: str
) -> None:
    import flax.linen as nn
    import jax
    from jobs import job_config, run_job, step_ids, worker_logs

    from training import api
    from training.checkpoint.lifecycle import evaluate
    from training.data.pipeline import batch_ids

    cfg = job_config(
        str(tmp_path),
        "",  # the built-in task's dataset: this task has its own data
        jax_cache,
        run_name="user-task",
        task=str(REPO / EXAMPLE),
        task_args={"hidden": 32, "train_examples": 1024, "validation_examples": 256},
        steps=24,
        checkpoint_every=5,
        learning_rate=1e-2,
        min_workers=1,
        max_workers=2,
        val_batch=64,
        chaos=["preempt:worker=1,step=12"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    st = api.status(cfg.run_uri)
    assert st["state"] == "finished" and st["step"] == cfg.optimizer.steps, st

    # A host was lost and the job went on on the one left, from a checkpoint.
    [failure] = api.events(cfg.run_uri, ["failure"])
    assert "lost" in failure["reason"], failure
    assert [(e["old_workers"], e["new_workers"]) for e in api.events(cfg.run_uri, ["resize"])] == [(2, 1)]
    assert api.events(cfg.run_uri, ["restore"]), "the survivor restored a checkpoint"

    # Every step took exactly the examples the pipeline defines for it: none twice, none skipped.
    task = load_task(cfg)
    source = task.data().train
    ids = step_ids(cfg.run_uri)
    assert sorted(ids) == list(range(cfg.optimizer.steps))
    for step, got in ids.items():
        want = batch_ids(source, seed=cfg.optimizer.seed, global_batch=cfg.optimizer.global_batch, batch_index=step)
        assert got == [int(i) for i in want], f"step {step}: wrong examples after the resize"

    # It learned: the training loss fell, and the held-out loss is well below the untrained model's.
    losses = {e["step"]: e["loss"] for e in api.events(cfg.run_uri, ["progress"])}
    assert losses[cfg.optimizer.steps] < 0.5 * losses[1], losses
    verdict = api.validate(cfg.run_uri)
    assert verdict["step"] == cfg.optimizer.steps and verdict["verdict"] == "validated", verdict
    assert {"loss", "mae"} <= set(verdict["metrics"]), verdict
    untrained = evaluate(cfg, nn.unbox(task.init(jax.random.key(cfg.optimizer.seed))))
    assert float(verdict["metrics"]["loss"]) < 0.5 * untrained["loss"], (verdict, untrained)


@pytest.mark.slow
def test_a_task_that_uses_jax_everywhere_trains_through_a_lost_host_on_the_exact_examples(
    tmp_path: Path, jax_cache: str
) -> None:
    """Its import, factory, constructor and data() use JAX: each worker builds it once its round has joined."""
    from jobs import job_config, run_job, step_ids, worker_logs

    from training import api
    from training.data.pipeline import batch_ids

    cfg = job_config(
        str(tmp_path),
        "",
        jax_cache,
        run_name="jax-task",
        task=str(REPO / JAX_TASK),
        task_args={"examples": 512},
        steps=16,
        checkpoint_every=4,
        learning_rate=5e-2,
        min_workers=1,
        max_workers=2,
        chaos=["preempt:worker=1,step=9"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    st = api.status(cfg.run_uri)
    assert st is not None and st["state"] == "finished" and st["step"] == cfg.optimizer.steps, st
    assert [(e["old_workers"], e["new_workers"]) for e in api.events(cfg.run_uri, ("resize",))] == [(2, 1)]
    # Each worker built the task as a process of its round: both of the first, then the survivor alone.
    logs = worker_logs(cfg.run_uri)
    for seen in ("built in process 0 of 2", "built in process 1 of 2", "built in process 0 of 1"):
        assert f"jax_task: {seen}" in logs, logs
    source = load_task(cfg).data().train
    ids = step_ids(cfg.run_uri)
    assert sorted(ids) == list(range(cfg.optimizer.steps))
    for step, got in ids.items():
        want = batch_ids(source, seed=cfg.optimizer.seed, global_batch=cfg.optimizer.global_batch, batch_index=step)
        assert got == [int(i) for i in want], f"step {step}: wrong examples after the resize"
    losses = {e["step"]: e["loss"] for e in api.events(cfg.run_uri, ("progress",))}
    assert losses[cfg.optimizer.steps] < 0.5 * losses[min(losses)], losses


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "method", "hosts"),
    [
        ("factory", "its factory make_task()", 1),
        ("data", "its data()", 1),
        ("init", "its init()", 1),
        ("loss", "its loss()", 2),  # traced by process 0 alone, process 1 waiting for its program
    ],
)
def test_the_task_s_code_raising_in_a_job_ends_it_at_once_in_one_line(
    tmp_path: Path, jax_cache: str, stage: str, method: str, hosts: int
) -> None:
    """The job's reason and its failed event: the task, the method and the error; the traceback in the log."""
    from jobs import job_config, run_job, worker_logs

    from training import api

    cfg = job_config(
        str(tmp_path),
        "",
        jax_cache,
        run_name=f"broken-{stage}",
        task=str(REPO / JAX_TASK),
        task_args={"fail": stage},
        steps=4,
        min_workers=hosts,
        max_workers=hosts,
        max_failures=3,  # a budget left: the job ends anyway, as another round would fail the same way
    )
    assert run_job(cfg) != 0
    st = api.status(cfg.run_uri)
    assert st is not None and st["state"] == "failed", st
    line = f"task {cfg.task!r}: {method} raised RuntimeError: {stage} is broken on purpose"
    reason = str(st["reason"])
    assert reason.startswith(f"{line} (worker ") and " on host " in reason and "\n" not in reason, reason
    [failed] = api.events(cfg.run_uri, ("failed",))
    assert failed["reason"] == reason
    assert not api.events(cfg.run_uri, ("failure",)), "not retried"
    log = Path(reason.rsplit("traceback in ", 1)[1].rstrip(")")).read_text()
    assert "Traceback (most recent call last)" in log and "jax_task.py" in log and "second line" in log, log[-3000:]
    assert "RuntimeError" in worker_logs(cfg.run_uri)


def readme_block(heading: str) -> str:
    """The first ```bash block after a heading of the README."""
    readme = (REPO / "README.md").read_text()
    m = re.search(r"```bash\n(.*?)```", readme[readme.index(heading) :], re.S)
    assert m, f"no bash block after {heading!r}"
    return m.group(1)


@pytest.mark.slow
def test_the_readme_s_train_your_own_model_commands_run_as_written(tmp_path: Path) -> None:
    """In a directory holding only the example and the shared .venv, as a user's checkout would."""
    project = tmp_path / "project"
    shutil.copytree(REPO / "examples", project / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    (project / ".venv").symlink_to(REPO / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "RTRAIN_"))}
    commands = [c for c in readme_block("## Train your own model").replace("\\\n", " ").splitlines() if c.strip()]
    assert [c.split()[:2] for c in commands] == [[".venv/bin/rtrain", "train"], [".venv/bin/rtrain", "validate"]]
    out = []
    for cmd in commands:
        r = subprocess.run(["bash", "-c", cmd], cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
        out.append(r.stdout)
    assert re.search(r"finished: step (\d+)/\1, .*1 failure\(s\) absorbed", out[0]), out[0]
    assert re.search(r"^\s+\d+\s+validated\s", out[1], re.M), out[1]
    saved = json.loads(next((project / "var" / "runs").glob("*/config.json")).read_text())
    assert saved["task"] == f"{project / 'examples' / 'regression' / 'task.py'}:make_task"
