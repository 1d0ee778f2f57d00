"""The whole run (tests, doctests in src/, README) never measures the machine: attnlab takes
its typical tuning figures (see tests/conftest.py and attnlab._tuning)."""

import os

os.environ["ATTNLAB_TUNE"] = "off"
