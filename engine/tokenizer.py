"""Text <-> token ids for the vocabularies in GGUF files, reproducing llama.cpp (`src/llama-vocab.cpp`).

Two kinds of vocabulary, named by `tokenizer.ggml.model`:

- "gpt2": byte-level BPE (SmolLM2, Qwen2.5, Llama 3, ...). The merges run in HF `tokenizers` (Rust) behind
  the pre-tokenizer regexes that llama.cpp uses for the file's `tokenizer.ggml.pre`.
- "llama": SentencePiece (Llama 2, TinyLlama, Mistral v0.1, Phi-3, ...). llama.cpp's merge-by-score loop,
  ported as it is: prompts are short, and the loop is O(n log n) in the characters of a text piece.

Both kinds first cut special tokens out of the text the way llama.cpp's `tokenizer_st_partition` does
(longest token text first). `special=False` means what it means in llama.cpp: control tokens are then plain
text, while user-defined tokens (Qwen's `<tool_call>`) are still matched.

Known departures from llama.cpp: `detokenize` does not apply llama.cpp's `clean_spaces` pass (GPT-2 and
Llama 3 vocabularies; it would break `detokenize(tokenize(s)) == s`); a normal BPE token holding a character
outside the byte alphabet renders as that character's UTF-8 instead of "[UNK_BYTE_0x..]"; and a code point
that Oniguruma's Unicode tables class differently from llama.cpp's (letters added in Unicode 16, say) can be
pre-tokenized differently.
"""

from __future__ import annotations

import heapq
import operator
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE
from tokenizers.pre_tokenizers import ByteLevel, Split
from tokenizers.pre_tokenizers import Sequence as PreTokenizerSequence

from engine.errors import ModelFileError, UnsupportedModelError
from engine.vocabulary import PackedVocabulary

# GGUF token types (gguf.TokenType), as llama.cpp's converters write them.
TOKEN_UNDEFINED = 0
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

_KEY = "tokenizer.ggml."
_SPM_SPACE = "\u2581"  # "▁", SentencePiece's stand-in for a space
_C_SPACE = " \t\n\v\f\r"  # what C's isspace() strips after an rstrip special token
_SURROGATES = re.compile("[\ud800-\udfff]")


# --- byte-level alphabet (GPT-2) -------------------------------------------------------------------------


