"""adaspec.figures.save_png: a palette PNG that keeps the plot's colours, smaller than matplotlib's."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402

from adaspec.figures import save_png  # noqa: E402


def test_a_palette_png_with_the_plots_colours(tmp_path):
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, colour in enumerate(["#1f77b4", "#ff7f0e", "#2ca02c"]):
        ax.plot([1, 2, 3], [i, i + 1, i + 3], color=colour, linewidth=4, label=str(i))
    ax.legend()
    fig.savefig(tmp_path / "rgba.png", dpi=100)
    save_png(fig, tmp_path / "small.png", dpi=100)
    plt.close(fig)
    rgba, small = Image.open(tmp_path / "rgba.png"), Image.open(tmp_path / "small.png")
    assert small.mode == "P" and small.size == rgba.size
    assert (tmp_path / "small.png").stat().st_size < (tmp_path / "rgba.png").stat().st_size
    colours = {c for _, c in small.convert("RGB").getcolors(1 << 16)}
    for hexc in ("#1f77b4", "#ff7f0e", "#2ca02c"):  # each line's colour survives the palette exactly
        assert tuple(int(hexc[i:i + 2], 16) for i in (1, 3, 5)) in colours
