"""Helpers shared by the test suite (``tests/conftest.py`` holds fixtures and hooks only).

``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject.toml's pytest section), so a test
imports ``from helpers.oracle import oracle``. One module per concern:

- :mod:`helpers.oracle`       the float64 oracle every result is compared with, and ``randn``;
- :mod:`helpers.tolerance`    the low-precision rule (2× / 3× the naive error + a floor) and
  its margin log (``ATTNKIT_TOLERANCE_LOG``; :mod:`helpers.tolerance_report` reads it);
- :mod:`helpers.running`      ``run_backend`` / ``skip_unless_supported``: a backend's run or
  a skip with its own reasons;
- :mod:`helpers.recorders`    ``OpOutputs``: which aten ops ran and how large their outputs;
- :mod:`helpers.native_checks`, :mod:`helpers.eager_tiles`: native kernel / compiled-tile
  checks shared by the backend tests;
- :mod:`helpers.layers`, :mod:`helpers.masks`: small builders for the layer and mask tests;
- :mod:`helpers.textparse`, :mod:`helpers.webpage`: reading the text walkthrough back, and
  the run's one headless Chromium for the browser tests.
"""
