"""Tokenizers for dataset preparation: bytes, a byte-level BPE trained on the corpus, or a user's file.

A prepared dataset records its tokenizer in the manifest (kind, fingerprint,
vocabulary size, file) and keeps the tokenizer's definition beside its shards,
so the ids in the records can always be decoded again with exactly the
tokenizer that produced them (:func:`load_tokenizer`).  A tokenizer's
fingerprint is the sha256 of its definition; it is part of the dataset's
fingerprint, so the same corpus prepared with another tokenizer is another
dataset.

* ``bytes``: the UTF-8 bytes themselves (vocab 256, byte 0 ends a document).
  Nothing to train, ship or download.
* ``bpe``: a byte-level BPE of a given vocabulary size, trained with Hugging
  Face ``tokenizers`` on the train split only (deterministic: the same corpus
  gives the same ``tokenizer.json``), with ``<|eos|>`` as its id 0.
* a path to a Hugging Face ``tokenizer.json`` or a SentencePiece ``.model``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, Required, TypedDict

import numpy as np

from training.data.errors import DatasetError
from training.storage import NotFound, Store, open_store, scheme


class TokenizerEntry(TypedDict, total=False):
    """The tokenizer a dataset was prepared with, as its manifest names it: kind, fingerprint, vocabulary, the file
    stored beside the manifest, and a trained BPE's recipe (the fingerprint of what it was trained from)."""

    kind: Required[str]
    fingerprint: str
    vocab_size: int
    file: str | None
    recipe: str


BYTE_VOCAB = 256
BYTE_EOS = 0  # The byte that ends every document of a byte-level dataset.
BPE_EOS = "<|eos|>"
# End-of-document tokens looked for in a user's tokenizer.json, in this order.
EOS_CANDIDATES = ("<|end_of_text|>", "<|eos|>", "</s>", "<|endoftext|>", "<eos>")
# Beginning-of-text tokens looked for in a user's tokenizer.json (for an export's bos_token_id), in this order.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
HF_FILE = "tokenizer.json"
SPM_FILE = "tokenizer.model"
# How `bpe` is trained: part of its recipe fingerprint, so a change here is a new dataset.
_BPE_RECIPE = {
    "model": "BPE",
    "pre_tokenizer": "ByteLevel(add_prefix_space=False)",
    "decoder": "ByteLevel",
    "special_tokens": [BPE_EOS],
    "initial_alphabet": "ByteLevel",
    "trained_on": "train split",
}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dtype_for(vocab_size: int) -> str:
    """The record dtype of a vocabulary's ids (the byte tokenizer's own is uint8)."""
    return "uint16" if vocab_size <= 65536 else "uint32"


