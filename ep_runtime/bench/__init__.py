"""Benchmarks: programs, not tests. Each module has ``main(argv)`` and is run as
``ep-runtime bench <module name with - for _>``; each prints a table and writes JSON."""
