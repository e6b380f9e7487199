"""research/style.py and research/plots.py: one colour per model in every figure of docs/results/, one legend per figure, y axes that fit
the data; the figures are drawn from the committed records alone."""

import json

import matplotlib
import pytest


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from research import common, plots, style  # noqa: E402


def test_the_colour_map_gives_every_model_its_own_colour():
    listed = list(style.COLOURS.values())
    assert len(set(listed)) == len(listed)
    assert set(style.SAME_MODEL.values()) <= set(style.COLOURS) and not set(style.SAME_MODEL) & set(style.COLOURS)
    assert not set(style.SPARE) & set(listed)
    assert style.colour("brect") == style.colour("brect-fixed-skip")
    assert style.colour("a-new-ablation") in style.SPARE


def _record_names():
    names = set()
    for path in common.RESULTS.glob("*/*.json"):
        record = json.loads(path.read_text())
        if "model" not in record:
            continue
        tag = ""
        if path.parent.name.startswith("mqar"):
            from research import mqar

            tag = mqar._variant(record)
        names.add(record["model"] + tag)
    return names


def test_every_model_of_the_records_has_a_listed_colour():
    names = _record_names()
    assert {"slide", "bst-sh-s4", "attention", "brect", "mamba", "bst-sh-unstruct-smooth"} <= names
    missing = {n for n in names if style.canonical(n) not in style.COLOURS}
    assert not missing, f"add these to research/style.py: {sorted(missing)}"


@pytest.fixture
def figures(monkeypatch, tmp_path):
    """Redraw figures into tmp_path, keeping each figure (plt.close is intercepted) for inspection."""
    kept = {}
    close = plt.close

    def keep(fig=None):
        kept[len(kept)] = fig
        close(fig)

    monkeypatch.setattr(plt, "close", keep)

    def draw(name):
        kept.clear()
        (png,) = plots.redraw([name], plots=tmp_path)
        assert png.stat().st_size > 0
        return kept[0]

    return draw


def _labelled_colours(fig):
    """label -> set of colours over every line and bar of every panel of ``fig``."""
    out = {}
    for ax in fig.axes:
        drawn = [(line.get_label(), line.get_color()) for line in ax.get_lines()]
        drawn += [(bars.get_label(), bars.patches[0].get_facecolor()) for bars in ax.containers]  # ax.bar's
        for label, colour in drawn:
            if not label.startswith("_") and label != "chance":
                out.setdefault(label, set()).add(matplotlib.colors.to_hex(colour))
    return out


@pytest.mark.parametrize("name", ["mqar", "lm_quality", "lm_long_books", "mqar_gpu"])
def test_each_figure_has_one_colour_per_model_and_one_legend(figures, name):
    fig = figures(name)
    colours = _labelled_colours(fig)
    assert colours and all(len(c) == 1 for c in colours.values()), colours
    flat = [next(iter(c)) for c in colours.values()]
    assert len(set(flat)) == len(flat), "two models share a colour"
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in fig.axes)


def test_the_gpu_mqar_axis_fits_its_accuracies(figures):
    fig = figures("mqar_gpu")
    (ax,) = fig.axes
    heights = [p.get_height() for p in ax.patches]
    low, high = ax.get_ylim()
    assert low == 0 and max(heights) < high < 2 * max(heights)
