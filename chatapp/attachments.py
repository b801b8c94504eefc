"""A file attached to a message: its text as a fenced Markdown block headed by its name.

Only text goes in: a file that is not UTF-8 or holds NUL bytes is refused, and so is one over the size limit
(a prompt of that size would not fit a small model's context anyway). Errors name the file and the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_BYTES = 256 * 1024
COMMAND = "/read"

# A few names Markdown highlighters know that differ from the file's extension.
_LANGUAGES = {
    "py": "python", "js": "javascript", "ts": "typescript", "rs": "rust", "rb": "ruby", "sh": "bash",
    "md": "markdown", "yml": "yaml", "h": "c", "hpp": "cpp", "cc": "cpp", "kt": "kotlin",
}  # fmt: skip


class AttachmentError(Exception):
    """A file that cannot be attached; the message is one line."""


def language_for(path: Path) -> str:
    ext = path.suffix.lower().lstrip(".")
    return _LANGUAGES.get(ext, ext)


def fenced(name: str, text: str, language: str = "") -> str:
    """`text` in a code fence longer than any run of backticks inside it, under its file name."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    body = text if text.endswith("\n") else text + "\n"
    return f"`{name}`\n{fence}{language}\n{body}{fence}"


def read_attachment(spec: str, cwd: Path | None = None, limit: int = MAX_BYTES) -> str:
    """The fenced block for the file at `spec` (~ and relative paths allowed), or AttachmentError."""
    spec = spec.strip().strip("'\"")
    if not spec:
        raise AttachmentError(f"{COMMAND} needs a file: {COMMAND} PATH")
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    try:
        if path.is_dir():
            raise AttachmentError(f"{spec} is a directory, not a file")
        size = path.stat().st_size
        if size > limit:
            raise AttachmentError(f"{spec} is {size / 1024:,.0f} KB; files up to {limit // 1024} KB can be attached")
        data = path.read_bytes()
    except FileNotFoundError:
        raise AttachmentError(f"no such file: {spec}") from None
    except OSError as e:
        raise AttachmentError(f"cannot read {spec}: {e.strerror or e}") from None
    if b"\0" in data:
        raise AttachmentError(f"{spec} is a binary file; only text files can be attached")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise AttachmentError(f"{spec} is not UTF-8 text; only text files can be attached") from None
    return fenced(path.name, text.removeprefix("\ufeff"), language_for(path))


def expand_read_command(message: str, cwd: Path | None = None) -> str | None:
    """A message whose first line is `/read PATH`, with that line replaced by the file's block; None when the
    message is not a /read command. Raises AttachmentError."""
    first, _, rest = message.partition("\n")
    head = first.strip()
    if head != COMMAND and not head.startswith(COMMAND + " "):
        return None
    block = read_attachment(head[len(COMMAND) :], cwd)
    return block + "\n\n" + rest.lstrip("\n")
