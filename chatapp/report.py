"""The llama.cpp-style timing summary `chatapp run` prints to stderr."""

from __future__ import annotations

from typing import TextIO

from engine import Model
from engine.events import TurnStats


def _line(label: str, ms: float, count: int, unit: str) -> str:
    per = ms / count if count else 0.0
    rate = 1000.0 * count / ms if ms > 0 else 0.0
    return f"{label:>16} = {ms:10.2f} ms / {count:5d} {unit:6} ({per:8.2f} ms per token, {rate:8.2f} tokens per second)"


def print_run_summary(model: Model, stats: TurnStats | None, out: TextIO) -> None:
    print(file=out)
    print(f"{'load time':>16} = {model.load_s * 1000:10.2f} ms", file=out)
    if stats is None:
        return
    print(_line("prompt eval time", stats.prefill_ms, stats.evaluated_tokens, "tokens"), file=out)
    if stats.draft_prefill_ms:  # the draft model's own pass over the prompt, before the reply
        print(f"{'draft prompt':>16} = {stats.draft_prefill_ms:10.2f} ms", file=out)
    # The first token comes from the prompt's logits; each later one costs a forward pass.
    print(_line("eval time", stats.decode_ms, max(stats.generated_tokens - 1, 0), "runs"), file=out)
    total = stats.prefill_ms + stats.draft_prefill_ms + stats.decode_ms
    print(
        f"{'total time':>16} = {total:10.2f} ms / {stats.prompt_tokens + stats.generated_tokens:5d} tokens",
        file=out,
    )
    reused = f", {stats.reused_tokens} reused from cache" if stats.reused_tokens else ""
    print(
        f"{'stop':>16} = {stats.stop_reason}; context {stats.n_ctx_used}/{stats.n_ctx}{reused}; "
        f"{model.threads} threads",
        file=out,
    )
    if stats.drafter:
        print(
            f"{'draft':>16} = {stats.drafter}: {stats.draft_accepted}/{stats.draft_tokens} guesses accepted "
            f"({stats.acceptance_rate:.0%}), {stats.tokens_per_pass:.2f} tokens per target pass",
            file=out,
        )
