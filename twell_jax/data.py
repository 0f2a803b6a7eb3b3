"""Training data: tokenizers (bytes or a Hugging Face tokenizer.json), a corpus of text files or
token arrays split into train and held-out streams by a hash of each path, and batches that are
a pure function of (seed, stream, step)."""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import numpy as np




class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256); documents are separated by byte 0 (NUL)."""

    vocab_size = 256
    separator = 0

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, np.uint8)

    def decode(self, tokens) -> str:
        """Token ids -> text; invalid UTF-8 (a sequence cut inside a character) is replaced."""
        return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package."""

    _SEPARATORS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError as e:
            raise SystemExit(
                f"--tokenizer {path}: the 'tokenizers' package is not installed; "
                "`pip install tokenizers`, or use --tokenizer bytes") from e
        if not Path(path).is_file():
            raise SystemExit(f"--tokenizer {path}: no such file ('bytes', or a tokenizer.json)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the package's own error types: a stranger's file, one line
            raise SystemExit(f"--tokenizer {path}: not a tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size()
        ids = [self._tok.token_to_id(t) for t in self._SEPARATORS]
        self.separator = next((i for i in ids if i is not None), 0)

    def encode(self, data: bytes) -> np.ndarray:
        return np.asarray(self._tok.encode(data.decode("utf-8", errors="replace")).ids, np.int32)

    def decode(self, tokens) -> str:
        return self._tok.decode([int(t) for t in tokens])


def make_tokenizer(spec: str):
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams: ``train`` and ``heldout`` (1-D integer arrays)."""

    train: np.ndarray
    heldout: np.ndarray
    vocab_size: int
    description: str


def default_data_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(root: Path, default: bool) -> list[Path]:
    """Sorted text files under root: for the stdlib, its .py files outside site-packages;
    otherwise every non-hidden file whose first 8 KB hold no NUL byte."""
    files = []
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p in ("__pycache__", "site-packages", "dist-packages")
               for p in parts) or not path.is_file():
            continue
        if default:
            if path.suffix == ".py":
                files.append(path)
        else:
            with open(path, "rb") as f:
                if b"\0" not in f.read(8192):
                    files.append(path)
    return files


def is_heldout(relative_path: str, fraction: float) -> bool:
    """Deterministic split by a hash of the file's path relative to the data folder."""
    h = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:8], "little")
    return h / 2**64 < fraction


def load_corpus(data: str, tokenizer, heldout_fraction: float = 0.05) -> Corpus:
    """Reads and tokenizes ``data`` (see ``TrainConfig.data``) into train and held-out streams."""
    default = not data
    root = default_data_dir() if default else Path(data)
    if not root.exists():
        raise FileNotFoundError(f"--data {root} does not exist")
    if root.is_file():
        if root.suffix == ".npy":
            tokens = np.load(root, mmap_mode="r")
        elif root.suffix == ".bin":
            tokens = np.memmap(root, dtype=np.uint16, mode="r")
        else:
            raise ValueError(f"--data {root}: a token file must end in .npy or .bin")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"--data {root}: expected a 1-D integer array, got "
                             f"{tokens.dtype} {tokens.shape}")
        cut = int(len(tokens) * (1 - heldout_fraction))
        vocab = int(tokens.max()) + 1 if len(tokens) else 0
        return Corpus(tokens[:cut], tokens[cut:], max(vocab, tokenizer.vocab_size),
                      f"{root} ({len(tokens):,} tokens)")
    files = _text_files(root, default)
    if not files:
        raise ValueError(f"--data {root}: no text files found")
    sep = np.asarray([tokenizer.separator], np.int32)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for path in files:
        held = is_heldout(path.relative_to(root).as_posix(), heldout_fraction)
        parts[held] += [tokenizer.encode(path.read_bytes()).astype(np.int32), sep]
    dtype = np.uint8 if tokenizer.vocab_size <= 256 else np.int32
    train, heldout = (np.concatenate(parts[h]).astype(dtype) if parts[h] else np.zeros(0, dtype)
                      for h in (False, True))
    return Corpus(train, heldout, tokenizer.vocab_size,
                  f"{root}: {len(files)} files, {len(train):,} train / {len(heldout):,} held-out "
                  "tokens")


def sample_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int,
                 stream: int = 0) -> np.ndarray:
    """[batch_size, seq_len + 1] int32 random windows; a pure function of (seed, stream, step)."""
    n = len(tokens) - seq_len
    if n < 1:
        raise ValueError(f"need more than seq_len + 1 = {seq_len + 1} tokens, got {len(tokens)}")
    rng = np.random.default_rng([seed, stream, step])
    starts = rng.integers(0, n, size=batch_size)
    return np.stack([np.asarray(tokens[s:s + seq_len + 1], np.int32) for s in starts])


TRAIN_STREAM = 0


EVAL_STREAM = 1
