"""docs/troubleshooting.md shows error messages whole: no line of a code block runs past a narrow page's edge."""

from __future__ import annotations

from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"
WIDTH = 80  # a code block does not wrap; GitHub and narrow windows cut it off beyond about this


def test_every_line_of_every_code_block_fits_the_page() -> None:
    inside, too_long = False, []
    for number, line in enumerate(PAGE.read_text().splitlines(), start=1):
        if line.startswith("```"):
            inside = not inside
        elif inside and len(line) > WIDTH:
            too_long.append(f"line {number}: {len(line)} characters")
    assert too_long == [], f"wrap these lines of {PAGE.name} at {WIDTH} characters: {too_long}"
