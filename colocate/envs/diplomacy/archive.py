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


def save_game(game, stem: str) -> tuple[str, str]:
    """-> (`<stem>.json`, `<stem>.svg`): the saved game and the final board."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    json_path, svg_path = f"{stem}.json", f"{stem}.svg"
    _write_atomic(json_path, json.dumps(to_saved_game_format(game)) + "\n")
    _write_atomic(svg_path, game.render(incl_orders=False, output_format="svg"))
    return json_path, svg_path


def load_game(path: str):
    """The game of a `save_game` file, rebuilt by the package (raises if it cannot)."""
    games = load_saved_games_from_disk(path, on_error="raise")
    if len(games) != 1:
        raise ValueError(f"{path}: expected one saved game, found {len(games)}")
    return games[0]
