"""The README's benchmark figures are what bench/RESULTS.md says (bench/figures.py generates them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import figures


def test_readme_figures_match_results() -> None:
    diff = figures.check(figures.README.read_text(), figures.RESULTS.read_text())
    assert diff == [], (
        "README.md's figures differ from bench/RESULTS.md; run python -m bench.figures\n" + "\n".join(diff)
    )


def test_a_changed_result_makes_the_readme_stale() -> None:
    results = figures.RESULTS.read_text()
    readme = figures.replace(figures.README.read_text(), figures.render(results))
    assert figures.check(readme, results) == []
    # The operator benchmark's headline moves: the README generated before it no longer matches.
    block = figures.blocks(results)["operator"]
    old = next(r for r in block.rows if r[0] == "time until all children applied (s)")[2]
    moved = results.replace(f"| time until all children applied (s) | {block.rows[0][1]} | {old} |",
                            f"| time until all children applied (s) | {block.rows[0][1]} | 99.99 |")  # fmt: skip
    assert moved != results
    diff = figures.check(readme, moved)
    assert any(line.startswith("+") and "99.99 s" in line for line in diff)
    assert any(line.startswith("-") and f"{old} s" in line for line in diff)


def test_a_figure_whose_row_is_gone_says_which() -> None:
    results = figures.RESULTS.read_text().replace("| NetworkPolicy deleted |", "| NP removed |")
    with pytest.raises(figures.FiguresError, match=r"operator-drift.*NetworkPolicy deleted"):
        figures.render(results)


def test_the_check_command_exits_1_on_a_stale_readme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = tmp_path / "README.md"
    stale = figures.README.read_text().replace("| 17x sooner |", "| 3x sooner |")
    readme.write_text(stale)
    monkeypatch.setattr(figures, "README", readme)
    assert figures.main(["--check"]) == 1
    assert figures.main([]) == 0
    assert figures.main(["--check"]) == 0 and "| 17x sooner |" in readme.read_text()
