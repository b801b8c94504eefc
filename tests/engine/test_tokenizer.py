"""Tokenizer tests: the real GGUF vocabularies against llama.cpp's ids in tests/golden, and small
synthetic vocabularies for the SentencePiece path, the pre-tokenizer fallbacks and the metadata errors."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader, GGUFValueType

from engine.errors import ModelFileError, UnsupportedModelError
from engine.tokenizer import StreamDetokenizer, Tokenizer

# name -> (the conftest fixture giving the model's path, pulled when missing; the conftest fixture of its golden)
REAL_MODELS = {"smollm2": ("smollm2_path", "golden_smollm2"), "qwen2.5": ("qwen_path", "golden_qwen")}
MULTIBYTE_TEXTS = [
    "你好，世界！今天天气很好。",
    "emoji 😀🚀 and symbols ∑∫√",
    "naïve café — 日本語のテキスト, 한국어 문장, 👩‍👩‍👧 family",
    "a treble clef 𝄞 and a llama 🦙",  # 𝄞 takes two or three byte tokens in both vocabularies
]

# GGUF token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def gguf_metadata(path: Path) -> dict[str, Any]:
    """GGUF key -> plain Python value. (Stand-in until the tests switch to engine.gguf_file.)"""
    reader = GGUFReader(path)
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
                meta[name] = [bytes(field.parts[i]).decode() for i in field.data]
            else:
                meta[name] = [field.parts[i][0].item() for i in field.data]
        elif kind == GGUFValueType.STRING:
            meta[name] = bytes(field.parts[field.data[0]]).decode()
        else:
            meta[name] = field.parts[field.data[0]][0].item()
    return meta


@dataclass
class RealModel:
    name: str
    meta: dict[str, Any]
    tok: Tokenizer
    golden: dict[str, Any]
    build_s: float


@pytest.fixture(scope="module", params=list(REAL_MODELS))
def real(request: pytest.FixtureRequest) -> RealModel:
    path_fixture, golden_fixture = REAL_MODELS[request.param]
    meta = gguf_metadata(request.getfixturevalue(path_fixture))  # slow (4-12 s): once per model per module
    golden = request.getfixturevalue(golden_fixture)
    start = time.perf_counter()
    tok = Tokenizer.from_metadata(meta)
    return RealModel(request.param, meta, tok, golden, time.perf_counter() - start)


# --- real models against llama.cpp -----------------------------------------------------------------------


def test_golden_tokenize_matches_llama_cpp_exactly(real: RealModel) -> None:
    results = [(entry["text"], entry["ids"], real.tok.tokenize(entry["text"])) for entry in real.golden["tokenize"]]
    mismatches = [(text, want, got) for text, want, got in results if got != want]
    assert len(results) >= 10 and not mismatches, f"{real.name}: {mismatches}"


def test_golden_prompts_and_teacher_text_match_llama_cpp(real: RealModel) -> None:
    for entry in real.golden["greedy"]:
        assert real.tok.tokenize(entry["prompt"]) == entry["prompt_ids"], entry["prompt"]
    for entry in real.golden["teacher"]:
        assert real.tok.tokenize(entry["text"]) == entry["ids"]
        assert real.tok.detokenize(entry["ids"]) == entry["text"]


def test_golden_generated_text_matches_llama_cpp(real: RealModel) -> None:
    # llama.cpp wrote greedy_text with control tokens left out; ours renders them, so drop them first.
    for entry in real.golden["greedy"]:
        ids = [i for i in entry["greedy_ids"] if not real.tok.is_control(i)]
        assert real.tok.detokenize(ids) == entry["greedy_text"]


def test_detokenize_round_trips_golden_texts(real: RealModel) -> None:
    for entry in real.golden["tokenize"]:
        assert real.tok.detokenize(entry["ids"]) == entry["text"]
        assert real.tok.detokenize(real.tok.tokenize(entry["text"])) == entry["text"]


def test_never_adds_bos(real: RealModel) -> None:
    assert real.tok.tokenize("") == []
    assert real.tok.tokenize("Hello")[0] != real.tok.bos_id
    assert real.tok.add_bos is False  # both files say add_bos_token = false


def test_special_false_tokenizes_control_tokens_as_text(real: RealModel) -> None:
    tok = real.tok
    im_start = tok.token_id("<|im_start|>")
    assert im_start is not None and tok.is_control(im_start)
    assert tok.tokenize("<|im_start|>user", special=True)[0] == im_start
    plain = tok.tokenize("<|im_start|>user", special=False)
    assert len(plain) > 2
    assert im_start not in plain and not any(tok.is_control(i) for i in plain)
    assert tok.detokenize(plain) == "<|im_start|>user"


def test_special_tokens_and_end_of_turn_ids(real: RealModel) -> None:
    tok = real.tok
    assert tok.n_vocab == len(real.meta["tokenizer.ggml.tokens"])
    assert tok.eos_id == real.meta["tokenizer.ggml.eos_token_id"]
    assert tok.bos_id == real.meta["tokenizer.ggml.bos_token_id"]
    im_end, endoftext = tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")
    assert {tok.eos_id, im_end, endoftext} <= tok.eot_ids
    assert tok.token_id("<|im_start|>") not in tok.eot_ids
    assert all(tok.is_control(i) for i in tok.eot_ids)
    assert not tok.is_control(tok.tokenize("Hello")[0])
    assert tok.warnings == ()


def test_token_id_and_token_text(real: RealModel) -> None:
    tok = real.tok
    the = tok.tokenize(" the")
    assert len(the) == 1
    assert tok.token_id(" the") == the[0]  # by rendered text
    assert tok.token_id("Ġthe") == the[0]  # by vocabulary text
    assert tok.token_id("no such token, surely") is None
    assert tok.token_text(the[0]) == " the"
    assert tok.token_text(tok.tokenize("\n")[0]) == "\\n"
    assert tok.token_text(tok.eos_id) == "<|im_end|>"
    # a token holding part of a character shows its bytes
    clef = tok.tokenize("𝄞")
    assert len(clef) > 1 and tok.token_text(clef[-1]) == "\\x9e"  # its last byte alone
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_text(tok.n_vocab)


def test_user_defined_tokens_match_even_without_special(real: RealModel) -> None:
    # Qwen2.5's <tool_call> is user-defined (type 4): llama.cpp matches it even with parse_special=False.
    types = real.meta["tokenizer.ggml.token_type"]
    user_defined = [i for i, t in enumerate(types) if t == USER_DEFINED]
    if real.name == "qwen2.5":
        assert user_defined, "Qwen2.5 declares <tool_call> and </tool_call> as user-defined tokens"
    for token_id in user_defined:
        text = real.meta["tokenizer.ggml.tokens"][token_id]
        assert real.tok.tokenize(f"x {text} y", special=False).count(token_id) == 1


def test_stream_detokenizer_on_multibyte_text(real: RealModel) -> None:
    held_back = 0
    for text in MULTIBYTE_TEXTS + [entry["text"] for entry in real.golden["tokenize"]]:
        ids = real.tok.tokenize(text)
        decoder = real.tok.stream_detokenizer()
        assert isinstance(decoder, StreamDetokenizer)
        pieces = [decoder.push(i) for i in ids]
        assert all("\ufffd" not in piece for piece in pieces), text
        held_back += pieces.count("")
        assert "".join(pieces) + decoder.flush() == text == real.tok.detokenize(ids)
    assert held_back > 0, "no token split a character: the test did not exercise the hold-back"


def test_stream_detokenizer_flushes_an_unfinished_character(real: RealModel) -> None:
    ids = real.tok.tokenize("𝄞")
    assert len(ids) > 1
    decoder = real.tok.stream_detokenizer()
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.flush() == ""


def test_build_is_fast_enough_for_start_up(real: RealModel) -> None:
    # Measured 0.1-0.4 s on an idle machine; the bound only catches a regression to per-token Python work.
    assert real.build_s < 10.0, f"{real.name}: building the tokenizer took {real.build_s:.1f} s"


# --- synthetic byte-level BPE vocabularies ---------------------------------------------------------------


def byte_alphabet() -> list[str]:
    """GPT-2's 256 byte characters, in byte order (written out here independently of the engine)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def bpe_meta(**overrides: Any) -> dict[str, Any]:
    tokens = byte_alphabet() + ["Ġh", "Ġhe", "ll", "Ġhell", "Ġhello", "12", "<|im_start|>", "<|im_end|>"]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [NORMAL] * (len(tokens) - 2) + [CONTROL, CONTROL],
        "tokenizer.ggml.merges": ["Ġ h", "Ġh e", "l l", "Ġhe ll", "Ġhell o", "1 2"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 2,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    meta.update(overrides)
    return meta


def test_synthetic_bpe_merges_and_specials() -> None:
    tok = Tokenizer.from_metadata(bpe_meta())
    hello, im_start, im_end = tok.token_id("Ġhello"), tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert tok.tokenize(" hello") == [hello]
    assert tok.tokenize("<|im_start|> hello<|im_end|>") == [im_start, hello, im_end]
    assert tok.eot_ids == {im_end}
    assert tok.add_bos is False and tok.warnings == ()
    assert tok.detokenize(tok.tokenize("héllo wörld\n")) == "héllo wörld\n"


def test_a_byte_missing_from_the_vocabulary_still_separates_its_neighbours() -> None:
    # Falcon's vocabulary has no "\v": llama.cpp drops it, but only after the merges, so " \v " stays two
    # spaces rather than becoming the two-space token.
    tokens = [t for t in bpe_meta()["tokenizer.ggml.tokens"] if t != "ċ"] + ["ĠĠ"]
    meta = bpe_meta(
        **{
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [NORMAL] * (len(tokens) - 3) + [CONTROL, CONTROL, NORMAL],
            "tokenizer.ggml.merges": [*bpe_meta()["tokenizer.ggml.merges"], "Ġ Ġ"],
            "tokenizer.ggml.bos_token_id": len(tokens) - 3,
            "tokenizer.ggml.eos_token_id": len(tokens) - 2,
        }
    )
    tok = Tokenizer.from_metadata(meta)
    space = tok.token_id(" ")
    assert tok.tokenize("  ") == [tok.token_id("ĠĠ")]
    assert tok.tokenize(" \v ") == [space, space]
    assert all(i < tok.n_vocab for i in tok.tokenize("a\vb\v"))


def test_pre_tokenizer_choice_changes_digit_splitting() -> None:
    twelve = Tokenizer.from_metadata(bpe_meta()).token_id("12")
    assert Tokenizer.from_metadata(bpe_meta()).tokenize("12") == [twelve]  # gpt-2 keeps digits together
    smollm = Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.pre": "smollm"}))
    assert smollm.tokenize("12") == [smollm.token_id("1"), smollm.token_id("2")]  # smollm splits every digit


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning() -> None:
    tok = Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.pre": "brand-new-model"}))
    assert tok.pre == "gpt-2"
    assert len(tok.warnings) == 1 and "brand-new-model" in tok.warnings[0]
    assert tok.tokenize(" hello") == [tok.token_id("Ġhello")]


def test_missing_pre_tokenizer_uses_llama_cpp_default_with_a_warning() -> None:
    meta = bpe_meta()
    del meta["tokenizer.ggml.pre"]
    tok = Tokenizer.from_metadata(meta)
    assert tok.pre == "default"
    assert "tokenizer.ggml.pre" in tok.warnings[0]


def test_llama3_pre_tokenizer_defaults_to_bos() -> None:
    tok = Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert tok.add_bos is True
    assert Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.add_bos_token": False})).add_bos is False


@pytest.mark.parametrize("model", ["t5", "bert", "rwkv", "gemma4", "mystery"])
def test_unsupported_tokenizer_model_is_named(model: str) -> None:
    with pytest.raises(UnsupportedModelError, match=f"tokenizer.ggml.model = '{model}'"):
        Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.model": model}))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.token_type": [NORMAL] * 3}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.eos_token_id": 10_000}, "tokenizer.ggml.eos_token_id"),
        ({"tokenizer.ggml.bos_token_id": -1}, "tokenizer.ggml.bos_token_id"),
        ({"tokenizer.ggml.eot_token_id": "<|im_end|>"}, "tokenizer.ggml.eot_token_id"),
        ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None}, "bos_token_id"),
    ],
)
def test_bad_metadata_names_the_key(overrides: dict[str, Any], key: str) -> None:
    meta = {k: v for k, v in bpe_meta(**overrides).items() if v is not None}
    with pytest.raises(ModelFileError, match=key):
        Tokenizer.from_metadata(meta)


