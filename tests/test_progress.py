"""Progress bars of the long-running commands: drawn with an ETA on a terminal, silent with --quiet or in logs."""

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
