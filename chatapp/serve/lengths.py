"""A prompt's length told before the work of tokenizing it.

No token covers more bytes of text than the vocabulary's longest token, so a text of `n` bytes becomes at least
`n / longest` tokens. When that alone is more than the context holds, the prompt is refused without tokenizing
(or, for chat, rendering) megabytes: quick, and without the memory that tokenizing them would take.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


@functools.lru_cache(maxsize=4)
def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most bytes of text one token can stand for: each token's text (escapes and byte tokens' `<0xAB>`
    spellings only make it longer than what it covers) and each special token's literal text.

    0.6 s for SmolLM2's 49k tokens, 2.3 s for Gemma 3's 262k (Xeon, 2 shared threads): the server computes it
    once, on the inference thread as the model becomes ready."""
    texts = (tokenizer.token_text(i) for i in range(tokenizer.n_vocab))
    longest = max((_n_bytes(t) for t in texts), default=1)
    return max(longest, *(_n_bytes(t) for t in tokenizer.special_texts), 1)


def fewest_tokens(texts: Iterable[str], longest: int) -> tuple[int, int]:
    """(the fewest tokens `texts` can become, their length in bytes)."""
    n_bytes = sum(_n_bytes(t) for t in texts)
    return math.ceil(n_bytes / longest), n_bytes


def _n_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # a lone surrogate counts as the 3 bytes it is spelt in
