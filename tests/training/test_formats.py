"""Preparation from JSONL, Parquet and saved Hugging Face datasets, with the bytes, BPE and file tokenizers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordReader

from training import data
from training.data import formats, tokenizer
from training.data.shards import Manifest
from training.data.tokens import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 16
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def documents(n: int = 24) -> list[str]:
    """ASCII documents of a few repeated words: a BPE has something to merge, every record decodes cleanly."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(30 + 3 * i)) + f" doc{i}." for i in range(n)]


def write_text(root: Path, docs: list[str]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (root / f"doc{i:02d}.txt").write_text(doc)
    return str(root)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return str(path)


def write_parquet(path: Path, docs: list[str], column: str = "text") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs}), path, row_group_size=7)
    return str(path)


def write_hf(root: Path, docs: list[str]) -> str:
    """A dataset laid out as ``datasets.Dataset.save_to_disk`` writes it: Arrow stream files and state.json."""
    root.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    half = len(docs) // 2
    names = []
    for k, part in enumerate((table.slice(0, half), table.slice(half))):
        names.append(f"data-{k:05d}-of-00002.arrow")
        with pa.OSFile(str(root / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as writer:
            writer.write_table(part)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": "train"}))
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return str(root)


def prep(source: str, out: Path, **kw: object) -> Manifest:
    kw = {"val_fraction": 0.2, "records_per_shard": 16, **kw}
    return data.prepare(source, str(out), SEQ_LEN, **kw)  # type: ignore[arg-type]


def read_ids(dataset: str, split: str) -> list[np.ndarray]:
    manifest = data.load_manifest(dataset)
    out: list[np.ndarray] = []
    for path in data.local_shards(dataset, split):
        reader = ArrayRecordReader(path)
        out.extend(np.frombuffer(r, dtype=manifest.get("token_dtype", "uint8")) for r in reader.read_all())
        reader.close()
    return out


def decoded_pieces(dataset: str) -> list[str]:
    """Every record of both splits decoded with the dataset's own tokenizer, cut at the eos id."""
    tok = load_tokenizer(dataset)
    pieces: list[str] = []
    for split in data.SPLITS:
        for ids in read_ids(dataset, split):
            cuts = np.flatnonzero(ids == tok.eos_id)
            for part in np.split(ids, cuts):
                part = part[part != tok.eos_id]
                if len(part):
                    pieces.append(tok.decode(part))
    return pieces


def assert_serves(dataset: str) -> None:
    ex = data.lm_source(dataset, "train")[0]
    for key in ("inputs", "targets", "segment_ids", "positions"):
        assert ex[key].shape == (SEQ_LEN,), key
    np.testing.assert_array_equal(ex["inputs"][1:], ex["targets"][:-1])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    root = tmp_path_factory.mktemp("bpe")
    docs = documents()
    prep(write_text(root / "src", docs), root / "ds", tokenizer="bpe", vocab_size=300)
    return str(root / "ds"), docs


# ----------------------------------------------------------------------------
# Formats.
# ----------------------------------------------------------------------------


def test_text_jsonl_parquet_and_hf_prepare_and_serve_the_same_documents(tmp_path: Path) -> None:
    docs = documents()
    sources = {
        "text": write_text(tmp_path / "text", docs),
        "jsonl": write_jsonl(tmp_path / "jsonl" / "corpus.jsonl", docs),
        "parquet": write_parquet(tmp_path / "parquet" / "corpus.parquet", docs),
        "hf": write_hf(tmp_path / "hf", docs),
    }
    total = sum(len(d.encode()) for d in docs)
    for fmt, source in sources.items():
        assert formats.open_source(source).fmt == fmt
        manifest = prep(source, tmp_path / f"ds-{fmt}")
        assert manifest["input_format"] == fmt and manifest["input_bytes"] == total
        assert manifest["input_files"] == len(docs)
        assert manifest["splits"]["validation"]["records"] >= 1
        assert_serves(str(tmp_path / f"ds-{fmt}"))
        text = "".join(decoded_pieces(str(tmp_path / f"ds-{fmt}")))
        assert all(w in text for w in WORDS)
    # Rows are named file#row: the same rows from JSONL and Parquet split alike.
    names = [d.name for d in formats.open_source(sources["jsonl"]).documents()]
    assert names[:2] == ["corpus.jsonl#0", "corpus.jsonl#1"]
    assert [d.name for d in formats.open_source(sources["hf"]).documents()][:2] == ["train#0", "train#1"]
    # An explicit format and field, and max_bytes counting UTF-8 bytes of text.
    other = write_jsonl(tmp_path / "other" / "c.jsonl", docs, field="body")
    manifest = prep(other, tmp_path / "ds-body", fmt="jsonl", field="body", max_bytes=1000)
    assert manifest["input_bytes"] == 1000


def test_a_missing_field_or_column_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n\n{"body": "no text here"}\n')
    with pytest.raises(data.DatasetError) as err:
        prep(str(path), tmp_path / "ds")
    msg = str(err.value)
    assert "\n" not in msg and "c.jsonl" in msg and "line 3" in msg and "'text'" in msg

    path.write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(data.DatasetError, match="line 2: a JSON list, not an object"):
        prep(str(path), tmp_path / "ds")

    parquet = write_parquet(tmp_path / "p.parquet", ["a", "b"], column="body")
    with pytest.raises(data.DatasetError) as err:
        prep(parquet, tmp_path / "ds")
    msg = str(err.value)
    assert "\n" not in msg and "p.parquet" in msg and "'text'" in msg and "['id', 'body']" in msg

    hf = write_hf(tmp_path / "hf", ["a", "b"])
    with pytest.raises(data.DatasetError, match=r"no column 'body'.*\['text', 'id'\]"):
        prep(hf, tmp_path / "ds", field="body")
    assert not (tmp_path / "ds").exists(), "nothing is written before the inputs are read"


# ----------------------------------------------------------------------------
# Tokenizers.
# ----------------------------------------------------------------------------


BPE_SCRIPT = """
import hashlib, pathlib, sys
from training import data
src, out = sys.argv[1:]
data.prepare(src, out, 16, tokenizer="bpe", vocab_size=300, val_fraction=0.2, records_per_shard=16)
print(hashlib.sha256((pathlib.Path(out) / "tokenizer.json").read_bytes()).hexdigest())
"""


def test_bpe_is_trained_deterministically_and_recorded_in_the_manifest(
    bpe: tuple[str, list[str]], tmp_path: Path
) -> None:
    dataset, _ = bpe
    manifest = data.load_manifest(dataset)
    raw = (Path(dataset) / "tokenizer.json").read_bytes()
    entry = manifest["tokenizer"]
    assert manifest["format"] == 2 and manifest["token_dtype"] == "uint16"
    assert entry["kind"] == "bpe" and entry["file"] == "tokenizer.json"
    assert entry["fingerprint"] == tokenizer._sha256(raw)
    assert manifest["vocab_size"] == entry["vocab_size"] <= 300
    assert json.loads(raw)["added_tokens"][0]["content"] == "<|eos|>" and manifest["eos_id"] == 0

    # The same corpus gives the same tokenizer.json bytes, in fresh processes (hash seeds, threads).
    src = str(Path(dataset).parent / "src")
    digests = {
        subprocess.run(
            [sys.executable, "-c", BPE_SCRIPT, src, str(tmp_path / f"ds{seed}")],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "RAYON_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"},
        ).stdout.strip()
        for seed, threads in ((1, 1), (2, 4))
    }
    assert digests == {entry["fingerprint"]}


def test_bpe_records_decode_back_to_the_corpus_and_a_rerun_is_a_no_op(
    bpe: tuple[str, list[str]], tmp_path: Path
) -> None:
    dataset, docs = bpe
    pieces = decoded_pieces(dataset)
    assert pieces and all(any(p in d for d in docs) for p in pieces)
    train = read_ids(dataset, "train")
    assert all(len(r) == SEQ_LEN + 1 and r.dtype == np.uint16 for r in train)
    assert_serves(dataset)
    tok = load_tokenizer(dataset)
    assert tok.kind == "bpe" and tok.decode(tok.encode(docs[0])) == docs[0]
    assert len(tok.encode(docs[0])) < len(docs[0].encode()), "the BPE merges something"

    before = {p.name: p.stat().st_mtime_ns for p in Path(dataset).iterdir()}
    manifest = data.load_manifest(dataset)
    messages: list[str] = []
    src = str(Path(dataset).parent / "src")
    assert prep(src, Path(dataset), tokenizer="bpe", vocab_size=300, progress=messages.append) == manifest
    assert any("nothing to do" in m for m in messages) and not any("training" in m for m in messages)
    assert {p.name: p.stat().st_mtime_ns for p in Path(dataset).iterdir()} == before

    # Another tokenizer on the same output is another dataset: refused, naming both tokenizers.
    with pytest.raises(data.DatasetExistsError) as err:
        prep(src, Path(dataset), tokenizer="bpe", vocab_size=280)
    msg = str(err.value)
    assert "\n" not in msg and "tokenizer bpe (vocab 300" in msg and "tokenizer bpe (vocab 280" in msg
    with pytest.raises(data.DatasetExistsError, match=r"tokenizer bpe \(vocab .*tokenizer bytes"):
        prep(src, Path(dataset))


def test_a_tokenizer_json_by_path_is_used_and_copied_into_the_dataset(
    bpe: tuple[str, list[str]], tmp_path: Path
) -> None:
    dataset, docs = bpe
    path = tmp_path / "my-tokenizer.json"
    path.write_bytes((Path(dataset) / "tokenizer.json").read_bytes())
    source = write_jsonl(tmp_path / "c.jsonl", docs)
    manifest = prep(source, tmp_path / "ds", tokenizer=str(path))
    assert manifest["tokenizer"]["kind"] == "huggingface" and manifest["eos_id"] == 0
    assert (tmp_path / "ds" / "tokenizer.json").read_bytes() == path.read_bytes()
    assert manifest["tokenizer"]["fingerprint"] == data.load_manifest(dataset)["tokenizer"]["fingerprint"]
    assert all(any(p in d for d in docs) for p in decoded_pieces(str(tmp_path / "ds")))
    assert_serves(str(tmp_path / "ds"))

    # The eos is the first known end token in the vocabulary; none is an error naming the file.
    spec = json.loads(path.read_text())
    spec["added_tokens"][0]["content"] = "<|pad|>"
    spec["model"]["vocab"]["<|pad|>"] = spec["model"]["vocab"].pop("<|eos|>")
    bad = tmp_path / "no-eos.json"
    bad.write_text(json.dumps(spec))
    with pytest.raises(data.DatasetError, match=r"no-eos.json: no end-of-document token"):
        prep(source, tmp_path / "ds2", tokenizer=str(bad))


def test_tokenizer_errors_are_one_line_naming_the_thing(tmp_path: Path) -> None:
    source = write_text(tmp_path / "src", documents(4))
    for spec, kw, pattern in (
        (str(tmp_path / "nope.json"), {}, r"tokenizer file .*nope.json does not exist"),
        ("bpe", {"vocab_size": 200}, r"bpe vocab_size 200 is too small: at least 257"),
        ("bpe", {}, r"bpe tokenizer needs a vocab_size"),
    ):
        with pytest.raises(data.DatasetError, match=pattern) as err:
            prep(source, tmp_path / "ds", tokenizer=spec, **kw)
        assert "\n" not in str(err.value)
    model = tmp_path / "sp.model"
    model.write_bytes(b"\x00")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        with pytest.raises(data.DatasetError, match=r"pip install sentencepiece"):
            prep(source, tmp_path / "ds", tokenizer=str(model))
    assert not (tmp_path / "ds").exists()


def test_a_bytes_dataset_loads_the_byte_tokenizer_and_keeps_format_1(tmp_path: Path) -> None:
    docs = documents(6)
    manifest = prep(write_text(tmp_path / "src", docs), tmp_path / "ds")
    assert manifest["format"] == 1 and manifest["token_dtype"] == "uint8" and manifest["eos_id"] == 0
    assert manifest["tokenizer"]["kind"] == "bytes" and not (tmp_path / "ds" / "tokenizer.json").exists()
    # A dataset prepared before tokenizers existed (no tokenizer entry) reads as bytes.
    old = {k: v for k, v in manifest.items() if k not in ("tokenizer", "token_dtype", "eos_id", "input_format")}
    (tmp_path / "ds" / data.MANIFEST).write_text(json.dumps(old))
    tok = load_tokenizer(str(tmp_path / "ds"))
    assert tok.kind == "bytes" and tok.vocab_size == 256
    assert all(any(p in d for d in docs) for p in decoded_pieces(str(tmp_path / "ds")))
