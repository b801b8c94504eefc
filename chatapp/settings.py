"""Settings: the bundled `defaults.toml`, overlaid by the user's `config.toml`, overlaid by the command line.

Every key is checked against the defaults' schema: an unknown key, a wrong type or an out-of-range value is a
`ConfigError` naming the file (and line, where it can be found), the key and what was expected. The message is
one line; the CLI prints `str(error)` and never a traceback.

The `[sampling]` table maps one to one onto `engine.sampling.SamplingSettings`; its keys, types and ranges are
the engine's declaration, `engine.sampling.SAMPLER_SETTINGS`.
The `[remote]` table (`RemoteSettings`) points the app at an OpenAI-compatible server instead of the local
engine; `OPENAI_BASE_URL` and `OPENAI_API_KEY` override its `base_url` and `api_key`, as the `openai` client's own
defaults do, and the command line overrides them.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatapp import paths
from chatapp.mcp.config import McpConfigError, McpSettings, add_servers, read_mcp_json, settings_from_table
from engine.cache_types import CACHE_TYPES

if TYPE_CHECKING:
    from engine.sampling import SamplingSettings

DEVICES = ("auto", "cpu", "cuda")  # "gpu" is accepted too and read as "cuda"
# A draft model's types: engine.requantize.TYPES and "file" (kept here so that reading settings loads no kernels;
# a test holds the two lists together).
DRAFT_TYPES = ("q4_0", "file")
CLI = "command line"  # the source name used in errors about `cli_overrides`
ENVIRONMENT = "environment"  # the source name of OPENAI_BASE_URL / OPENAI_API_KEY
ENV_VARS = {"OPENAI_BASE_URL": "base_url", "OPENAI_API_KEY": "api_key"}


class ConfigError(Exception):
    """A settings or catalog file (or command-line value) that cannot be used. The message is one line."""


@dataclass(frozen=True)
class RemoteSettings:
    """An OpenAI-compatible server to use instead of the local engine (`[remote]`)."""

    base_url: str = ""  # e.g. "http://gpu-box:8000/v1"; "" = the local engine
    api_key: str = ""  # sent as `Authorization: Bearer`; "" = none
    model: str = ""  # the remote model's id; "" = the first one the server lists (`-m` overrides)
    timeout: float = 120.0  # seconds to wait for the server's next bytes (the first token's wait included)
    logprobs: bool = True  # ask for each token's log-probability and top alternatives (for the inspector)

    @property
    def enabled(self) -> bool:
        return bool(self.base_url.strip())


@dataclass(frozen=True)
class AppSettings:
    """Everything the app reads from configuration, after layering."""

    model: str  # a catalog name, a path to a .gguf file, or a .gguf file's name in the models directory
    n_ctx: int  # context size in tokens
    threads: int  # CPU threads for inference; 0 = all cores
    device: str  # "auto" (a CUDA GPU when one is usable), "cpu" or "cuda"
    gpu_layers: int  # llama.cpp's -ngl: leading layers on the GPU; -1 (or n_layer + 1) = all and the output head
    system_prompt: str  # "" = no system message
    sampling: SamplingSettings  # handed to the engine as is
    model_draft: str = ""  # a draft model for speculative decoding (same vocabulary); "" = none
    draft_max: int = 16  # most tokens a drafter guesses per step
    draft_type: str = "file"  # a draft model's matrices as stored, or re-encoded at load to this type ("q4_0")
    lookup: bool = False  # prompt lookup: guesses from n-gram matches in the conversation itself
    deterministic: bool = False  # prompts computed row by row as decoding does: logits independent of the cache
    cache_type_k: str = "f16"  # how the KV cache stores keys: f16 or q8_0 (llama.cpp's -ctk)
    cache_type_v: str = "f16"  # and values (-ctv); q8_0 halves the cache's memory
    kv_cache_mb: int = 1024  # size limit of the folder of saved KV caches (least recently used go); 0 = none
    theme: str = "textual-dark"  # the app's look; the app saves the user's pick (ctrl+p → theme) in config.toml
    models_folder: str = ""  # a folder of the user's own .gguf files, offered by the model picker; "" = none
    remote: RemoteSettings = RemoteSettings()  # enabled: replies come from that server, not the local engine
    mcp: McpSettings = McpSettings()  # MCP servers whose tools the chat offers (`[mcp]`, `--mcp-config`)
    sources: tuple[str, ...] = ()  # what contributed, lowest precedence first (files, "command line")


# ---------------------------------------------------------------------------------------------------------
# Schema: a type and a range check per key


@dataclass(frozen=True)
class _Rule:
    kind: type  # int, float, str or bool
    check: Callable[[Any], bool] | None = None
    expected: str = ""  # what `check` wants, e.g. "≥ 0"


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}

_TOP_RULES: dict[str, _Rule] = {
    "model": _Rule(str, lambda v: bool(v.strip()), "(not empty)"),
    "n_ctx": _Rule(int, lambda v: v >= 1, "≥ 1"),
    "threads": _Rule(int, lambda v: v >= 0, "≥ 0 (0 = all cores)"),
    "device": _Rule(str, lambda v: v in DEVICES or v == "gpu", f"one of {', '.join(map(repr, DEVICES))}"),
    "gpu_layers": _Rule(int, lambda v: v >= -1, "≥ -1 (-1 = all)"),
    "theme": _Rule(str, lambda v: bool(v.strip()), "(a theme's name, e.g. \"textual-dark\")"),
    "models_folder": _Rule(str),
    "system_prompt": _Rule(str),
    "model_draft": _Rule(str),
    "draft_max": _Rule(int, lambda v: 1 <= v <= 256, "between 1 and 256"),
    "draft_type": _Rule(str, lambda v: v.strip().lower() in DRAFT_TYPES, f"one of {', '.join(DRAFT_TYPES)}"),
    "lookup": _Rule(bool),
    "deterministic": _Rule(bool),
    "kv_cache_mb": _Rule(int, lambda v: v >= 0, "≥ 0 (0 = never save a KV cache)"),
    "cache_type_k": _Rule(str, lambda v: v.strip().lower() in CACHE_TYPES, f"one of {', '.join(CACHE_TYPES)}"),
    "cache_type_v": _Rule(str, lambda v: v.strip().lower() in CACHE_TYPES, f"one of {', '.join(CACHE_TYPES)}"),
}

_REMOTE_RULES: dict[str, _Rule] = {
    "base_url": _Rule(
        str, lambda v: not v.strip() or re.match(r"https?://[^/\s]+", v.strip()) is not None,
        "starting with http:// or https:// (or \"\" for the local engine)",
    ),
    "api_key": _Rule(str),
    "model": _Rule(str),
    "timeout": _Rule(float, lambda v: 0 < v <= 86400, "> 0 seconds"),
    "logprobs": _Rule(bool),
}


@functools.cache
def _sampling_rules() -> dict[str, _Rule]:
    """The `[sampling]` keys, read off the engine's one declaration of each setting (`SAMPLER_SETTINGS`)."""
    # Imported here, not at the top: importing `engine` loads Numba (seconds), and the catalog and `chatapp
    # pull` read TOML through this module without needing the engine.
    from engine.sampling import SAMPLER_SETTINGS

    return {s.name: _Rule(s.kind, s.accepts, s.expected) for s in SAMPLER_SETTINGS}


