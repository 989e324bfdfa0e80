"""Progress bars of the long-running commands: drawn with an ETA on a terminal, silent with --quiet, a plain line
with an estimate now and then in logs."""

import io

from rich.console import Console

from mixerzoo.progress import progress_bar, show_progress, stages


def test_bar_shows_eta_on_a_terminal_and_nothing_when_quiet_or_piped():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with progress_bar(console) as progress:
        task = progress.add_task("loss model-a", total=4)
        progress.advance(task, 2)
        progress.refresh()
    assert "loss model-a" in out.getvalue() and "eta" in out.getvalue() and "2/4" in out.getvalue()
    for quiet, terminal in ((True, True), (False, False)):
        out = io.StringIO()
        with progress_bar(Console(file=out, force_terminal=terminal), quiet=quiet) as progress:
            progress.advance(progress.add_task("x", total=2), 2)
        assert out.getvalue() == ""


def test_show_progress_follows_the_stream():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert show_progress(stream=Tty()) and not show_progress(quiet=True, stream=Tty())
    assert not show_progress(stream=io.StringIO())


def test_stages_advance_by_name(capsys):
    with stages("import", ["read", "write"], quiet=True) as step:
        step()
        step()
    assert capsys.readouterr().err == ""


def test_a_long_job_off_a_terminal_prints_a_line_with_an_estimate_now_and_then(monkeypatch, capsys):
    """In a log (``evaluate --tasks mqar`` at 32k piped to a file): no bar, but every LOG_INTERVAL_S a plain line
    on stderr with done/total, elapsed and the time left; nothing on the results' stream, nothing when quiet."""
    import mixerzoo.progress as progress_module

    out = io.StringIO()
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.0)
    with progress_bar(Console(file=out, force_terminal=False)) as progress:
        task = progress.add_task("mqar kvm", total=4096)
        for _ in range(4):
            progress.advance(task, 1024)
    lines = capsys.readouterr().err.splitlines()
    assert out.getvalue() == "" and len(lines) == 4, lines
    assert lines[-1].startswith("mqar kvm: 4,096/4,096, 0:00:00 elapsed, eta ") and "eta" in lines[1], lines
    with progress_bar(Console(file=out, force_terminal=False), quiet=True) as progress:
        progress.advance(progress.add_task("x", total=2), 2)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 3600.0)  # a short job prints its results only
    with progress_bar(Console(file=out, force_terminal=False)) as progress:
        progress.advance(progress.add_task("x", total=2), 2)
    assert capsys.readouterr().err == ""
