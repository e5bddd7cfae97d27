"""Plots write PNGs (one point, no validation, empty); progress bar and summary formatting."""

from lockstep.observe import ProgressBar, format_summary, format_value, plot_loss, plot_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(p):
    data = p.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_plot_loss_with_validation(tmp_path):
    train = [{"step": s, "loss": 4.0 / (s + 1)} for s in range(50)]
    val = [{"step": s, "val_loss": 4.2 / (s + 1)} for s in (10, 20, 49)]
    assert _is_png(plot_loss(train, tmp_path / "loss.png", val))
    mixed = train + val  # one stream holding both kinds of record
    assert _is_png(plot_loss(mixed, tmp_path / "mixed.png"))


def test_plot_loss_single_point_and_empty(tmp_path):
    assert _is_png(plot_loss([{"step": 0, "loss": 3.0}], tmp_path / "one.png"))
    assert _is_png(plot_loss([], tmp_path / "sub" / "none.png"))
    assert _is_png(plot_loss([{"step": 0, "loss": None}], tmp_path / "null.png"))


def test_plot_series(tmp_path):
    recs = [{"step": i, "reward": i * 0.1, "kl": 0.01 * i} for i in range(5)]
    assert _is_png(plot_series(recs, ["reward", "kl"], tmp_path / "r.png", "RL"))


def test_progress_bar(capsys):
    with ProgressBar(10, desc="t") as bar:
        for s in range(1, 11):
            bar.update(s, loss=2.0, tokens_per_s=12345.0)
        bar.write("hello")
    err = capsys.readouterr()
    assert "hello" in err.out + err.err and "tok/s=12.3k" in err.err
    off = ProgressBar(10, enabled=False)
    off.update(3, loss=1.0)
    off.write("hidden")
    off.close()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_format_summary():
    text = format_summary({"steps": 100, "loss": 2.3456, "tok/s": 123456.0, "m": {"rss": 1.5}})
    assert "steps" in text and "2.346" in text and "123k" in text and "m.rss" in text
    assert format_value(3e-5) == "3.00e-05" and format_value(7) == "7"