def test_duplicate_token_is_refused() -> None:
    tokens = bpe_meta()["tokenizer.ggml.tokens"]
    tokens[-3] = "ll"
    with pytest.raises(ModelFileError, match="duplicate token 'll'"):
        Tokenizer.from_metadata(bpe_meta(**{"tokenizer.ggml.tokens": tokens}))


# --- synthetic SentencePiece vocabularies ----------------------------------------------------------------


def spm_meta(pieces: dict[str, float], **overrides: Any) -> dict[str, Any]:
    """A Llama-style vocabulary: <unk> <s> </s>, the 256 byte tokens, then `pieces` with their scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [0.0] * 256 + list(pieces.values()),
        "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    meta.update(overrides)
    return meta


SPM_PIECES = {
    "▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
    "▁h": -3.0, "ll": -3.5, "he": -4.0, "▁he": -5.0, "llo": -5.0, "▁hello": -6.0, "▁w": -3.0, "or": -4.0,
    "▁wor": -7.0, "ld": -8.0,
}  # fmt: skip


def spm_ids(tok: Tokenizer, *pieces: str) -> list[int]:
    ids = [tok.token_id(p) for p in pieces]
    assert None not in ids, pieces
    return ids  # type: ignore[return-value]


def test_spm_merges_by_score_with_a_leading_space() -> None:
    tok = Tokenizer.from_metadata(spm_meta(SPM_PIECES))
    assert tok.model == "llama" and tok.add_bos is True and tok.bos_id == 1 and tok.eos_id == 2
    # "▁hello": ▁h (-3), then ll (-3.5); "he" (-4) is gone with its h; then "▁he" and "llo" tie at -5 and
    # the leftmost goes first; last "▁he" + "llo" = "▁hello" (-6).
    assert tok.tokenize("hello") == spm_ids(tok, "▁hello")
    # "▁world": ▁w (-3), or (-4), ▁wor (-7), ld (-8); "▁world" is not a token, so two pieces remain.
    assert tok.tokenize("world") == spm_ids(tok, "▁wor", "ld")
    assert tok.tokenize("hello world") == spm_ids(tok, "▁hello", "▁wor", "ld")
    assert tok.detokenize(tok.tokenize("hello world")) == "hello world"


def test_spm_ties_go_to_the_leftmost_pair() -> None:
    pieces = {"▁": -1.0, "a": -1.0, "b": -1.0, "c": -1.0, "ab": -2.0, "bc": -2.0}
    tok = Tokenizer.from_metadata(spm_meta(pieces))
    assert tok.tokenize("abc") == spm_ids(tok, "▁", "ab", "c")
    better_bc = Tokenizer.from_metadata(spm_meta({**pieces, "bc": -1.5}))
    assert better_bc.tokenize("abc") == spm_ids(better_bc, "▁", "a", "bc")


def test_spm_byte_fallback_and_streaming() -> None:
    tok = Tokenizer.from_metadata(spm_meta(SPM_PIECES))
    ids = tok.tokenize("hé😀")
    # "▁h" is a token, "é" and "😀" are not: they go out as their UTF-8 bytes.
    expected = spm_ids(tok, "▁h") + [3 + b for b in "é😀".encode()]
    assert ids == expected
    assert tok.detokenize(ids) == "hé😀"
    decoder = tok.stream_detokenizer()
    pieces = [decoder.push(i) for i in ids]
    assert pieces == ["h", "", "é", "", "", "", "😀"]  # the added space of the first token is dropped
    assert decoder.flush() == ""


def test_spm_special_tokens_and_the_space_after_them() -> None:
    tok = Tokenizer.from_metadata(spm_meta(SPM_PIECES))
    # A space is added at the start and after each special token, as llama.cpp does.
    assert tok.tokenize("<s>hello</s>hello") == [1, *spm_ids(tok, "▁hello"), 2, *spm_ids(tok, "▁hello")]
    plain = tok.tokenize("<s>", special=False)
    assert 1 not in plain and tok.detokenize(plain) == "<s>"
    assert tok.eot_ids == {2}
    assert tok.detokenize([1, *spm_ids(tok, "▁hello"), 2]) == "<s> hello</s>"


def test_spm_without_space_prefix() -> None:
    tok = Tokenizer.from_metadata(spm_meta(SPM_PIECES, **{"tokenizer.ggml.add_space_prefix": False}))
    assert tok.tokenize("hello") == spm_ids(tok, "he", "llo")
    assert tok.detokenize(spm_ids(tok, "▁hello")) == " hello"


def test_phi3_special_tokens_swallow_the_whitespace_after_them() -> None:
    pieces = {**SPM_PIECES, "<|user|>": 0.0}
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(SPM_PIECES) + [USER_DEFINED]
    meta = spm_meta(pieces, **{"tokenizer.ggml.token_type": types})
    user = len(types) - 1
    plain = Tokenizer.from_metadata(meta).tokenize("<|user|>\nhello")
    assert plain[0] == user and len(plain) > 2  # the newline stays
    phi3 = Tokenizer.from_metadata({**meta, "general.name": "Phi-3-mini-4k-instruct"})
    assert phi3.tokenize("<|user|>\nhello") == [user, *spm_ids(phi3, "▁hello")]


def test_spm_scores_must_match_the_vocabulary() -> None:
    meta = spm_meta(SPM_PIECES, **{"tokenizer.ggml.scores": [0.0] * 5})
    with pytest.raises(ModelFileError, match="tokenizer.ggml.scores"):
        Tokenizer.from_metadata(meta)
