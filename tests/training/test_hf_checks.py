"""``init_from`` refuses bad weights when the config is resolved, from the safetensors' headers alone: a directory
that is not there, a ``.bin``-only checkpoint, a missing tensor or shard, a wrong shape or dtype, a truncated file.
Each is one line naming the file and the tensor; ``rtrain train`` exits 3 with no run directory made, and the
DAG's ``resolve_config`` fails the same way, before anything runs.

The damaged checkpoints are written with the ``safetensors`` library, not this project's writer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hf_files import PUBLISHED, tensor_shapes, write_header
from safetensors.numpy import load_file, save_file

from training import hf
from training.cli import main
from training.config import ConfigError, load_config

FIXTURE = Path(__file__).parent / "data" / "hf" / "llama3-tied"
RTRAIN = str(Path(sys.executable).parent / "rtrain")
VICTIM = "model.layers.1.mlp.up_proj.weight"  # [48, 32] in the fixture


def _tensors() -> dict[str, np.ndarray]:
    return load_file(FIXTURE / "model.safetensors")


def _rewrite(d: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _missing_tensor(d: Path) -> None:
    _rewrite(d, {k: v for k, v in _tensors().items() if k != VICTIM})


def _wrong_shape(d: Path) -> None:
    _rewrite(d, _tensors() | {VICTIM: np.ascontiguousarray(_tensors()[VICTIM].T)})


def _wrong_dtype(d: Path) -> None:
    _rewrite(d, _tensors() | {VICTIM: _tensors()[VICTIM].astype(np.int32)})


def _truncated(d: Path) -> None:
    """Cut inside the victim: it and every tensor after it lie past the end; the first one cut is named."""
    path = d / "model.safetensors"
    n = int.from_bytes(path.read_bytes()[:8], "little")
    begin, end = json.loads(path.read_bytes()[8 : 8 + n])[VICTIM]["data_offsets"]
    os.truncate(path, 8 + n + (begin + end) // 2)


def _bin_only(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a torch.save zip")


def _sharded(d: Path) -> dict[str, str]:
    """The weights in two shards with an index, as transformers shards them."""
    tensors = _tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
    shards["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    (d / "model.safetensors").unlink()
    for f, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / f, metadata={"format": "pt"})
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (d / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def _missing_shard(d: Path) -> None:
    _sharded(d)
    (d / "model-00002-of-00002.safetensors").unlink()


def _index_names_a_tensor_its_file_lacks(d: Path) -> None:
    weight_map = _sharded(d)
    weight_map[VICTIM] = next(f for f in set(weight_map.values()) if f != weight_map[VICTIM])
    (d / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _offsets_short_of_the_shape(d: Path) -> None:
    shapes = {k: ("F32", list(v.shape)) for k, v in _tensors().items()}
    write_header(d / "model.safetensors", shapes)
    raw = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header[VICTIM]["shape"] = [48, 33]  # its bytes hold [48, 32]
    body = json.dumps(header).encode()
    body += b" " * (n - len(body))
    (d / "model.safetensors").write_bytes(raw[:8] + body + raw[8 + n :])


def _nothing_there(d: Path) -> None:
    shutil.rmtree(d)


# (what is wrong, the damage, what the one line says: the file, and the tensor where one is at fault)
CASES: list[tuple[str, Callable[[Path], object], str]] = [
    ("no directory", _nothing_there, r"llama3-tied: no such directory"),
    (
        ".bin only",
        _bin_only,
        r"llama3-tied/pytorch_model\.bin: a PyTorch \.bin checkpoint; init_from reads safetensors",
    ),
    ("missing tensor", _missing_tensor, rf"llama3-tied/model\.safetensors: no tensor {VICTIM} "),
    (
        "wrong shape",
        _wrong_shape,
        rf"llama3-tied/model\.safetensors: tensor {VICTIM} has shape \[32, 48\], its config\.json's model needs "
        r"\[48, 32\]",
    ),
    ("wrong dtype", _wrong_dtype, rf"llama3-tied/model\.safetensors: tensor {VICTIM} is I32, not one of "),
    ("truncated", _truncated, rf"llama3-tied/model\.safetensors: truncated: tensor {VICTIM} \(bytes \d+ to \d+\)"),
    (
        "missing shard",
        _missing_shard,
        r"llama3-tied/model-00002-of-00002\.safetensors: missing \(named by model\.safetensors\.index\.json\)",
    ),
    (
        "index names a tensor its file lacks",
        _index_names_a_tensor_its_file_lacks,
        rf"llama3-tied/model-0000\d-of-00002\.safetensors: no tensor {VICTIM} \(model\.safetensors\.index\.json puts",
    ),
    (
        "offsets short of the shape",
        _offsets_short_of_the_shape,
        rf"llama3-tied/model\.safetensors: tensor {VICTIM}'s data_offsets \[\d+, \d+\] do not hold its shape "
        r"\[48, 33\] of F32",
    ),
]
IDS = [c[0] for c in CASES]


def _damaged(tmp_path: Path, damage: Callable[[Path], object]) -> Path:
    d = tmp_path / "llama3-tied"
    shutil.copytree(FIXTURE, d)
    damage(d)
    return d


@pytest.mark.parametrize(("what", "damage", "says"), CASES, ids=IDS)
def test_the_config_refuses_bad_weights_in_one_line_naming_the_file_and_tensor(
    what: str, damage: Callable[[Path], object], says: str, tmp_path: Path
) -> None:
    d = _damaged(tmp_path, damage)
    with pytest.raises(ConfigError, match=f"^init_from: .*{says}") as e:
        load_config(None, None, [f"model.init_from={d}"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("what", "damage", "says"), CASES, ids=IDS)
def test_rtrain_train_exits_3_before_anything_is_written(
    what: str, damage: Callable[[Path], object], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _damaged(tmp_path, damage)
    root = tmp_path / "runs"
    assert main(["train", f"model.init_from={d}", f"root={root}", "run_name=ft", "model.seq_len=32"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rtrain: error: init_from: "), err
    assert re.search(says, err), err
    assert not root.exists()  # no run directory, so no job


@pytest.mark.parametrize("case", ["missing tensor", "truncated"])
def test_the_rtrain_command_itself_exits_3_with_one_line(case: str, tmp_path: Path) -> None:
    """The installed ``rtrain`` in a process of its own: exit 3, one line on stderr, nothing under the root."""
    _, damage, says = CASES[IDS.index(case)]
    d = _damaged(tmp_path, damage)
    root = tmp_path / "runs"
    proc = subprocess.run(
        [RTRAIN, "train", f"model.init_from={d}", f"root={root}", "run_name=ft"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rtrain: ")]
    assert len(lines) == 1 and re.search(says, lines[0]), proc.stderr
    assert not root.exists()


@pytest.mark.parametrize(("what", "damage", "says"), CASES, ids=IDS)
def test_the_dag_s_resolve_config_refuses_them_the_same_way(
    what: str, damage: Callable[[Path], object], says: str, tmp_path: Path
) -> None:
    from airflow.sdk.exceptions import AirflowFailException
    from rtrain_airflow.operators.training import RTrainResolveRunConfigOperator

    d = _damaged(tmp_path, damage)
    params = {"run_name": "ft", "preset": "tiny", "storage_root": str(tmp_path / "runs"), "init_from": str(d)}
    with pytest.raises(AirflowFailException, match=f"^invalid conf: init_from: .*{says}") as e:
        RTrainResolveRunConfigOperator(task_id="resolve_config").execute({"params": params})  # type: ignore[arg-type]
    assert "\n" not in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_a_whole_checkpoint_sharded_or_not_passes_and_each_file_is_read_for_its_header_only(tmp_path: Path) -> None:
    whole = _damaged(tmp_path, lambda d: None)
    assert load_config(None, None, [f"model.init_from={whole}"]).model.d_ff == 48
    sharded = _damaged(tmp_path / "s", _sharded)
    assert load_config(None, None, [f"model.init_from={sharded}"]).model.d_ff == 48
    # A 70B checkpoint of 30 shards whose bytes were never written (holes): only the headers are read.
    big = tmp_path / "70b"
    from hf_files import write_checkpoint

    write_checkpoint(big, PUBLISHED["llama3.1-70b"])
    assert len(list(big.glob("*.safetensors"))) > 20
    assert load_config("llama3.1-70b", None, [f"model.init_from={big}"]).model.n_layers == 80


def test_the_shapes_checked_are_those_the_model_loads() -> None:
    """hf_shapes against the published layout (hf_files) and against the model's own abstract parameters."""
    for config in PUBLISHED.values():
        keys = hf.model_keys(config, "config.json")
        assert hf.hf_shapes(keys) == {k: tuple(v) for k, v in tensor_shapes(config).items()}
    keys = hf.checkpoint_keys(str(FIXTURE)).model
    assert set(hf.hf_shapes(keys)) == set(_tensors())
    assert all(hf.hf_shapes(keys)[k] == v.shape for k, v in _tensors().items())


def test_a_truncated_file_on_gcs_is_refused_as_a_local_one(gcs_root: str, tmp_path: Path) -> None:
    from training.storage import open_store

    d = _damaged(tmp_path, _truncated)
    store = open_store(f"{gcs_root}/llama3-tied")
    for f in d.iterdir():
        store.put(f.name, f.read_bytes())
    with pytest.raises(ConfigError, match=rf"llama3-tied/model\.safetensors: truncated: tensor {VICTIM} "):
        load_config(None, None, [f"model.init_from={gcs_root}/llama3-tied"])
