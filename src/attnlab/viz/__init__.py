"""attnlab.viz"""

from attnlab.viz import report  # noqa: F401  (attnlab.viz.report(explanation, path) writes the HTML report)