# ---------------------------------------------------------------------------------------------------------
# Reading TOML with errors fit for a user


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; any failure is a one-line ConfigError naming the file (and line, for bad syntax)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(_toml_error_message(path, e, text)) from None


def _toml_error_message(path: Path, error: tomllib.TOMLDecodeError, text: str) -> str:
    # Python 3.14 gives the error a `lineno`; older ones put "(at line L, column C)" in the message.
    message = str(error)
    lineno = getattr(error, "lineno", None)
    match = re.search(r"\s*\(at line (\d+), column \d+\)$", message)
    if match:
        lineno = lineno or int(match.group(1))
        message = message[: match.start()]
    elif message.endswith("(at end of document)"):
        lineno = lineno or text.count("\n") + 1
        message = message.removesuffix("(at end of document)").rstrip()
    message = getattr(error, "msg", None) or message
    where = f"{path}, line {lineno}" if lineno else str(path)
    return f"{where}: invalid TOML: {message}"


def _find_line(path: Path, table: str | None, key: str) -> int | None:
    """Best effort: the line where `key` is set in `[table]` (or at top level), for error messages."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    current: str | None = None
    key_re = re.compile(rf"""^\s*(["']?){re.escape(key)}\1\s*=""")
    dotted_re = re.compile(rf"""^\s*{re.escape(table or "")}\s*\.\s*{re.escape(key)}\s*=""")
    for number, line in enumerate(lines, start=1):
        header = re.match(r"^\s*\[\s*([^\]]+?)\s*\]", line)
        if header:
            current = header.group(1).strip("\"'")
        elif current == table and key_re.match(line):
            return number
        elif table and current is None and dotted_re.match(line):
            return number
    return None


# ---------------------------------------------------------------------------------------------------------
# Layering


def _coerce(value: Any, rule: _Rule, where: str, from_cli: bool) -> Any:
    """The value as the rule's type, or ConfigError saying what `where` expected."""
    kind = _KIND_NAMES.get(rule.kind, rule.kind.__name__)
    expected = rule.expected if rule.expected.startswith("one of") else f"{kind} {rule.expected}".strip()
    result: Any = None
    if rule.kind is bool:
        result = value if isinstance(value, bool) else None
    elif rule.kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            result = value
        elif from_cli and isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            result = int(value)
    elif rule.kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            result = float(value)
        elif from_cli and isinstance(value, str):
            try:
                result = float(value)
            except ValueError:
                result = None
    elif rule.kind is str:
        result = value if isinstance(value, str) else None
    else:  # a field type this module does not know: pass it through for the engine to judge
        result = value
    if result is None or (rule.check is not None and not rule.check(result)):
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    return result


def _merge_layer(
    merged: dict[str, Any],
    sampling: dict[str, Any],
    layer: Mapping[str, Any],
    source: str,
    path: Path | None,
    remote: dict[str, Any] | None = None,
    mcp: list[McpSettings] | None = None,
) -> None:
    """Check `layer` against the schema and copy its values over `merged` / `sampling` / `remote` / `mcp[0]`."""
    remote = {} if remote is None else remote
    mcp = [McpSettings()] if mcp is None else mcp
    from_cli = path is None
    sampling_rules = _sampling_rules()

    def where(table: str | None, key: str) -> str:
        dotted = f"{table}.{key}" if table else key
        if source == ENVIRONMENT:
            return next(var for var, name in ENV_VARS.items() if name == key)
        if path is None:
            return f"{source}: {dotted}"
        line = _find_line(path, table, key)
        return f"{path}, line {line}: {dotted}" if line else f"{path}: {dotted}"

    def unknown(table: str | None, key: str, known: Mapping[str, Any]) -> ConfigError:
        close = difflib.get_close_matches(key, list(known), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        scope = f"[{table}]" if table else "the top level"
        return ConfigError(
            f"{where(table, key)}: unknown key in {scope}{hint} (expected one of: {', '.join(known)})"
        )

    tables = {"sampling": None, "remote": None, "mcp": None}
    for key, value in layer.items():
        if from_cli and value is None:
            continue  # an option the user did not give
        table, _, sub = key.partition(".") if from_cli and "." in key else (None, "", key)
        if table is not None and table not in tables:
            raise unknown(None, key, _TOP_RULES | tables)
        if table == "remote":
            if sub not in _REMOTE_RULES:
                raise unknown("remote", sub, _REMOTE_RULES)
            remote[sub] = _coerce(value, _REMOTE_RULES[sub], where("remote", sub), from_cli)
        elif key == "remote":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where(None, key)}: expected a table of remote settings, got {value!r}")
            for sub_key, sub_value in value.items():
                if sub_key not in _REMOTE_RULES:
                    raise unknown("remote", sub_key, _REMOTE_RULES)
                remote[sub_key] = _coerce(sub_value, _REMOTE_RULES[sub_key], where("remote", sub_key), from_cli)
        elif key == "mcp":
            try:
                mcp[0] = settings_from_table(value, where(None, key), mcp[0])
            except McpConfigError as exc:
                raise ConfigError(str(exc)) from None
        elif key == "mcp_config":  # --mcp-config FILE: its servers join the config's
            try:
                mcp[0] = add_servers(mcp[0], read_mcp_json(Path(value)))
            except McpConfigError as exc:
                raise ConfigError(str(exc)) from None
        elif table == "sampling" or (table is None and from_cli and key in sampling_rules):
            if sub not in sampling_rules:
                raise unknown("sampling", sub, sampling_rules)
            sampling[sub] = _coerce(value, sampling_rules[sub], where("sampling", sub), from_cli)
        elif key == "sampling":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where(None, key)}: expected a table of sampling settings, got {value!r}")
            for sub_key, sub_value in value.items():
                if from_cli and sub_value is None:
                    continue
                if sub_key not in sampling_rules:
                    raise unknown("sampling", sub_key, sampling_rules)
                rule = sampling_rules[sub_key]
                sampling[sub_key] = _coerce(sub_value, rule, where("sampling", sub_key), from_cli)
        elif key in _TOP_RULES:
            merged[key] = _coerce(value, _TOP_RULES[key], where(None, key), from_cli)
        else:
            raise unknown(None, key, _TOP_RULES | tables)


