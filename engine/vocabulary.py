"""A large vocabulary's texts and ids in flat arrays: a few bytes a token, where Python objects take ~150.

A SentencePiece vocabulary is encoded here in Python (tokenizer.py), so its texts, their ids and their scores
stay with the model. As a list of str, a text -> id dict and a list of floats, Gemma 3's 262,144 tokens held
46 MB; here they are the texts' UTF-8 back to back with their offsets, a hash table of flat arrays for the
lookups, and the scores as float32: 6 MB.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

# Any str, lone surrogates included (a file's token text can hold one), encodes and decodes back unchanged.
_ERRORS = "surrogatepass"


class PackedVocabulary:
    """Token texts <-> ids, immutable. `get(text)` is a dict's `get`; `text(i)` the i-th text."""

    def __init__(self, texts: Sequence[str]) -> None:
        """texts: one per id, all different (the caller checks)."""
        encoded = [t.encode("utf-8", _ERRORS) for t in texts]
        self._blob = b"".join(encoded)
        ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
        # text i: blob[offsets[i] : offsets[i+1]]; 32 bits while the blob fits (any real vocabulary's: Gemma 3's 2 MB)
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), ends])
        wide = len(self._blob) >= 1 << 32
        self._offsets = array("q" if wide else "I", offsets.astype(np.int64 if wide else np.uint32).tobytes())
        hashes = np.fromiter(map(hash, texts), dtype=np.int64, count=len(texts))
        # A hash table without Python objects: the texts' hashes grouped by their low bits (the bucket), and
        # where each bucket starts; about one text a bucket, so a lookup reads a few items.
        self._mask = (1 << max(1, (len(texts) - 1).bit_length())) - 1
        buckets = hashes & self._mask
        order = np.argsort(buckets, kind="stable")
        starts = np.searchsorted(buckets[order], np.arange(self._mask + 2))
        # arrays, not ndarrays: indexing them gives plain ints, several times faster in the lookups
        self._starts = array("i", starts.astype(np.int32).tobytes())
        # a bucket's texts are told apart by the hash's high 32 bits; equal ones are compared as texts
        self._hashes = array("i", (hashes[order] >> 32).astype(np.int32).tobytes())
        self._ids = array("i", order.astype(np.int32).tobytes())

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def text(self, token_id: int) -> str:
        return self._blob[self._offsets[token_id] : self._offsets[token_id + 1]].decode("utf-8", _ERRORS)

    def get(self, text: str) -> int | None:
        """The id of `text`, or None when it is not a token."""
        h = hash(text)
        bucket, high = h & self._mask, h >> 32
        for i in range(self._starts[bucket], self._starts[bucket + 1]):
            if self._hashes[i] == high:  # equal hashes: compare the texts themselves
                token_id = self._ids[i]
                if self.text(token_id) == text:
                    return token_id
        return None

    def __contains__(self, text: str) -> bool:
        return self.get(text) is not None

    @property
    def nbytes(self) -> int:
        arrays = (self._offsets, self._starts, self._hashes, self._ids)
        return len(self._blob) + sum(a.itemsize * len(a) for a in arrays)
