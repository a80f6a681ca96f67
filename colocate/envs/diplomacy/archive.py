"""Saved games and board pictures, in the `diplomacy` package's own formats.

A saved game is one line of `to_saved_game_format` JSON (every phase's state, orders and results),
so `diplomacy.utils.export.load_saved_games_from_disk` and the package's other tools open it. The
picture is the package's SVG renderer on the final board. Both are written atomically. Needs the
game's history: games built with `Game()` and `process()`, not restored with `set_state`.
"""
from __future__ import annotations

import json
import os
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from diplomacy.utils.export import load_saved_games_from_disk, to_saved_game_format


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def board_key(game) -> tuple:
    """What the renderer draws: the phase, the note, each power's units, dislodged units, centres and
    influence (the provinces it last held)."""
    return (game.get_current_phase(), game.note) + tuple(
        (name, tuple(sorted(p.units)), tuple(sorted(p.retreats)), tuple(sorted(p.centers)), tuple(sorted(p.influence)))
        for name, p in sorted(game.powers.items()))


def save_game(game, stem: str, boards: dict | None = None) -> tuple[str, str]:
    """-> (`<stem>.json`, `<stem>.svg`): the saved game and the final board. The renderer costs far
    more than the rest of an evaluation game, and seeded games often end on the same board: `boards`
    (board_key -> SVG text) lets a caller render each distinct board once."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    json_path, svg_path = f"{stem}.json", f"{stem}.svg"
    _write_atomic(json_path, json.dumps(to_saved_game_format(game)) + "\n")
    boards = {} if boards is None else boards
    key = board_key(game)
    if key not in boards:
        boards[key] = game.render(incl_orders=False, output_format="svg")
    _write_atomic(svg_path, boards[key])
    return json_path, svg_path


def load_game(path: str):
    """The game of a `save_game` file, rebuilt by the package (raises if it cannot)."""
    games = load_saved_games_from_disk(path, on_error="raise")
    if len(games) != 1:
        raise ValueError(f"{path}: expected one saved game, found {len(games)}")
    return games[0]
