"""The web UI (`simpletuner ui`): run folders read as runs, a launch queue, and the Starlette app serving them.

runs: a read-only model of run folders; jobs: the queue that launches, stops and resumes runs; app: the pages.
See documentation/ARCHITECTURE.md, "ui".
"""