class Tokenizer:
    """Text <-> token ids, with what a dataset records about it.

    ``kind``: bytes | bpe | huggingface | sentencepiece; ``fingerprint``: the
    sha256 of its definition; ``file``: the name its definition has inside a
    dataset (None: nothing to store); ``eos_id``: the id that ends a document; ``bos_id``: the id that
    begins a text, where the vocabulary has one (None: it has none).
    """

    kind: str
    vocab_size: int
    eos_id: int
    fingerprint: str
    file: str | None = None
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        raise NotImplementedError

    def definition(self) -> bytes | None:
        """The bytes stored as ``file`` in a dataset (None for a tokenizer without a file)."""
        return None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_documents(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        """Documents (UTF-8 bytes) as arrays of ids, without the end-of-document token."""
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        return [np.asarray(ids, dtype=self.token_dtype) for ids in self.encode_batch(texts)]

    @property
    def token_dtype(self) -> str:
        return dtype_for(self.vocab_size)

    def manifest_entry(self) -> TokenizerEntry:
        return TokenizerEntry(kind=self.kind, fingerprint=self.fingerprint, vocab_size=self.vocab_size, file=self.file)


class ByteTokenizer(Tokenizer):
    """The byte-level tokenizer: ids are the bytes of the text (vocab 256, eos 0)."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS
    fingerprint = _sha256(
        json.dumps({"kind": "bytes", "vocab_size": BYTE_VOCAB, "eos_id": BYTE_EOS}, sort_keys=True).encode()
    )

    @property
    def token_dtype(self) -> str:
        return "uint8"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tobytes()).decode("utf-8", errors="replace")

    def encode_documents(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        # The raw bytes, not their decoded text: a file that is not UTF-8 is packed unchanged.
        return [np.frombuffer(d, dtype=np.uint8) for d in docs]


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer, from its ``tokenizer.json`` (trained here or the user's)."""

    file = HF_FILE

    def __init__(self, raw: bytes, kind: str, what: str, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        try:
            self._tok = _HF.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise DatasetError(f"{what}: not a Hugging Face tokenizer.json ({e})") from None
        # Text that happens to spell a special token is text, not a document boundary.
        self._tok.encode_special_tokens = True
        self._raw = raw
        self.kind = kind
        self.fingerprint = _sha256(raw)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        found = [t for t in candidates if self._tok.token_to_id(t) is not None]
        if not found:
            raise DatasetError(
                f"{what}: no end-of-document token in its vocabulary (looked for {', '.join(candidates)})"
            )
        self.eos_token = found[0]
        eos = self._tok.token_to_id(found[0])
        assert eos is not None
        self.eos_id = int(eos)
        bos = next((i for t in BOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None)
        self.bos_id = None if bos is None else int(bos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def definition(self) -> bytes:
        return self._raw


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (``.model``), when the ``sentencepiece`` package is installed."""

    kind = "sentencepiece"
    file = SPM_FILE

    def __init__(self, raw: bytes, what: str) -> None:
        spm = _import_sentencepiece()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=raw)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError variously
            raise DatasetError(f"{what}: not a SentencePiece model ({e})") from None
        self._raw = raw
        self.fingerprint = _sha256(raw)
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise DatasetError(f"{what}: the SentencePiece model has no end-of-document (eos) piece")
        self.eos_id = eos
        bos = int(self._sp.bos_id())
        self.bos_id = bos if bos >= 0 else None

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._sp.encode(text, out_type=int)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return str(self._sp.decode([int(i) for i in ids]))

    def definition(self) -> bytes:
        return self._raw


def _import_sentencepiece() -> Any:
    try:
        return importlib.import_module("sentencepiece")
    except ImportError:
        raise DatasetError(
            "a SentencePiece .model tokenizer needs the sentencepiece package: pip install sentencepiece"
        ) from None


class BPETrainer:
    """The recipe of a ``bpe`` tokenizer: a byte-level BPE of ``vocab_size`` trained on the train split.

    Its fingerprint is the recipe's (the trained tokenizer.json is a function of
    it and the train split, which the dataset fingerprint already covers), so
    whether an output is already prepared is known before anything is trained.
    """

    kind = "bpe"

    def __init__(self, vocab_size: int) -> None:
        minimum = BYTE_VOCAB + len(_BPE_RECIPE["special_tokens"])
        if vocab_size < minimum:
            raise DatasetError(
                f"bpe vocab_size {vocab_size} is too small: at least {minimum} "
                f"(256 byte tokens + {minimum - BYTE_VOCAB} special)"
            )
        self.vocab_size = vocab_size
        self.fingerprint = _sha256(json.dumps({**_BPE_RECIPE, "vocab_size": vocab_size}, sort_keys=True).encode())

    def train(self, texts: Iterable[str]) -> HFTokenizer:
        """Train on ``texts`` (in a fixed order: the result depends only on them)."""
        from tokenizers import Tokenizer as _HF
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = _HF(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=self.vocab_size,
            special_tokens=[BPE_EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return HFTokenizer(tok.to_str().encode("utf-8"), "bpe", "trained bpe", eos_token=BPE_EOS)


def resolve(spec: str, vocab_size: int | None = None) -> Tokenizer | BPETrainer:
    """The tokenizer named by ``spec``: "bytes", "bpe" (a trainer of ``vocab_size``), or a file path.

    A file is a Hugging Face ``tokenizer.json`` (or a directory holding one) or
    a SentencePiece ``.model``; ``vocab_size`` is the file's own then.
    """
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "bpe":
        if vocab_size is None:
            raise DatasetError("the bpe tokenizer needs a vocab_size (e.g. --vocab-size 8192)")
        return BPETrainer(vocab_size)
    if not scheme(spec).filesystem:  # a checkpoint's tokenizer.json in a store (init_from on gs://)
        parent, _, name = spec.rpartition("/")
        try:
            raw = open_store(parent).get(name)
        except NotFound:
            raise DatasetError(f"tokenizer file {spec} does not exist") from None
        return SentencePieceTokenizer(raw, spec) if spec.endswith(".model") else HFTokenizer(raw, "huggingface", spec)
    path = os.path.expanduser(spec)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, HF_FILE)):
        path = os.path.join(path, HF_FILE)
    if not os.path.isfile(path):
        raise DatasetError(f"tokenizer file {spec} does not exist (a tokenizer is bytes, bpe, or a file path)")
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".model"):
        return SentencePieceTokenizer(raw, path)
    return HFTokenizer(raw, "huggingface", path)


def from_manifest(entry: TokenizerEntry | None, store: Store, eos_id: int | None = None) -> Tokenizer:
    """The tokenizer a dataset was prepared with, from its manifest's entry (``tokenizer``) and the file stored
    beside it; ``eos_id``, the manifest's, is checked against it."""
    if not entry or entry.get("kind") == "bytes":
        return ByteTokenizer()
    name = str(entry.get("file") or HF_FILE)
    try:
        raw = store.get(name)
    except NotFound:
        raise DatasetError(f"{store.child(name)} is missing: the dataset's tokenizer is gone") from None
    if _sha256(raw) != entry.get("fingerprint"):
        raise DatasetError(
            f"{store.child(name)}: sha256 {_sha256(raw)[:12]} does not match the manifest's tokenizer fingerprint "
            f"{str(entry.get('fingerprint'))[:12]}"
        )
    kind = str(entry["kind"])
    what = store.child(name)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(raw, what)
    eos_token = BPE_EOS if kind == "bpe" else None
    tok = HFTokenizer(raw, kind, what, eos_token=eos_token)
    if eos_id is not None and tok.eos_id != int(eos_id):
        raise DatasetError(f"{what}: eos id {tok.eos_id}, the manifest says {eos_id}")
    return tok
