"""`conveyor serve` flags come from the config models, and README documents every one of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.server.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def serve_flags() -> list[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return [opt for action in serve._actions for opt in action.option_strings if opt.startswith("--")]


def test_flags_map_one_to_one_to_config_fields():
    args = build_parser().parse_args(
        ["serve", "/models/x", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--scheduling", "static"]
    )
    assert (args.model, args.max_num_seqs, args.enable_prefix_caching, args.scheduling) == (
        "/models/x",
        8,
        False,
        "static",
    )
    assert args.max_num_batched_tokens is None  # unset flags fall back to the model's default


@pytest.mark.parametrize("flag", [f for f in serve_flags() if f not in ("--help", "--log-level")])
def test_readme_documents_every_serve_flag(flag):
    assert f"`{flag}`" in README.read_text(), f"README's serving configuration lacks {flag}"


def test_bad_choice_is_rejected():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduling", "sometimes"])


def test_check_serve_args_refuses_abbreviations_and_unknown_flags() -> None:
    from conveyor.server.cli import check_serve_args

    assert check_serve_args(["model", "--port", "9000", "--seed", "3"]) is None
    assert check_serve_args(["model", "--po=1"]) == "unrecognized arguments: --po=1"
    assert check_serve_args(["model", "--max-num-s", "3"]) == "unrecognized arguments: --max-num-s 3"
    assert "invalid int value" in (check_serve_args(["model", "--seed", "x"]) or "")