def _byte_to_char() -> tuple[str, ...]:
    """GPT-2's byte -> char map: printable Latin-1 bytes stand for themselves, the other 68 move to U+0100."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + shifted))
            shifted += 1
    return tuple(chars)


# Built once at import: every Tokenizer shares them.
_BYTE_TO_CHAR = _byte_to_char()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# str.translate tables between the byte alphabet and Latin-1 (one char per byte), so that converting a token
# is two C calls: text.translate(_ALPHABET_TO_LATIN1).encode("latin-1"). Latin-1 chars outside the alphabet
# map to U+FFFF, which makes that encode fail and sends the token down the careful path.
_ALPHABET_TO_LATIN1: dict[int, str] = {ord(c): chr(b) for b, c in enumerate(_BYTE_TO_CHAR)}
for _b in range(256):
    _ALPHABET_TO_LATIN1.setdefault(_b, "\uffff")
_LATIN1_TO_ALPHABET: dict[int, str] = {b: c for b, c in enumerate(_BYTE_TO_CHAR)}

# For token_text(): control characters shown as escapes so that one token stays on one table row.
_PRINTABLE = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}


# --- pre-tokenizers: the regexes llama.cpp's llm_tokenizer_bpe uses, by tokenizer.ggml.pre ---------------


@dataclass(frozen=True)
class _Pre:
    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces the previous one left
    ignore_merges: bool = False  # a word that is itself a token is not split by the merges
    add_bos: bool = False  # llama.cpp's add_bos when the file has no tokenizer.ggml.add_bos_token


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_UPPER_THEN_LOWER = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_UPPER_ONLY = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_TEKKEN = _UPPER_THEN_LOWER + "|" + _UPPER_ONLY + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _UPPER_THEN_LOWER
    + _CONTRACTIONS
    + "?|"
    + _UPPER_ONLY
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp runs regexes without \p{..} through std::wregex after turning every non-ASCII whitespace char of
# the text into "\v", so a literal class never matches U+1680, U+2000-U+200A, U+2028, U+2029, U+202F,
# U+205F or U+3000. DeepSeek's classes below have those gaps cut out to match; the \s in them still does.
_CJK_HANGUL = (  # llama.cpp: [\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+ less whitespace
    "[\u4e00-\u9fa5\u0800-\u167f\u1681-\u1fff\u200b-\u2027\u202a-\u202e\u2030-\u205e\u2060-\u2fff"
    "\u3001-\u4e00\uac00-\ud7ff]+"
)
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK3 = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM's cased-letter class, spelled out in its tokenizer.json; escapes keep it safe from editors
# that normalise text (U+212A KELVIN SIGN is not "K").
_DEEPSEEK_LETTERS = (
    "[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]"
)
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_PRE_TOKENIZERS: dict[str, _Pre] = {}


def _register(names: str, *regexes: str, ignore_merges: bool = False, add_bos: bool = False) -> None:
    for name in names.split():
        _PRE_TOKENIZERS[name] = _Pre(regexes, ignore_merges, add_bos)


_register("default", r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
_register(
    "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jina-v1-en"
    " jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling exaone4",
    _GPT2,
)
_register(
    "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
    _LLAMA3,
    ignore_merges=True,
    add_bos=True,
)
_register("dbrx smaug-bpe chatglm-bpe", _LLAMA3)
_register("glm4 glm5", _LLAMA3, ignore_merges=True)
_register("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", _QWEN2)
_register("qwen35", _QWEN35)
_register("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", r"\p{N}", _GPT2)
_register("falcon", r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")
_register(
    "deepseek-llm",
    "[\r\n]",
    r"\s?" + _DEEPSEEK_LETTERS + "+",
    r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001-\u3002]+",  # [　-。] less U+3000
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
)
_register("deepseek-coder", "[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
_register("deepseek-v3 hunyuan-dense joyai-llm hy_v4", r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3)
_register("poro-chat bloom gpt3-finnish", _PORO)
_register("viking", _PORO, r"\p{N}")
_register("tekken", _TEKKEN, ignore_merges=True, add_bos=True)
_register("gpt-4o llama4 kanana2 talkie minimax-m2", _GPT4O)
_register("seed-coder", _SEED_CODER)
_register("bailingmoe bailingmoe2 llada-moe", _BAILINGMOE)

# Token texts llama.cpp treats as end-of-generation (and forces to control type), whatever the metadata says.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    }
)  # fmt: skip
# Fill-in-the-middle tokens llama.cpp finds by text when the file has no id for them: all become control
# tokens, and pad/rep/sep also end generation.
_FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_FIM_DEPRECATED_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}


# --- the tokenizer ---------------------------------------------------------------------------------------


class Tokenizer:
    """A GGUF vocabulary: `tokenize` gives llama.cpp's ids, `detokenize` and `StreamDetokenizer` give text back.

    Build it with `Tokenizer.from_metadata(meta)`. Instances are read-only after that and safe to share
    between threads.
    """

    n_vocab: int  # number of tokens, i.e. the logits' length
    bos_id: int | None
    eos_id: int | None
    eot_ids: frozenset[int]  # ids that end a reply: EOS, EOT, EOM and end-of-turn markers like <|im_end|>
    add_bos: bool  # whether a prompt should start with BOS (tokenize never adds it)
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # the pre-tokenizer used for a "gpt2" vocabulary (after any fallback)
    warnings: tuple[str, ...]  # what was guessed or repaired while reading the metadata

    def __init__(
        self,
        *,
        model: str,
        pre: str | None,
        texts: list[str],
        types: bytes,
        bos_id: int | None,
        eos_id: int | None,
        eot_ids: frozenset[int],
        add_bos: bool,
        add_space_prefix: bool,
        rstrip_ids: frozenset[int] = frozenset(),
        hf: HFTokenizer | None = None,
        barrier_id: int | None = None,
        scores: array | None = None,
        warnings: tuple[str, ...] = (),
    ) -> None:
        """Use `from_metadata`; this only stores what it prepared."""
        self.model = model
        self.pre = pre
        self.n_vocab = len(texts)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_ids = eot_ids
        self.add_bos = add_bos
        self.warnings = warnings
        # A byte-level BPE vocabulary lives in the HF tokenizer, which already maps both ways; keeping a
        # Python copy too would cost ~7 MB for 49k tokens. SentencePiece keeps it here, packed (vocabulary.py):
        # we encode that ourselves.
        self._vocab = None if hf is not None else PackedVocabulary(texts)  # token text <-> id
        self._types = types  # one byte per token: its TOKEN_* type
        self._hf = hf  # byte-level BPE only
        self._barrier_id = barrier_id  # HF's stand-in for a byte the vocabulary lacks; never returned
        self._scores = scores  # SentencePiece only: float32 per token
        self._spm = model == "llama"
        # SentencePiece puts a space before the text; detokenize takes it off the first token again.
        self._add_space_prefix = add_space_prefix and self._spm
        # token bytes, filled on first use: the tokens a chat meets, not a slot for each (2 MB for 262k tokens)
        self._pieces: dict[int, bytes] = {}
        # llama.cpp's special-token cache: ids matched verbatim in the text, longest text (in bytes) first.
        kinds = np.frombuffer(types, dtype=np.uint8)
        specials = np.flatnonzero(np.isin(kinds, (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN))).tolist()
        specials.sort(key=lambda i: (-len(texts[i].encode()), i))
        self._specials = [(i, texts[i], i in rstrip_ids) for i in specials]
        self._user_defined = [s for s in self._specials if types[s[0]] == TOKEN_USER_DEFINED]
        self._byte_ids: dict[int, int] | None = None  # SentencePiece byte-fallback table, built on first use

    # -- building ---------------------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (key -> plain Python value).

        Raises UnsupportedModelError for a vocabulary kind we do not tokenize, ModelFileError for missing or
        inconsistent tokenizer metadata.
        """
        model = meta.get(_KEY + "model")
        if model is None:
            raise ModelFileError(f"{_KEY}model: missing; the file has no tokenizer")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"{_KEY}model = {model!r}: unsupported tokenizer; only 'gpt2' (byte-level BPE) "
                "and 'llama' (SentencePiece) vocabularies are supported"
            )
        warnings: list[str] = []
        texts = _read_tokens(meta, warnings)
        n = len(texts)
        types = _read_types(meta, n, warnings)
        vocab = dict(zip(texts, range(n), strict=True))
        if len(vocab) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(texts):
                if t in seen:
                    raise ModelFileError(f"{_KEY}tokens: duplicate token {t!r} at ids {seen[t]} and {i}")
                seen[t] = i

        bos_id = _read_id(meta, "bos_token_id", n)
        eos_id = _read_id(meta, "eos_token_id", n)
        if model == "llama":
            # llama.cpp's SentencePiece defaults: <s> = 1, </s> = 2.
            bos_id = 1 if bos_id is None and n > 1 else bos_id
            eos_id = 2 if eos_id is None and n > 2 else eos_id
        types, eot_ids = _end_of_generation(meta, texts, types, vocab, eos_id)
        general_name = str(meta.get("general.name", "")).lower()
        rstrip_ids: frozenset[int] = frozenset()

        if model == "gpt2":
            pre_name = meta.get(_KEY + "pre")
            if pre_name is None:
                warnings.append(f"{_KEY}pre is missing; using llama.cpp's 'default' pre-tokenizer")
                pre_name = "default"
            pre = _PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                warnings.append(
                    f"{_KEY}pre = {pre_name!r} is not known here; using the GPT-2 pre-tokenizer, "
                    "so some prompts may tokenize differently from llama.cpp"
                )
                pre_name, pre = "gpt-2", _PRE_TOKENIZERS["gpt-2"]
            hf, barrier_id = _build_bpe(meta, vocab, pre, warnings)
            add_bos_default, scores = pre.add_bos, None
        else:
            pre_name, hf, barrier_id, add_bos_default = None, None, None, True
            scores = _read_scores(meta, n)
            if "phi-3" in general_name or "phi3" in general_name:
                # llama.cpp strips the whitespace after Phi-3's special tokens (HF's rstrip=True).
                special = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
                rstrip = {i for i, t in enumerate(types) if t in special}
                rstrip |= {vocab[t] for t in ("</s>",) if t in vocab}
                rstrip -= {vocab[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in vocab}
                rstrip_ids = frozenset(rstrip)

        add_bos = bool(meta.get(_KEY + "add_bos_token", add_bos_default))
        if add_bos and bos_id is None:
            raise ModelFileError(f"{_KEY}add_bos_token is true, but {_KEY}bos_token_id is not set")
        return cls(
            model=model,
            pre=pre_name,
            texts=texts,
            types=types,
            bos_id=bos_id,
            eos_id=eos_id,
            eot_ids=eot_ids,
            add_bos=add_bos,
            add_space_prefix=bool(meta.get(_KEY + "add_space_prefix", True)),
            rstrip_ids=rstrip_ids,
            hf=hf,
            barrier_id=barrier_id,
            scores=scores,
            warnings=tuple(warnings),
        )

    # -- text -> ids ------------------------------------------------------------------------------------

    def tokenize(self, text: str, special: bool = True, plain_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids for `text`, as llama.cpp's llama_tokenize(add_special=False, parse_special=special).

        Never adds BOS: the caller does that when `add_bos` says so. With special=False, control tokens such
        as "<|im_start|>" are tokenized as plain text (do this for user-typed text). `plain_spans`, with
        special=True: (start, end) character ranges of `text`, in order and apart, that are read as with
        special=False, so a rendered prompt's own markers are control tokens and the messages inside it are text.
        """
        if not text:
            return []
        try:
            text.encode()
        except UnicodeEncodeError:  # lone surrogates (e.g. undecodable terminal input) are not text
            text = _SURROGATES.sub("\ufffd", text)  # one character for one: plain_spans keep their places
        if special and plain_spans:
            pieces = self._split_guarded(text, plain_spans)
        else:
            pieces = self._split_special(text, self._specials if special else self._user_defined)
        out: list[int] = []
        if self._spm:
            after_special = True  # SentencePiece adds a space at the start and after each special token
            known: dict[str, int | None] = {}  # this call's lookups: a text repeats its pairs many times
            for piece in pieces:
                if isinstance(piece, int):
                    out.append(piece)
                    after_special = True
                else:
                    if self._add_space_prefix and after_special:
                        piece = " " + piece
                    self._spm_encode(piece.replace(" ", _SPM_SPACE), out, known)
                    after_special = False
            return out
        assert self._hf is not None
        if len(pieces) == 1 and isinstance(pieces[0], str):
            out = self._hf.encode(pieces[0], add_special_tokens=False).ids
        else:
            chunks = [p for p in pieces if isinstance(p, str)]
            encoded = iter(self._hf.encode_batch_fast(chunks, add_special_tokens=False))
            for piece in pieces:
                if isinstance(piece, int):
                    out.append(piece)
                else:
                    out.extend(next(encoded).ids)
        if self._barrier_id is not None:
            out = [i for i in out if i != self._barrier_id]
        return out

    def _split_guarded(self, text: str, plain_spans: Sequence[tuple[int, int]]) -> list[str | int]:
        """`_split_special` with every special token outside `plain_spans` and only the always-matched
        (user-defined) ones inside; text pieces that meet at a span's edge are joined again, so the text is cut
        exactly where an unguarded special token stands and the BPE sees the same chunks as without guards."""
        pieces: list[str | int] = []
        at = 0
        for start, end in [*plain_spans, (len(text), len(text))]:
            if not at <= start <= end <= len(text):
                raise ValueError(f"plain span {start}..{end} is out of order or outside the text")
            for part, specials in ((text[at:start], self._specials), (text[start:end], self._user_defined)):
                if not part:
                    continue
                for piece in self._split_special(part, specials):
                    if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
                        pieces[-1] += piece
                    else:
                        pieces.append(piece)
            at = end
        return pieces

    def _split_special(self, text: str, specials: list[tuple[int, str, bool]]) -> list[str | int]:
        """Cut special-token texts out of `text` as llama.cpp's tokenizer_st_partition does: for each special
        token, longest first, every occurrence left to right in the text pieces still unsplit."""
        pieces: list[str | int] = [text]
        for token_id, token, rstrip in specials:
            if token not in text:  # one C-speed scan rules out nearly every special token
                continue
            split: list[str | int] = []
            for piece in pieces:
                if isinstance(piece, int) or token not in piece:
                    split.append(piece)
                    continue
                start = 0
                while (at := piece.find(token, start)) >= 0:
                    if at > start:
                        split.append(piece[start:at])
                    split.append(token_id)
                    start = at + len(token)
                    if rstrip:
                        while start < len(piece) and piece[start] in _C_SPACE:
                            start += 1
                if start < len(piece):
                    split.append(piece[start:])
            pieces = split
        return pieces

    def _spm_encode(self, text: str, out: list[int], known: dict[str, int | None]) -> None:
        """llama.cpp's llm_tokenizer_spm_session: start from single characters and keep merging the adjacent
        pair whose merged text is the highest-scoring token (leftmost on ties); what is left that is not a
        token goes out as byte tokens <0xNN>. `known`: texts looked up already (id or None), added to."""
        scores, vocab = self._scores, self._vocab
        assert scores is not None and vocab is not None

        def id_of(piece: str) -> int | None:
            if piece in known:
                return known[piece]
            token_id = known[piece] = vocab.get(piece)
            return token_id

        symbols = list(text)  # "" once merged into its left neighbour
        n = len(symbols)
        if n == 0:
            return
        prev = list(range(-1, n - 1))
        next_ = [*range(1, n), -1]
        # (-score, left index, merged length, right index): heapq pops the best score, then the leftmost.
        heap: list[tuple[float, int, int, int]] = []
        for i in range(1, n):
            merged = symbols[i - 1] + symbols[i]
            if (token_id := id_of(merged)) is not None:
                heap.append((-scores[token_id], i - 1, len(merged), i))
        heapq.heapify(heap)
        while heap:
            _, left, size, right = heapq.heappop(heap)
            a, b = symbols[left], symbols[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # one side was merged since this pair was queued
            symbols[left], symbols[right] = a + b, ""
            next_[left] = after = next_[right]
            if after >= 0:
                prev[after] = left
            for lo, hi in ((prev[left], left), (left, after)):
                if lo >= 0 and hi >= 0:
                    merged = symbols[lo] + symbols[hi]
                    if (token_id := id_of(merged)) is not None:
                        heapq.heappush(heap, (-scores[token_id], lo, len(merged), hi))
        # Every merged symbol is a token by construction, so llama.cpp's rev_merge re-segmentation never
        # fires: a symbol is a token, or a single character that goes out as bytes.
        i = 0
        while i >= 0:
            token_id = id_of(symbols[i])
            if token_id is not None:
                out.append(token_id)
            else:
                out.extend(self._byte_token(b) for b in symbols[i].encode())
            i = next_[i]

    def _byte_token(self, byte: int) -> int:
        """SentencePiece byte fallback: the <0xNN> token, else the byte itself as a token (llama.cpp)."""
        if self._byte_ids is None:
            vocab = self._vocab
            assert vocab is not None  # SentencePiece vocabularies are packed
            table = {}
            for b in range(256):
                token_id = vocab.get(f"<0x{b:02X}>")
                if token_id is None and b < 0x80:
                    token_id = vocab.get(chr(b))
                if token_id is not None:
                    table[b] = token_id
            self._byte_ids = table
        token_id = self._byte_ids.get(byte)
        if token_id is None:
            raise ModelFileError(f"{_KEY}tokens: no byte-fallback token <0x{byte:02X}> for this text")
        return token_id

    # -- ids -> text ------------------------------------------------------------------------------------

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of `ids`. Control tokens render as their text; invalid UTF-8 becomes U+FFFD.

        As llama.cpp's llama_detokenize, a SentencePiece vocabulary drops the space it added in front of the
        first token, so that detokenize(tokenize(s)) == s.
        """
        pieces = [self._piece(i) for i in ids]
        if self._add_space_prefix and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", "replace")

    def stream_detokenizer(self) -> StreamDetokenizer:
        """A detokenizer for one reply's ids, fed one token at a time."""
        return StreamDetokenizer(self)

    def token_text(self, token_id: int) -> str:
        """One token's text for a UI table: control characters escaped (\\n, \\t, \\x00), bytes that are not
        whole UTF-8 shown as \\xNN, and a token that renders as nothing shown by its vocabulary text."""
        piece = self._piece(token_id)
        if not piece:
            return self._text(token_id)
        return piece.decode("utf-8", "backslashreplace").translate(_PRINTABLE)

    def token_id(self, text: str) -> int | None:
        """The id of the token whose vocabulary text is `text` (e.g. "<|im_end|>", "Ġthe"), else of the token
        that renders as `text` (" the"); None when there is none."""
        token_id = self._lookup(text)
        if token_id is None:
            if self._spm:
                spelled = text.replace(" ", _SPM_SPACE)
            else:
                spelled = text.encode().decode("latin-1").translate(_LATIN1_TO_ALPHABET)
            token_id = self._lookup(spelled)
        return token_id

    def _text(self, token_id: int) -> str:
        """Token `token_id`'s vocabulary text (an id already checked)."""
        if self._vocab is not None:
            return self._vocab.text(token_id)
        assert self._hf is not None  # one of the two is always set
        text = self._hf.id_to_token(token_id)
        assert text is not None  # the id was checked against the vocabulary
        return text

    def _lookup(self, text: str) -> int | None:
        """The id of the vocabulary text `text`, if it is one."""
        if self._vocab is not None:
            return self._vocab.get(text)
        assert self._hf is not None  # one of the two is always set
        token_id = self._hf.token_to_id(text)
        return token_id if token_id is not None and token_id < self.n_vocab else None  # not the barrier

    @property
    def special_texts(self) -> frozenset[str]:
        """The texts that tokenize(special=True) turns into one special token (control, user-defined, unknown)."""
        return frozenset(text for _, text, _ in self._specials)

    @property
    def control_texts(self) -> frozenset[str]:
        """The texts that are one token with special=True but plain text with special=False: what untrusted
        text must never be allowed to become."""
        return self.special_texts - frozenset(text for _, text, _ in self._user_defined)

    def is_control(self, token_id: int) -> bool:
        """Whether the token is a control token (<|im_start|>, </s>, ...), not text the model writes."""
        self._check_id(token_id)
        return self._types[token_id] == TOKEN_CONTROL

    def all_token_bytes(self) -> list[bytes]:
        """Every token's bytes, in id order, as `detokenize` renders each alone (control tokens as their text).

        Built on each call and not cached (a constrained-decoding vocabulary is built once per model)."""
        return [self._make_piece(i) for i in range(self.n_vocab)]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")

    def _piece(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for, as llama.cpp's token_to_piece(special=True); cached."""
        self._check_id(token_id)
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id)
        return piece

    def _make_piece(self, token_id: int) -> bytes:
        text, kind = self._text(token_id), self._types[token_id]
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
            return text.encode()
        if kind == TOKEN_BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            try:
                return bytes([int(text[3:5], 16)])  # "<0xNN>"
            except ValueError:
                return text.encode()  # a byte token not spelled <0xNN>: show what it says
        if kind != TOKEN_NORMAL:
            return b""  # unused / undefined tokens render as nothing in llama.cpp
        if self._spm:
            return text.replace(_SPM_SPACE, " ").encode()
        try:
            return text.translate(_ALPHABET_TO_LATIN1).encode("latin-1")
        except UnicodeEncodeError:  # a char outside the byte alphabet: keep it as its own UTF-8
            return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode() for c in text)

    def __repr__(self) -> str:
        kind = f"{self.model}/{self.pre}" if self.pre else self.model
        return f"Tokenizer({kind}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


class StreamDetokenizer:
    """Text of a reply as its tokens arrive: `push(id)` returns what became printable, holding back the
    start of a UTF-8 sequence split across tokens, and `flush()` returns whatever is left.

    All pushes plus flush concatenate to `detokenize(ids)` whenever that text is valid UTF-8. Each push works
    on that token's bytes only (at most 3 bytes are held), so a reply costs O(1) per token.
    """

    __slots__ = ("_piece", "_held", "_strip_space")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._piece = tokenizer._piece
        self._held = b""
        self._strip_space = tokenizer._add_space_prefix  # as detokenize: the first token's added space

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete ("" while a character is incomplete)."""
        data = self._piece(token_id)
        if self._strip_space:
            self._strip_space = False
            if data[:1] == b" ":
                data = data[1:]
        if self._held:
            data = self._held + data
        cut = _utf8_complete_prefix(data)
        self._held = data[cut:]
        return data[:cut].decode("utf-8", "replace")

    def flush(self) -> str:
        """The held-back bytes, if any, decoded with U+FFFD for what is incomplete."""
        held, self._held = self._held, b""
        return held.decode("utf-8", "replace")


def _utf8_complete_prefix(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not stop inside a UTF-8 sequence."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte < 0x80:
            return n  # ASCII: nothing open
        if byte >= 0xC0:  # the lead byte of the last sequence
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4 if byte < 0xF8 else 1
            return n - back if back < need else n
    return n  # only continuation bytes: invalid anyway, let the decoder replace them


# --- reading the metadata --------------------------------------------------------------------------------


def _read_tokens(meta: Mapping[str, Any], warnings: list[str]) -> list[str]:
    key = _KEY + "tokens"
    tokens = meta.get(key)
    if tokens is None or isinstance(tokens, str) or len(tokens) == 0:
        raise ModelFileError(f"{key}: missing or empty; the file has no vocabulary")
    texts = list(tokens)
    if "" in texts:  # llama.cpp renames empty tokens so that they cannot match anything
        empty = [i for i, t in enumerate(texts) if t == ""]
        for i in empty:
            texts[i] = f"[EMPTY_{i}]"
        warnings.append(f"{key}: {len(empty)} empty token(s), renamed [EMPTY_<id>] as llama.cpp does")
    return texts


def _read_types(meta: Mapping[str, Any], n: int, warnings: list[str]) -> bytes:
    key = _KEY + "token_type"
    raw = meta.get(key)
    if raw is None:
        warnings.append(f"{key} is missing; treating every token as normal text")
        return bytes([TOKEN_NORMAL]) * n
    types = np.asarray(raw, dtype=np.int64)
    if types.ndim != 1 or len(types) != n:
        raise ModelFileError(f"{key}: {len(types)} entries for {n} tokens in {_KEY}tokens")
    # llama.cpp reads any other value as "undefined"
    types = np.where((types >= TOKEN_UNDEFINED) & (types <= TOKEN_BYTE), types, TOKEN_UNDEFINED)
    return types.astype(np.uint8).tobytes()


def _read_scores(meta: Mapping[str, Any], n: int) -> array:
    """float32 per token, in an array whose items index as Python floats (the encoder's heap compares them)."""
    key = _KEY + "scores"
    raw = meta.get(key)
    if raw is None:
        return array("f", bytes(4 * n))  # as llama.cpp: no scores, every merge ties and the leftmost wins
    scores = np.asarray(raw, dtype=np.float32)
    if scores.ndim != 1 or len(scores) != n:
        raise ModelFileError(f"{key}: {len(scores)} entries for {n} tokens in {_KEY}tokens")
    return array("f", scores.tobytes())


def _read_id(meta: Mapping[str, Any], name: str, n: int) -> int | None:
    key = _KEY + name
    value = meta.get(key)
    if value is None:
        return None
    try:
        token_id = operator.index(value)
    except TypeError:
        raise ModelFileError(f"{key}: expected a token id, found {value!r}") from None
    if not 0 <= token_id < n:
        raise ModelFileError(f"{key} = {token_id} is outside the vocabulary of {n} tokens")
    return token_id


def _end_of_generation(
    meta: Mapping[str, Any], texts: list[str], types: bytes, vocab: dict[str, int], eos_id: int | None
) -> tuple[bytes, frozenset[int]]:
    """llama.cpp's end-of-generation set (EOS, EOT, EOM, FIM pad/rep/sep, and the tokens whose text marks an
    end of turn), with the type fixes it makes on the way: such tokens become control tokens."""
    fixed = bytearray(types)
    eog: set[int] = set()
    for name, candidates in _FIM_TEXTS.items():
        token_id = _read_id(meta, name + "_token_id", len(texts))
        if token_id is None and name in _FIM_DEPRECATED_KEYS:
            token_id = _read_id(meta, _FIM_DEPRECATED_KEYS[name] + "_token_id", len(texts))
        if token_id is None:
            for text in candidates:
                if (found := vocab.get(text)) is not None:
                    token_id = found
                    fixed[found] = TOKEN_CONTROL
                    break
        if token_id is not None and name in ("fim_pad", "fim_rep", "fim_sep"):
            eog.add(token_id)
    for text in _EOG_TEXTS:
        if (token_id := vocab.get(text)) is not None:
            eog.add(token_id)
            fixed[token_id] = TOKEN_CONTROL
    for name in ("eot_token_id", "eom_token_id"):
        if (token_id := _read_id(meta, name, len(texts))) is not None:
            eog.add(token_id)
    if eos_id is not None:
        eog.add(eos_id)
    # gpt-oss and solar-open: "<|end|>" ends a message, not the reply, when <|return|>/<|call|> exist.
    has = {texts[i] for i in eog}
    if "<|end|>" in has and ({"<|return|>", "<|call|>"} <= has or {"<|calls|>", "<|flush|>"} <= has):
        end = vocab["<|end|>"]
        eog.discard(end)
        fixed[end] = TOKEN_USER_DEFINED
    # gemma4 / paddleocr: "</s>" is text there.
    if "<|tool_response>" in has and "</s>" in has:
        eog.discard(vocab["</s>"])
        fixed[vocab["</s>"]] = TOKEN_NORMAL
    # gpt-oss: llama.cpp always renders these, so they are matched in text even with special=False.
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if (token_id := vocab.get(text)) is not None:
            fixed[token_id] = TOKEN_USER_DEFINED
    return bytes(fixed), frozenset(eog)


def _build_bpe(
    meta: Mapping[str, Any], vocab: dict[str, int], pre: _Pre, warnings: list[str]
) -> tuple[HFTokenizer, int | None]:
    """The HF tokenizer for a byte-level BPE vocabulary, and the id of its barrier token (see below)."""
    key = _KEY + "merges"
    merges = meta.get(key)
    if merges is None or isinstance(merges, str):
        raise ModelFileError(f"{key}: missing; a 'gpt2' vocabulary needs its BPE merges")
    merges = list(merges)
    # Each merge is "left right". Splitting them all in one join/split is ~3x faster than one split each.
    parts = " ".join(merges).split(" ")
    if len(parts) == 2 * len(merges):
        halves = iter(parts)
        pairs = list(zip(halves, halves, strict=True))
    else:  # some merge has no space or several: split at the first space after the first char (llama.cpp)
        pairs = []
        for merge in merges:
            at = merge.find(" ", 1)
            if at > 0:
                pairs.append((merge[:at], merge[at + 1 :]))
    # A byte the vocabulary lacks (Falcon has no "\v") stays in llama.cpp as a symbol that nothing merges
    # with, and is dropped at the end; HF drops it first, and its neighbours then merge. Mapping such bytes
    # to a stand-in unknown token, outside the vocabulary and removed by tokenize(), keeps the barrier.
    barrier: str | None = None
    barrier_id: int | None = None
    if any(c not in vocab for c in _BYTE_TO_CHAR):
        barrier, barrier_id = "<missing byte>", len(vocab)
        while barrier in vocab:
            barrier += "\uffff"
        vocab[barrier] = barrier_id  # taken out again below: BPE keeps its own copy
    try:
        try:
            model = BPE(vocab, pairs, unk_token=barrier, ignore_merges=pre.ignore_merges)
        except Exception:  # a merge naming a token the vocabulary lacks; llama.cpp tolerates those
            kept = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
            warnings.append(f"{key}: dropped {len(pairs) - len(kept)} merge(s) naming tokens not in the vocabulary")
            try:
                model = BPE(vocab, kept, unk_token=barrier, ignore_merges=pre.ignore_merges)
            except Exception as err:
                raise ModelFileError(f"{key}: cannot build the BPE model: {err}") from None
    finally:
        if barrier is not None:
            del vocab[barrier]
    hf = HFTokenizer(model)
    splits = [Split(Regex(regex), behavior="isolated") for regex in pre.regexes]
    hf.pre_tokenizer = PreTokenizerSequence([*splits, ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf, barrier_id
