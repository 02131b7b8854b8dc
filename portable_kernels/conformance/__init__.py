"""The conformance suite: every kernel x every registered variant x dtypes x shapes, on the
device at hand, against the kernels' float64 references.

Run it with the command line::

    portable-kernels conformance [--device cuda] [--quick] [--json cuda.json] [-n 8]

or as a pytest plugin, wherever the package is installed::

    pytest --pyargs portable_kernels.conformance --pk-device cuda --pk-json cuda.json

Layout: ``harness.py`` (cases, running one, recording it), ``report.py`` (the JSON report,
the matrix, Markdown/HTML, merging devices), ``plugin.py`` (the pytest plugin, registered
through the ``pytest11`` entry point), ``cli.py`` (``portable-kernels conformance`` and
``portable-kernels report``), and one ``test_<kernel>.py`` per kernel declaring its
``SUITE``. See docs/conformance-report.md and docs/plugin-authors.md.

This module imports nothing: pytest imports the plugin (and so this package) at the start
of every session in the environment, including sessions that never run the suite.
"""
