"""Chat templates: the real models' templates render exactly, and hostile or missing templates fall back to a
built-in format the vocabulary is written in."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path

import jinja2
import pytest

import engine.template
from engine.events import Message
from engine.template import ChatTemplate

CONVERSATION = [
    Message("system", "Answer in one word."),
    Message("user", "Capital of France?"),
    Message("assistant", "Paris."),
    Message("user", "And of Italy?"),
]
CHATML = (
    "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
    "<|im_start|>user\nCapital of France?<|im_end|>\n"
    "<|im_start|>assistant\nParis.<|im_end|>\n"
    "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
WITHOUT_SYSTEM = CHATML.split("<|im_end|>\n", 1)[1]  # the same conversation, system turn removed


def model_template(model) -> tuple[str, str, str]:
    """(chat template, BOS text, EOS text) of a loaded real model."""
    tok = model.tokenizer
    return model.file.metadata["tokenizer.chat_template"], tok.detokenize([tok.bos_id]), tok.detokenize([tok.eos_id])


@pytest.fixture(scope="module")
def smollm(smollm2_model) -> tuple[str, str, str]:
    return model_template(smollm2_model)


@pytest.fixture(scope="module")
def qwen(qwen_model) -> tuple[str, str, str]:
    return model_template(qwen_model)


def chatml(messages: list[Message], add_generation_prompt: bool = True) -> str:
    turns = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
    return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


# --- the real templates -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm_template(smollm: tuple[str, str, str]) -> None:
    t = ChatTemplate.from_metadata(*smollm)
    assert t.render(CONVERSATION, add_generation_prompt=True) == CHATML
    no_prompt = CHATML.removesuffix("<|im_start|>assistant\n")
    assert t.render(CONVERSATION, add_generation_prompt=False) == no_prompt
    default_system = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    )
    assert t.render(CONVERSATION[1:], add_generation_prompt=True) == default_system + WITHOUT_SYSTEM
    assert t.end_of_turn_strings() == ["<|im_end|>"]
    assert not t.uses_fallback and t.warning is None


@pytest.mark.slow
def test_qwen_template_injects_its_default_system_prompt(qwen: tuple[str, str, str]) -> None:
    t = ChatTemplate.from_metadata(*qwen)
    assert t.render(CONVERSATION, add_generation_prompt=True) == CHATML
    default_system = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )
    assert t.render(CONVERSATION[1:], add_generation_prompt=True) == default_system + WITHOUT_SYSTEM
    assert t.end_of_turn_strings() == ["<|im_end|>"]
    assert not t.uses_fallback and t.warning is None


class CountingClock:
    """Stands in for engine.template's clock: each reading advances it by one, so the render's deadline counts
    the Python lines the render runs (the tracer reads the clock once a line) instead of seconds that a fast,
    slow or loaded machine would stretch. `reads` is how many lines ran."""

    def __init__(self) -> None:
        self.reads = 0

    def monotonic(self) -> float:
        self.reads += 1
        return float(self.reads)


@pytest.fixture
def counting_clock(monkeypatch: pytest.MonkeyPatch) -> CountingClock:
    clock = CountingClock()
    monkeypatch.setattr(engine.template, "time", clock)
    return clock


# Traced lines to compile Qwen2.5's template and render 400 messages of 50 words: measured 38 465 (Python 3.11,
# Jinja2 3.1). Bound 4x that, so a render doing per-character or quadratic work in Python fails, a new Jinja not.
QWEN_LONG_LINES = 160_000


@pytest.mark.slow
def test_qwen_template_renders_long_conversations_quickly(
    qwen: tuple[str, str, str], counting_clock, monkeypatch
) -> None:
    """Within a budget of traced lines, enforced by the render's own deadline (over it, the render falls back)."""
    monkeypatch.setattr(engine.template, "RENDER_TIME_LIMIT_S", QWEN_LONG_LINES)
    t = ChatTemplate.from_metadata(*qwen)
    long = [Message("user" if i % 2 == 0 else "assistant", "word " * 50) for i in range(400)]
    counting_clock.reads = 0
    text = t.render(long, add_generation_prompt=True)
    print(f"traced lines: {counting_clock.reads}")
    assert counting_clock.reads < QWEN_LONG_LINES, counting_clock.reads
    assert not t.uses_fallback and text.count("<|im_start|>") == 402


# --- what the environment offers templates, as HF transformers does ---------------------------------------


