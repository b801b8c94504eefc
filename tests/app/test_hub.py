"""`chatapp pull hf:ORG/REPO[:QUANT|/FILE.gguf]` through huggingface_hub, against a local server that speaks the
hub's file API (tests/app/fake_hub.py) and serves the real SmolLM2 GGUF."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from chatapp import hub
from chatapp.catalog import sha256_file
from chatapp.hub import HubError, HubFile, HubSpec, choose_file
from tests.app.fake_hub import FakeHub
from tests.app.fake_hub import HubFile as Served
from tests.reliability.support import PYTHON, REPO

REPO_ID = "test-org/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("hf:org/repo", HubSpec("org/repo")),
        ("hf:org/repo:Q8_0", HubSpec("org/repo", quant="Q8_0")),
        ("hf:org/repo/model.Q4_K_M.gguf", HubSpec("org/repo", file="model.Q4_K_M.gguf")),
        ("hf:org/repo/sub/dir/m.gguf", HubSpec("org/repo", file="sub/dir/m.gguf")),
    ],
)
def test_specs_parse(text: str, spec: HubSpec) -> None:
    assert HubSpec.parse(text) == spec
    assert spec.text == text


@pytest.mark.parametrize("text", ["hf:", "hf:repo", "hf:org/", "hf:/repo", "hf:org/repo:", "hf:../x/y", "hf:a b/c"])
def test_malformed_specs_are_refused_by_name(text: str) -> None:
    with pytest.raises(hub.ModelNotFound, match="is not a hub model"):
        HubSpec.parse(text)


def test_a_file_that_is_not_gguf_is_refused_before_any_request() -> None:
    with pytest.raises(HubError, match=r"README\.md is not a GGUF file"):
        HubSpec.parse("hf:org/repo/README.md")


FILES = [
    HubFile("README.md", 10, None),
    HubFile("m-Q4_K_M.gguf", 100, "a"),
    HubFile("m-Q4_K_M_L.gguf", 100, "b"),
    HubFile("m.q8_0.gguf", 100, "c"),
    HubFile("big-Q6_K-00001-of-00002.gguf", 100, "d"),
    HubFile("big-Q6_K-00002-of-00002.gguf", 100, "e"),
]


@pytest.mark.parametrize(
    ("text", "chosen"),
    [
        ("hf:o/r", "m-Q4_K_M.gguf"),  # llama.cpp's default tag, as a whole word (not Q4_K_M_L)
        ("hf:o/r:Q8_0", "m.q8_0.gguf"),  # tags match in any case
        ("hf:o/r/m-Q4_K_M_L.gguf", "m-Q4_K_M_L.gguf"),
    ],
)
def test_the_file_a_spec_means(text: str, chosen: str) -> None:
    assert choose_file(HubSpec.parse(text), FILES).name == chosen


def test_files_that_cannot_be_chosen_are_named() -> None:
    with pytest.raises(HubError, match=r"no Q2_K file.*it has: m-Q4_K_M\.gguf, m-Q4_K_M_L\.gguf, m\.q8_0\.gguf"):
        choose_file(HubSpec.parse("hf:o/r:Q2_K"), FILES)
    with pytest.raises(HubError, match="one part of a split GGUF"):
        choose_file(HubSpec.parse("hf:o/r/big-Q6_K-00001-of-00002.gguf"), FILES)
    with pytest.raises(HubError, match="has no file nope.gguf"):
        choose_file(HubSpec.parse("hf:o/r/nope.gguf"), FILES)
    assert choose_file(HubSpec.parse("hf:o/r"), [HubFile("only.F16.gguf", 1, "x")]).name == "only.F16.gguf"


def pull_cli(spec: str, endpoint: str, cache: Path, **popen) -> subprocess.Popen:
    """`chatapp pull SPEC` in a child whose model cache is `cache` and whose hub is `endpoint`."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "CHATAPP_CACHE_DIR": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_TOKEN", None)
    args = [PYTHON, "-m", "chatapp", "pull", spec]
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(child: subprocess.Popen) -> tuple[int, str, str]:
    out, err = child.communicate(timeout=300)
    return child.returncode, out, err


def ranged_gets(fake: FakeHub) -> list[int]:
    """Start offsets of the byte-range downloads the client asked for."""
    return [int(r[6:].split("-")[0]) for method, _, r in fake.requests if method == "GET" and r]


