"""Structured output through `chatapp serve` on the real Qwen2.5-Coder-1.5B, driven by the official `openai` client:
response_format (json_schema, json_object), llama-server's grammar and json_schema fields, logit_bias, and 400s
that name the field for bad schemas, bad grammars and fields the server does not implement. Then `chatapp run`
with --json-schema, locally and against this server through the remote client.

One server for the module; every request is short (max_tokens <= 120).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from chatapp.cli import main
from engine.gguf_file import open_gguf
from engine.tokenizer import Tokenizer

from .test_serve import Server, _assert_error, _start, _user

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 40},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2100},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "year", "genres", "in_print"],
    "additionalProperties": False,
}
PROMPTS = [
    "Tell me about the novel Dune.",
    "What is your favourite recipe?",  # nothing to do with books: the schema must hold all the same
    "Reply with a haiku about the sea.",
]
BOOK_FORMAT = {"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK, "strict": True}}


@pytest.fixture(scope="module")
def qserver(qwen15_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("serve-constrained"), qwen15_path)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_json_schema_reply_validates(qserver: Server, temperature: float) -> None:
    client = qserver.client()
    for i, prompt in enumerate(PROMPTS):
        reply = client.chat.completions.create(
            model=qserver.model, messages=_user(prompt), response_format=BOOK_FORMAT, temperature=temperature,
            seed=i, max_tokens=120,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), BOOK)


def test_json_object_gives_an_object_and_streams(qserver: Server) -> None:
    client = qserver.client()
    stream = client.chat.completions.create(
        model=qserver.model, messages=_user("List two colours and their hex codes."), stream=True,
        response_format={"type": "json_object"}, temperature=0, max_tokens=100,
    )  # fmt: skip
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert isinstance(json.loads("".join(parts)), dict)


def test_llama_server_grammar_and_json_schema_fields(qserver: Server) -> None:
    client = qserver.client()
    gbnf = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,30} "."'
    reply = client.chat.completions.create(
        model=qserver.model, messages=_user("Is the sky blue?"), temperature=0, max_tokens=40,
        extra_body={"grammar": gbnf},
    )  # fmt: skip
    assert re.fullmatch(r"(yes|no) because [a-z ]{3,30}\.", reply.choices[0].message.content), reply
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3}
    completion = client.completions.create(
        model=qserver.model, prompt="The first three primes as a JSON array:", temperature=0, max_tokens=30,
        extra_body={"json_schema": schema},
    )  # fmt: skip
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"grammar": 'root ::= "a" | missing-rule'}, "grammar"),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "json_schema"),
        ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema"),
        ({"logit_bias": {"12": 101}}, "logit_bias['12']"),
        ({"logit_bias": {"999999999": 5}}, "logit_bias"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # the legacy field; tools are honoured
        ({"grammar_triggers": [{"type": "word", "value": "x"}]}, "grammar_triggers"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ],
)  # fmt: skip
def test_bad_or_unsupported_fields_get_a_400_naming_them(qserver: Server, extra: dict, param: str) -> None:
    body = {"model": qserver.model, "messages": _user("hi"), "max_tokens": 4, **extra}
    error = _assert_error(qserver.http("POST", "/v1/chat/completions", json=body), 400, param)
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_logit_bias_bans_a_token(qserver: Server, qwen15_path: Path) -> None:
    client = qserver.client()
    ask = {"model": qserver.model, "messages": _user("Say hello."), "temperature": 0, "max_tokens": 1}
    first = client.chat.completions.create(**ask).choices[0].message.content
    tok = Tokenizer.from_metadata(open_gguf(qwen15_path).metadata)
    (token_id,) = tok.tokenize(first, special=False)
    banned = client.chat.completions.create(**ask, logit_bias={str(token_id): -100}).choices[0].message.content
    assert banned and banned != first


def test_run_json_schema_through_the_remote_client(qserver: Server, capsys: pytest.CaptureFixture[str]) -> None:
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                         "required": ["city"], "additionalProperties": False})  # fmt: skip
    for chat in (["--chat"], []):
        code = main(["run", "--api-base", f"{qserver.url}/v1", "-p", "Name the capital of France.", *chat,
                     "--json-schema", schema, "--temp", "0", "-n", "40"])  # fmt: skip
        assert code == 0
        out = capsys.readouterr().out
        reply = out if chat else out.removeprefix("Name the capital of France.")
        jsonschema.validate(json.loads(reply), json.loads(schema))


def test_run_json_schema_locally(smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schema_file = tmp_path / "schema.json"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
              "legs": {"type": "integer"}}, "required": ["name", "legs"], "additionalProperties": False}  # fmt: skip
    schema_file.write_text(json.dumps(schema))
    code = main(["run", "-m", str(smollm2_path), "--chat", "-p", "Describe a cat.", "--json-schema",
                 str(schema_file), "--temp", "0", "-n", "60"])  # fmt: skip
    assert code == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)
    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= "a" | nowhere')
    assert main(["run", "-m", str(smollm2_path), "-p", "x", "--grammar", str(bad)]) == 2
    assert "--grammar" in capsys.readouterr().err


def test_a_remote_regex_constraint_is_refused_clearly() -> None:
    from chatapp.remote import RemoteError, constraint_fields
    from engine.constraint import GrammarSpec

    assert constraint_fields(GrammarSpec("json_object"), chat=True) == {"response_format": {"type": "json_object"}}
    with pytest.raises(RemoteError, match="regex"):
        constraint_fields(GrammarSpec("regex", "[0-9]+"), chat=True)


# A reply that opens with a thinking block, written by the real model: no reachable GGUF is a thinking model,
# so a grammar makes this one write the block's shape and the model fills it in.
THINKING = 'root ::= "<think>" [a-z ,]{8,60} ".</think>" [A-Za-z ,]{2,40} "."'


def test_a_think_block_goes_to_reasoning_content_whole_streamed_and_through_the_remote_client(
    qserver: Server,
) -> None:
    from chatapp.remote import connect
    from engine.constraint import GrammarSpec
    from engine.events import Message, TokenEvent
    from engine.sampling import SamplingSettings

    ask = {"model": qserver.model, "messages": _user("Is the sky blue?"), "temperature": 0, "max_tokens": 48,
           "extra_body": {"grammar": THINKING}}  # fmt: skip
    client = qserver.client()
    whole = client.chat.completions.create(**ask).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ,]{8,60}\.", reasoning), whole
    assert re.fullmatch(r"[A-Za-z ,]{2,40}\.", whole.message.content) and "think>" not in whole.message.content
    assert whole.finish_reason == "stop"

    deltas = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = [d.model_extra.get("reasoning_content") or "" for d in deltas]
    assert sum(1 for s in streamed if s) > 1  # sent as generated
    assert "".join(streamed) == reasoning and "".join(d.content or "" for d in deltas) == whole.message.content

    backend = connect(f"{qserver.url}/v1", settings=SamplingSettings(temperature=0, max_tokens=48))
    events = list(backend.stream_reply([Message("user", "Is the sky blue?")], constraint=GrammarSpec("gbnf", THINKING)))
    stats = events[-1]
    assert stats.reasoning == reasoning and stats.reply == whole.message.content
    shown = "".join(e.text for e in events if isinstance(e, TokenEvent))  # as a local model's thinking is shown
    assert shown == f"<think>{reasoning}</think>\n\n{whole.message.content}"
