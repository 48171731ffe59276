"""Benchmarks and studies: scripts run as `python bench/<name>.py`, importable as
`bench.<name>` (installed with the library) where one reuses another or a test checks
it."""
