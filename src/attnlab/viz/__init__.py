"""attnlab.viz: pictures of attention.

:mod:`attnlab.viz.plots` draws heatmaps and the static -> contextual embedding plot with
matplotlib (the ``viz`` extra, imported when a plot is drawn); :mod:`attnlab.viz.html_report`
writes the self-contained interactive HTML report (NumPy only); :func:`show` gives one of
its views at a time, inline in a Jupyter notebook (:mod:`attnlab.viz.notebook`).
"""

from attnlab.viz.html_report import render_html, write_report
from attnlab.viz.notebook import View, show

# ``attnlab.viz.report(explanation, path)`` writes the HTML report.
report = write_report

__all__ = ["View", "render_html", "report", "show", "write_report"]