def test_a_real_gguf_is_pulled_resumed_after_a_drop_and_checked(smollm2_path: Path, tmp_path: Path) -> None:
    served = {FILE: Served(smollm2_path), "README.md": Served(b"# SmolLM2\n", lfs=False)}
    with FakeHub({REPO_ID: served}, cut_after=30 << 20) as fake:
        status, out, err = finish(pull_cli(f"hf:{REPO_ID}:Q4_1", fake.url, tmp_path))
    assert status == 0, err
    assert "sha256 verified against the hub" in out
    assert any(start > 0 for start in ranged_gets(fake)), "the dropped download started over instead of resuming"
    path = hub.repo_dir(tmp_path / "models", REPO_ID) / FILE
    assert sha256_file(path) == sha256_file(smollm2_path)
    assert "Traceback" not in err


def test_kill_9_mid_download_leaves_nothing_usable_then_a_pull_succeeds(smollm2_path: Path, tmp_path: Path) -> None:
    """huggingface_hub resumes a dropped connection within a pull (above), but downloads each pull to a temporary
    file of its own: what a killed pull leaves is never under the final name, and the next pull clears it."""
    with FakeHub({REPO_ID: {FILE: Served(smollm2_path)}}, hold_after=24 << 20) as fake:
        child = pull_cli(f"hf:{REPO_ID}", fake.url, tmp_path)  # one .gguf: chosen without a tag
        try:
            assert fake.holding.wait(timeout=120), "the download never started"
            folder = hub.repo_dir(tmp_path / "models", REPO_ID)
            # Kill once the client has written some of what it received: a condition polled, not a sleep
            # (the deadline is only a hang guard).
            deadline = time.monotonic() + 120
            while not [p for p in folder.rglob("*.incomplete") if p.stat().st_size > 0]:
                assert time.monotonic() < deadline and child.poll() is None, "the client never wrote any data"
                time.sleep(0.02)
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            fake.release.set()
        assert not (folder / FILE).exists(), "a half download is under the final name"
        assert [p for p in folder.rglob("*.incomplete") if p.stat().st_size > 0], "the kill came before any data"

        status, out, err = finish(pull_cli(f"hf:{REPO_ID}", fake.url, tmp_path))
    assert status == 0, err
    assert sha256_file(folder / FILE) == sha256_file(smollm2_path)
    assert not list(folder.rglob("*.incomplete")), "the killed pull's partial file was left behind"


def test_a_pulled_model_is_found_offline_and_loads(smollm2_path: Path, tmp_path: Path, monkeypatch) -> None:
    with FakeHub({REPO_ID: {FILE: Served(smollm2_path)}}) as fake:
        assert finish(pull_cli(f"hf:{REPO_ID}:Q4_1", fake.url, tmp_path))[0] == 0
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path))  # the hub is gone now
    from chatapp.cli import resolve_model_path
    from engine import load_model

    said: list[str] = []
    path = resolve_model_path(f"hf:{REPO_ID}:Q4_1", said.append)
    assert path == hub.repo_dir(tmp_path / "models", REPO_ID) / FILE and not said
    model = load_model(path, n_ctx=64)
    logits = model.session().eval(model.tokenize("The capital of France is"))
    assert logits.shape == (49152,) and model.detokenize([int(logits.argmax())]).strip() == "Paris"


@pytest.mark.parametrize(
    ("files", "spec", "message"),
    [
        ({FILE: Served(b"GGUF" + bytes(64), sha256="0" * 64)}, "", "does not match the hub's"),
        ({FILE: Served(b"PK\x03\x04 not a model at all")}, "", "is not a GGUF file"),
        ({FILE: Served(b"GGUF" + bytes(64), lfs=False)}, "", "lists no sha256"),
        ({FILE: Served(b"GGUF")}, ":Q2_K", "has no Q2_K file"),
        ({FILE: Served(b"GGUF")}, "/README.md", "README.md is not a GGUF file"),
    ],
    ids=["wrong-sha256", "not-gguf", "no-sha256", "unknown-quant", "not-a-gguf-name"],
)
def test_a_bad_offer_is_one_line_exit_2_and_leaves_nothing(files, spec: str, message: str, tmp_path: Path) -> None:
    with FakeHub({REPO_ID: files}) as fake:
        status, out, err = finish(pull_cli(f"hf:{REPO_ID}{spec}", fake.url, tmp_path))
    assert status == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert not list((tmp_path / "models").rglob("*.gguf")), "a file that failed its checks was kept"


