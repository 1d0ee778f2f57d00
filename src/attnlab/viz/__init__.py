"""attnlab.viz: pictures of attention.

:mod:`attnlab.viz.plots` draws heatmaps and the static -> contextual embedding plot with
matplotlib (the ``viz`` extra, imported when a plot is drawn); :mod:`attnlab.viz.html_report`
writes the self-contained interactive HTML report (NumPy only).
"""

from attnlab.viz.html_report import render_html, write_report

# ``attnlab.viz.report(explanation, path)`` writes the HTML report.
report = write_report

__all__ = ["render_html", "report", "write_report"]