def save_user_setting(key: str, value: str | int | float | bool, config_file: Path | None = None) -> None:
    """Set a top-level `key` in the user's config.toml, keeping the rest of the file (comments included) as
    it was; the file is replaced atomically. Raises ConfigError when the file cannot be read as TOML (it is
    then left alone) or written."""
    import tomlkit

    config_file = paths.user_config_file() if config_file is None else config_file
    try:
        text = config_file.read_text(encoding="utf-8") if config_file.exists() else ""
        doc = tomlkit.parse(text)
    except (OSError, UnicodeDecodeError, tomlkit.exceptions.ParseError) as e:
        raise ConfigError(f"{config_file}: cannot update {key}: {e}") from None
    if key in doc:
        doc[key] = value
    else:  # at the top, before any [table], where a top-level key must go
        body = tomlkit.document()
        body.add(key, value)
        doc = tomlkit.parse(tomlkit.dumps(body) + ("\n" if text and not text.startswith("\n") else "") + text)
    tmp = config_file.with_name(config_file.name + ".tmp")
    try:
        config_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(tomlkit.dumps(doc), encoding="utf-8")
        os.replace(tmp, config_file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"{config_file}: cannot save {key}: {e.strerror or e}") from None


def defaults_file() -> Path:
    """The bundled defaults."""
    return paths.config_dir() / "defaults.toml"