def test_an_unknown_repository_is_named(tmp_path: Path) -> None:
    with FakeHub({}) as fake:
        status, _, err = finish(pull_cli("hf:nobody/nothing", fake.url, tmp_path))
    assert status == 2 and err.strip().splitlines() == [
        "chatapp: error: no model repository nobody/nothing on the hub (or it is private: set HF_TOKEN)"
    ], err


def test_the_hub_unreachable_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status, _, err = finish(pull_cli(f"hf:{REPO_ID}", f"http://127.0.0.1:{port}", tmp_path))
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith(f"chatapp: error: cannot list {REPO_ID}"), err


# --- refused or failing mid-download ---------------------------------------------------------------------

# A small GGUF-headed file, cut after its first MiB so that the client resumes with a ranged GET.
PAYLOAD = b"GGUF" + bytes(range(256)) * (3 << 12)  # ~3 MiB
CUT = 1 << 20


@pytest.fixture
def small_chunks(monkeypatch) -> None:
    """huggingface_hub writes what it receives in 10 MiB chunks; 64 KiB ones let a 1 MiB cut leave data behind."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)


def pull_in_process(fake: FakeHub, tmp_path: Path) -> Path:
    return hub.pull(f"hf:{REPO_ID}", models_dir=tmp_path / "models", endpoint=fake.url, progress_bars=False)


def partial_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "models").rglob("*") if p.is_file() and p.name.endswith((".gguf", ".incomplete"))]


@pytest.mark.parametrize(("status", "message"), [(401, "401"), (500, "500"), (503, "503")])
def test_a_refusal_mid_download_is_one_clear_error_and_leaves_nothing(
    status: int, message: str, tmp_path, small_chunks
) -> None:
    """The first GET drops after 1 MiB; the resume is answered 401 (a token revoked mid-pull) or a 5xx: the pull
    ends with a HubError naming the status, no traceback, and no file under the final name or half-written."""
    with FakeHub({REPO_ID: {"m.Q8_0.gguf": Served(PAYLOAD)}}, cut_after=CUT, resume_statuses=[status]) as fake:
        with pytest.raises(HubError, match=message) as err:
            pull_in_process(fake, tmp_path)
    assert any(start > 0 for start in ranged_gets(fake)), "the refusal did not come mid-download"
    assert "\n" not in str(err.value), str(err.value)
    assert not partial_files(tmp_path), partial_files(tmp_path)


def test_a_429_mid_download_is_waited_out_and_the_pull_completes(tmp_path, small_chunks) -> None:
    """Too many requests (Retry-After: 0) on the resume: the client asks again and the pull completes, checked."""
    with FakeHub({REPO_ID: {"m.Q8_0.gguf": Served(PAYLOAD)}}, cut_after=CUT, resume_statuses=[429, 429]) as fake:
        path = pull_in_process(fake, tmp_path)
        assert not fake.resume_statuses, "the 429s were never met"
    assert path.read_bytes() == PAYLOAD
    assert len([start for start in ranged_gets(fake) if start > 0]) >= 3, ranged_gets(fake)


def test_a_full_disk_mid_download_is_one_clear_error_and_frees_the_space(tmp_path, monkeypatch, small_chunks) -> None:
    """The disk fills after 1 MiB is written (the download's file writes raise ENOSPC; no tmpfs is needed, so it
    runs unprivileged): a HubError that says so, and the partial file is removed, not left filling the disk."""
    import errno

    from huggingface_hub import file_download

    real_http_get = file_download.http_get

    class FullDisk:
        def __init__(self, f) -> None:
            self._f, self._written = f, 0

        def write(self, data: bytes) -> int:
            if self._written + len(data) > CUT:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._written += len(data)
            return self._f.write(data)

        def __getattr__(self, name: str):
            return getattr(self._f, name)

    def filling_http_get(url, temp_file, **kw):
        return real_http_get(url, FullDisk(temp_file), **kw)

    monkeypatch.setattr(file_download, "http_get", filling_http_get)
    with FakeHub({REPO_ID: {"m.Q8_0.gguf": Served(PAYLOAD)}}) as fake:
        with pytest.raises(HubError, match="No space left on device"):
            pull_in_process(fake, tmp_path)
    assert not partial_files(tmp_path), partial_files(tmp_path)
