"""What a newcomer meets first: ``attnlab demo``'s options are the models it can run, and the
report's disabled tabs point to the bundled decoder."""

from __future__ import annotations

from importlib import resources

import pytest

from attnlab.cli import build_parser, main


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return " ".join(sub.choices[command].format_help().split())


def test_demo_offers_only_the_models_it_can_run(capsys):
    text = _help("demo")
    assert "--model {random,minilm,smollm2}" in text and "gpt2" not in text.split("options:")[1]
    assert "attnlab explain --checkpoint PATH" in text
    with pytest.raises(SystemExit) as stop:  # a usage error: argparse's exit
        main(["demo", "--model", "gpt2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'gpt2'" in err
    assert "--model {random,minilm,checkpoint,gpt2,smollm2}" in _help("explain")  # explain reads files


def test_the_reports_hints_name_the_bundled_decoder():
    js = resources.files("attnlab.viz").joinpath("assets", "report.js").read_text(encoding="utf-8")
    hints = js[js.index("var MISSING"):js.index("var KIND_NAMES")]
    assert hints.count("--model smollm2") == 2 and "--model gpt2 or checkpoint" not in hints