def load_settings(
    cli_overrides: Mapping[str, Any] | None = None,
    *,
    config_file: Path | None = None,
    defaults: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> AppSettings:
    """Bundled defaults ← the user's config file ← `cli_overrides`.

    `config_file` defaults to `paths.user_config_file()`, which may be absent; a file given explicitly
    must exist.
    `cli_overrides` takes top-level keys ("model", "n_ctx", ...), sampling keys either flat ("temperature"),
    dotted ("sampling.temperature") or as a "sampling" dict; None values mean "not given" and are skipped;
    remote keys dotted ("remote.base_url"). `environ` (default `os.environ`) supplies OPENAI_BASE_URL and
    OPENAI_API_KEY, between the config file and the command line. Raises ConfigError.
    """
    defaults = defaults_file() if defaults is None else defaults
    merged: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    remote: dict[str, Any] = {}
    mcp = [McpSettings()]
    _merge_layer(merged, sampling, read_toml(defaults), str(defaults), defaults, remote, mcp)
    missing = [k for k in _TOP_RULES if k not in merged]
    missing += [f"sampling.{k}" for k in _sampling_rules() if k not in sampling]
    if missing:
        raise ConfigError(f"{defaults}: missing key '{missing[0]}'")
    sources = [str(defaults)]

    explicit = config_file is not None
    config_file = paths.user_config_file() if config_file is None else config_file
    if explicit or config_file.exists():
        _merge_layer(merged, sampling, read_toml(config_file), str(config_file), config_file, remote, mcp)
        sources.append(str(config_file))

    environ = os.environ if environ is None else environ
    from_env = {f"remote.{key}": environ[var] for var, key in ENV_VARS.items() if environ.get(var)}
    if from_env:
        _merge_layer(merged, sampling, from_env, ENVIRONMENT, None, remote)
        sources.append(ENVIRONMENT)

    if cli_overrides:
        _merge_layer(merged, sampling, cli_overrides, CLI, None, remote, mcp)
        sources.append(CLI)

    from engine.sampling import SamplingSettings

    if merged["device"] == "gpu":
        merged["device"] = "cuda"
    return AppSettings(
        **merged,
        sampling=SamplingSettings(**sampling),
        remote=RemoteSettings(**remote),
        mcp=mcp[0],
        sources=tuple(sources),
    )
