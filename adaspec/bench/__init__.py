"""Benchmark client: drives any OpenAI-compatible server and turns timings into tables and plots.

Layout (one job per file): dataset (prompts), sse (stream parsing), client (timed requests),
metrics (per-run numbers), specstats (/metrics scrape), runner (`bench serve`), arms and
server (processes a sweep starts), conditions (manifest facts), sweep, aggregate, pareto,
plot, report, cli.
"""