def render(source: str, messages: list[Message] | None = None, **kwargs: object) -> tuple[str, ChatTemplate]:
    t = ChatTemplate.from_metadata(source, "<s>", "</s>")
    return t.render(messages or [Message("user", "Hi")], **{"add_generation_prompt": True, **kwargs}), t


def test_variables_and_message_access() -> None:
    text, t = render(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}"
    )
    assert text == "<s>user=Hi;></s>" and t.warning is None
    source = "{{ messages|length }}{% if add_generation_prompt %}>{% endif %}."
    assert render(source, add_generation_prompt=False)[0] == "1."


def test_trim_and_lstrip_blocks() -> None:
    source = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert render(source)[0] == "U:Hi\n"


def test_tojson_is_hf_flavoured() -> None:
    text, _ = render(
        "{{ messages|tojson }}|{{ {'b': 1, 'a': '<é>'}|tojson(indent=1, sort_keys=true) }}",
        [Message("user", "café <b>")],
    )
    assert text == '[{"role": "user", "content": "café <b>"}]|{\n "a": "<é>",\n "b": 1\n}'  # no HTML escaping


def test_strftime_now_loop_controls_and_generation_tag() -> None:
    assert render("{{ strftime_now('%Y') }}")[0] == str(datetime.now().year)
    loop = "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert render(loop)[0] == "01"
    assert render("A{% generation %}B{% endgeneration %}C")[0] == "ABC"


