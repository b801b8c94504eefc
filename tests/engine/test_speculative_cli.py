"""Speculative decoding from the command line and config: -md/--model-draft, --draft-max, --lookup."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chatapp.cli import main
from chatapp.settings import ConfigError, load_settings

from .synthetic import write_tiny_model


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(smollm2_path, tmp_path, isolated_dirs, capsys) -> None:
    tiny = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    rc = main(["run", "-m", str(smollm2_path), "-md", str(tiny.path), "-p", "Hello", "-n", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert "does not share the vocabulary" in err[-1] and err[-1].startswith("chatapp: error:")
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(
    "flags",
    [["--lookup"], ["-md", "SELF", "--draft-max", "4"], ["-md", "SELF", "--lookup"]],
    ids=["lookup", "draft", "both"],
)
def test_run_with_a_drafter_reports_its_guesses(smollm2_path, isolated_dirs, capsys, flags) -> None:
    flags = [str(smollm2_path) if f == "SELF" else f for f in flags]
    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    rc = main(["run", "-m", str(smollm2_path), *flags, "-p", text, "-n", "12", "--temp", "0"])
    out = capsys.readouterr()
    assert rc == 0
    assert "guesses accepted" in out.err and "tokens per target pass" in out.err
    assert ("draft prompt" in out.err) == ("-md" in flags)  # a draft model's own prompt pass is shown
    assert ("lookup + " in out.err) == ("-md" in flags and "--lookup" in flags)  # both: lookup's guesses first


def test_config_keys(tmp_path, isolated_dirs) -> None:
    config = tmp_path / "config.toml"
    config.write_text('lookup = true\ndraft_max = 8\nmodel_draft = "small.gguf"\nkv_cache_mb = 64\n')
    s = load_settings(config_file=config)
    assert (s.lookup, s.draft_max, s.model_draft, s.kv_cache_mb) == (True, 8, "small.gguf", 64)
    assert load_settings({"lookup": True, "draft_max": 3}).draft_max == 3
    config.write_text("draft_max = 0\n")
    with pytest.raises(ConfigError, match="draft_max"):
        load_settings(config_file=config)


async def test_the_inspector_shows_acceptance_and_drafted_tokens() -> None:
    """The inspector's phase bars carry the draft line, its table marks drafted tokens, and both survive the
    round trip through the saved stats."""
    from textual.app import App
    from textual.widgets import DataTable

    from chatapp.chat_state import Turn, stats_from_dict, stats_line, stats_to_dict
    from chatapp.tui.widgets.inspector import InspectorScreen
    from engine.events import STOP_EOS, TokenEvent, TurnStats

    tokens = [
        TokenEvent(5, "def", 40.0, 0.5, 0.9, (), 0),
        TokenEvent(6, " add", 12.0, 0.5, 0.8, (), 1),
        TokenEvent(7, "(", 0.0, 0.5, 0.99, (), 2, drafted=True),
    ]
    stats = TurnStats(12, 0, 12, 40.0, 41.0, 12.5, 3, STOP_EOS, 15, 2048, drafter="lookup", draft_tokens=2,
                      draft_accepted=1, target_passes=1)  # fmt: skip
    stats, tokens, _ = stats_from_dict(stats_to_dict(stats, tokens))
    assert tokens[2].drafted and stats.acceptance_rate == 0.5 and stats.tokens_per_pass == 2.0
    assert "lookup: 50% accepted, 2.00/pass" in stats_line(stats)
    assert "from the saved cache" in stats_line(replace(stats, restored_tokens=1200))

    class Host(App[None]):
        def on_mount(self) -> None:
            self.push_screen(InspectorScreen(Turn("assistant", "def add(", stats=stats, tokens=tokens), title="t"))

    app = Host()
    async with app.run_test() as pilot:
        await pilot.pause()
        screen = app.screen
        bars = str(screen.query_one("#phase-bars").render())
        assert "lookup: 1/2 guesses accepted (50%)" in bars and "2.00 tokens per target pass" in bars
        table = screen.query_one("#tokens", DataTable)
        assert str(table.get_row_at(2)[3]).endswith("draft") and not str(table.get_row_at(1)[3]).endswith("draft")


def test_the_app_gets_the_drafter_and_the_saved_cache(smollm2_path, isolated_dirs, monkeypatch) -> None:
    """`chatapp -md MODEL`: the app's backend factory builds a ChatSession with that draft model, and with the
    saved-cache store of the user cache, saving after every turn."""
    import chatapp.tui.launch as tui_launch
    from chatapp.kv_cache import kv_cache_dir
    from engine.speculative import ModelDrafter

    factories = []
    monkeypatch.setattr(tui_launch, "run_app", lambda factory, **kw: factories.append(factory))
    assert main(["-m", str(smollm2_path), "-md", str(smollm2_path), "--draft-max", "5"]) == 0
    chat = factories[0](lambda line: None)
    assert isinstance(chat.drafter, ModelDrafter) and chat.drafter.length.most == 5
    assert chat.kv_store is not None and chat.kv_store.folder == kv_cache_dir() and chat.autosave


def test_bench_with_lookup_reports_plain_and_drafted_decode(smollm2_path, isolated_dirs, capsys) -> None:
    import json

    rc = main(["bench", "-m", str(smollm2_path), "--lookup", "-p", "32", "-n", "8", "-r", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["drafter"] == "lookup"
    assert result["text_decode_tok_s"] > 0 and result["draft_decode_tok_s"] > 0
    assert 0 <= result["draft_acceptance"] <= 1


def test_bench_sets_each_repetition_against_the_read_bandwidth_beside_it(smollm2_path, isolated_dirs, capsys) -> None:
    import json
    import statistics

    rc = main(["bench", "-m", str(smollm2_path), "-p", "16", "-n", "8", "-r", "3", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["repetitions"] == 3
    rates, limits = result["decode_tok_s_runs"], result["read_bandwidth_gb_s_runs"]
    assert len(rates) == len(limits) == 3 and min(limits) > 0
    assert result["decode_tok_s"] == pytest.approx(statistics.mean(rates))
    shares = [100 * result["weights_mb_per_token"] * 1e6 * r / (b * 1e9) for r, b in zip(rates, limits, strict=True)]
    assert result["bandwidth_pct_runs"] == pytest.approx(shares)
    assert result["bandwidth_pct"] == pytest.approx(statistics.median(shares))
    assert result["read_bandwidth_gb_s"] == pytest.approx(statistics.median(limits))


@pytest.mark.parametrize("kind", ["q4_0", "file"])
def test_the_draft_type_decides_how_the_draft_is_loaded(smollm2_path, isolated_dirs, capsys, kind) -> None:
    rc = main(["run", "-m", str(smollm2_path), "-md", str(smollm2_path), "--draft-type", kind, "-p", "Hi", "-n", "2"])
    err = capsys.readouterr().err
    assert rc == 0
    assert ("re-encoding weights as Q4_0" in err) == (kind == "q4_0")
    assert ("weights Q4_0, 96 -> 76 MB a token" in err) == (kind == "q4_0")  # SmolLM2: Q4_1 and a Q8_0 head


def test_an_unknown_draft_type_is_refused_in_one_line(smollm2_path, isolated_dirs, capsys) -> None:
    rc = main(["run", "-m", str(smollm2_path), "-md", str(smollm2_path), "--draft-type", "q9", "-p", "Hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == ["chatapp: error: command line: draft_type: expected one of q4_0, file, got 'q9'"]
