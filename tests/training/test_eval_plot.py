"""The evaluation plot shows differences at their size: the perplexity axis starts at 0 and every point is labelled."""

import matplotlib.pyplot as plt

from training import evaluate as E


def report(*models):
    return {
        "dataset": {"dataset": "embedded", "split": "validation"},
        "models": [
            {"name": name, "results": [{"length": L, "ppl_token": p} for L, p in zip((512, 4096), ppls)]}
            for name, ppls in models
        ],
    }


def test_a_tiny_difference_is_not_drawn_as_a_cliff(tmp_path):
    # 0.1% apart: an auto-scaled axis would span exactly this difference and fill the plot height with it.
    data = report(("a", (700.0, 700.7)), ("b", (650.0, 650.3)))
    fig = E.plot_figure(data)
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert low == 0
    assert 700.7 < high <= 1.3 * 700.7
    # The drawn difference of model a is < 0.2% of the axis height; the values are written on the points.
    assert (700.7 - 700.0) / (high - low) < 0.002
    assert {t.get_text() for t in ax.texts} == {"700", "700.7", "650", "650.3"}
    plt.close(fig)
    path = E.plot(data, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 1000 and path.endswith("eval.png")


def test_rows_with_errors_are_skipped():
    data = report(("a", (12.5,)))
    data["models"][0]["results"].append({"length": 65536, "error": "too long"})
    fig = E.plot_figure(data)
    assert fig.axes[0].get_ylim()[0] == 0 and [t.get_text() for t in fig.axes[0].texts] == ["12.5"]
    plt.close(fig)