def test_raise_exception_fails_the_template_with_its_message() -> None:
    text, t = render("{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    assert text == chatml([Message("user", "Hi")])
    assert t.warning == (
        "chat template failed (TemplateError: Conversation roles must alternate user/assistant); using ChatML"
    )


# --- fallback to ChatML -----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", [None, "", "  \n"])
def test_no_template_means_chatml(source: str | None) -> None:
    t = ChatTemplate.from_metadata(source, "", "")
    assert t.uses_fallback and t.warning == "the model has no chat template; using ChatML"
    assert t.render(CONVERSATION, add_generation_prompt=True) == CHATML
    assert t.render(CONVERSATION, add_generation_prompt=False) == chatml(CONVERSATION, False)
    assert t.end_of_turn_strings() == ["<|im_end|>"]


def test_a_template_that_does_not_compile() -> None:
    t = ChatTemplate.from_metadata("{% for %}", "", "")
    assert t.uses_fallback  # known before the first render
    assert t.warning is not None
    assert t.warning.startswith("chat template does not compile (TemplateSyntaxError")
    assert t.render(CONVERSATION, add_generation_prompt=True) == CHATML


def test_an_empty_render_falls_back() -> None:
    text, t = render("{% if false %}x{% endif %}  \n")
    assert text == chatml([Message("user", "Hi")])
    assert t.warning == "chat template rendered an empty prompt; using ChatML"


def test_an_undefined_variable_used_as_an_object_falls_back() -> None:
    text, t = render("{{ tools.names() }}")
    assert t.uses_fallback and t.warning is not None and "UndefinedError" in t.warning


def test_the_first_failure_is_final_and_warned_once() -> None:
    t = ChatTemplate.from_metadata(
        "{% if messages|length > 1 %}{{ raise_exception('too long') }}{% endif %}[{{ messages[0].content }}]",
        "",
        "",
    )
    one = [Message("user", "Hi")]
    assert t.render(one, add_generation_prompt=True) == "[Hi]" and t.warning is None
    assert t.render(CONVERSATION, add_generation_prompt=True) == CHATML
    warning = t.warning
    assert warning == "chat template failed (TemplateError: too long); using ChatML"
    for _ in range(3):  # the template that worked for `one` is not tried again: the format stays ChatML
        assert t.render(one, add_generation_prompt=True) == chatml(one)
        assert t.render(CONVERSATION, add_generation_prompt=True) == CHATML
    assert t.warning == warning and t.uses_fallback


# --- escape attempts --------------------------------------------------------------------------------------


def test_the_popen_payload_is_live_outside_the_sandbox_and_dead_inside(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    payload = "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}"
    # The oracle: unsandboxed, the same attribute chain reaches os and runs the command.
    live = "{% set p = cycler.__init__.__globals__.os.popen('touch " + str(marker) + "') %}{{ p.close() }}"
    jinja2.Environment().from_string(live).render()
    assert marker.exists()
    marker.unlink()

    text, t = render("<|im_start|>" + payload)
    assert not marker.exists()
    assert text == chatml([Message("user", "Hi")])
    assert t.warning == (
        "chat template failed (SecurityError: access to attribute '__init__' of 'type' object is unsafe); using ChatML"
    )


@pytest.mark.parametrize(
    "payload",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",  # rendered as '' by a plain sandbox; we refuse it outright
        "{{ ''['__class__'] }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ self.__init__.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ range.__init__ }}",
        "{{ cycler.__init__ }}",
        "{{ self._TemplateReference__context }}",
        "{% set x = ''|attr('__class__') %}{{ x.__mro__ }}",
        "{% set x = messages|attr('__class__') %}{{ x }}",
        "{{ messages[0].__class__ }}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_internal_attributes_never_resolve(payload: str) -> None:
    text, t = render("<|im_start|>user\n" + payload)
    assert text == chatml([Message("user", "Hi")])
    assert "<class" not in text and "function" not in text
    assert t.uses_fallback and t.warning is not None
    assert t.warning.startswith("chat template failed (SecurityError: access to attribute")


@pytest.mark.parametrize("payload", ["{{ config }}{{ request }}", "{{ config.items() }}", "{{ request.environ }}"])
def test_flask_style_globals_do_not_exist(payload: str) -> None:
    text, t = render(payload)
    assert text == chatml([Message("user", "Hi")])
    assert t.uses_fallback and t.warning is not None


# --- resource exhaustion ----------------------------------------------------------------------------------


SIZE_BOMB_LINES = 10**6  # 5x the most measured (test_size_bombs_fail_promptly)

@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ("{% for i in range(10**9) %}x{% endfor %}", "argument 1000000000 to safe_range is too large"),
        ("{% for i in range(200000) %}x{% endfor %}", "Range too big"),  # Jinja's own MAX_RANGE
        ("{{ 'x' * 10**9 }}", "a sequence of 1 repeated 1000000000 times is too large"),
        ("{{ [0] * 10**9 }}", "a sequence of 1 repeated 1000000000 times is too large"),
        ("{{ 9 ** 999999999 }}", "9 ** 999999999 is too large"),
        ("{{ 'x'.center(10**9) }}", "argument 1000000000 to center is too large"),
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output is over 1000000 characters"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
        ("{% for m in messages recursive %}{{ loop([m]) }}{% endfor %}", "RecursionError"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "a string over 1000000 characters",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "a sequence over 1000000 items",
        ),
    ],
)
def test_size_bombs_fail_promptly(payload: str, reason: str, counting_clock, monkeypatch) -> None:
    """Promptly: each bomb is stopped by its own guard (the reason), within a budget of traced lines, the same on
    any machine. Measured up to 198 000 (the recursion bombs; the others 3 200-29 000); a bomb that ran to the
    deadline would be named a timeout."""
    monkeypatch.setattr(engine.template, "RENDER_TIME_LIMIT_S", SIZE_BOMB_LINES)
    text, t = render(payload)
    print(f"traced lines: {counting_clock.reads}")
    assert text == chatml([Message("user", "Hi")])
    assert t.warning is not None and reason in t.warning


def test_a_silent_endless_loop_hits_the_time_limit(counting_clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The code's own deadline stops a loop of 10**10 iterations: with the clock counting lines, at the limit."""
    limit = 20_000
    monkeypatch.setattr(engine.template, "RENDER_TIME_LIMIT_S", limit)
    before = sys.gettrace()
    text, t = render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x")
    assert limit < counting_clock.reads < 2 * limit  # stopped at the deadline, not after 10**10 iterations
    assert text == chatml([Message("user", "Hi")])
    assert t.warning == f"chat template failed (timeout: rendering took longer than {limit} s); using ChatML"
    assert sys.gettrace() is before


def test_the_time_limit_is_on_the_real_clock() -> None:
    """Without the counting clock, the deadline reads time.monotonic (the tests above replace it)."""
    assert engine.template.time is time


def test_an_oversized_template_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.template, "MAX_SOURCE_CHARS", 100)
    t = ChatTemplate.from_metadata("x" * 101, "", "")
    assert t.uses_fallback and t.warning == "chat template is 101 characters, over 100; using ChatML"


def test_a_previous_tracer_is_restored() -> None:
    def tracer(frame: object, event: str, arg: object) -> None:
        return None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        text, t = render("[{{ messages[0].content }}]")
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(before)
    assert text == "[Hi]" and t.warning is None


# --- end-of-turn strings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "eos", "expected"),
    [
        (  # Llama 3
            "{{ bos_token }}{% for m in messages %}"
            "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
            " + m['content'] | trim + '<|eot_id|>' }}"
            "{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
            "<|end_of_text|>",
            ["<|eot_id|>"],
        ),
        (  # Phi-3: closes the turn, then the conversation with EOS
            "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
            "<|endoftext|>",
            ["<|end|>", "<|endoftext|>"],
        ),
        (  # Mistral
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] +"
            " ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}",
            "</s>",
            ["</s>"],
        ),
        (  # Gemma
            "{% for m in messages %}"
            "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role'])"
            " + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
            "<eos>",
            ["<end_of_turn>"],
        ),
        (  # nothing after the assistant's text: the EOS token is all we know
            "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}",
            "<|endoftext|>",
            ["<|endoftext|>"],
        ),
    ],
)
def test_end_of_turn_strings(source: str, eos: str, expected: list[str]) -> None:
    t = ChatTemplate.from_metadata(source, "<s>", eos)
    assert t.end_of_turn_strings() == expected
    assert t.warning is None


