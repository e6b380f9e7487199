"""The figures of docs/results/ redrawn from the committed records (colours and line styles: research/style.py).

python -m research.plots                 # every PNG of docs/results/ from research/results/ (nothing trained)
python -m research.plots --only mqar     # one figure (lm_quality, lm_long, lm_long_books, lm_long_gpu, mqar, ...)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from research import common, lm_long, lm_quality, mqar


FIGURES = ("lm_quality", "lm_long", "lm_long_books", "lm_long_gpu", "mqar", "mqar_gpu")


def redraw(only: list[str] | None = None, plots: Path = common.PLOTS, results: Path = common.RESULTS) -> list[Path]:
    """Every figure of docs/results/ (or those named in ``only``) from the committed records; returns the PNGs."""
    written = []
    for name in only or FIGURES:
        png = Path(plots) / f"{name}.png"
        if name == "lm_quality":
            lm_quality.plot(lm_quality.load_results(Path(results) / name), png)
        elif name in ("lm_long", "lm_long_books", "lm_long_gpu"):
            proto = lm_long.GPU if name == "lm_long_gpu" else lm_long.CPU
            lm_long.plot(lm_long.load_records(Path(results) / name), png, proto)
        elif name in ("mqar", "mqar_gpu"):
            mqar.plot(mqar.load_results(Path(results) / name), png)
        else:
            raise ValueError(f"no figure {name!r}; figures: {', '.join(FIGURES)}")
        written.append(png)
        print(png)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--only", nargs="+", choices=FIGURES, default=None, help="these figures (default: every one)")
    args = p.parse_args(argv)
    redraw(args.only)


if __name__ == "__main__":
    main()
