"""The benchmark cases, one module each (bench/README.md). Each runs by itself
(``python bench/cases/<case>.py [--quick | --smoke]``); bench/run.py runs them together."""
