"""engine.vocabulary.PackedVocabulary: a dict's answers for token texts, from flat arrays."""

from __future__ import annotations

from engine.vocabulary import PackedVocabulary


class _SameHash(str):
    """A str whose hash collides with every other's: lookups must compare the texts themselves."""

    def __hash__(self) -> int:
        return 7


def test_every_text_maps_to_its_id_and_back() -> None:
    texts = ["a", "▁the", "<0x0A>", "日本", "", "\ud800lone", "emoji 🙂", "ab", "b"]
    vocab = PackedVocabulary(texts)
    assert len(vocab) == len(texts)
    for i, t in enumerate(texts):
        assert vocab.get(t) == i
        assert vocab.text(i) == t
    assert vocab.get("abc") is None and "abc" not in vocab and "ab" in vocab


def test_colliding_hashes_are_told_apart_by_their_texts() -> None:
    texts = [_SameHash(t) for t in ("x", "y", "z", "xy")]
    vocab = PackedVocabulary(texts)
    for i, t in enumerate(texts):
        assert vocab.get(_SameHash(t)) == i
    assert vocab.get(_SameHash("w")) is None


def test_a_large_vocabulary_is_a_few_bytes_a_token() -> None:
    texts = [f"tok{i}" for i in range(100_000)]
    vocab = PackedVocabulary(texts)
    assert vocab.get("tok99999") == 99_999 and vocab.get("tok100000") is None
    assert vocab.nbytes < 100_000 * (8 + 8 + 8 + 4 + 9)  # offsets, buckets (<= 2 a text), hashes, ids, UTF-8
