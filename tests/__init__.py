"""The test suite, as a package: ``tests.cases``, ``tests.zoo`` and ``tests._processes`` import as
this suite's modules even where another installed distribution ships a top-level ``tests``."""