# --- the built-in format follows the vocabulary ------------------------------------------------------------

GEMMA_SPECIALS = {"<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"}


def test_no_template_and_gemma_tokens_means_gemma_turns() -> None:
    t = ChatTemplate.from_metadata(None, "<bos>", "<eos>", GEMMA_SPECIALS)
    assert t.warning == "the model has no chat template; using Gemma's turn format"
    assert t.render(CONVERSATION, add_generation_prompt=True) == (
        "<start_of_turn>user\nAnswer in one word.\n\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert t.end_of_turn_strings() == ["<end_of_turn>"]


def test_a_lone_system_message_becomes_gemmas_first_user_turn() -> None:
    t = ChatTemplate.from_metadata(None, "", "", GEMMA_SPECIALS)
    assert t.render([Message("system", " Be brief. ")], add_generation_prompt=False) == (
        "<start_of_turn>user\nBe brief.<end_of_turn>\n"
    )


def test_no_template_and_llama3_tokens_means_llama3_headers() -> None:
    specials = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}
    t = ChatTemplate.from_metadata("", "<|begin_of_text|>", "<|eot_id|>", specials)
    text = t.render(CONVERSATION[1:2], add_generation_prompt=True)
    assert text == (
        "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert t.end_of_turn_strings() == ["<|eot_id|>"]


def test_chatml_when_the_vocabulary_has_chatml_or_no_known_markers() -> None:
    both = GEMMA_SPECIALS | {"<|im_start|>", "<|im_end|>"}  # ChatML first: the most common writing
    assert ChatTemplate.from_metadata(None, "", "", both).render(CONVERSATION, True) == CHATML
    only_half = {"<start_of_turn>"}  # a format is used only when every marker is one token
    assert ChatTemplate.from_metadata(None, "", "", only_half).render(CONVERSATION, True) == CHATML


def test_a_failing_template_falls_back_to_the_vocabularys_format() -> None:
    t = ChatTemplate.from_metadata("{{ raise_exception('no') }}", "", "", GEMMA_SPECIALS)
    assert t.render(CONVERSATION[1:2], add_generation_prompt=True).startswith("<start_of_turn>user\n")
    assert t.warning is not None and t.warning.endswith("; using Gemma's turn format")


@pytest.mark.slow
def test_gemma3_file_without_template_chats_in_its_own_tokens(gemma3_model) -> None:
    """The Gemma 3 base file has no chat template: its prompt uses <start_of_turn> tokens, and <end_of_turn>
    stops a reply, instead of ChatML tags the vocabulary spells out as text."""
    from engine.chat import ChatSession

    tok = gemma3_model.tokenizer
    assert "tokenizer.chat_template" not in gemma3_model.file.metadata
    chat = ChatSession(gemma3_model)
    ids = chat.prompt_tokens([Message("user", "Hello")])
    start, end = tok.token_id("<start_of_turn>"), tok.token_id("<end_of_turn>")
    assert ids[0] == tok.bos_id and ids.count(start) == 2
    assert tok.token_id("<|im_start|>") is None and end in chat.stop_ids
    assert any("Gemma's turn format" in w for w in chat.warnings())
